"""What the scheduler's queues say to status pages, metrics and waiting clients: counts kept as
queues change (O(1) or O(tiers + log n) per answer), and the backlog and the fairness gauges by
user (O(users), for status pages and metrics only). Nothing here changes a queue."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from .clock import Clock
from .fairness_window import FairnessReading, FairnessWindow
from .queues import ModelQueues, Parked
from .standing import position_in


class UserBacklog(NamedTuple):
    model: str
    tier: str
    user: str
    depth: int
    oldest_enqueued_at: float
    virtual_time: float


class DeadlineOutcomes(NamedTuple):
    """Of one tier's requests with a limit shorter than the queue's (their tier's or their
    client's): started in time, waited their limit out, refused at once as out of reach."""

    met: int
    missed: int
    refused: int


class SchedulerStatistics(NamedTuple):
    queued: int
    in_flight: int
    released_total: int
    completed_total: int
    cancelled_total: int  # left the queue because the caller went away
    abandoned_total: int  # granted, then cancelled before it was used
    rejected_full_total: int
    timed_out_total: int
    queued_by_model_tier: Mapping[tuple[str, str], int]
    in_flight_by_model: Mapping[str, int]


class SchedulerReads:
    """The reads of `SchedulerCore` (which keeps the fields below)."""

    _models: dict[str, ModelQueues]
    _tier_index: dict[str, int]
    _queued_total: int
    _released_total: int
    _completed_total: int
    _cancelled_total: int
    _abandoned_total: int
    _rejected_full_total: int
    _timed_out_total: int
    _clock: Clock
    _fairness_window: FairnessWindow
    _deadline_outcomes: dict[str, list[int]]

    def statistics(self) -> SchedulerStatistics:
        by_tier = {
            (model, tier.limits.name): tier.queued
            for model, queues in self._models.items()
            for tier in queues.tiers
            if tier.queued
        }
        by_model = {model: q.in_flight for model, q in self._models.items() if q.in_flight}
        return SchedulerStatistics(
            queued=self._queued_total,
            # Every lease released is in flight until it completes or is abandoned.
            in_flight=self._released_total - self._completed_total - self._abandoned_total,
            released_total=self._released_total,
            completed_total=self._completed_total,
            cancelled_total=self._cancelled_total,
            abandoned_total=self._abandoned_total,
            rejected_full_total=self._rejected_full_total,
            timed_out_total=self._timed_out_total,
            queued_by_model_tier=by_tier,
            in_flight_by_model=by_model,
        )

    def deadline_outcomes(self) -> dict[str, DeadlineOutcomes]:
        """Per tier, what became of the requests with a limit of their own (O(tiers))."""
        return {tier: DeadlineOutcomes(*counts) for tier, counts in self._deadline_outcomes.items()}

    def backlog(self, model: str | None = None) -> list[UserBacklog]:
        """Every backlogged user with depth and oldest arrival (for status pages; O(users))."""
        result = []
        for queues in self._models.values():
            if model is not None and queues.model != model:
                continue
            for tier in queues.tiers:
                for user_queue in tier.users.values():
                    if not user_queue.depth:
                        continue
                    oldest = min(user_queue.live(), key=_arrival)
                    result.append(
                        UserBacklog(
                            model=queues.model,
                            tier=tier.limits.name,
                            user=user_queue.user,
                            depth=user_queue.depth,
                            oldest_enqueued_at=oldest.enqueued_at,
                            virtual_time=user_queue.virtual_time,
                        )
                    )
        return result

    def fairness(self) -> list[FairnessReading]:
        """The fairness gauges of every (model, tier) with backlogged users, over the sliding
        window ending now (`FairnessWindow`; O(backlogged users))."""
        tiers = (tier for queues in self._models.values() for tier in queues.tiers)
        return self._fairness_window.read(self._clock.now(), tiers)

    def queued_of(self, model: str, tier: str, user: str) -> int:
        """How many requests `user` has queued in `tier` of `model` (O(1))."""
        queues = self._models.get(model)
        index = self._tier_index.get(tier)
        if queues is None or index is None:
            return 0
        user_queue = queues.tiers[index].users.get(user)
        return user_queue.depth if user_queue is not None else 0

    def position_estimate(self, model: str, tier: str, user: str, own_index: int) -> int:
        """`waiting.estimate_position` of `user`'s `own_index`-th request in `tier` of `model`
        over this scheduler's backlog, from counts kept as queues change: O(tiers + log n)."""
        queues = self._models.get(model)
        index = self._tier_index.get(tier)
        if queues is None or index is None:
            return own_index
        tiers = queues.tiers
        ahead = 0
        for upper in range(index):  # strict tiers: everything queued above goes first
            ahead += tiers[upper].depths.total
        tier_queue = tiers[index]
        user_queue = tier_queue.users.get(user)
        own_depth = user_queue.depth if user_queue is not None else 0
        return position_in(own_index, own_depth, ahead, tier_queue.depths)


def _arrival(parked: Parked) -> float:
    return parked.enqueued_at
