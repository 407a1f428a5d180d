"""Deadlines in the core: earliest deadline first inside a user's queue, and a request that its
place and the measured drain rate say cannot start in time refused at once (never without a
rate). Driven by events and a `FakeClock` only."""

from __future__ import annotations

import contextlib
import tracemalloc

import pytest

from fair_sched_plugin.core import (
    DeadlineOutcomes,
    Decision,
    InflightLimitGate,
    Lease,
    SchedulerCore,
    Ticket,
    TierLimits,
)
from fair_sched_plugin.core.release_rate import DrainRate
from fair_sched_plugin.errors import DeadlineUnreachable, QueueTimeout
from fair_sched_plugin.testing import FakeClock, make_ticket

TIERS = (TierLimits("interactive"), TierLimits("batch"))


def _core(clock: FakeClock, tiers: tuple[TierLimits, ...] = TIERS) -> SchedulerCore:
    return SchedulerCore(tiers, InflightLimitGate(1), clock=clock)


def _limited(user: str, max_wait_s: float, tier: str = "interactive") -> Ticket:
    return make_ticket(user, tier=tier)._replace(max_wait_s=max_wait_s)


def _leases(decisions: list[Decision]) -> list[Lease]:
    return [d.outcome for d in decisions if isinstance(d.outcome, Lease)]


def _drain_steadily(core: SchedulerCore, running: list[Lease], clock: FakeClock, count: int,
                    every_s: float = 1.0) -> list[Decision]:  # fmt: skip
    """End the running lease every `every_s` for `count` ends (deadlines ticked before each);
    the decisions made meanwhile, in order."""
    decisions = []
    for _ in range(count):
        clock.advance(every_s)
        core.tick(clock.now())
        running.pop(0).release()
        new = core.take_decisions()
        running.extend(_leases(new))
        decisions.extend(new)
    return decisions


def _measured(clock: FakeClock) -> tuple[SchedulerCore, list[Lease]]:
    """A core whose one slot drained a backlog at one release a second for thirty seconds (the
    backlog's first run of releases is not sampled: it fills the engine), with user "flood"
    still 20 deep."""
    core = _core(clock)
    first = core.try_acquire(make_ticket("flood"))
    assert first is not None
    for _ in range(50):
        core.submit(make_ticket("flood"))
    running = [first]
    _drain_steadily(core, running, clock, 30)
    assert core.statistics().queued == 20
    return core, running


def test_a_users_requests_go_earliest_deadline_first() -> None:
    clock = FakeClock()
    core = _core(clock)
    first = core.try_acquire(make_ticket("a"))
    assert first is not None
    late = core.submit(_limited("a", 60))
    also_late = core.submit(_limited("a", 50))
    urgent = core.submit(_limited("a", 5))
    running = [first]
    granted = _leases(_drain_steadily(core, running, clock, 3, every_s=0.1))
    order = [lease.ticket.max_wait_s for lease in granted]
    assert order == [urgent.ticket.max_wait_s, also_late.ticket.max_wait_s, late.ticket.max_wait_s]


def test_earliest_deadline_first_never_jumps_another_users_turn() -> None:
    clock = FakeClock()
    core = _core(clock)
    first = core.try_acquire(make_ticket("a"))
    assert first is not None
    core.submit(_limited("a", 60))
    core.submit(make_ticket("b"))
    core.submit(_limited("a", 5))
    running = [first]
    granted = _leases(_drain_steadily(core, running, clock, 3, every_s=0.1))
    # Round robin as without deadlines: b's turn first (a was charged for its lease), then a's
    # requests, its urgent one first.
    assert [(lease.ticket.user, lease.ticket.max_wait_s) for lease in granted] == [
        ("b", None),
        ("a", 5),
        ("a", 60),
    ]


