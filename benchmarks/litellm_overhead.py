"""What the LiteLLM plugin costs and what it buys, measured side by side in one run.

One emulated engine (a subprocess: priority policy, 8 slots, 8 ms a step, so ~1,000 tokens/s at
8 running) behind two `litellm` proxies started from the same config, one with the plugin
(callback + custom_auth + `fair_sched:`) and one without. Phases:

1. **Flood** through the proxy with the plugin, through the proxy without it, and direct to the
   engine: one user sends FLOOD requests at once, 1 s later two light users send one each.
   Reported: light users' TTFT (and the power user's median TTFT in the same run), generated
   tokens per second over the flood (engine throughput), the engine's largest waiting queue
   (with the plugin it runs first on a fresh engine, so `max_waiting_seen` is its own), and the
   proxy process's CPU seconds per 1,000 streamed tokens (utime + stime from /proc/PID/stat).
2. **One request at a time**, alternating between the two proxies: p50 latency ratio.

    .venv/bin/python benchmarks/litellm_overhead.py [--flood 100] [--tokens 32] [--sequential 30]

Targets: single-request p50 with/without <= 1.05; light users' TTFT with the plugin <= 0.10 x
direct; throughput with/without >= 0.97; engine waiting never above `waiting_below`. Takes
about 1-2 minutes on two cores (most of it starting the two proxies).
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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# The harness lives with the integration tests; run from anywhere in the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from fair_sched_plugin.lab.emulator import EmulatorConfig, run_emulator_subprocess
from fair_sched_plugin.lab.harness.litellm_proxy import (
    MASTER_KEY,
    ProxyProcess,
    StreamResult,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
    stream_chat,
)

CHAT = "/v1/chat/completions"
WAITING_BELOW = 3
MAX_NUM_SEQS = 8
LIGHT_DELAY_S = 1.0
PHASE_TIMEOUT_S = 120.0
HEAVY_KEY, LIGHT_KEYS = "sk-heavy", ("sk-light-1", "sk-light-2")


def fair_sched_section() -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "interactive", "waiting_below": WAITING_BELOW, "vllm_priority": 0},
            {"name": "batch", "waiting_below": 1, "vllm_priority": 10},
        ],
        "principals": [
            {"name": "heavy", "keys": [HEAVY_KEY]},
            {"name": "light-1", "keys": [LIGHT_KEYS[0]]},
            {"name": "light-2", "keys": [LIGHT_KEYS[1]]},
        ],
        "backends": {"tiny": {"priority_scheduling": True}},
        "metrics_poll_ms": 50,
    }


def chat(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def engine_stats(engine_url: str) -> Mapping[str, Any]:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        response = await client.get(f"{engine_url}/emulator/stats")
        response.raise_for_status()
        stats: Mapping[str, Any] = response.json()
        return stats


@dataclass
class FloodOutcome:
    name: str
    heavy: list[StreamResult]
    light: list[StreamResult]
    seconds: float
    generated_tokens: int
    streamed_tokens: int
    max_waiting_seen: int
    proxy_cpu_s: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def light_ttft_p50(self) -> float:
        return statistics.median(r.ttft or float("nan") for r in self.light)

    @property
    def heavy_ttft_p50(self) -> float:
        return statistics.median(r.ttft or float("nan") for r in self.heavy)

    @property
    def cpu_per_1k_tokens(self) -> float | None:
        if self.proxy_cpu_s is None or not self.streamed_tokens:
            return None
        return self.proxy_cpu_s / (self.streamed_tokens / 1000)


async def flood(
    name: str,
    base_url: str,
    keys: tuple[str, str, str],
    engine_url: str,
    size: int,
    tokens: int,
    proxy: ProxyProcess | None,
) -> FloodOutcome:
    before = await engine_stats(engine_url)
    cpu_before = proxy.cpu_seconds() if proxy else None
    clients = [open_client(base_url, key, timeout=PHASE_TIMEOUT_S) for key in keys]
    async with contextlib.AsyncExitStack() as exits:
        for client in clients:
            await exits.enter_async_context(client)
        started = time.perf_counter()
        heavy_tasks = [
            asyncio.create_task(stream_chat(clients[0], CHAT, chat(tokens))) for _ in range(size)
        ]
        try:
            await asyncio.sleep(LIGHT_DELAY_S)
            light = await asyncio.wait_for(
                asyncio.gather(*(stream_chat(c, CHAT, chat(tokens)) for c in clients[1:])),
                PHASE_TIMEOUT_S,
            )
            heavy = await asyncio.wait_for(asyncio.gather(*heavy_tasks), PHASE_TIMEOUT_S)
        finally:
            for task in heavy_tasks:
                task.cancel()
            await asyncio.gather(*heavy_tasks, return_exceptions=True)
        seconds = time.perf_counter() - started
    cpu = proxy.cpu_seconds() - cpu_before if proxy and cpu_before is not None else None
    after = await engine_stats(engine_url)
    failed = [r for r in (*heavy, *light) if r.status != 200 or r.content_chunks != tokens]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests failed, e.g. {failed[0]}")
    return FloodOutcome(
        name,
        list(heavy),
        list(light),
        seconds,
        after["generation_tokens_total"] - before["generation_tokens_total"],
        sum(r.content_chunks for r in (*heavy, *light)),
        after["max_waiting_seen"],
        cpu,
    )


async def one_at_a_time(
    with_plugin: ProxyProcess, without: ProxyProcess, count: int, tokens: int
) -> tuple[list[float], list[float]]:
    """Alternate single streamed requests between the two proxies; end-to-end seconds each."""
    timings: dict[str, list[float]] = {"with": [], "without": []}
    async with (
        open_client(with_plugin.base_url, HEAVY_KEY) as plugin_client,
        open_client(without.base_url, MASTER_KEY) as plain_client,
    ):
        for client in (plugin_client, plain_client):  # warm connections and code paths
            await stream_chat(client, CHAT, chat(tokens))
        for index in range(count):
            order = [("with", plugin_client), ("without", plain_client)]
            for label, client in order if index % 2 == 0 else order[::-1]:
                result = await asyncio.wait_for(stream_chat(client, CHAT, chat(tokens)), 30)
                if result.status != 200 or result.done_at is None:
                    raise RuntimeError(f"single request failed: {result}")
                timings[label].append(result.done_at - result.sent_at)
    return timings["with"], timings["without"]


def share_before(heavy: list[StreamResult], moment: float | None) -> float:
    if moment is None:
        return float("nan")
    return sum(1 for r in heavy if r.first_token_at and r.first_token_at < moment) / len(heavy)


def report(
    floods: list[FloodOutcome], single: tuple[list[float], list[float]], args: argparse.Namespace
) -> None:
    by_name = {outcome.name: outcome for outcome in floods}
    plugin, plain, direct = by_name["with plugin"], by_name["without plugin"], by_name["direct"]
    print(
        f"\nflood: {args.flood} x {args.tokens} tokens from one user, 2 light users {LIGHT_DELAY_S}"
        f" s later; engine {MAX_NUM_SEQS} slots, waiting_below {WAITING_BELOW}\n"
    )
    header = (
        f"{'':16}{'light TTFT p50':>15}{'heavy TTFT p50':>15}{'heavy before light':>19}"
        f"{'tokens/s':>10}{'makespan':>10}{'max waiting':>12}{'CPU s/1k tok':>13}"
        f"{'proxy CPU':>10}"
    )
    print(header)
    for outcome in (plugin, plain, direct):
        cpu = outcome.cpu_per_1k_tokens
        shares = [share_before(outcome.heavy, r.first_token_at) for r in outcome.light]
        waiting = str(outcome.max_waiting_seen) if outcome is plugin else "-"
        busy = outcome.proxy_cpu_s
        share = f"{busy / outcome.seconds:.0%}" if busy is not None else "-"
        print(
            f"{outcome.name:16}{outcome.light_ttft_p50:>14.3f}s{outcome.heavy_ttft_p50:>14.3f}s"
            f"{statistics.mean(shares):>18.0%} {outcome.tokens_per_s:>9.0f}"
            f"{outcome.seconds:>9.2f}s{waiting:>12}"
            f"{(f'{cpu:.3f}' if cpu is not None else '-'):>13}"
            f"{share:>10}"
        )
    with_p50, without_p50 = statistics.median(single[0]), statistics.median(single[1])
    ttft_ratio = plugin.light_ttft_p50 / direct.light_ttft_p50
    throughput_ratio = plugin.tokens_per_s / plain.tokens_per_s
    cpu_with, cpu_without = plugin.cpu_per_1k_tokens, plain.cpu_per_1k_tokens
    print(
        f"\none request at a time ({len(single[0])} each, {args.single_tokens} tokens, streamed): "
        f"p50 {with_p50 * 1000:.1f} ms with plugin, {without_p50 * 1000:.1f} ms without"
    )
    rows = [
        ("single-request p50, with / without", with_p50 / without_p50, "<= 1.05"),
        ("light users' TTFT, with plugin / direct", ttft_ratio, "<= 0.10"),
        ("engine throughput, with / without plugin", throughput_ratio, ">= 0.97"),
        ("engine max waiting with plugin", float(plugin.max_waiting_seen), f"<= {WAITING_BELOW}"),
    ]
    if cpu_with is not None and cpu_without is not None:
        rows.append(("proxy CPU per 1k tokens, with / without", cpu_with / cpu_without, "-"))
    print()
    for label, value, target in rows:
        print(f"  {label:44} {value:8.3f}   target {target}")
    print(
        f"\nload average (1 min) at start {args.load_at_start:.1f}, at end {os.getloadavg()[0]:.1f}"
        f" on {os.cpu_count()} CPUs ('proxy CPU': the proxy's share of one core during the flood)"
    )


async def main(args: argparse.Namespace) -> None:
    args.load_at_start = os.getloadavg()[0]
    engine = EmulatorConfig(
        models=("tiny",),
        max_num_seqs=MAX_NUM_SEQS,
        policy="priority",
        base_step_ms=8.0,
        step_ms_per_running_seq=0.0,
        prefill_ms_per_token=0.0,
        request_log_size=1000,
    )
    with tempfile.TemporaryDirectory(prefix="fair-sched-litellm-bench-") as tmp:
        workdir = Path(tmp)
        async with run_emulator_subprocess(engine) as emu, contextlib.AsyncExitStack() as exits:
            models = [model_entry("tiny", f"{emu.base_url}/v1")]
            print("starting two LiteLLM proxies ...", flush=True)
            plugin_proxy, plain_proxy = await asyncio.gather(
                exits.enter_async_context(
                    litellm_proxy(proxy_config(models, fair_sched_section()), workdir, "with")
                ),
                exits.enter_async_context(
                    litellm_proxy(
                        proxy_config(models, None, plugin=False, custom_auth=False),
                        workdir,
                        "without",
                    )
                ),
            )
            floods = []
            # With the plugin first: the fresh engine's max_waiting_seen is then its own.
            print("flood with the plugin ...", flush=True)
            floods.append(
                await flood(
                    "with plugin",
                    plugin_proxy.base_url,
                    (HEAVY_KEY, *LIGHT_KEYS),
                    emu.base_url,
                    args.flood,
                    args.tokens,
                    plugin_proxy,
                )
            )
            print("flood without the plugin ...", flush=True)
            floods.append(
                await flood(
                    "without plugin",
                    plain_proxy.base_url,
                    (MASTER_KEY, MASTER_KEY, MASTER_KEY),
                    emu.base_url,
                    args.flood,
                    args.tokens,
                    plain_proxy,
                )
            )
            print("flood direct to the engine ...", flush=True)
            floods.append(
                await flood(
                    "direct",
                    emu.base_url,
                    ("x", "y", "z"),
                    emu.base_url,
                    args.flood,
                    args.tokens,
                    None,
                )
            )
            print("one request at a time ...", flush=True)
            single = await one_at_a_time(
                plugin_proxy, plain_proxy, args.sequential, args.single_tokens
            )
        report(floods, single, args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=100, help="power user's requests")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per flood request")
    parser.add_argument("--sequential", type=int, default=30, help="single requests per proxy")
    parser.add_argument("--single-tokens", type=int, default=16)
    args = parser.parse_args()
    if not 1 <= args.flood <= 500 or not 1 <= args.sequential <= 500:
        parser.error("--flood and --sequential must be within 1..500")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
