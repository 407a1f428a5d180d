"""Bytecode instructions the interpreter runs per admit+release pair of the core: a count that
does not vary with the machine's load, for comparing two versions of the core where the time
per pair does (`core_decisions.py` on a shared machine varies by about 10 % between two runs of
the same code).

    PYTHONPATH=<checkout> .venv/bin/python benchmarks/core_opcodes.py [--users 10 1000]

The same workload as `core_decisions.py --layer core`: U backlogged users, a lease ends (which
releases the next waiter), then a ticket is admitted to keep the backlog constant. Counted with
`sys.settrace` opcode events, after a warm-up; only the pairs are counted.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from types import FrameType
from typing import Any

from fair_sched_plugin.core import InflightLimitGate, Lease, SchedulerCore, Ticket, TierLimits
from fair_sched_plugin.testing import FakeClock

TIERS = (TierLimits("interactive", waiting_below=3), TierLimits("batch", waiting_below=1))
POLICIES = ("round_robin", "weighted", "tokens", "cost")


class _CollectingCore(SchedulerCore):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.granted: deque[Lease] = deque()

    def _decided(self, parked: object, outcome: object) -> None:
        if isinstance(outcome, Lease):
            self.granted.append(outcome)


def opcodes_per_pair(users: int, pairs: int, fairness: Any) -> float:
    core = _CollectingCore(
        TIERS,
        InflightLimitGate(8),
        clock=FakeClock(),
        fairness=fairness,
        max_per_user=10,
        max_total=10 * users + 100,
    )
    tickets = [
        Ticket(model="m", user=f"u{user}", tier="interactive", cost=100) for user in range(users)
    ]
    for ticket in tickets:
        core.submit(ticket)
        core.submit(ticket)
    for index in range(200):  # to a steady state
        core.granted.popleft().release(tokens_used=120)
        core.submit(tickets[index % users])
    counted = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal counted
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        if event == "opcode":
            counted += 1
        return tracer

    sys.settrace(tracer)
    try:
        for index in range(pairs):
            core.granted.popleft().release(tokens_used=120)
            core.submit(tickets[index % users])
    finally:
        sys.settrace(None)
    return counted / pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--pairs", type=int, default=2000)
    args = parser.parse_args()
    print(f"{'fairness':>12} {'users':>6} {'opcodes/pair':>13}")
    for fairness in POLICIES:
        for users in args.users:
            count = opcodes_per_pair(users, args.pairs, fairness)
            print(f"{fairness:>12} {users:6d} {count:13.1f}")


if __name__ == "__main__":
    main()
