"""How many streamed tokens per second the engine emulator sustains.

The emulator must never be the bottleneck of our measurements. This runs it in a subprocess
pinned to one core (clients on the other cores, where there are any), with a 1 ms step and no
per-sequence step cost, and lets 64 concurrent streaming clients pull tokens for a fixed time.
It prints the streamed tokens/s and the emulator's CPU time per 1,000 tokens; the latter gives
its capacity on one core even when the clients, not the emulator, are what limits the rate.

    .venv/bin/python benchmarks/emulator_throughput.py [--clients 64] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from fair_sched_plugin.lab.emulator import EmulatorConfig, run_emulator_subprocess

TARGET_TOKENS_PER_S = 2_000


@dataclass
class Tally:
    tokens: int = 0
    requests: int = 0
    transport_errors: int = 0


def _process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process from /proc (Linux); None elsewhere."""
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():
        return None
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pin(pid: int, cores: set[int]) -> None:
    if hasattr(os, "sched_setaffinity") and cores:
        os.sched_setaffinity(pid, cores)


def _usage_tokens(stream_tail: bytes) -> int:
    """completion_tokens of the usage chunk at the end of a stream."""
    for line in reversed(stream_tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            return int(json.loads(line[len(b"data: ") :])["usage"]["completion_tokens"])
    raise ValueError("the stream ended without a usage chunk")


async def _stream_until(
    http: httpx.AsyncClient, deadline: float, max_tokens: int, tally: Tally
) -> None:
    body = {
        "prompt": "benchmark",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        tail = b""
        try:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for chunk in response.aiter_raw():
                    tail = (tail + chunk)[-1024:]  # only the usage chunk at the end matters
        except httpx.TransportError as exc:
            # Counted and reported, not fatal: one reset connection should not void a run.
            tally.transport_errors += 1
            print(f"transport error: {exc!r}", file=sys.stderr)
            continue
        tally.tokens += _usage_tokens(tail)
        tally.requests += 1


async def measure(clients: int, seconds: float, max_tokens: int) -> int:
    config = EmulatorConfig(
        max_num_seqs=clients,
        base_step_ms=1.0,
        step_ms_per_running_seq=0.0,
        prefill_ms_per_token=0.0,
    )
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    async with run_emulator_subprocess(config) as emulator:
        pid = emulator.process.pid
        if len(cores) > 1:
            _pin(pid, {cores[0]})
            _pin(0, set(cores[1:]))
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=emulator.base_url, limits=limits, timeout=30) as http:
            tally = Tally()
            loop = asyncio.get_running_loop()
            cpu_before = _process_cpu_seconds(pid)
            client_cpu_before = time.process_time()
            started = loop.time()
            deadline = started + seconds
            await asyncio.gather(
                *(_stream_until(http, deadline, max_tokens, tally) for _ in range(clients))
            )
            elapsed = loop.time() - started
            cpu_after = _process_cpu_seconds(pid)
            client_cpu = time.process_time() - client_cpu_before
    rate = tally.tokens / elapsed
    print(f"clients: {clients}, max_tokens: {max_tokens}, cores: {len(cores) or 'unknown'}")
    print(
        f"requests: {tally.requests}, tokens: {tally.tokens}, elapsed: {elapsed:.2f} s, "
        f"transport errors: {tally.transport_errors}"
    )
    print(f"streamed tokens/s (sustained): {rate:,.0f}  (target >= {TARGET_TOKENS_PER_S:,})")
    print(f"client CPU: {1000 * client_cpu / tally.tokens:.3f} s per 1,000 tokens")
    if cpu_before is not None and cpu_after is not None:
        emulator_cpu = cpu_after - cpu_before
        print(
            f"emulator CPU: {emulator_cpu:.2f} s = {1000 * emulator_cpu / tally.tokens:.3f} s "
            f"per 1,000 tokens -> capacity on one core ~ {tally.tokens / emulator_cpu:,.0f} "
            f"tokens/s (utilisation {emulator_cpu / elapsed:.0%})"
        )
    return 0 if rate >= TARGET_TOKENS_PER_S and not tally.transport_errors else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    return asyncio.run(measure(args.clients, args.seconds, args.max_tokens))


if __name__ == "__main__":
    sys.exit(main())
