"""The plugin's CPU inside LiteLLM: LiteLLM's CPU per relayed token, with the plugin and without.

The shared-process layout: on two shared cores a LiteLLM proxy's relaying is the
bottleneck, so every millisecond the plugin adds per token is throughput lost. This puts
LiteLLM's CPU in the foreground: one emulated engine (a subprocess, 8 slots, 1 ms a step, so it
is never what limits the flood) behind one `litellm --config` proxy per variant, all started
first, then rounds in which the variants take turns (each round starting with the next one):

- a flood of streamed requests (`--concurrency` in flight, `--requests` in all, `--tokens`
  each, `stream_options.include_usage` as the real-vLLM stage sends): CPU seconds (utime +
  stime from /proc) of every process in the proxy's process group, divided by the content
  chunks the client received (one token each from the emulator) and by the requests;
- `--single` requests one at a time, the variants alternating request by request: each
  request's latency (sent to last byte) and time to first token, and each proxy's CPU per
  token over that phase (every proxy is idle while another one answers, so what a proxy spends
  per second whatever the traffic is counted too).

Before the rounds, every proxy's CPU per second while no request runs (`--idle-s`): a cost per
second, not per token, which a flood pays over its whole length (the plugin's metrics watcher
scrapes each engine ten times a second at `metrics_poll_ms: 100`). The summary compares each
variant with `plain` round by round (the ratio of the two floods of one round, then the median
and range over the rounds), so a machine whose load changes between rounds moves both sides.

Variants: `plain` (LiteLLM alone: no callback, no custom_auth, the master key) and `plugin`
(callback + custom_auth + a `fair_sched:` section like the real-vLLM stage's, the interactive
tier on `waiting_below: auto`).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/litellm_cpu.py [--rounds 6] [--requests 120]
        [--single 20] [--compare-with ../other-checkout]   # that checkout's plugin as a third proxy

Prints numbers, asserts nothing. About 3-5 minutes on two cores (most of it starting proxies
and relaying). The load average before and after is printed: the numbers are only comparable
within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The harness lives with the integration tests; run from anywhere in the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from fair_sched_plugin.lab.emulator import EmulatorConfig, run_emulator_subprocess
from fair_sched_plugin.lab.harness.litellm_proxy import (
    MASTER_KEY,
    ProxyProcess,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
    stream_chat,
)
from fair_sched_plugin.lab.harness.processes import group_cpu_seconds, process_cpu_seconds

CHAT = "/v1/chat/completions"
MODEL = "tiny"
POWER_KEY = "sk-power"
FLOOD_TIMEOUT_S = 300.0
WARMUP_REQUESTS = 8
# The bounds for the plugin against LiteLLM alone, printed beside the ratios.
TARGET_CPU_RATIO = 1.02
TARGET_LATENCY_RATIO = 1.02


def fair_sched_section() -> dict[str, Any]:
    """The real-vLLM stage's section (tests/vllm/test_real_engine.py `fair_section`, auto)."""
    return {
        "tiers": [
            {
                "name": "interactive",
                "waiting_below": "auto",
                "ttft_target_ms": 2000,
                "vllm_priority": 0,
            },
            {"name": "batch", "waiting_below": 1, "vllm_priority": 10},
        ],
        "default_tier": "interactive",
        "principals": [{"name": "power", "keys": [POWER_KEY]}],
        "backends": {MODEL: {"priority_scheduling": True}},
        "queue": {"max_per_user": 1000, "max_total": 10000, "max_wait_s": 300},
        "metrics_poll_ms": 100,
    }


@dataclass(frozen=True)
class Variant:
    """One proxy: its config, the key its client sends, and extra environment for it."""

    name: str
    config: Callable[[list[dict[str, Any]]], dict[str, Any]]
    key: str
    env: Mapping[str, str] = field(default_factory=dict)


def plain_config(models: list[dict[str, Any]]) -> dict[str, Any]:
    return proxy_config(models, None, plugin=False, custom_auth=False)


def plugin_config(models: list[dict[str, Any]]) -> dict[str, Any]:
    return proxy_config(models, fair_sched_section())


VARIANTS = {
    "plain": Variant("plain", plain_config, MASTER_KEY),
    "plugin": Variant("plugin", plugin_config, POWER_KEY),
}


