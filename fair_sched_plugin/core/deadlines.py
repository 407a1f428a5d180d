"""Parked tickets' deadlines (`queue.max_wait_s`): every ticket gets the same max wait, so
deadlines are in arrival order: one deque and one wake-up for its head, not one per ticket."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from .queues import QUEUED, Parked


class Deadlines:
    """The parked tickets in arrival order, and the due time of the one wake-up armed for them
    (`armed_due`; None: none armed). Tickets that left the queue stay until they reach the head
    or are compacted away (O(1) removal)."""

    __slots__ = ("_parked", "armed_due", "max_wait_s")

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self._parked: deque[Parked] = deque()
        self.armed_due: float | None = None

    def __len__(self) -> int:
        return len(self._parked)

    def add(self, parked: Parked, queued: int) -> float | None:
        """Track `parked` (`queued`: how many are parked now, it included); the due time of a
        wake-up to arm, or None: one armed is due no later (same max wait, later arrival)."""
        # Tickets that left (granted, mostly) would otherwise stay until a tick reaches them,
        # which is only at the head's deadline (`max_wait_s`, minutes): memory, and every pass
        # of the garbage collector, would grow with that long's arrivals, not with the queue.
        # Those in front go now (the armed wake-up may then be early: `tick` re-arms); behind a
        # head that stays parked, a rebuild once they outnumber the live ones.
        tracked = self._parked
        while tracked and tracked[0].state != QUEUED:
            tracked.popleft()
        tracked.append(parked)
        if len(tracked) > 2 * queued + 64:
            self.compact(queued)
        return self.arm() if self.armed_due is None else None

    def arm(self) -> float | None:
        """The due time of a wake-up to arm for the live head (None: armed for it already, or
        nothing is parked)."""
        parked = self._parked
        if self.armed_due is not None and parked and parked[0].state == QUEUED:
            return None
        while parked and parked[0].state != QUEUED:
            parked.popleft()
        if not parked:
            return None
        due = parked[0].enqueued_at + self.max_wait_s
        if self.armed_due is not None and self.armed_due <= due:
            return None
        self.armed_due = due
        return due

    def overdue(self, now: float) -> Iterator[Parked]:
        """Take out, head first, the parked tickets still queued whose deadline passed."""
        # `self._parked` read afresh each time: the caller's removal may compact it.
        while self._parked:
            head = self._parked[0]
            if head.state != QUEUED:
                self._parked.popleft()
                continue
            if head.enqueued_at + self.max_wait_s > now:
                return
            self._parked.popleft()
            yield head

    def compact(self, queued: int) -> None:
        # Tickets that left stay until their deadline; rebuild when they outnumber the `queued`
        # live ones, so memory cannot grow with submit-and-cancel abuse (or with grants: `add`).
        if len(self._parked) > 64 and len(self._parked) > 2 * queued:
            self._parked = deque(p for p in self._parked if p.state == QUEUED)

    def clear(self) -> None:
        self._parked.clear()
        self.armed_due = None
