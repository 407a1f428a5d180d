"""Two deployments behind one model name: `unequal-replicas` and `shared-prefixes`.

Each variant gets its own engines (fresh emulators: their counters and prefix caches are its
own) and its own gateway: none (``direct``: every request into one engine's queue, the flood's
direct FIFO), LiteLLM with both engines as deployments of model ``tiny`` and its default router,
or the same LiteLLM proxy with the plugin (``backends.tiny.api_bases``: a gate per deployment,
placement by prefix affinity and load). While a variant plays, every engine's ``/metrics`` is
sampled (waiting, running, prefix-cache counters), so the report shows each engine's queue over
time, not only the client's view.

- **unequal-replicas**: one engine three times slower (`--speed 0.33`); one power user sends a
  flood, light users send a few requests from 1 s on. All users in one tier, `waiting_below: 3`.
- **shared-prefixes**: 20 users, each with its own long system prompt and short questions, all
  requests at once; each engine's prefix cache holds a little more than half of all prompts;
  `waiting_below: 8` (the engines' slots), prefill 0.4 ms per uncached token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx

from ...engine_metrics.parser import MetricsParseError, parse_metrics
from ...engine_metrics.profiles import VLLM_PROFILE
from .client import Caller, RequestRecord, make_client, stream_one
from .flood import LIGHT_KEYS, POWER_KEY, WARM_UP_TOKENS
from .processes import (
    MASTER_KEY,
    ChildProcess,
    EmulatorSettings,
    emulator_process,
    engine_stats,
    enter_side_by_side,
    fair_proxy,
    litellm_config,
    litellm_proxy,
    plugin_available,
)
from .stats import jain_index, percentile, summarize_flood

Progress = Callable[[str], None]
ReplicaGateway = Literal["direct", "litellm", "plugin", "fair_proxy"]
SAMPLE_EVERY_S = 0.2
# The emulator's token estimate (lab/emulator/app.py) and vLLM's default block size.
CHARS_PER_TOKEN = 4
BLOCK_TOKENS = 16
# A run's requests are bounded in time: a stream silent this long is an error (client.py), and
# the whole run is cut off after this long.
RUN_LIMIT_S = 240.0
ARRIVAL_GRACE_MS = 3000


@dataclass(frozen=True)
class ReplicaVariant:
    name: str
    label: str
    gateway: ReplicaGateway


def replica_variants(*, with_direct: bool) -> list[ReplicaVariant]:
    """LiteLLM's default router, the same proxy with the plugin, and (optionally) direct FIFO."""
    plugin: ReplicaGateway = "plugin" if plugin_available() else "fair_proxy"
    via = "LiteLLM + plugin" if plugin == "plugin" else "fair-sched proxy*"
    variants = [
        ReplicaVariant("litellm", "LiteLLM (default router)", "litellm"),
        ReplicaVariant("plugin", via, plugin),
    ]
    if with_direct:
        variants.insert(0, ReplicaVariant("direct", "direct FIFO (one engine)", "direct"))
    return variants


# ----------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class UnequalSize:
    power_requests: int = 120
    max_tokens: int = 16
    # Each light user sends one request at each of these times (seconds after the flood).
    light_at_s: tuple[float, ...] = (1.0, 2.0, 3.0)
    waiting_below: int = 3
    # The plugin is told the engines' slots (`backends.tiny.max_num_seqs`, as an operator knows
    # vLLM's --max-num-seqs); None leaves the gate to learn them.
    max_num_seqs: int | None = 8
    # Slow steps (80 ms; ~125 tokens/s for both engines together) keep the engines, not the
    # LiteLLM proxy, the bottleneck: on a loaded 2-core machine a LiteLLM proxy relaying 120
    # streams at 30 ms steps kept the fast engine at 3 of 8 slots with nothing queued, with or
    # without the plugin. The slow engine takes three times as long per step.
    engines: tuple[EmulatorSettings, ...] = (
        EmulatorSettings(step_ms=80.0, step_ms_per_seq=0.5),
        EmulatorSettings(step_ms=80.0, step_ms_per_seq=0.5, speed=0.33),
    )