def chat(tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Flood:
    variant: str
    cpu_s: float
    seconds: float
    requests: int
    tokens: int

    @property
    def ms_per_token(self) -> float:
        return self.cpu_s * 1000 / self.tokens

    @property
    def ms_per_request(self) -> float:
        return self.cpu_s * 1000 / self.requests

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Singles:
    """One variant's requests sent one at a time in one round."""

    variant: str
    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    tokens: int = 0

    @property
    def ms_per_token(self) -> float:
        return self.cpu_s * 1000 / self.tokens


def rotated(variants: Sequence[Variant], turn: int) -> list[Variant]:
    """The variants in the order of turn `turn`: each turn starts with the next one, so every
    variant takes every place (after the same neighbours) equally often."""
    first = turn % len(variants)
    return [*variants[first:], *variants[:first]]


def _checked(variant: str, tokens: int, status: int, chunks: int, error: str | None) -> str | None:
    return None if status == 200 and chunks == tokens else f"{variant}: {status} {chunks} {error}"


async def flood(
    variant: str, proxy: ProxyProcess, key: str, requests: int, concurrency: int, tokens: int
) -> Flood:
    """`requests` streams, `concurrency` at a time; the proxy group's CPU over the flood."""
    body = chat(tokens)
    async with open_client(proxy.base_url, key, timeout=FLOOD_TIMEOUT_S) as client:
        left = requests
        received = 0
        failures: list[str] = []

        async def worker() -> None:
            nonlocal left, received
            while left > 0:
                left -= 1
                result = await stream_chat(client, CHAT, body)
                failure = _checked(
                    variant, tokens, result.status, result.content_chunks, result.error
                )
                if failure:
                    failures.append(failure)
                received += result.content_chunks

        cpu_before = group_cpu_seconds(proxy.pid)
        started = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(*(worker() for _ in range(concurrency))), FLOOD_TIMEOUT_S
        )
        seconds = time.perf_counter() - started
        cpu = group_cpu_seconds(proxy.pid) - cpu_before
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return Flood(variant, cpu, seconds, requests, received)


async def singles(
    variants: Sequence[Variant],
    proxies: Mapping[str, ProxyProcess],
    count: int,
    tokens: int,
    *,
    together: bool,
) -> dict[str, Singles]:
    """`count` requests per variant, each proxy answering one at a time: the variants take
    turns request by request, or (`together`) each turn sends one to every variant at once, so
    a change in the machine's load falls on all of them. Each request's latency and TTFT, and
    the proxy's CPU while it ran (its own process, read before and after each request: a scan
    of every process's group would hold the client up for milliseconds)."""
    body = chat(tokens)
    found = {variant.name: Singles(variant.name) for variant in variants}
    async with contextlib.AsyncExitStack() as exits:
        clients = {
            variant.name: await exits.enter_async_context(
                open_client(proxies[variant.name].base_url, variant.key, timeout=FLOOD_TIMEOUT_S)
            )
            for variant in variants
        }

        async def one(variant: Variant) -> None:
            pid = proxies[variant.name].pid
            cpu_before = process_cpu_seconds(pid)
            result = await stream_chat(clients[variant.name], CHAT, body)
            cpu = process_cpu_seconds(pid) - cpu_before
            failure = _checked(
                variant.name, tokens, result.status, result.content_chunks, result.error
            )
            if failure or result.done_at is None or result.ttft is None:
                raise RuntimeError(f"a single request failed: {failure}")
            mine = found[variant.name]
            mine.latencies_s.append(result.done_at - result.sent_at)
            mine.ttfts_s.append(result.ttft)
            mine.tokens += result.content_chunks
            mine.cpu_s += cpu

        for index in range(count):
            order = rotated(variants, index)
            for turn in [order] if together else [[variant] for variant in order]:
                await asyncio.gather(*(one(variant) for variant in turn))
    return found


def _ratios(mine: Sequence[float], base: Sequence[float]) -> str:
    """Round by round `mine / base`: the median, then the range."""
    ratios = sorted(a / b for a, b in zip(mine, base, strict=True))
    return f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"


