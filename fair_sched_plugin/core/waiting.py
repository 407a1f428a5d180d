"""What a waiting client is told: its place in the fair order and how fast the queue drains.

Pure estimates (no I/O, the clock is passed in): the scheduler's real order depends on the
fairness policy and on requests that have not arrived yet, so these are honest guesses, never
promises. They feed the keep-alive comments, the where-do-I-stand endpoint and `Retry-After`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from .reads import UserBacklog

# Releases remembered per model for the drain rate, and how far back they count.
DRAIN_SAMPLES = 64
DRAIN_WINDOW_S = 120.0


def estimate_position(
    own_index: int,
    user: str,
    tier: str,
    backlog: Iterable[UserBacklog],
    tier_order: Sequence[str],
) -> int:
    """The 1-based release position of a user's `own_index`-th parked request (1: its oldest).

    Strict tiers: everything queued in a more urgent tier goes first. Inside the tier the
    fairness policy takes turns between users, so each other backlogged user gets about one
    release per release of ours: up to `own_index` of their requests come before ours.
    """
    rank = tier_order.index(tier)
    ahead = 0
    for row in backlog:
        row_rank = tier_order.index(row.tier) if row.tier in tier_order else len(tier_order)
        if row_rank < rank:
            ahead += row.depth
        elif row_rank == rank and row.user != user:
            ahead += min(row.depth, own_index)
    return ahead + own_index


class DrainMeter:
    """Releases per second per model, measured over the recent releases (a sliding window)."""

    def __init__(self, *, samples: int = DRAIN_SAMPLES, window_s: float = DRAIN_WINDOW_S) -> None:
        self._samples = samples
        self._window_s = window_s
        self._released: dict[str, deque[float]] = {}

    def record(self, model: str, now: float) -> None:
        """One request of `model` was released at `now`."""
        times = self._released.get(model)
        if times is None:
            times = self._released[model] = deque(maxlen=self._samples)
        times.append(now)

    def rate(self, model: str, now: float) -> float | None:
        """Releases per second over the window; None until two releases in it were seen."""
        times = self._released.get(model)
        if not times:
            return None
        while times and now - times[0] > self._window_s:
            times.popleft()
        if len(times) < 2:
            return None
        # Counted up to now, not up to the last release: a queue that stopped draining shows a
        # falling rate instead of the last good one.
        span = now - times[0]
        return (len(times) - 1) / span if span > 0 else None

    def eta_s(self, model: str, position: int, now: float) -> float | None:
        """Seconds until the request at `position` is released if the queue keeps draining as
        it did: `position` releases at the rate measured between the recent releases, counted
        from the last one. None before two releases were seen, and None once that time has
        passed without the request being released: the queue stalled, and no honest ETA is
        left (the rate up to now, `rate()`, would make the ETA grow with the stall instead,
        a client being told "almost there" later and later until it timed out)."""
        times = self._released.get(model)
        if not times:
            return None
        while times and now - times[0] > self._window_s:
            times.popleft()
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        rate = (len(times) - 1) / (times[-1] - times[0])
        remaining = times[-1] + position / rate - now
        return remaining if remaining > 0 else None


def retry_after_s(
    ahead: int, rate: float | None, *, floor_s: float = 1.0, ceiling_s: float = 600.0
) -> float:
    """`Retry-After` for a refused request: the time for `ahead` releases at the measured rate,
    between `floor_s` and `ceiling_s` (`floor_s` when no rate was measured yet)."""
    if not rate:
        return floor_s
    return min(ceiling_s, max(floor_s, ahead / rate))