QUICK_UNEQUAL = UnequalSize(power_requests=48, light_at_s=(1.0, 2.0))


@dataclass(frozen=True)
class SharedPrefixSize:
    users: int = 20
    requests_per_user: int = 6
    system_prompt_tokens: int = 1500
    max_tokens: int = 16
    # A queue as deep as the engine's slots: with misses costing 600 ms of prefill, a queue of
    # 3 drained before requests released through a LiteLLM proxy (a second or more on its way
    # on this machine) arrived, and the engines ran 3-4 of 8 slots (docs/results.md).
    waiting_below: int = 8
    # Each engine's cache holds this share of all users' system prompts: a little more than
    # half, so that two engines hold every prompt only if each user keeps to one of them.
    cache_share: float = 0.6
    # Prefill is what a cache hit saves: 0.4 ms per uncached token makes a 1,500-token miss
    # cost ~600 ms of engine time, fifty decode steps, so that the engines, not the LiteLLM
    # proxy's CPU, decide the throughput. At 0.1 ms the proxy was the bottleneck on two cores
    # (both variants' engines ran 1-3 of 8 slots) and the run measured LiteLLM, not placement.
    prefill_ms_per_token: float = 0.4
    step_ms: float = 12.0
    max_num_seqs: int = 8

    @property
    def prompt_blocks(self) -> int:
        return math.ceil(self.system_prompt_tokens / BLOCK_TOKENS)

    @property
    def cache_blocks(self) -> int:
        return math.ceil(self.cache_share * self.users * self.prompt_blocks)

    def engine(self) -> EmulatorSettings:
        return EmulatorSettings(
            max_num_seqs=self.max_num_seqs,
            step_ms=self.step_ms,
            step_ms_per_seq=0.5,
            prefill_ms_per_token=self.prefill_ms_per_token,
            prefix_cache_blocks=self.cache_blocks,
            block_tokens=BLOCK_TOKENS,
        )


QUICK_SHARED = SharedPrefixSize(users=12, requests_per_user=4, system_prompt_tokens=1000)


# ----------------------------------------------------------------------------- workloads


def user_key(index: int) -> str:
    return f"sk-bench-user-{index:02d}-{hashlib.sha256(str(index).encode()).hexdigest()[:8]}"


def system_prompt(user: int, tokens: int) -> str:
    """A user's own system prompt of about `tokens` tokens; differs from the others' in its
    first characters, so that two users share no cached block."""
    words: list[str] = []
    seed = hashlib.sha256(f"user-{user}".encode()).digest()
    while sum(len(word) + 1 for word in words) < tokens * CHARS_PER_TOKEN:
        seed = hashlib.sha256(seed).digest()
        words += [seed[i : i + 3].hex() for i in range(0, 30, 3)]
    text = f"Team {user:02d} assistant. " + " ".join(words)
    return text[: tokens * CHARS_PER_TOKEN]


def shared_prefix_requests(size: SharedPrefixSize) -> list[tuple[int, list[dict[str, str]]]]:
    """Every request as (user, messages), in sending order: round by round over the users."""
    prompts = [system_prompt(user, size.system_prompt_tokens) for user in range(size.users)]
    return [
        (
            user,
            [
                {"role": "system", "content": prompts[user]},
                {"role": "user", "content": f"Question {k} of user {user}: what changed today?"},
            ],
        )
        for k in range(size.requests_per_user)
        for user in range(size.users)
    ]


