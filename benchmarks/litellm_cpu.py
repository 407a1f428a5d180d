"""The plugin's CPU inside LiteLLM: LiteLLM's CPU per relayed token, with the plugin and without.

Issue #17's shared-process layout: on two shared cores a LiteLLM proxy's relaying is the
bottleneck, so every millisecond the plugin adds per token is throughput lost. This puts
LiteLLM's CPU in the foreground: one emulated engine (a subprocess, 8 slots, 1 ms a step, so it
is never what limits the flood) behind one `litellm --config` proxy per variant, all started
first, then floods of streamed requests (`--concurrency` in flight, `--requests` in all,
`--tokens` each, `stream_options.include_usage` as the real-vLLM stage sends), the variants
alternating round by round. Measured per flood: CPU seconds (utime + stime from /proc) of every
process in the proxy's process group, divided by the content chunks the client received
(one token each from the emulator) and by the requests. Before the floods, every proxy's CPU
per second while no request runs (`--idle-s`): a cost per second, not per token, which a flood
pays over its whole length (the plugin's metrics watcher scrapes each engine ten times a
second at `metrics_poll_ms: 100`).

Variants: `plain` (LiteLLM alone: no callback, no custom_auth, the master key) and `plugin`
(callback + custom_auth + a `fair_sched:` section like the real-vLLM stage's, the interactive
tier on `waiting_below: auto`).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/litellm_cpu.py [--rounds 3] [--requests 120]
        [--compare-with ../other-checkout]   # before/after: that checkout's plugin as a third proxy

Prints numbers, asserts nothing. About 3-5 minutes on two cores (most of it starting proxies
and relaying). `uptime` before and after: the numbers are only comparable within one run.
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

from fair_sched_plugin.emulator import EmulatorConfig, run_emulator_subprocess
from tests.integrations.litellm_harness import (
    MASTER_KEY,
    ProxyProcess,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
    stream_chat,
)

CHAT = "/v1/chat/completions"
MODEL = "tiny"
POWER_KEY = "sk-power"
FLOOD_TIMEOUT_S = 300.0
WARMUP_REQUESTS = 8


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


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every live process in process group `pgid` (the proxy and any worker)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            # After the command name: pgrp is field 5, utime 14, stime 15 (1-based, man 5 proc).
            if int(fields[2]) == pgid:
                total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


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
                if result.status != 200 or result.content_chunks != tokens:
                    failures.append(f"{result.status} {result.content_chunks} {result.error}")
                received += result.content_chunks

        cpu_before = group_cpu_seconds(proxy.pid)
        started = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(*(worker() for _ in range(concurrency))), FLOOD_TIMEOUT_S
        )
        seconds = time.perf_counter() - started
        cpu = group_cpu_seconds(proxy.pid) - cpu_before
    if failures:
        raise RuntimeError(f"{variant}: {len(failures)} requests failed, e.g. {failures[0]}")
    return Flood(variant, cpu, seconds, requests, received)


def summary(floods: Sequence[Flood], names: Sequence[str]) -> list[str]:
    lines = [
        f"{'variant':28}{'ms CPU/token':>14}{'ms CPU/request':>16}{'tokens/s':>10}"
        f"{'vs plain':>10}   (median of rounds; every round's ms/token)"
    ]
    medians: dict[str, float] = {}
    for name in names:
        mine = [f for f in floods if f.variant == name]
        medians[name] = statistics.median(f.ms_per_token for f in mine)
    for name in names:
        mine = [f for f in floods if f.variant == name]
        base = medians.get("plain")
        ratio = f"{medians[name] / base:.3f}" if base else "-"
        each = " ".join(f"{f.ms_per_token:.3f}" for f in mine)
        lines.append(
            f"{name:28}{medians[name]:>14.3f}"
            f"{statistics.median(f.ms_per_request for f in mine):>16.1f}"
            f"{statistics.median(f.tokens_per_s for f in mine):>10.0f}{ratio:>10}   {each}"
        )
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


async def run(
    variants: Sequence[Variant], args: argparse.Namespace, workdir: Path
) -> tuple[list[Flood], dict[str, float]]:
    engine = EmulatorConfig(
        models=(MODEL,),
        max_num_seqs=8,
        policy="priority",
        base_step_ms=1.0,
        step_ms_per_running_seq=0.0,
        prefill_ms_per_token=0.0,
        request_log_size=100,
    )
    floods: list[Flood] = []
    async with run_emulator_subprocess(engine) as emu, contextlib.AsyncExitStack() as exits:
        models = [model_entry(MODEL, f"{emu.base_url}/v1")]
        proxies: dict[str, ProxyProcess] = {}
        for variant in variants:  # one at a time: each start is ~10 s of CPU
            print(f"starting LiteLLM ({variant.name}) ...", flush=True)
            proxies[variant.name] = await exits.enter_async_context(
                litellm_proxy(variant.config(models), workdir, variant.name, env=variant.env)
            )
        for variant in variants:  # lazy imports, connection pools, the first requests' paths
            await flood(
                variant.name, proxies[variant.name], variant.key, WARMUP_REQUESTS, 4, args.tokens
            )
        idle = await idle_cpu(proxies, args.idle_s) if args.idle_s > 0 else {}
        for name, cpu_ms in idle.items():
            print(f"idle {name:24} {cpu_ms:.1f} ms CPU per second", flush=True)
        for index in range(args.rounds):
            order = variants if index % 2 == 0 else list(reversed(variants))
            for variant in order:
                result = await flood(
                    variant.name,
                    proxies[variant.name],
                    variant.key,
                    args.requests,
                    args.concurrency,
                    args.tokens,
                )
                print(
                    f"round {index + 1} {variant.name:24} {result.ms_per_token:.3f} ms/token "
                    f"{result.ms_per_request:.1f} ms/request {result.tokens_per_s:.0f} tokens/s",
                    flush=True,
                )
                floods.append(result)
    return floods, idle


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=120, help="streams per flood")
    parser.add_argument("--concurrency", type=int, default=24, help="streams in flight")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per stream")
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
        floods, idle = asyncio.run(run([known[name] for name in names], args, Path(tmp)))
    print(
        f"\n{args.rounds} rounds of {args.requests} streams x {args.tokens} tokens, "
        f"{args.concurrency} in flight, variants alternating\n"
    )
    print("\n".join(summary(floods, names)))
    if idle:
        print(
            f"\nidle ({args.idle_s:g} s, no requests), CPU ms per second: "
            + ", ".join(f"{name} {cpu_ms:.1f}" for name, cpu_ms in idle.items())
        )
    print(
        f"\nload average (1, 5 min) before {load_before[0]:.2f} {load_before[1]:.2f}, after "
        f"{os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
