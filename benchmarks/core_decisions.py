"""Core scheduler throughput: admit+release pairs per second, decision latency, bytes per ticket.

    .venv/bin/python benchmarks/core_decisions.py [--users 10 1000 10000] [--pairs 200000]

With U backlogged users (each with a few parked requests), every pair is: one lease ends, which
releases the next waiter (an O(log U) heap decision), then one new ticket is admitted to keep the
backlog constant. The clock is fake and the gate an in-flight limit, so only the core is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
import tracemalloc

from fair_sched_plugin.core import (
    FairnessPolicy,
    FairScheduler,
    InflightLimitGate,
    Lease,
    Ticket,
    TierLimits,
)
from fair_sched_plugin.testing import FakeClock

TIERS = (TierLimits("interactive", waiting_below=3), TierLimits("batch", waiting_below=1))


async def _run_pairs(users: int, pairs: int, fairness: FairnessPolicy) -> tuple[float, list[float]]:
    clock = FakeClock()
    gate = InflightLimitGate(8)
    scheduler = FairScheduler(
        TIERS,
        gate,
        clock=clock,
        fairness=fairness,
        max_per_user=10,
        max_total=10 * users + 100,
    )
    granted: list[Lease] = []
    loop = asyncio.get_running_loop()

    def park(user: int) -> None:
        # A waiter without a task: the future is resolved by the release decision itself.
        waiter_ticket = Ticket(model="m", user=f"u{user}", tier="interactive", cost=100)
        future = scheduler._enqueue(waiter_ticket).future
        future.add_done_callback(
            lambda f: granted.append(f.result()) if not (f.cancelled() or f.exception()) else None
        )

    for user in range(users):
        park(user)
        park(user)
    scheduler._dispatch("m")
    await asyncio.sleep(0)
    latencies = []
    started = time.perf_counter()
    next_user = 0
    for index in range(pairs):
        lease = granted.pop(0) if granted else None
        if lease is None:
            await asyncio.sleep(0)
            lease = granted.pop(0)
        t0 = time.perf_counter_ns()
        lease.release(tokens_used=120)  # ends one lease and releases the next waiter
        park(next_user)
        t1 = time.perf_counter_ns()
        next_user = (next_user + 1) % users
        if index % 16 == 0:
            latencies.append((t1 - t0) / 1000)
        if not granted:
            await asyncio.sleep(0)  # let done-callbacks deliver the newly granted leases
    elapsed = time.perf_counter() - started
    assert loop is asyncio.get_running_loop()
    scheduler.close()
    return pairs / elapsed, latencies


async def _bytes_per_ticket(count: int) -> float:
    gc.collect()
    tracemalloc.start()
    clock = FakeClock()
    scheduler = FairScheduler(
        TIERS, InflightLimitGate(1), clock=clock, max_per_user=count, max_total=count
    )
    before = tracemalloc.get_traced_memory()[0]
    futures = [
        scheduler._enqueue(
            Ticket(model="m", user=f"u{i % 1000}", tier="interactive", cost=100)
        ).future
        for i in range(count)
    ]
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    scheduler.close()
    for future in futures:
        future.exception()
    return (after - before) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[10, 1000, 10000])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument(
        "--fairness", default="round_robin", choices=["round_robin", "weighted", "tokens"]
    )
    args = parser.parse_args()
    print(f"fairness={args.fairness} pairs={args.pairs}")
    print(f"{'backlogged users':>17} {'pairs/s':>10} {'p50 us':>8} {'p99 us':>8}")
    for users in args.users:
        rate, latencies = asyncio.run(_run_pairs(users, args.pairs, args.fairness))
        quantiles = statistics.quantiles(latencies, n=100)
        print(f"{users:>17} {rate:>10,.0f} {quantiles[49]:>8.1f} {quantiles[98]:>8.1f}")
    per_ticket = asyncio.run(_bytes_per_ticket(50_000))
    print(
        f"bytes per parked ticket (50,000 parked; waiter, future, queue entries): {per_ticket:,.0f}"
    )


if __name__ == "__main__":
    main()
