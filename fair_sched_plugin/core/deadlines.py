"""Parked tickets' deadlines: a ticket's deadline is its arrival plus the shortest of
`queue.max_wait_s`, its tier's `max_wait_s` and the client's own limit (`Ticket.max_wait_s`).
`Deadlines` keeps the parked tickets in deadline order with one wake-up for the earliest (whether
a ticket can still make its deadline is `release_rate.py`'s prediction)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from .queues import QUEUED, Parked


class Deadlines:
    """The parked tickets by deadline, and the due time of the one wake-up armed for them
    (`armed_due`; None: none armed). Tickets that left the queue stay until they reach the front
    or are compacted away (O(1) removal).

    Most tickets wait the queue's limit, so their deadlines come in arrival order: those go to a
    deque (O(1)). A ticket due before the deque's last one (a shorter limit of its tier or its
    client) goes to a heap (O(log n)); the earliest deadline is the earlier of the two fronts."""

    __slots__ = ("_earlier", "_in_order", "_order", "armed_due")

    def __init__(self) -> None:
        self._in_order: deque[Parked] = deque()
        self._earlier: list[tuple[float, int, Parked]] = []
        self._order = itertools.count()
        self.armed_due: float | None = None

    def __len__(self) -> int:
        return len(self._in_order) + len(self._earlier)

    def add(self, parked: Parked, queued: int) -> float | None:
        """Track `parked` (`queued`: how many are parked now, it included); the due time of a
        wake-up to arm, or None: one armed is due no later."""
        # Tickets that left (granted, mostly) would otherwise stay until their deadline
        # (`max_wait_s`, minutes): memory would grow with that long's arrivals, not with the
        # queue. Those in front go now; the rest by a rebuild once they outnumber the live ones.
        in_order = self._in_order
        while in_order and in_order[0].state != QUEUED:
            in_order.popleft()
        deadline = parked.deadline
        if in_order and in_order[-1].deadline > deadline:
            earlier = self._earlier
            while earlier and earlier[0][2].state != QUEUED:
                heapq.heappop(earlier)
            heapq.heappush(earlier, (deadline, next(self._order), parked))
            if len(earlier) > 2 * queued + 64:
                self.compact(queued)
        else:
            in_order.append(parked)
            if len(in_order) > 2 * queued + 64:
                self.compact(queued)
        armed = self.armed_due
        if armed is not None and armed <= deadline:
            return None
        return self.arm()

    def add_latest(self, parked: Parked, queued: int) -> float | None:
        """`add`, for a ticket due no earlier than every one tracked (the queue's own limit,
        the longest there is, from now): behind the others, without comparing."""
        in_order = self._in_order
        while in_order and in_order[0].state != QUEUED:
            in_order.popleft()
        in_order.append(parked)
        if len(in_order) > 2 * queued + 64:
            self.compact(queued)
        return self.arm() if self.armed_due is None else None

    def _front(self) -> Parked | None:
        """The live ticket with the earliest deadline (dropping those that left before it)."""
        in_order = self._in_order
        while in_order and in_order[0].state != QUEUED:
            in_order.popleft()
        earlier = self._earlier
        while earlier and earlier[0][2].state != QUEUED:
            heapq.heappop(earlier)
        if not earlier:
            return in_order[0] if in_order else None
        if in_order and in_order[0].deadline < earlier[0][0]:
            return in_order[0]
        return earlier[0][2]

    def arm(self) -> float | None:
        """The due time of a wake-up to arm for the earliest live deadline (None: one armed is
        due no later, or nothing is parked)."""
        front = self._front()
        if front is None:
            return None
        due = front.deadline
        if self.armed_due is not None and self.armed_due <= due:
            return None
        self.armed_due = due
        return due

    def overdue(self, now: float) -> Iterator[Parked]:
        """Take out, earliest first, the parked tickets still queued whose deadline passed."""
        while True:
            # Read afresh each time: the caller's removal may compact the queues.
            front = self._front()
            if front is None or front.deadline > now:
                return
            if self._in_order and self._in_order[0] is front:
                self._in_order.popleft()
            else:
                heapq.heappop(self._earlier)
            yield front

    def compact(self, queued: int) -> None:
        # Tickets that left stay until they reach the front; rebuild when they outnumber the
        # `queued` live ones, so memory cannot grow with submit-and-cancel abuse.
        if len(self) > 64 and len(self) > 2 * queued:
            self._in_order = deque(p for p in self._in_order if p.state == QUEUED)
            self._earlier = [entry for entry in self._earlier if entry[2].state == QUEUED]
            heapq.heapify(self._earlier)

    def clear(self) -> None:
        self._in_order.clear()
        self._earlier.clear()
        self.armed_due = None
