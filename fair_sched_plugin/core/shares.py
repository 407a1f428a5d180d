"""Tier shares: adjacent tiers with a `share` split a model's releases by weight (start-time fair
queuing between tiers, by request); a tier without one keeps strict priority over every tier
below it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .queues import ModelQueues, TierQueue
from .ticket import TierLimits


class TierShares:
    """The groups of `tiers` (indexes, most urgent group first) and the choice among them."""

    __slots__ = ("groups", "shared")

    def __init__(self, tiers: Sequence[TierLimits]) -> None:
        groups: list[tuple[int, ...]] = []
        for index, limits in enumerate(tiers):
            if limits.share is not None and limits.share <= 0:
                raise ValueError(f"tier {limits.name!r}: share must be > 0")
            previous = groups[-1] if groups else None
            if (
                limits.share is not None
                and previous is not None
                and (tiers[previous[-1]].share is not None)
            ):
                groups[-1] = (*previous, index)
            else:
                groups.append((index,))
        self.groups = groups
        # Without a group of two or more, tiers are strictly ordered and none of this runs.
        self.shared = any(len(group) > 1 for group in groups)

    def next_tier(
        self, queues: ModelQueues, may_release: Callable[[str, TierLimits], bool]
    ) -> tuple[TierQueue, int, float] | None:
        """The tier to release from: groups in priority order; inside a group, the releasable
        tier with the smallest virtual finish time, with its group and start tag. `charge`
        advances the clocks once it has released (a head that waits for its deployment costs its
        tier nothing)."""
        tiers = queues.tiers
        for group_id, group in enumerate(self.groups):
            best: TierQueue | None = None
            best_start = 0.0
            group_clock = queues.share_clock.get(group_id, 0.0)
            for index in group:
                tier = tiers[index]
                if not tier.queued or not may_release(queues.model, tier.limits):
                    continue
                start = max(tier.share_vtime, group_clock)
                if best is None or start < best_start:
                    best, best_start = tier, start
            if best is not None:
                return best, group_id, best_start
        return None

    @staticmethod
    def charge(queues: ModelQueues, tier: TierQueue, group_id: int, start: float) -> None:
        if tier.limits.share is not None:
            queues.share_clock[group_id] = start
            tier.share_vtime = start + 1.0 / tier.limits.share
