"""Time for the core: injectable, so tests advance a fake clock instead of sleeping
(`fair_sched_plugin.testing.FakeClock`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """A monotonic clock that can also run a callback at a given time."""

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle: ...


class LoopClock:
    """The running event loop's clock (`loop.time()`), bound lazily so nothing touches a loop at
    construction time."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        return asyncio.get_running_loop().call_at(when, callback)


class MonotonicClock:
    """`time.monotonic()`: what asyncio's default event loop reads for `loop.time()`."""

    def now(self) -> float:
        return time.monotonic()
