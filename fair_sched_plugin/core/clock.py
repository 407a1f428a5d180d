"""Time for the core: read from an injected clock, so tests set it instead of sleeping
(`fair_sched_plugin.testing.FakeClock`). The core never waits: what is due later is data that
its next `tick(now)` acts on (`SchedulerCore.next_due`); the driver owns the timer."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A monotonic clock."""

    def now(self) -> float: ...


class MonotonicClock:
    """`time.monotonic()`: what asyncio's default event loop reads for `loop.time()`."""

    def now(self) -> float:
        return time.monotonic()
