"""Estimates told to waiting clients: release positions and the measured drain rate."""

from __future__ import annotations

import pytest

from fair_sched_plugin.core import DrainMeter, UserBacklog, estimate_position, retry_after_s
from fair_sched_plugin.testing import FakeClock

TIERS = ("interactive", "batch")


def row(user: str, depth: int, tier: str = "interactive") -> UserBacklog:
    return UserBacklog("m", tier, user, depth, 0.0, 0.0)


def test_alone_in_the_queue_the_position_is_the_own_index() -> None:
    backlog = [row("alice", 30)]
    assert [estimate_position(i, "alice", "interactive", backlog, TIERS) for i in (1, 2, 30)] == [
        1,
        2,
        30,
    ]


def test_round_robin_other_users_take_one_turn_per_own_turn_up_to_their_depth() -> None:
    backlog = [row("alice", 5), row("bob", 2), row("carol", 10)]
    # alice's 3rd: bob's 2 and carol's 3 come first, with alice's own 1st and 2nd.
    assert estimate_position(3, "alice", "interactive", backlog, TIERS) == 3 + 2 + 3


def test_a_more_urgent_tier_goes_first_and_a_less_urgent_one_not_at_all() -> None:
    backlog = [row("alice", 1, "batch"), row("bob", 4), row("carol", 7, "batch")]
    assert estimate_position(1, "alice", "batch", backlog, TIERS) == 4 + 1 + 1
    assert estimate_position(1, "bob", "interactive", backlog, TIERS) == 1


def test_drain_rate_is_measured_over_recent_releases_and_falls_when_draining_stops() -> None:
    clock = FakeClock()
    meter = DrainMeter(window_s=10.0)
    assert meter.rate("m", clock.now()) is None
    for _ in range(5):
        meter.record("m", clock.now())
        clock.advance(0.5)
    # 4 intervals since the first release, counted up to now (2.5 s).
    assert meter.rate("m", clock.now()) == pytest.approx(4 / 2.5)
    # The ETA counts 8 releases at the rate between the releases (4 in 2.0 s) from the last
    # release (0.5 s ago): it does not take the falling rate, which would make it grow.
    assert meter.eta_s("m", 8, clock.now()) == pytest.approx(8 / (4 / 2.0) - 0.5)
    clock.advance(5.0)
    assert meter.rate("m", clock.now()) == pytest.approx(4 / 7.5)
    clock.advance(10.0)  # everything left the window
    assert meter.rate("m", clock.now()) is None
    assert meter.eta_s("m", 1, clock.now()) is None
    assert meter.rate("other", clock.now()) is None


def test_retry_after_follows_the_rate_within_bounds() -> None:
    assert retry_after_s(10, None) == 1.0
    assert retry_after_s(10, 2.0) == 5.0
    assert retry_after_s(1, 100.0) == 1.0
    assert retry_after_s(10_000, 0.01, ceiling_s=600) == 600


def test_while_nothing_drains_the_eta_never_grows_and_ends_once_overdue() -> None:
    """The keep-alive bug: position 1 stayed while the ETA grew (0.5, 1.0, ... s) until the
    request timed out. Counted from the last release at the rate between releases, it only
    falls; once the request should have gone and did not, there is no ETA."""
    clock = FakeClock()
    meter = DrainMeter()
    for _ in range(3):  # two a second
        clock.advance(0.5)
        meter.record("m", clock.now())
    etas = []
    for _ in range(8):
        etas.append(meter.eta_s("m", 1, clock.now()))
        clock.advance(0.2)
    known = [eta for eta in etas if eta is not None]
    assert known and known == sorted(known, reverse=True)
    assert etas[-1] is None
    assert etas.index(None) == len(known)  # once gone, it stays gone while nothing drains
    meter.record("m", clock.now())  # draining again: an ETA again
    assert meter.eta_s("m", 1, clock.now()) == pytest.approx(1 / (3 / 2.6))