def summary(
    floods: Sequence[Flood], rounds: Sequence[Mapping[str, Singles]], names: Sequence[str]
) -> list[str]:
    """The table the run ends with: per variant the median over rounds, and its ratio to
    `plain` round by round (median, and the range over the rounds)."""
    by_name = {name: [f for f in floods if f.variant == name] for name in names}
    lines = [
        "flood: ms CPU per token (median of rounds), vs plain round by round (median, range); "
        "every round's ms/token",
        f"{'variant':16}{'ms CPU/token':>14}{'ms CPU/request':>16}{'tokens/s':>10}"
        f"{'vs plain':>26}   rounds",
    ]
    for name in names:
        mine = by_name[name]
        ratio = (
            _ratios([f.ms_per_token for f in mine], [f.ms_per_token for f in by_name["plain"]])
            if "plain" in by_name
            else "-"
        )
        lines.append(
            f"{name:16}{statistics.median(f.ms_per_token for f in mine):>14.3f}"
            f"{statistics.median(f.ms_per_request for f in mine):>16.1f}"
            f"{statistics.median(f.tokens_per_s for f in mine):>10.0f}{ratio:>26}   "
            + " ".join(f"{f.ms_per_token:.3f}" for f in mine)
        )
    if rounds and rounds[0]:
        count = len(rounds[0][names[0]].latencies_s)
        lines += [
            "",
            f"one request at a time ({count} per variant and round, alternating): latency (sent "
            "to last byte) and TTFT p50 over all rounds; vs plain: each round's p50 ratio "
            "(median, range); ms CPU per token over the phase",
            f"{'variant':16}{'latency p50 ms':>16}{'vs plain':>26}{'TTFT p50 ms':>13}"
            f"{'ms CPU/token':>14}{'vs plain':>26}",
        ]
        for name in names:
            ones = [found[name] for found in rounds]
            base = [found["plain"] for found in rounds] if "plain" in names else None
            p50s = [statistics.median(s.latencies_s) for s in ones]
            cpu = [s.ms_per_token for s in ones]
            latency_ratio = (
                _ratios(p50s, [statistics.median(s.latencies_s) for s in base]) if base else "-"
            )
            cpu_ratio = _ratios(cpu, [s.ms_per_token for s in base]) if base else "-"
            every = [x for s in ones for x in s.latencies_s]
            ttfts = [x for s in ones for x in s.ttfts_s]
            lines.append(
                f"{name:16}{statistics.median(every) * 1000:>16.1f}{latency_ratio:>26}"
                f"{statistics.median(ttfts) * 1000:>13.1f}{statistics.median(cpu):>14.3f}"
                f"{cpu_ratio:>26}"
            )
    lines += [
        "",
        f"targets: CPU per token <= {TARGET_CPU_RATIO:g} x plain, single-request "
        f"latency <= {TARGET_LATENCY_RATIO:g} x plain",
    ]
    return lines


async def idle_cpu(proxies: Mapping[str, ProxyProcess], seconds: float) -> dict[str, float]:
    """Each proxy's CPU milliseconds per second over the same `seconds` with no request: what
    it spends whatever the traffic (the plugin's metrics watcher scrapes every engine each
    `metrics_poll_ms`)."""
    before = {name: group_cpu_seconds(proxy.pid) for name, proxy in proxies.items()}
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - started
    return {
        name: (group_cpu_seconds(proxy.pid) - before[name]) * 1000 / elapsed
        for name, proxy in proxies.items()
    }


@dataclass
class Results:
    floods: list[Flood] = field(default_factory=list)
    singles: list[dict[str, Singles]] = field(default_factory=list)
    idle: dict[str, float] = field(default_factory=dict)