def best_hit_rate(
    requests: Sequence[tuple[int, Sequence[Mapping[str, str]]]], block_tokens: int = BLOCK_TOKENS
) -> float:
    """The prefix-cache hit rate (cached / prompt tokens) of a cache that never evicts: a
    request hits the whole blocks it shares with an earlier request of the same user, so every
    user's first request misses. Tokens are counted as the emulator counts them."""
    queried = hit = 0
    seen: dict[int, list[str]] = {}
    for user, messages in requests:
        text = "".join(message["content"] for message in messages)
        tokens = max(1, len(text) // CHARS_PER_TOKEN)
        queried += tokens
        common = max((_common_chars(text, other) for other in seen.get(user, ())), default=0)
        # Only whole blocks are cached, and vLLM never serves the last prompt token from cache.
        cacheable = min(common // CHARS_PER_TOKEN, tokens - 1)
        hit += cacheable // block_tokens * block_tokens
        seen.setdefault(user, []).append(text)
    return hit / queried if queried else 0.0


def _common_chars(a: str, b: str) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


# ----------------------------------------------------------------------------- engines


@dataclass
class EngineSample:
    at: float
    waiting: float
    running: float
    queries: float | None
    hits: float | None


@dataclass
class EngineTrace:
    """One engine during one variant's run: its /metrics over time and its own statistics."""

    name: str
    base_url: str
    samples: list[EngineSample] = field(default_factory=list)
    stats_before: dict[str, Any] = field(default_factory=dict)
    stats_after: dict[str, Any] = field(default_factory=dict)


async def _scrape(client: httpx.AsyncClient, engine: EngineTrace, at: float) -> None:
    try:
        response = await client.get(f"{engine.base_url}/metrics")
        parsed = parse_metrics(response.text, VLLM_PROFILE, None)
    except (httpx.HTTPError, MetricsParseError):
        return  # a missed sample, not zero load
    queries, hits = parsed.prefix_cache_queries, parsed.prefix_cache_hits
    engine.samples.append(EngineSample(at, parsed.waiting, parsed.running, queries, hits))


async def sample_engines(
    client: httpx.AsyncClient, engines: Sequence[EngineTrace], clock_zero: float, stop_at: float
) -> None:
    """Scrape every engine every SAMPLE_EVERY_S until `stop_at` (perf_counter seconds)."""
    while time.perf_counter() < stop_at:
        at = time.perf_counter() - clock_zero
        await asyncio.gather(*(_scrape(client, engine, at) for engine in engines))
        await asyncio.sleep(SAMPLE_EVERY_S)


def engine_summary(engine: EngineTrace, until_s: float) -> dict[str, Any]:
    """Max and mean waiting (sampled, while the run lasted), the engine's own exact maximum,
    requests received and the prefix-cache hit rate over the run (its counters' growth)."""
    during = [s for s in engine.samples if s.at <= until_s] or engine.samples
    waiting = [s.waiting for s in during]
    counted = [s for s in engine.samples if s.queries is not None and s.hits is not None]
    queries = hits = 0.0
    if len(counted) >= 2:
        queries = (counted[-1].queries or 0.0) - (counted[0].queries or 0.0)
        hits = (counted[-1].hits or 0.0) - (counted[0].hits or 0.0)
    received = engine.stats_after.get("requests_received", 0) - engine.stats_before.get(
        "requests_received", 0
    )
    return {
        "name": engine.name,
        "max_waiting_sampled": max(waiting, default=None),
        "mean_waiting_sampled": sum(waiting) / len(waiting) if waiting else None,
        "mean_running_sampled": (sum(s.running for s in during) / len(during) if during else None),
        "max_waiting_seen": engine.stats_after.get("max_waiting_seen"),
        "requests_received": received,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "hit_rate": hits / queries if queries else None,
    }


def jain_while_backlogged(records: Sequence[RequestRecord]) -> float | None:
    """Jain's index of per-user service (tokens streamed) up to the moment the first user had
    nothing left in flight; a request's tokens are counted evenly over its streaming time."""
    ends: dict[str, float] = {}
    for record in records:
        if record.ended is not None:
            ends[record.user] = max(ends.get(record.user, 0.0), record.ended)
    if len(ends) < 2:
        return None
    window_end = min(ends.values())
    service = dict.fromkeys(ends, 0.0)
    for record in records:
        first, ended = record.first_token, record.ended
        if first is None or ended is None or record.error or first >= window_end:
            continue
        streamed = ended - first
        inside = 1.0 if streamed <= 0 else min(1.0, (window_end - first) / streamed)
        service[record.user] += record.tokens * inside
    return jain_index(list(service.values()))


# ----------------------------------------------------------------------------- targets


@dataclass
class ReplicaTarget:
    variant: ReplicaVariant
    engines: list[EngineTrace]
    base_url: str
    gateway_pid: int | None = None


def replica_fair_sched(
    api_bases: Sequence[str],
    waiting_below: int,
    principals: Sequence[Mapping[str, Any]],
    max_num_seqs: int | None = None,
) -> dict[str, Any]:
    """The plugin's settings: one tier, every deployment of `tiny` gated on its own."""
    # A LiteLLM proxy on a loaded 2-core machine takes over a second to forward a released
    # request (measured: the light users' requests reached the plugin's hook 1-2 s after they
    # were sent); until then a released request must keep counting against its deployment.
    backend: dict[str, Any] = {
        "api_bases": list(api_bases),
        "engine": "vllm",
        "arrival_grace_ms": ARRIVAL_GRACE_MS,
    }
    if max_num_seqs is not None:
        backend["max_num_seqs"] = max_num_seqs
    return {
        "tiers": [{"name": "interactive", "waiting_below": waiting_below}],
        "default_tier": "interactive",
        "principals": [dict(p) for p in principals],
        "backends": {"tiny": backend},
        "queue": {"max_per_user": 5000, "max_total": 20000, "max_wait_s": 300},
        # The default poll: two deployments' scrapes every 50 ms cost a loaded proxy its loop.
        "metrics_poll_ms": 100,
        "observability": {"admin_key": MASTER_KEY},
    }


@contextlib.asynccontextmanager
async def _replica_target(
    variant: ReplicaVariant,
    engines: Sequence[EmulatorSettings],
    fair_sched: Callable[[Sequence[str]], dict[str, Any]],
    workdir: Path,
) -> AsyncIterator[ReplicaTarget]:
    # Direct FIFO: every request into one engine's queue (the first, fastest one).
    settings = engines[:1] if variant.gateway == "direct" else engines
    async with contextlib.AsyncExitStack() as stack:
        started = [await stack.enter_async_context(emulator_process(one)) for one in settings]
        traces = [
            EngineTrace(_engine_name(one, index), child.base_url)
            for index, (one, child) in enumerate(zip(settings, started, strict=True))
        ]
        api_bases = [f"{child.base_url}/v1" for child in started]
        if variant.gateway == "direct":
            yield ReplicaTarget(variant, traces, api_bases[0])
            return
        gateway: contextlib.AbstractAsyncContextManager[ChildProcess]
        if variant.gateway == "fair_proxy":
            gateway = fair_proxy(fair_sched(api_bases), workdir, f"replicas-{variant.name}")
        else:
            section = fair_sched(api_bases) if variant.gateway == "plugin" else None
            config = litellm_config(api_bases, section)
            gateway = litellm_proxy(config, workdir, f"replicas-{variant.name}")
        child = await stack.enter_async_context(gateway)
        yield ReplicaTarget(variant, traces, child.base_url, child.pid)


def _engine_name(settings: EmulatorSettings, index: int) -> str:
    if settings.speed != 1.0:
        return f"engine {index + 1} (speed {settings.speed:g})"
    return f"engine {index + 1}"


@contextlib.asynccontextmanager
async def started_replica_targets(
    variants: Sequence[ReplicaVariant],
    engines: Sequence[EmulatorSettings],
    fair_sched: Callable[[Sequence[str]], dict[str, Any]],
    workdir: Path,
    progress: Progress,
) -> AsyncIterator[list[ReplicaTarget]]:
    """Start every variant's engines and gateway at once (LiteLLM imports slowly); stop all."""
    async with contextlib.AsyncExitStack() as stack:
        yield await enter_side_by_side(
            stack,
            [_replica_target(variant, engines, fair_sched, workdir) for variant in variants],
            progress,
            f"starting {len(variants)} variant(s), each with its own engines ...",
        )


# ----------------------------------------------------------------------------- playing


@dataclass
class ReplicaResult:
    variant: ReplicaVariant
    records: list[RequestRecord]
    engines: list[EngineTrace]
    summary: dict[str, Any] = field(default_factory=dict)


Job = tuple[Caller, float, Sequence[dict[str, str]] | None]  # who, when (s), messages


async def _play(
    target: ReplicaTarget, jobs: Sequence[Job], max_tokens: int, progress: Progress
) -> ReplicaResult:
    """Send every job at its time, sample the engines until all are done, summarise."""
    variant = target.variant
    async with make_client(connections=len(jobs) + 16) as client:
        # The first request through a LiteLLM proxy pays for lazy imports: not measured. The
        # warm-up prompt is short, so it leaves nothing in the prefix caches.
        await stream_one(client, target.base_url, jobs[0][0], WARM_UP_TOKENS, time.perf_counter())
        for engine in target.engines:
            engine.stats_before = await engine_stats(client, engine.base_url)
        clock_zero = time.perf_counter()
        stop_sampling = clock_zero + RUN_LIMIT_S
        sampler = asyncio.ensure_future(
            sample_engines(client, target.engines, clock_zero, stop_sampling)
        )

        async def send(caller: Caller, at: float, messages: Any) -> RequestRecord:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - clock_zero)))
            return await stream_one(
                client, target.base_url, caller, max_tokens, clock_zero, messages
            )

        progress(f"[{variant.name}] sending {len(jobs)} requests ...")
        try:
            records = list(
                await asyncio.wait_for(asyncio.gather(*(send(*job) for job in jobs)), RUN_LIMIT_S)
            )
        finally:
            # One more scrape after the last request so the counters include its prefill.
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        at = time.perf_counter() - clock_zero
        for engine in target.engines:
            await _scrape(client, engine, at)
            engine.stats_after = await engine_stats(client, engine.base_url)
    result = ReplicaResult(variant, records, target.engines)
    result.summary = summarize_replicas(records, target.engines)
    summary = result.summary
    progress(
        f"[{variant.name}] done: {summary['throughput_tps']:.0f} tokens/s, errors "
        f"{summary['errors']}, max waiting per engine "
        f"{[e['max_waiting_seen'] for e in summary['engines']]}, hit rate "
        f"{_fmt(summary['hit_rate'])}"
    )
    return result


