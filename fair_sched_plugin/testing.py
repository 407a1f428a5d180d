"""Test doubles for code built on fair-sched: a clock that moves only when told to and a gate
opened by hand (in the spirit of `trio.testing.MockClock`).

Pure like the core: importing this module pulls in no HTTP stack, LiteLLM or Redis.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from .core.clock import TimerHandle
from .core.gate import CapacityListener
from .core.ticket import Lease, Ticket, TierLimits

__all__ = ["FakeClock", "ManualGate"]


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
    """An `AdmissionGate` opened and closed by hand; `allow(n)` lets exactly n more through."""

    def __init__(self, *, is_open: bool = False) -> None:
        self._listener: CapacityListener | None = None
        self._open = is_open
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

    def place(self, ticket: Ticket, tier: TierLimits) -> str | None:
        return None

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        return False

    def waits_for_home(self, ticket: Ticket, tier: TierLimits) -> bool:
        return False

    def on_released(self, lease: Lease) -> None:
        if not self._open:
            self._budget -= 1
        self.released.append(lease)

    def on_started(self, lease: Lease) -> None:
        pass

    def on_ended(self, lease: Lease) -> None:
        self.ended.append(lease)
