"""Core scheduler throughput: admit+release pairs per second, decision latency, bytes per ticket.

    .venv/bin/python benchmarks/core_decisions.py [--users 10 1000 10000] [--pairs 200000]\
        [--cpu-time] [--held 0.5] [--layer core driver]

Two layers, each measured alone: `core`, the sans-I/O `SchedulerCore` driven by events (its
decisions collected, no event loop), and `driver`, the whole admission through memory://'s
`FairScheduler` (a future per parked ticket, resolved by the decision, delivered by the loop).

With U backlogged users (each with a few parked requests), every pair is: one lease ends, which
releases the next waiter (an O(log U) heap decision), then one new ticket is admitted to keep the
backlog constant. The clock is fake and the gate an in-flight limit, so only the core is measured.
`--held F`: the gate says a fraction F of the users' requests would rather go to another
deployment (`prefers_elsewhere`), so decisions run the look-ahead (F=1: every decision looks at
the head and LOOKAHEAD more users, then releases the head: the worst case).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
import tracemalloc
from collections import deque

from fair_sched_plugin.core import (
    FairnessPolicy,
    InflightLimitGate,
    Lease,
    SchedulerCore,
    Ticket,
    TierLimits,
)
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.testing import FakeClock

# Wall time by default; `--cpu-time` counts this process's CPU time instead, for a machine that
# other work shares (waiting for a core then does not count).
_seconds = time.perf_counter
_nanoseconds = time.perf_counter_ns
# One pair in this many is timed alone (p50, p99). Only those read the clock: reading CPU time
# is a system call (~0.2 µs, twice a pair), which the pairs per second must not count (read on
# every pair, it was ~9 % of a pair under --cpu-time).
SAMPLE_EVERY = 16

TIERS = (TierLimits("interactive", waiting_below=3), TierLimits("batch", waiting_below=1))


class _HeldGate(InflightLimitGate):
    """An in-flight limit whose `prefers_elsewhere` holds back the users in `held`."""

    def __init__(self, limit: int, held: frozenset[str]) -> None:
        super().__init__(limit)
        self._held = held

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        return ticket.user in self._held


class _CollectingCore(SchedulerCore):
    """The core with its grants appended to a deque (what a driver would resolve)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.granted: deque[Lease] = deque()

    def _decided(self, parked: object, outcome: object) -> None:
        if isinstance(outcome, Lease):
            self.granted.append(outcome)


def _held_users(users: int, held: float) -> frozenset[str]:
    # Spread evenly over the fairness order (as many as users * held).
    return frozenset(
        f"u{user}" for user in range(users) if int(user * held) != int((user + 1) * held)
    )


def _run_core_pairs(
    users: int, pairs: int, fairness: FairnessPolicy, held: float = 0.0
) -> tuple[float, list[float]]:
    core = _CollectingCore(
        TIERS,
        _HeldGate(8, _held_users(users, held)),
        clock=FakeClock(),
        fairness=fairness,
        max_per_user=10,
        max_total=10 * users + 100,
    )
    granted = core.granted
    tickets = [
        Ticket(model="m", user=f"u{user}", tier="interactive", cost=100) for user in range(users)
    ]
    for ticket in tickets:
        core.submit(ticket)
        core.submit(ticket)
    latencies = []
    started = _seconds()
    next_user = 0
    for index in range(pairs):
        lease = granted.popleft()
        if index % SAMPLE_EVERY:
            lease.release(tokens_used=120)  # ends one lease and releases the next waiter
            core.submit(tickets[next_user])
        else:
            t0 = _nanoseconds()
            lease.release(tokens_used=120)
            core.submit(tickets[next_user])
            latencies.append((_nanoseconds() - t0) / 1000)
        next_user = (next_user + 1) % users
    elapsed = _seconds() - started
    core.close()
    return pairs / elapsed, latencies


def _core_bytes_per_ticket(count: int) -> float:
    gc.collect()
    tracemalloc.start()
    core = _CollectingCore(
        TIERS, InflightLimitGate(1), clock=FakeClock(), max_per_user=count, max_total=count
    )
    holder = core.try_acquire(Ticket(model="m", user="holder", tier="interactive"))
    assert holder is not None
    tickets = [
        Ticket(model="m", user=f"u{i % 1000}", tier="interactive", cost=100) for i in range(count)
    ]
    before = tracemalloc.get_traced_memory()[0]
    parked = [core.submit(ticket) for ticket in tickets]
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    core.close()
    del parked
    return (after - before) / count