def summarize_replicas(
    records: Sequence[RequestRecord], engines: Sequence[EngineTrace]
) -> dict[str, Any]:
    """The flood's client-side summary plus each engine's queue, hit rates and Jain's index."""
    summary = summarize_flood(records)
    ends = [r.ended for r in records if r.ended is not None]
    until = max(ends, default=0.0)
    per_engine = [engine_summary(engine, until) for engine in engines]
    queries = sum(e["prefix_cache_queries"] for e in per_engine)
    hits = sum(e["prefix_cache_hits"] for e in per_engine)
    summary["engines"] = per_engine
    summary["hit_rate"] = hits / queries if queries else None
    summary["jain_backlogged"] = jain_while_backlogged(records)
    summary["light_ttft_p95"] = percentile(
        [r.ttft for r in records if r.group == "light" and r.ttft is not None and not r.error], 95
    )
    return summary


def unequal_principals() -> list[dict[str, Any]]:
    return [
        {"name": "power", "keys": [POWER_KEY]},
        *({"name": f"light-{i + 1}", "keys": [key]} for i, key in enumerate(LIGHT_KEYS)),
    ]


def shared_principals(size: SharedPrefixSize) -> list[dict[str, Any]]:
    return [{"name": f"user-{u:02d}", "keys": [user_key(u)]} for u in range(size.users)]


