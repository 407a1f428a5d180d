"""The speed-change scenario: fixed `waiting_below` 0, 1, 3 and 8 against `auto`.

A power user keeps the engine overloaded (a closed loop of streaming requests) and two light
users send one request each every `light_every_s`; all are in the `interactive` tier. After
`before_s` the emulator's `slow` fault makes every engine step `slow` times longer for `slow_s`,
then it is switched off again. Each variant has its own engine and gateway and runs alone.

Measured per variant: engine tokens/s over the run; the light users' TTFT p95 outside the
transitions (the `transition_s` after each switch) and per phase; the engine's mean running
sequences while requests were parked in front of it (sent by the clients, not yet received by
the engine) against its `max_num_seqs`; and a time series of the allowed queue (the gate's
`waiting_threshold` from the status page) and of the light users' TTFT, for the plot.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ...observability import STATUS_PATH
from .client import Caller, RequestRecord, make_client, stream_one
from .flood import (
    LIGHT_KEYS,
    POWER_KEY,
    WARM_UP_TOKENS,
    Gateway,
    Target,
    Variant,
)
from .processes import MASTER_KEY, EmulatorSettings, engine_stats

# 8 slots at ~34 ms a step: 48 tokens take ~1.6 s, 3x that while slow. Slow enough that the
# engine, not the proxies' CPU on a shared 2-core machine, is the bottleneck.
SPEED_ENGINE = EmulatorSettings(max_num_seqs=8, policy="fcfs", step_ms=30.0, step_ms_per_seq=0.5)
SAMPLE_EVERY_S = 0.25
# The status page is rendered by the gateway: read it less often than the engine's counters.
ALLOWED_EVERY_S = 1.0


@dataclass(frozen=True)
class SpeedChangeSize:
    before_s: float = 20.0
    slow_s: float = 20.0
    after_s: float = 20.0
    slow: float = 3.0
    power_concurrency: int = 16
    # Light: 0.5 requests/s together, 30% of the slow engine's 1.7 requests/s. At one every 2 s
    # each they asked for about their round-robin share while slow and queued behind themselves.
    light_every_s: float = 4.0
    max_tokens: int = 48
    # The power user's lengths vary (uniform, seeded): equal lengths make the engine run in
    # lockstep waves whose slots all free at once, and a light user's TTFT then depends on where
    # in the wave it arrives more than on the queue.
    power_tokens: tuple[int, int] = (16, 80)
    ttft_target_ms: float = 2000.0
    # After a switch: the queue formed before it drains at the new pace (8 queued at 1.7
    # requests/s while slow: ~5 s), and a controller needs a few seconds to see the change.
    transition_s: float = 8.0

    @property
    def total_s(self) -> float:
        return self.before_s + self.slow_s + self.after_s

    @property
    def switches(self) -> tuple[float, float]:
        return self.before_s, self.before_s + self.slow_s


QUICK_SPEED_SIZE = SpeedChangeSize(before_s=10.0, slow_s=10.0, after_s=10.0, transition_s=4.0)


# The fixed settings `auto`'s throughput is compared with (the best of them).
COMPARED_FIXED = ("fixed_1", "fixed_3", "fixed_8")


def speed_change_variants(size: SpeedChangeSize) -> list[Variant]:
    """Fixed 0 (no engine queue), 1, 3 and 8, and auto with the scenario's TTFT target (its
    default minimum of 1, and a minimum of 0), through the standalone fair proxy: the same core
    as the plugin, without LiteLLM's per-chunk CPU cost, which on a shared 2-core machine would
    make six LiteLLM proxies, not the engine, the bottleneck (the real-vLLM comparison through
    LiteLLM is `benchmarks/auto_vs_fixed.py`). Every gateway is told the engine's slots
    (`max_num_seqs`): without a queue the gate cannot learn them without queueing requests."""
    gateway: Gateway = "fair_proxy"
    slots = SPEED_ENGINE.max_num_seqs
    fixed = [
        Variant(f"fixed_{n}", f"waiting_below {n}", gateway, waiting_below=n, max_num_seqs=slots)
        for n in (0, 1, 3, 8)
    ]
    target = f"TTFT target {size.ttft_target_ms:.0f} ms"
    auto = [
        Variant(
            "auto",
            f"waiting_below auto ({target})",
            gateway,
            waiting_below="auto",
            ttft_target_ms=size.ttft_target_ms,
            max_num_seqs=slots,
        ),
        Variant(
            "auto_min_0",
            f"waiting_below auto, min 0 ({target})",
            gateway,
            waiting_below="auto",
            ttft_target_ms=size.ttft_target_ms,
            auto_min=0,
            max_num_seqs=slots,
        ),
    ]
    return [*fixed, *auto]


@dataclass
class Sample:
    at: float
    running: int
    waiting: int
    parked: int
    generated_tokens: int
    allowed: float | None


@dataclass
class SpeedChangeResult:
    variant: Variant
    records: list[RequestRecord]
    samples: list[Sample] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


async def play_speed_change(
    target: Target, size: SpeedChangeSize, progress: Callable[[str], None]
) -> SpeedChangeResult:
    variant = target.variant
    power = Caller("power", "power", POWER_KEY)
    lights = [Caller(f"light-{i + 1}", "light", key) for i, key in enumerate(LIGHT_KEYS)]
    records: list[RequestRecord] = []
    samples: list[Sample] = []
    sent = 0
    lengths = random.Random(17)  # the same lengths for every variant
    async with make_client(connections=size.power_concurrency + 32) as client:
        await _set_slow(client, target.engine_base, 1.0)
        await stream_one(client, target.base_url, power, WARM_UP_TOKENS, time.perf_counter())
        progress(f"[{variant.name}] {size.total_s:.0f} s, slow x{size.slow:g} from "
                 f"{size.before_s:.0f} s to {size.before_s + size.slow_s:.0f} s ...")  # fmt: skip
        before = await engine_stats(client, target.engine_base)
        received_at_start = before.get("requests_received", 0)
        clock_zero = time.perf_counter()
        deadline = clock_zero + size.total_s

        async def send(caller: Caller, max_tokens: int) -> None:
            nonlocal sent
            sent += 1
            records.append(
                await stream_one(client, target.base_url, caller, max_tokens, clock_zero)
            )

        async def power_loop() -> None:
            while time.perf_counter() < deadline:
                await send(power, lengths.randint(*size.power_tokens))

        async def light_loop(caller: Caller, offset_s: float) -> None:
            await asyncio.sleep(offset_s)
            tasks = []
            while time.perf_counter() < deadline:
                tasks.append(asyncio.ensure_future(send(caller, size.max_tokens)))
                await asyncio.sleep(size.light_every_s)
            await asyncio.gather(*tasks, return_exceptions=True)

        async def switch_speed() -> None:
            first, second = size.switches
            await asyncio.sleep(first)
            await _set_slow(client, target.engine_base, size.slow)
            await asyncio.sleep(second - first)
            await _set_slow(client, target.engine_base, 1.0)

        allowed_now: list[float | None] = [None]

        async def sample_engine() -> None:
            while time.perf_counter() < deadline:
                stats = await engine_stats(client, target.engine_base)
                received = stats.get("requests_received", 0) - received_at_start
                samples.append(
                    Sample(
                        at=time.perf_counter() - clock_zero,
                        running=stats.get("running", 0),
                        waiting=stats.get("waiting", 0),
                        parked=max(0, sent - received),
                        generated_tokens=stats.get("generation_tokens_total", 0),
                        allowed=allowed_now[0],
                    )
                )
                await asyncio.sleep(SAMPLE_EVERY_S)

        async def sample_allowed() -> None:
            while time.perf_counter() < deadline:
                allowed_now[0] = await _allowed_queue(client, target)
                await asyncio.sleep(ALLOWED_EVERY_S)

        workers = [
            *(power_loop() for _ in range(size.power_concurrency)),
            *(light_loop(caller, i * size.light_every_s / 2) for i, caller in enumerate(lights)),
            switch_speed(),
            sample_engine(),
            sample_allowed(),
        ]
        # The clients stop sending at the deadline; requests still running then are cut off
        # after a bounded wait (the report counts tokens inside the run only).
        run = asyncio.gather(*workers)
        await asyncio.wait({run}, timeout=size.total_s)
        after = await engine_stats(client, target.engine_base)
        elapsed = time.perf_counter() - clock_zero
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run, 30.0)
        await _set_slow(client, target.engine_base, 1.0)
    result = SpeedChangeResult(variant, records, samples)
    generated = after.get("generation_tokens_total", 0) - before.get("generation_tokens_total", 0)
    result.summary = summarize_speed_change(result, size, SPEED_ENGINE.max_num_seqs)
    result.summary["tokens_per_s"] = generated / elapsed
    progress(
        f"[{variant.name}] done: {result.summary['tokens_per_s']:.0f} tokens/s, light TTFT p95 "
        f"{_fmt(result.summary['light_ttft_p95_steady_s'])} outside transitions, mean running "
        f"while parked {result.summary['mean_running_while_parked']:.2f}"
    )
    return result


def summarize_speed_change(
    result: SpeedChangeResult, size: SpeedChangeSize, max_num_seqs: int
) -> dict[str, Any]:
    samples = [s for s in result.samples if s.at <= size.total_s]
    tokens_per_s = None
    if len(samples) >= 2:  # play_speed_change replaces it with the exact count over the run
        first, last = samples[0], samples[-1]
        tokens_per_s = (last.generated_tokens - first.generated_tokens) / (last.at - first.at)
    parked = [s.running for s in samples if s.parked > 0]
    first_switch, second_switch = size.switches

    def in_transition(at: float) -> bool:
        return any(switch <= at < switch + size.transition_s for switch in size.switches)

    def while_slow(at: float) -> bool:
        return first_switch <= at < second_switch

    light = [r for r in result.records if r.group == "light" and r.ttft is not None]

    def p95(records: Sequence[RequestRecord]) -> float | None:
        values = sorted(r.ttft for r in records if r.ttft is not None)
        # Nearest rank: with few requests the slowest counts rather than being rounded away.
        return values[math.ceil(0.95 * len(values)) - 1] if values else None

    fast = [r for r in light if not first_switch <= r.started < second_switch]
    slow = [r for r in light if first_switch <= r.started < second_switch]
    return {
        "tokens_per_s": tokens_per_s or 0.0,
        "light_ttft_p95_steady_s": p95([r for r in light if not in_transition(r.started)]),
        "light_ttft_p95_fast_s": p95([r for r in fast if not in_transition(r.started)]),
        "light_ttft_p95_slow_s": p95([r for r in slow if not in_transition(r.started)]),
        "light_requests": len(light),
        "errors": sum(1 for r in result.records if r.error),
        "mean_running_while_parked": sum(parked) / len(parked) if parked else 0.0,
        "max_num_seqs": max_num_seqs,
        "samples_parked": len(parked),
        "mean_allowed_fast": _mean_allowed(samples, lambda at: not while_slow(at)),
        "mean_allowed_slow": _mean_allowed(
            samples, lambda at: while_slow(at) and not in_transition(at)
        ),
    }


def _mean_allowed(samples: Sequence[Sample], keep: Callable[[float], bool]) -> float | None:
    values = [s.allowed for s in samples if s.allowed is not None and keep(s.at)]
    return sum(values) / len(values) if values else None


async def _set_slow(client: httpx.AsyncClient, engine_base: str, slow: float) -> None:
    with contextlib.suppress(httpx.HTTPError):
        await client.post(f"{engine_base.rstrip('/')}/emulator/faults", json={"slow": slow})


async def _allowed_queue(client: httpx.AsyncClient, target: Target) -> float | None:
    """The interactive tier's allowed engine queue from the gateway's status page."""
    base = target.base_url.removesuffix("/v1")
    try:
        response = await client.get(
            f"{base}{STATUS_PATH}", headers={"authorization": f"Bearer {MASTER_KEY}"}
        )
        document = response.json()
        value = document["models"]["tiny"]["gate"]["waiting_threshold"]["interactive"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return float(value)


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


__all__ = [
    "COMPARED_FIXED",
    "QUICK_SPEED_SIZE",
    "SPEED_ENGINE",
    "SpeedChangeResult",
    "SpeedChangeSize",
    "play_speed_change",
    "speed_change_variants",
    "summarize_speed_change",
]
