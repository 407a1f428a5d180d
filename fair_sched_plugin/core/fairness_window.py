"""Fairness as an operator watches it: per (model, tier), over a sliding window, how evenly the
backlogged users were served, the largest service gap between two of them, and how long the
most starved one has waited.

The queues keep running sums per user (`UserQueue.served`: the policy's charges, divided by the
weight; `served_tokens`: the tokens of its ended requests, divided by the weight here), when it
last got a release and which backlog period it is in: O(1) on the paths that already touch the
user. This module reads
them when asked (a scrape, a leader's heartbeat), keeps a few samples of them per window and
compares the newest with the one a window ago: O(backlogged users) per reading, nothing per
request. Sans-I/O: the time is passed in.

A user counts when it was backlogged throughout the window (queued at both samples, in the same
backlog period): VTC's service gap is bounded between such users, and a user that was idle part
of the window is not owed the service it did not ask for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from .fairness import FairnessPolicy
from .queues import TierQueue

# `observability.fairness_window_s`'s default: a minute, long enough for several releases of
# every backlogged user on a busy engine, short enough to show a change within a dashboard's
# refresh or two.
DEFAULT_FAIRNESS_WINDOW_S = 60.0

# Samples kept per window: the window slides in steps of window / this (and a reading costs at
# most one sample's O(backlogged users) more than the comparison itself).
SAMPLES_PER_WINDOW = 8

# The unit in which each policy equalises service (its charges); tokens are always measured too.
POLICY_UNITS: dict[str, str] = {
    "round_robin": "requests",
    "weighted": "requests",
    "tokens": "tokens",
    "cost": "cost",
}


class FairnessReading(NamedTuple):
    """One (model, tier) with backlogged users, over the window ending now."""

    model: str
    tier: str
    users: int  # backlogged throughout the window (what the index and the gap are over)
    # Jain's index per unit ("tokens", and the policy's own unit when it is another); empty
    # when no user was backlogged throughout the window.
    jain_index: tuple[tuple[str, float], ...]
    service_gap_tokens: float | None  # None: no user backlogged throughout the window
    starved_wait_s: float  # the longest any backlogged user has waited for its next release
    span_s: float  # how long the window actually was (a window or more once one has passed)


class _UserSample(NamedTuple):
    backlog: int  # which backlog period (`UserQueue.backlog_since`)
    served: float
    served_tokens: float
    waiting_since: float


_Sample = dict[tuple[str, str], dict[str, _UserSample]]


def jain_index(values: Iterable[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when everyone got the same, 1/n when one got everything; 1
    when nobody got anything (equal, if starved: the starved-wait gauge tells that)."""
    amounts = [max(value, 0.0) for value in values]
    squares = sum(amount * amount for amount in amounts)
    if not amounts or squares <= 0.0:
        return 1.0
    return min(1.0, sum(amounts) ** 2 / (len(amounts) * squares))


class FairnessWindow:
    """Samples of the users' service over a sliding window of `window_s` seconds."""

    __slots__ = ("_policy_unit", "_samples", "_step_s", "window_s")

    def __init__(self, window_s: float, policy: FairnessPolicy) -> None:
        if not window_s > 0:
            raise ValueError("the fairness window must be positive")
        self.window_s = window_s
        self._step_s = window_s / SAMPLES_PER_WINDOW
        self._policy_unit = POLICY_UNITS[policy]
        self._samples: deque[tuple[float, _Sample]] = deque()

    @property
    def samples_kept(self) -> int:
        return len(self._samples)

    def read(self, now: float, tiers: Iterable[TierQueue]) -> list[FairnessReading]:
        """The readings of every (model, tier) with backlogged users among `tiers` at `now`."""
        current: _Sample = {}
        for tier in tiers:
            if not tier.queued:
                continue
            rows = {
                user_queue.user: _UserSample(
                    user_queue.backlog_since,
                    user_queue.served,
                    user_queue.served_tokens / user_queue.weight(),
                    user_queue.waiting_since,
                )
                for user_queue in tier.users.values()
                if user_queue.depth
            }
            if rows:
                current[(tier.model, tier.limits.name)] = rows
        samples = self._samples
        if not samples or now - samples[-1][0] >= self._step_s:
            samples.append((now, current))
        # The baseline: the newest sample at least a window old (else the oldest there is).
        while len(samples) > 1 and samples[1][0] <= now - self.window_s:
            samples.popleft()
        since, baseline = samples[0]
        return [
            self._reading(key, rows, baseline.get(key, {}), now, now - since)
            for key, rows in current.items()
        ]

    def _reading(
        self,
        key: tuple[str, str],
        rows: dict[str, _UserSample],
        baseline: dict[str, _UserSample],
        now: float,
        span_s: float,
    ) -> FairnessReading:
        served: list[float] = []
        tokens: list[float] = []
        if span_s > 0:
            for user, row in rows.items():
                before = baseline.get(user)
                if before is not None and before.backlog == row.backlog:
                    served.append(row.served - before.served)
                    tokens.append(row.served_tokens - before.served_tokens)
        index: tuple[tuple[str, float], ...] = ()
        gap = None
        if tokens:
            index = (("tokens", jain_index(tokens)),)
            if self._policy_unit != "tokens":
                index += ((self._policy_unit, jain_index(served)),)
            gap = max(tokens) - min(tokens)
        starved = max(now - row.waiting_since for row in rows.values())
        return FairnessReading(
            key[0], key[1], len(tokens), index, gap, max(starved, 0.0), max(span_s, 0.0)
        )