def test_nothing_is_refused_early_before_a_drain_rate_is_measured() -> None:
    clock = FakeClock()
    core = _core(clock)
    first = core.try_acquire(make_ticket("flood"))
    assert first is not None
    for _ in range(50):
        core.submit(make_ticket("flood"))
    parked = core.submit(_limited("late", 0.5))  # 50 ahead, half a second: still parked
    assert core.take_decisions() == []
    clock.advance(0.5)
    core.tick(clock.now())
    (decision,) = core.take_decisions()
    assert decision.parked is parked and isinstance(decision.outcome, QueueTimeout)


def test_a_request_that_cannot_start_in_time_is_refused_at_admission() -> None:
    clock = FakeClock()
    core, _running = _measured(clock)
    # One release a second and round robin against "flood" (a round of one release, measured,
    # and "batch" adds one): the k-th of "batch" is the (2k-1)-th released, 2(k-1) s from
    # now. It is admitted where that leaves 40 % of its 4 s to spare: the first two.
    admitted, refused = [], []
    for _ in range(10):
        try:
            admitted.append(core.submit(_limited("batch", 4)))
        except DeadlineUnreachable as exc:
            refused.append(exc)
    assert len(admitted) == 2 and len(refused) == 8
    assert refused[0].status_code == 429 and refused[0].error_code == "deadline_unreachable"
    assert all(exc.retry_after_s >= 1 for exc in refused)


def test_refusing_early_loses_no_request_that_would_have_started_in_time() -> None:
    clock = FakeClock()
    core, running = _measured(clock)
    admitted = []
    for _ in range(10):
        with contextlib.suppress(DeadlineUnreachable):
            admitted.append(core.submit(_limited("batch", 4)))
    deadline = clock.now() + 4
    decisions = _drain_steadily(core, running, clock, 6)
    in_time = [g for g in _leases(decisions) if g.ticket.user == "batch"]
    # Turns alternate with "flood" at one release a second: batch's releases at +1 s and +3 s
    # are all that 4 s allow, both were admitted, and nothing admitted waited its limit out.
    assert len(in_time) == 2 and all(g.released_at <= deadline for g in in_time)
    assert [g.ticket for g in in_time] == [p.ticket for p in admitted]
    assert not [d for d in decisions if isinstance(d.outcome, QueueTimeout)]


def test_users_who_come_back_between_rounds_lengthen_the_predicted_wait() -> None:
    clock = FakeClock()
    core, running = _measured(clock)
    # Three light users each come back once a round while "flood" stays backlogged: a round is
    # now four releases, which the prediction measures (they are not queued when it looks).
    for _ in range(12):
        for user in ("l1", "l2", "l3"):
            core.submit(make_ticket(user))
        _drain_steadily(core, running, clock, 4, every_s=0.25)
    admitted = []
    for _ in range(10):
        with contextlib.suppress(DeadlineUnreachable):
            admitted.append(core.submit(_limited("batch", 4)))
    # A round is four releases and "batch" adds one: one second a round; 40 % of 4 s to spare
    # leaves 2.4 s, so its first three (at 0, 1.25 and 2.5 s, the last at the bound) at most.
    assert 2 <= len(admitted) <= 3


def test_a_request_with_nobody_queued_ahead_is_never_refused() -> None:
    clock = FakeClock()
    core, running = _measured(clock)
    _drain_steadily(core, running, clock, 20)
    assert core.statistics().queued == 0 and running  # the last one still holds the slot
    alone = core.submit(_limited("alone", 0.01))
    assert alone.state == 0  # parked, not refused


