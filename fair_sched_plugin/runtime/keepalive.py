"""One clock for every parked stream's keep-alive comments on a loop.

A parked stream sends a comment every `queue.keepalive_interval_s`. With a sleep and a send
timeout per comment, each cost two timers and a task (about 13 us in asyncio), so 10,000 parked
streams took a quarter of a core. Here one timer per loop and interval wakes every stream that
waits for its next comment, and the same tick finds the streams whose client has not taken its
last comment within `max(interval, 1 s)` (a client that stopped reading is treated as gone): a
comment costs one wake-up of its stream's task and no timer.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Protocol


class Stalling(Protocol):
    def send_stalled(self) -> None:
        """Its client has not taken a comment within the timeout."""


class KeepAliveTicks:
    """Ticks every `interval_s` while some stream waits for one or is sending."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        self._loop = loop
        self._interval_s = interval_s
        self._timeout_s = max(interval_s, 1.0)
        # One future per waiting stream (a cancelled stream cancels only its own).
        self._waiters: list[asyncio.Future[None]] = []
        self._sending: dict[Stalling, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def next_tick(self) -> asyncio.Future[None]:
        """Done at the next tick (at most `interval_s` from now); a future rather than a
        coroutine, so awaiting it costs no frame. Cancelling it cancels only this wait."""
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(waiter)
        if self._timer is None:
            self._arm()
        return waiter

    def sending(self, stream: Stalling) -> None:
        """`stream` began sending a comment: it hears `send_stalled()` unless `sent()` comes
        within the timeout (found at the first tick after it)."""
        self._sending[stream] = self._loop.time()
        if self._timer is None:
            self._arm()

    def sent(self, stream: Stalling) -> None:
        self._sending.pop(stream, None)

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(self._interval_s, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self._sending:
            now = self._loop.time()
            overdue = [s for s, since in self._sending.items() if now - since >= self._timeout_s]
            for stream in overdue:
                del self._sending[stream]
                stream.send_stalled()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self._sending or self._waiters:
            self._arm()


_ticks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, KeepAliveTicks]] = (
    weakref.WeakKeyDictionary()
)


def ticks_for(interval_s: float) -> KeepAliveTicks:
    """The running loop's keep-alive clock for `interval_s`."""
    loop = asyncio.get_running_loop()
    by_interval = _ticks.get(loop)
    if by_interval is None:
        by_interval = _ticks[loop] = {}
    ticks = by_interval.get(interval_s)
    if ticks is None:
        ticks = by_interval[interval_s] = KeepAliveTicks(loop, interval_s)
    return ticks