def _key(variant: ReplicaVariant, own: str) -> str | None:
    if variant.gateway in ("plugin", "fair_proxy"):
        return own
    return MASTER_KEY if variant.gateway == "litellm" else None


async def play_unequal(
    target: ReplicaTarget, size: UnequalSize, progress: Progress
) -> ReplicaResult:
    variant = target.variant
    power = Caller("power", "power", _key(variant, POWER_KEY))
    jobs: list[Job] = [(power, 0.0, None)] * size.power_requests
    for index, key in enumerate(LIGHT_KEYS):
        light = Caller(f"light-{index + 1}", "light", _key(variant, key))
        jobs += [(light, at, None) for at in size.light_at_s]
    return await _play(target, jobs, size.max_tokens, progress)


async def play_shared(
    target: ReplicaTarget, size: SharedPrefixSize, progress: Progress
) -> ReplicaResult:
    variant = target.variant
    callers = [
        Caller(f"user-{u:02d}", "user", _key(variant, user_key(u))) for u in range(size.users)
    ]
    requests = shared_prefix_requests(size)
    jobs: list[Job] = [(callers[user], 0.0, messages) for user, messages in requests]
    result = await _play(target, jobs, size.max_tokens, progress)
    result.summary["best_hit_rate"] = best_hit_rate(requests)
    return result


