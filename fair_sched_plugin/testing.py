"""Test doubles for code built on fair-sched: a clock that moves only when told to, a gate
opened by hand (in the spirit of `trio.testing.MockClock`), and the few helpers every scheduler
test needs (tickets, waiting callers, letting woken tasks run, closing down).

Pure like the core: importing this module pulls in no HTTP stack, LiteLLM or Redis.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any, Protocol

from .core.gate import CapacityListener
from .core.snapshot import BackendSnapshot
from .core.ticket import Lease, Ticket, TierLimits
from .runtime.driver import FairScheduler, TimerHandle

__all__ = [
    "FakeClock",
    "GateLeaseOwner",
    "ManualGate",
    "drain",
    "make_ticket",
    "released_users",
    "settle",
    "snapshot",
    "submit",
]


class _FakeTimer:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A `Clock` that moves only when told to; `advance()` runs the timers that fall due."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _FakeTimer, Callable[[], None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        timer = _FakeTimer()
        heapq.heappush(self._timers, (when, next(self._order), timer, callback))
        return timer

    def advance(self, seconds: float) -> None:
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer, callback = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            if not timer.cancelled:
                callback()
        self._now = target


class ManualGate:
    """An `AdmissionGate` opened and closed by hand; `allow(n)` lets exactly n more through.
    `binds_to` is the deployment every released ticket is bound to (None: it places none);
    `newcomers` whether a user with nothing waiting in the engine may go while it is closed."""

    def __init__(
        self, *, is_open: bool = False, binds_to: str | None = None, newcomers: bool = False
    ) -> None:
        self._listener: CapacityListener | None = None
        self._open = is_open
        self.binds_to = binds_to
        self.newcomers = newcomers
        self._budget = 0
        self.released: list[Lease] = []
        self.ended: list[Lease] = []

    def set_listener(self, listener: CapacityListener) -> None:
        self._listener = listener

    def _notify(self) -> None:
        if self._listener is not None:
            self._listener(None)

    def open(self) -> None:
        self._open = True
        self._notify()

    def close(self) -> None:
        self._open = False

    def allow(self, count: int = 1) -> None:
        self._budget += count
        self._notify()

    def may_release(self, model: str, tier: TierLimits) -> bool:
        return self._open or self._budget > 0

    def orders_engine_queue(self, model: str) -> bool:
        return self.newcomers

    def may_release_newcomer(self, model: str, tier: TierLimits) -> bool:
        return self.newcomers

    def may_release_into_reserve(self, model: str, tier: TierLimits) -> bool:
        return False

    def place(self, ticket: Ticket, tier: TierLimits) -> str | None:
        return self.binds_to

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        return False

    def waits_for_home(self, ticket: Ticket, tier: TierLimits) -> bool:
        return False

    def on_released(self, lease: Lease) -> None:
        if not self._open and self._budget > 0:  # a newcomer's release spends none
            self._budget -= 1
        self.released.append(lease)

    def on_started(self, lease: Lease) -> None:
        pass

    def on_ended(self, lease: Lease) -> None:
        self.ended.append(lease)


class _GateEvents(Protocol):
    def on_started(self, lease: Lease) -> None: ...

    def on_ended(self, lease: Lease) -> None: ...


class GateLeaseOwner:
    """A `LeaseOwner` that only tells the gate (for leases built by hand, outside a scheduler)."""

    def __init__(self, gate: _GateEvents) -> None:
        self._gate = gate

    def lease_started(self, lease: Lease) -> None:
        self._gate.on_started(lease)

    def lease_ended(self, lease: Lease, tokens_used: int | None, *, abandoned: bool) -> None:
        self._gate.on_ended(lease)


def make_ticket(
    user: str,
    *,
    model: str = "m",
    tier: str = "interactive",
    weight: float = 1.0,
    cost: int = 1,
    price: float = 0.0,
    prefix: tuple[int, ...] = (),
) -> Ticket:
    """A ticket for `user` on model "m" in tier "interactive" unless told otherwise."""
    return Ticket(model, user, tier, weight=weight, cost=cost, price=price, prefix=prefix)


def snapshot(
    clock: FakeClock, url: str, *, waiting: float = 0, running: float = 0, **fields: Any
) -> BackendSnapshot:
    """A successful scrape of `url` sent now."""
    return BackendSnapshot(
        url=url, started_at=clock.now(), ok=True, waiting=waiting, running=running, **fields
    )


def submit(
    scheduler: FairScheduler, user: str, count: int = 1, **fields: Any
) -> list[asyncio.Task[Lease]]:
    """`count` callers of `scheduler.acquire` for `user` (`fields` as `make_ticket` takes them),
    each a task that starts waiting on the next turn of the loop."""
    return [
        asyncio.create_task(scheduler.acquire(make_ticket(user, **fields))) for _ in range(count)
    ]


def released_users(gate: ManualGate) -> list[str]:
    return [lease.ticket.user for lease in gate.released]


async def settle(rounds: int = 5) -> None:
    """Let woken tasks run (yields to the loop; never waits for time to pass)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def drain(scheduler: FairScheduler) -> None:
    """Close the scheduler and collect every other task's outcome (no unretrieved exceptions)."""
    scheduler.close()
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    await asyncio.gather(*others, return_exceptions=True)