def test_a_slower_drain_refuses_the_tail_at_the_users_next_turn_before_its_deadline() -> None:
    clock = FakeClock()
    core, running = _measured(clock)
    batch = [core.submit(_limited("batch", 10)) for _ in range(4)]
    # Admitted at one release a second, every start predicted within 60 % of its 10 s. The
    # engine slows to one release every 3 s (batch's turns at +3, +9, +15, +21 s): once the
    # drain rate shows it (within a run of releases), at batch's next turn (+9 s) its last two
    # are seen not to make +10 s and are refused then, before their deadline, not at it.
    decisions = _drain_steadily(core, running, clock, 4, every_s=3.0)
    refused = [d for d in decisions if isinstance(d.outcome, DeadlineUnreachable)]
    assert sorted(id(d.parked) for d in refused) == sorted(id(p) for p in batch[2:])
    assert not [d for d in decisions if isinstance(d.outcome, QueueTimeout)]
    granted = {id(lease.ticket) for lease in _leases(decisions)}
    assert batch[0].state != 0 and batch[1].state != 0 and granted


def test_a_tiers_max_wait_ends_the_wait_and_counts_as_missed() -> None:
    clock = FakeClock()
    core = _core(clock, (TierLimits("interactive", max_wait_s=2.0), TierLimits("batch")))
    first = core.try_acquire(make_ticket("a"))
    assert first is not None
    parked = core.submit(make_ticket("b"))
    batch = core.submit(make_ticket("c", tier="batch"))
    assert core.next_due() == pytest.approx(clock.now() + 2.0)
    clock.advance(2.0)
    core.tick(clock.now())
    (decision,) = core.take_decisions()
    assert decision.parked is parked and isinstance(decision.outcome, QueueTimeout)
    assert batch.state == 0  # still queued: the batch tier has no limit of its own
    outcomes = core.deadline_outcomes()
    assert outcomes["interactive"] == DeadlineOutcomes(met=1, missed=1, refused=0)
    assert "batch" not in outcomes


def test_deadline_outcomes_count_met_missed_and_refused_per_tier() -> None:
    clock = FakeClock()
    core, running = _measured(clock)
    for _ in range(10):
        with contextlib.suppress(DeadlineUnreachable):
            core.submit(_limited("batch", 4))
    _drain_steadily(core, running, clock, 6)
    assert core.deadline_outcomes() == {"interactive": DeadlineOutcomes(met=2, missed=0, refused=8)}


def test_a_later_arrival_with_a_shorter_limit_expires_first() -> None:
    clock = FakeClock()
    core = _core(clock)
    first = core.try_acquire(make_ticket("a"))
    assert first is not None
    patient = core.submit(_limited("b", 10))
    hasty = core.submit(_limited("c", 1))
    clock.advance(1.0)
    core.tick(clock.now())
    (decision,) = core.take_decisions()
    assert decision.parked is hasty and patient.state == 0


def test_the_drain_rate_ignores_idle_time_between_backlogs() -> None:
    rate = DrainRate()
    now = 0.0
    rate.backlog_began(now)
    for _ in range(18):  # the first run fills the engine: not sampled
        now += 0.5
        rate.released(now)
    assert rate.rate(now) == pytest.approx(2.0)
    now += 20.0  # the queue emptied and stayed empty
    rate.backlog_began(now)
    now += 0.5
    rate.released(now)
    assert rate.rate(now) == pytest.approx(2.0)


def test_the_drain_rate_is_unknown_until_enough_releases_and_after_a_long_stall() -> None:
    rate = DrainRate()
    rate.backlog_began(0.0)
    for step in range(1, 16):
        rate.released(step * 1.0)
    # The first run of eight fills the engine and is not sampled; the second is not over.
    assert rate.rate(15.0) is None
    rate.released(16.0)
    assert rate.rate(16.0) == pytest.approx(1.0)
    assert rate.rate(16.0 + 31.0) is None  # nothing released for longer than the stale limit


