"""The fairness gauges of the core: Jain's index, the service gap and the starved wait over a
sliding window, fed by events and a fake clock."""

from __future__ import annotations

import pytest

from fair_sched_plugin.core import (
    FairnessReading,
    FairnessWindow,
    InflightLimitGate,
    Lease,
    SchedulerCore,
    TierLimits,
)
from fair_sched_plugin.core.fairness_window import SAMPLES_PER_WINDOW, jain_index
from fair_sched_plugin.testing import FakeClock, make_ticket

TIERS = (TierLimits("interactive"),)
WINDOW_S = 10.0


def _core(clock: FakeClock, fairness: str = "round_robin", slots: int = 1) -> SchedulerCore:
    return SchedulerCore(
        TIERS,
        InflightLimitGate(slots),
        clock=clock,
        fairness=fairness,  # type: ignore[arg-type]
        fairness_window_s=WINDOW_S,
    )


def _serve(
    core: SchedulerCore,
    clock: FakeClock,
    rounds: int,
    tokens: dict[str, int],
    *,
    step_s: float = 0.5,
) -> list[FairnessReading]:
    """Keep every user of `tokens` backlogged (its next request queued before its lease ends)
    and end one lease per step, with the user's tokens used; the readings after each step."""
    readings = []
    for _ in range(rounds):
        for decision in core.take_decisions():
            lease = decision.outcome
            assert isinstance(lease, Lease)
            user = lease.ticket.user
            clock.advance(step_s)
            core.submit(make_ticket(user, cost=tokens[user]))
            lease.release(tokens_used=tokens[user])
            readings += core.fairness()
    return readings


def _backlogged_core(clock: FakeClock, fairness: str, tokens: dict[str, int]) -> SchedulerCore:
    core = _core(clock, fairness)
    for user, cost in tokens.items():
        for _ in range(2):
            core.submit(make_ticket(user, cost=cost))
    return core


def test_jain_index_is_one_for_equal_shares_and_one_over_n_for_a_monopoly() -> None:
    assert jain_index([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([]) == 1.0


def test_no_index_before_a_user_was_backlogged_over_two_samples() -> None:
    clock = FakeClock()
    core = _core(clock)
    core.submit(make_ticket("a"))
    core.submit(make_ticket("a"))
    (reading,) = core.fairness()
    assert reading.users == 0
    assert reading.jain_index == ()
    assert reading.service_gap_tokens is None


def test_tokens_fairness_evens_out_tokens_where_round_robin_evens_out_requests() -> None:
    tokens = {"long": 256, "short": 32}
    by_policy = {}
    for policy in ("round_robin", "tokens"):
        clock = FakeClock()
        core = _backlogged_core(clock, policy, tokens)
        last = _serve(core, clock, 80, tokens)[-1]
        assert last.users == 2
        by_policy[policy] = last
    rr, fair = by_policy["round_robin"], by_policy["tokens"]
    assert dict(rr.jain_index)["requests"] > 0.95
    assert dict(fair.jain_index)["tokens"] > 0.9 > dict(rr.jain_index)["tokens"]
    assert "requests" not in dict(fair.jain_index)
    assert rr.service_gap_tokens is not None and fair.service_gap_tokens is not None
    assert fair.service_gap_tokens < rr.service_gap_tokens


def test_the_window_slides_past_service_older_than_a_window() -> None:
    clock = FakeClock()
    tokens = {"a": 10, "b": 10}
    core = _backlogged_core(clock, "round_robin", tokens)
    readings = _serve(core, clock, 2 * int(WINDOW_S / 0.5), tokens)
    assert WINDOW_S <= readings[-1].span_s <= WINDOW_S * 1.5


def test_service_is_weighted() -> None:
    clock = FakeClock()
    core = _core(clock, "weighted")
    weights = {"heavy": 4.0, "light": 1.0}
    for user, weight in weights.items():
        for _ in range(5):
            core.submit(make_ticket(user, weight=weight))
    readings = []
    for _ in range(100):
        for decision in core.take_decisions():
            lease = decision.outcome
            assert isinstance(lease, Lease)
            clock.advance(0.5)
            core.submit(make_ticket(lease.ticket.user, weight=lease.ticket.weight))
            lease.release()
            readings += core.fairness()
    # Served 4:1, each divided by its weight: even, in requests and in tokens.
    index = dict(readings[-1].jain_index)
    assert index["requests"] > 0.95
    assert index["tokens"] > 0.95


def test_a_user_idle_part_of_the_window_is_left_out() -> None:
    clock = FakeClock()
    core = _core(clock)
    held = core.try_acquire(make_ticket("x"))  # the only slot: nothing is released below
    assert held is not None
    core.submit(make_ticket("a"))
    core.fairness()
    clock.advance(WINDOW_S)
    core.submit(make_ticket("b"))  # backlogged only since now
    (reading,) = core.fairness()
    assert reading.users == 1


def test_starved_wait_is_the_longest_wait_for_a_next_release() -> None:
    clock = FakeClock()
    core = _core(clock)
    held = core.try_acquire(make_ticket("x"))
    assert held is not None
    core.submit(make_ticket("a"))
    clock.advance(3.0)
    core.submit(make_ticket("b"))
    clock.advance(2.0)
    (reading,) = core.fairness()
    assert reading.starved_wait_s == pytest.approx(5.0)
    held.release()  # "a" goes: "b" has now waited longest
    (reading,) = core.fairness()
    assert reading.starved_wait_s == pytest.approx(2.0)


def test_samples_are_kept_per_window_step_not_per_reading() -> None:
    clock = FakeClock()
    window = FairnessWindow(WINDOW_S, "round_robin")
    for _ in range(3000):  # three windows, a reading every 10 ms
        window.read(clock.now(), [])
        clock.advance(0.01)
    assert window.samples_kept <= SAMPLES_PER_WINDOW + 1


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        FairnessWindow(0.0, "tokens")