async def _run_pairs(
    users: int, pairs: int, fairness: FairnessPolicy, held: float = 0.0
) -> tuple[float, list[float]]:
    clock = FakeClock()
    gate = _HeldGate(8, _held_users(users, held))
    scheduler = FairScheduler(
        TIERS,
        gate,
        clock=clock,
        fairness=fairness,
        max_per_user=10,
        max_total=10 * users + 100,
    )
    granted: deque[Lease] = deque()
    loop = asyncio.get_running_loop()
    names = [f"u{user}" for user in range(users)]

    def on_granted(future: asyncio.Future[Lease]) -> None:
        if not (future.cancelled() or future.exception()):
            granted.append(future.result())

    def park(user: int) -> None:
        # A waiter without a task (as the shared-state leader waits): the reservation's future
        # is resolved by the release decision itself. `enqueue()` runs that decision each time.
        waiter_ticket = Ticket(model="m", user=names[user], tier="interactive", cost=100)
        scheduler.enqueue(waiter_ticket).future.add_done_callback(on_granted)

    for user in range(users):
        park(user)
        park(user)
    await asyncio.sleep(0)
    latencies = []
    started = _seconds()
    next_user = 0
    for index in range(pairs):
        if not granted:
            await asyncio.sleep(0)
        lease = granted.popleft()
        if index % SAMPLE_EVERY:
            lease.release(tokens_used=120)  # ends one lease and releases the next waiter
            park(next_user)
        else:
            t0 = _nanoseconds()
            lease.release(tokens_used=120)
            park(next_user)
            latencies.append((_nanoseconds() - t0) / 1000)
        next_user = (next_user + 1) % users
        if not granted:
            await asyncio.sleep(0)  # let done-callbacks deliver the newly granted leases
    elapsed = _seconds() - started
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
    # One lease holds the only slot, so every reservation below stays parked.
    holder = scheduler.try_acquire(Ticket(model="m", user="holder", tier="interactive"))
    assert holder is not None
    before = tracemalloc.get_traced_memory()[0]
    # What the caller keeps is the future (as `acquire()` does); the reservation is a handle.
    futures = [
        scheduler.enqueue(
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
    parser.add_argument("--cpu-time", action="store_true", help="measure process CPU time")
    parser.add_argument(
        "--held", type=float, default=0.0, help="fraction of users held back for their prefix"
    )
    parser.add_argument(
        "--layer", nargs="+", default=["core", "driver"], choices=["core", "driver"]
    )
    args = parser.parse_args()
    if args.cpu_time:
        global _seconds, _nanoseconds
        _seconds, _nanoseconds = time.process_time, time.process_time_ns
    clock = "CPU" if args.cpu_time else "wall"
    print(f"fairness={args.fairness} pairs={args.pairs} held={args.held:g} ({clock} time)")
    print(f"{'layer':>7} {'backlogged users':>17} {'pairs/s':>10} {'p50 us':>8} {'p99 us':>8}")
    for layer in args.layer:
        for users in args.users:
            if layer == "core":
                rate, latencies = _run_core_pairs(users, args.pairs, args.fairness, args.held)
            else:
                rate, latencies = asyncio.run(
                    _run_pairs(users, args.pairs, args.fairness, args.held)
                )
            quantiles = statistics.quantiles(latencies, n=100)
            print(
                f"{layer:>7} {users:>17} {rate:>10,.0f} {quantiles[49]:>8.1f} {quantiles[98]:>8.1f}"
            )
    if "core" in args.layer:
        per_ticket = _core_bytes_per_ticket(50_000)
        print(f"core: bytes per parked ticket (50,000 parked; queue entries): {per_ticket:,.0f}")
    if "driver" in args.layer:
        per_ticket = asyncio.run(_bytes_per_ticket(50_000))
        what = "50,000 parked; reservation, future, queue entries"
        print(f"driver: bytes per parked ticket ({what}): {per_ticket:,.0f}")


if __name__ == "__main__":
    main()
