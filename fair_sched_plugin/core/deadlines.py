"""Parked tickets' deadlines: a ticket's deadline is its arrival plus the shortest of
`queue.max_wait_s`, its tier's `max_wait_s` and the client's own limit (`Ticket.max_wait_s`).
`Deadlines` keeps the parked tickets in deadline order with one wake-up for the earliest (whether
a ticket can still make its deadline is `drain.py`'s prediction)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from .queues import QUEUED, Parked


class Deadlines:
    """The parked tickets by deadline, and the due time of the one wake-up armed for them
    (`armed_due`; None: none armed). Tickets that left the queue stay until they reach the top
    or are compacted away (O(1) removal, O(log n) to add)."""

    __slots__ = ("_heap", "_order", "armed_due")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Parked]] = []
        self._order = itertools.count()
        self.armed_due: float | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, parked: Parked, queued: int) -> float | None:
        """Track `parked` (`queued`: how many are parked now, it included); the due time of a
        wake-up to arm, or None: one armed is due no later."""
        heap = self._heap
        # Tickets that left (granted, mostly) would otherwise stay until their deadline
        # (`max_wait_s`, minutes): memory would grow with that long's arrivals, not with the
        # queue. Those on top go now; the rest by a rebuild once they outnumber the live ones.
        while heap and heap[0][2].state != QUEUED:
            heapq.heappop(heap)
        heapq.heappush(heap, (parked.deadline, next(self._order), parked))
        if len(heap) > 2 * queued + 64:
            self.compact(queued)
        armed = self.armed_due
        if armed is not None and armed <= parked.deadline:
            return None
        return self.arm()

    def arm(self) -> float | None:
        """The due time of a wake-up to arm for the earliest live deadline (None: one armed is
        due no later, or nothing is parked)."""
        heap = self._heap
        while heap and heap[0][2].state != QUEUED:
            heapq.heappop(heap)
        if not heap:
            return None
        due = heap[0][0]
        if self.armed_due is not None and self.armed_due <= due:
            return None
        self.armed_due = due
        return due

    def overdue(self, now: float) -> Iterator[Parked]:
        """Take out, earliest first, the parked tickets still queued whose deadline passed."""
        # `self._heap` read afresh each time: the caller's removal may compact it.
        while self._heap:
            deadline, _, parked = self._heap[0]
            if parked.state != QUEUED:
                heapq.heappop(self._heap)
                continue
            if deadline > now:
                return
            heapq.heappop(self._heap)
            yield parked

    def compact(self, queued: int) -> None:
        # Tickets that left stay until they reach the top; rebuild when they outnumber the
        # `queued` live ones, so memory cannot grow with submit-and-cancel abuse.
        if len(self._heap) > 64 and len(self._heap) > 2 * queued:
            self._heap = [entry for entry in self._heap if entry[2].state == QUEUED]
            heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()
        self.armed_due = None