async def run_unequal(
    size: UnequalSize, workdir: Path, progress: Progress, *, with_direct: bool = True
) -> list[ReplicaResult]:
    """Every variant of `unequal-replicas`, one after another; ratios to direct FIFO added."""
    variants = replica_variants(with_direct=with_direct)

    def section(api_bases: Sequence[str]) -> dict[str, Any]:
        return replica_fair_sched(
            api_bases, size.waiting_below, unequal_principals(), size.max_num_seqs
        )

    async with started_replica_targets(
        variants, size.engines, section, workdir, progress
    ) as targets:
        results = [await play_unequal(target, size, progress) for target in targets]
    direct = next((r for r in results if r.variant.name == "direct"), None)
    for result in results:
        result.summary["light_ttft_vs_direct"] = _ratio(
            result.summary["light_ttft_p50"], direct.summary["light_ttft_p50"] if direct else None
        )
    return results


async def run_shared(
    size: SharedPrefixSize, workdir: Path, progress: Progress
) -> list[ReplicaResult]:
    """Both variants of `shared-prefixes`, one after another."""
    variants = replica_variants(with_direct=False)
    engine = size.engine()

    def section(api_bases: Sequence[str]) -> dict[str, Any]:
        return replica_fair_sched(
            api_bases, size.waiting_below, shared_principals(size), size.engine().max_num_seqs
        )

    async with started_replica_targets(
        variants, (engine, replace(engine)), section, workdir, progress
    ) as targets:
        return [await play_shared(target, size, progress) for target in targets]


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def replica_json(results: Sequence[ReplicaResult]) -> dict[str, Any]:
    return {
        result.variant.name: {
            "label": result.variant.label,
            "gateway": result.variant.gateway,
            "summary": result.summary,
            "engines": {
                engine.name: [
                    [s.at, s.waiting, s.running, s.queries, s.hits] for s in engine.samples
                ]
                for engine in result.engines
            },
            "requests": [record.to_json() for record in result.records],
        }
        for result in results
    }


__all__ = [
    "QUICK_SHARED",
    "QUICK_UNEQUAL",
    "EngineSample",
    "EngineTrace",
    "ReplicaResult",
    "ReplicaVariant",
    "SharedPrefixSize",
    "UnequalSize",
    "best_hit_rate",
    "engine_summary",
    "jain_while_backlogged",
    "replica_json",
    "run_shared",
    "run_unequal",
    "shared_prefix_requests",
]