async def run(variants: Sequence[Variant], args: argparse.Namespace, workdir: Path) -> Results:
    engine = EmulatorConfig(
        models=(MODEL,),
        max_num_seqs=8,
        policy="priority",
        base_step_ms=1.0,
        step_ms_per_running_seq=0.0,
        prefill_ms_per_token=0.0,
        request_log_size=100,
    )
    results = Results()
    async with contextlib.AsyncExitStack() as exits:
        proxies: dict[str, ProxyProcess] = {}
        for variant in variants:  # one at a time: each start is ~10 s of CPU
            print(f"starting LiteLLM ({variant.name}) ...", flush=True)
            # An engine each: a gate reads only its own proxy's requests in the engine's queue.
            emu = await exits.enter_async_context(run_emulator_subprocess(engine))
            models = [model_entry(MODEL, f"{emu.base_url}/v1")]
            proxies[variant.name] = await exits.enter_async_context(
                litellm_proxy(variant.config(models), workdir, variant.name, env=variant.env)
            )
        for variant in variants:  # lazy imports, connection pools, the first requests' paths
            await flood(
                variant.name, proxies[variant.name], variant.key, WARMUP_REQUESTS, 4, args.tokens
            )
        if args.idle_s > 0:
            results.idle = await idle_cpu(proxies, args.idle_s)
        for name, cpu_ms in results.idle.items():
            print(f"idle {name:24} {cpu_ms:.1f} ms CPU per second", flush=True)
        for index in range(args.rounds):
            order = rotated(variants, index)
            for turn in [order] if args.together else [[variant] for variant in order]:
                found_floods = await asyncio.gather(
                    *(
                        flood(
                            variant.name,
                            proxies[variant.name],
                            variant.key,
                            args.requests,
                            args.concurrency,
                            args.tokens,
                        )
                        for variant in turn
                    )
                )
                for result in found_floods:
                    print(
                        f"round {index + 1} {result.variant:16} flood {result.ms_per_token:.3f} "
                        f"ms/token {result.ms_per_request:.1f} ms/request "
                        f"{result.tokens_per_s:.0f} tokens/s",
                        flush=True,
                    )
                    results.floods.append(result)
            if args.single > 0:
                found = await singles(
                    order, proxies, args.single, args.tokens, together=args.together
                )
                results.singles.append(found)
                for name, mine in found.items():
                    print(
                        f"round {index + 1} {name:16} single latency p50 "
                        f"{statistics.median(mine.latencies_s) * 1000:.1f} ms, "
                        f"{mine.ms_per_token:.3f} ms CPU/token",
                        flush=True,
                    )
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=120, help="streams per flood")
    parser.add_argument("--concurrency", type=int, default=24, help="streams in flight")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per stream")
    parser.add_argument(
        "--single",
        type=int,
        default=20,
        help="requests one at a time per variant and round (0: none)",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="each round's floods (and each turn's single requests) to every variant at once",
    )
    parser.add_argument(
        "--idle-s", type=float, default=10.0, help="seconds of no traffic measured (0: none)"
    )
    parser.add_argument(
        "--compare-with",
        metavar="DIR",
        help="also `plugin@DIR`: the plugin imported from another checkout (its repository root)",
    )
    parser.add_argument("--variants", default="plain,plugin", help=f"of {sorted(VARIANTS)}")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 20 or not 1 <= args.requests <= 2000:
        parser.error("--rounds must be within 1..20 and --requests within 1..2000")
    if not 0 <= args.single <= 500:
        parser.error("--single must be within 0..500")
    if not 0 <= args.idle_s <= 120:
        parser.error("--idle-s must be within 0..120")
    if not 1 <= args.concurrency <= 256 or not 1 <= args.tokens <= 1000:
        parser.error("--concurrency must be within 1..256 and --tokens within 1..1000")
    return args


def main(extra: Mapping[str, Variant] | None = None, argv: Sequence[str] | None = None) -> None:
    """Run the variants named by `--variants` (`extra` adds some, for experiments)."""
    args = parse_args(argv)
    known = {**VARIANTS, **(extra or {})}
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    if args.compare_with:
        other = Path(args.compare_with).resolve()
        if not (other / "fair_sched_plugin").is_dir():
            raise SystemExit(f"--compare-with: no fair_sched_plugin package in {other}")
        # The proxy imports the plugin from that checkout first (PYTHONPATH).
        known["plugin@DIR"] = Variant(
            "plugin@DIR", plugin_config, POWER_KEY, {"PYTHONPATH": str(other)}
        )
        names.append("plugin@DIR")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(known)}")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fair-sched-litellm-cpu-") as tmp:
        results = asyncio.run(run([known[name] for name in names], args, Path(tmp)))
    print(
        f"\n{args.rounds} rounds of {args.requests} streams x {args.tokens} tokens, "
        f"{args.concurrency} in flight, then {args.single} one at a time, variants alternating\n"
    )
    print("\n".join(summary(results.floods, results.singles, names)))
    if results.idle:
        print(
            f"\nidle ({args.idle_s:g} s, no requests), CPU ms per second: "
            + ", ".join(f"{name} {cpu_ms:.1f}" for name, cpu_ms in results.idle.items())
        )
    print(
        f"\nload average (1, 5 min) before {load_before[0]:.2f} {load_before[1]:.2f}, after "
        f"{os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
