"""The floor of a light user's TTFT in the speed-change scenario, by setting.

A light request arriving at a saturated engine, first in our round-robin, waits for the next
completion with no engine queue (`waiting_below: 0`) and for the second with a queue of one: no
threshold shortens the wait for a slot (the engine does not preempt). This simulates the
scenario's slot turnover (8 slots, power requests of 16-80 tokens, uniform, at the emulator's
step time, a 30 ms refill gap) and prints those waits' 95th percentiles plus the request's own
first step, per engine slowdown. Pure and seeded: `python benchmarks/slot_turnover.py`.
"""

from __future__ import annotations

import bisect
import random

SLOTS = 8
POWER_TOKENS = (16, 80)
STEP_S = 0.030 + 0.0005 * SLOTS  # the speed-change emulator's step at 8 running
REFILL_S = 0.03
SIMULATED_S = 20_000.0


def completions(step_s: float, rng: random.Random) -> list[float]:
    ends: list[float] = []
    for _ in range(SLOTS):
        at = rng.uniform(0.0, 8.0)
        while at < SIMULATED_S:
            at += rng.randint(*POWER_TOKENS) * step_s + REFILL_S
            ends.append(at)
    return sorted(ends)


def p95_wait(ends: list[float], nth: int, rng: random.Random, samples: int = 100_000) -> float:
    """The 95th percentile of the wait from a random moment to the `nth` next completion."""
    waits = []
    for _ in range(samples):
        at = rng.uniform(100.0, SIMULATED_S - 100.0)
        waits.append(ends[bisect.bisect(ends, at) + nth - 1] - at)
    waits.sort()
    return waits[int(0.95 * len(waits))]


def main() -> None:
    rng = random.Random(17)
    print("slowdown | completion every | p95 TTFT floor, queue 0 | queue 1")
    for slowdown in (1.0, 2.0, 3.0):
        step_s = STEP_S * slowdown
        ends = completions(step_s, rng)
        gap = (ends[-1] - ends[0]) / (len(ends) - 1)
        floor = [p95_wait(ends, nth, rng) + step_s for nth in (1, 2)]
        print(f"x{slowdown:g} | {gap:.2f} s | {floor[0]:.2f} s | {floor[1]:.2f} s")


if __name__ == "__main__":
    main()