def test_a_drain_that_slows_down_shows_before_its_run_ends() -> None:
    rate = DrainRate()
    rate.backlog_began(0.0)
    for step in range(1, 17):
        rate.released(step * 1.0)
    assert rate.rate(16.0) == pytest.approx(1.0)
    assert rate.rate(16.0 + 9.0) == pytest.approx(1 / 9)  # none for longer than a run takes
    for step in range(1, 4):  # slow gaps, fewer than half a run: not yet evidence
        rate.released(16.0 + 3 * step)
        assert rate.rate(16.0 + 3 * step) == pytest.approx(1.0)
    rate.released(28.0)  # four releases in twelve seconds: under half the rate
    assert rate.rate(28.0) == pytest.approx(4 / 12)


def test_with_tier_shares_the_other_tiers_releases_count_too() -> None:
    clock = FakeClock()
    tiers = (TierLimits("a", share=1.0), TierLimits("b", share=1.0))
    core = _core(clock, tiers)
    first = core.try_acquire(make_ticket("flood-a", tier="a"))
    assert first is not None
    for _ in range(40):
        core.submit(make_ticket("flood-a", tier="a"))
        core.submit(make_ticket("flood-b", tier="b"))
    running = [first]
    _drain_steadily(core, running, clock, 30)  # one release a second, the tiers alternating
    admitted = []
    for _ in range(6):
        with contextlib.suppress(DeadlineUnreachable):
            admitted.append(core.submit(_limited("x", 6, tier="a")))
    # Its turns alternate with flood-a's in tier a, whose releases alternate with tier b's:
    # its k-th starts about 4(k - 1) s from now. Counting only tier a's releases would have
    # admitted a third, due at 8 s; with room to spare (3.6 s of 6), two are admitted.
    assert len(admitted) == 2
    decisions = _drain_steadily(core, running, clock, 10)
    x_started = [lease for lease in _leases(decisions) if lease.ticket.user == "x"]
    assert len(x_started) == 2
    assert not [d for d in decisions if isinstance(d.outcome, QueueTimeout)]


@pytest.mark.parametrize(
    ("fairness", "weight"), [("round_robin", 1.0), ("weighted", 1e-6), ("tokens", 1.0)]
)
def test_a_request_alone_in_its_tier_is_not_refused_for_its_own_past_turns(
    fairness: str, weight: float
) -> None:
    """Its virtual time lies rounds ahead of its tier's (it was released last, and with a tiny
    weight a million rounds ahead), but nobody else is queued in the tier to take those rounds:
    it is the next released, whatever waits in a lower tier."""
    clock = FakeClock()
    core = SchedulerCore(TIERS, InflightLimitGate(1), clock=clock, fairness=fairness)  # type: ignore[arg-type]
    first = core.try_acquire(make_ticket("a", weight=weight))
    assert first is not None
    for _ in range(20):
        core.submit(make_ticket("a", weight=weight))
        core.submit(make_ticket("b"))
    for _ in range(5):
        core.submit(make_ticket("z", tier="batch"))
    running = [first]
    _drain_steadily(core, running, clock, 40)
    assert core.statistics().queued == 5 and running[0].ticket.user == "a"
    alone = core.submit(make_ticket("a", weight=weight)._replace(max_wait_s=0.5))
    assert alone.state == 0  # parked, not refused


def test_ever_shorter_limits_submitted_and_cancelled_leave_no_wakeups_behind() -> None:
    """Each request's deadline is earlier than the one armed, so each arms a wake-up of its own;
    cancelled at once, each leaves the one before stale until its due time (up to a day). The
    memory held must stay bounded by what is queued, not grow with the requests."""
    clock = FakeClock()
    core = SchedulerCore(TIERS, InflightLimitGate(1), clock=clock, max_wait_s=86_400)
    assert core.try_acquire(make_ticket("x")) is not None

    def abuse(count: int, start: int) -> None:
        for step in range(start, start + count):
            core.cancel(core.submit(_limited("a", 86_000 - step * 0.5)))
            clock.advance(0.1)
            core.tick(clock.now())

    abuse(2_000, 0)  # whatever is allocated once is allocated by now
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        abuse(20_000, 2_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 100_000  # about 120 bytes a request before the wake-ups were compacted
