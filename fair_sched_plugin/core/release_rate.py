"""How fast a model's backlog drains, and when a parked ticket can expect to start.

`DrainRate` measures the releases per second from a backlogged queue; `start_after_s` turns a
ticket's place in the fair order into the earliest time it can expect to start, so a ticket that
cannot start before its deadline is refused at once instead of at the deadline.
"""

from __future__ import annotations

from collections import deque

# The gaps between releases from a backlogged queue that the drain rate averages over, and how
# many must have been seen before a prediction refuses anything (fewer: no rate, no refusal).
DRAIN_GAPS = 32
MIN_DRAIN_GAPS = 8
# No release from the backlog for this long: the rate measured before is no longer evidence.
DRAIN_STALE_S = 30.0
# How much faster than measured the prediction assumes the backlog drains (1: as measured). It
# errs early already: the next release is counted as starting now, and a backlog's release rate
# is what the engine manages at its busiest. Refusing a request that would have made it loses a
# request that could have been served; one admitted that then misses is answered at its deadline.
RATE_OPTIMISM = 1.0


class DrainRate:
    """Releases per second from a model's backlog: the recent gaps between releases from its
    queue, each counted from the later of the previous release and the moment the queue became
    backlogged (idle time is not drain time, so a quiet hour does not read as a slow engine)."""

    __slots__ = ("_gaps", "_last", "_sum", "backlog_since")

    def __init__(self) -> None:
        self._gaps: deque[float] = deque(maxlen=DRAIN_GAPS)
        self._sum = 0.0
        self._last = float("-inf")
        self.backlog_since = float("-inf")

    def released(self, now: float) -> None:
        """One request left the backlogged queue at `now`."""
        gaps = self._gaps
        since = self._last if self._last > self.backlog_since else self.backlog_since
        self._last = now
        if since == float("-inf"):
            return
        if len(gaps) == DRAIN_GAPS:
            self._sum -= gaps[0]
        gap = now - since
        gaps.append(gap)
        self._sum += gap

    def rate(self, now: float) -> float | None:
        """Releases per second, or None while too few were seen, none lately, or all at once."""
        if len(self._gaps) < MIN_DRAIN_GAPS or now - self._last > DRAIN_STALE_S:
            return None
        total = self._sum
        return len(self._gaps) / total if total > 1e-9 else None


def start_after_s(position: int, rate: float) -> float:
    """The earliest the request at `position` (1: the next one released) can expect to start,
    in seconds from now, at `rate` releases per second (optimistic: `RATE_OPTIMISM`)."""
    return (position - 1) / (rate * RATE_OPTIMISM)
