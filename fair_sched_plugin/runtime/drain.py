"""The requests running, and graceful drain: after it begins, requests still running get
`drain_grace_s` to finish, then each is told to end. `SchedulingService.begin_drain` starts it
(SIGTERM does, see `runtime/shutdown.py`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from ..core import Lease
from .driver import TimerClock, TimerHandle

logger = logging.getLogger("fair_sched")


class RunningRequest(Protocol):
    def shutdown(self) -> None:
        """The server drains and the grace period is over: end the request now."""


class Running:
    """The leases granted through the service and not ended yet, one entry each: the request
    that holds it (None: its caller holds the lease itself). The drain, the status document
    and the metrics read this one entry; none keeps a copy."""

    __slots__ = ("entries", "lease_ended")

    def __init__(self) -> None:
        self.entries: dict[Lease, RunningRequest | None] = {}
        # The scheduler's end listener, `(lease, abandoned)`: the entries' own `pop`, a C call
        # on every request's end (`abandoned` is only its unused default).
        self.lease_ended: Callable[[Lease, bool], object] = self.entries.pop

    def hold(self, lease: Lease, request: RunningRequest | None) -> None:
        """`request` holds `lease` until it ends (`lease_ended`)."""
        self.entries[lease] = request

    def __len__(self) -> int:
        return len(self.entries)


class GracefulDrain:
    """The timer that ends the running requests once a drain's grace period is over."""

    def __init__(self, clock: TimerClock, grace_s: float, running: Running) -> None:
        self._clock = clock
        self._grace_s = grace_s
        self._running = running
        self._draining = False
        self._timer: TimerHandle | None = None

    @property
    def draining(self) -> bool:
        return self._draining

    def begin(self, queued: int) -> None:
        """Say what the drain refuses (`queued` parked requests) and what it waits for; end
        what still runs once the grace period is over."""
        self._draining = True
        logger.warning(
            "fair_sched: draining: %d parked requests refused, %d running may finish within "
            "%g s (drain_grace_s)",
            queued,
            len(self._running),
            self._grace_s,
        )
        self._timer = self._clock.call_at(self._clock.now() + self._grace_s, self._end_running)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _end_running(self) -> None:
        self._timer = None
        holders = [holder for holder in self._running.entries.values() if holder is not None]
        if holders:
            logger.warning(
                "fair_sched: drain grace period over: ending %d running requests", len(holders)
            )
        for holder in holders:
            holder.shutdown()
