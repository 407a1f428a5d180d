"""The budget book: spend per principal per window on a fake clock."""

from __future__ import annotations

import pytest

from fair_sched_plugin.core import BudgetBook, BudgetRule
from fair_sched_plugin.testing import FakeClock

DEMOTE = BudgetRule(1.0, "usd", 60.0, "demote", "batch")
REJECT = BudgetRule(1000, "tokens", 3600.0, "reject")


def book(clock: FakeClock) -> BudgetBook:
    return BudgetBook({"ci-bot": DEMOTE, "crawler": REJECT}, clock=clock)


def test_under_budget_until_the_limit_is_spent() -> None:
    clock = FakeClock()
    budgets = book(clock)
    budgets.spend("ci-bot", usd=0.6)
    verdict = budgets.verdict("ci-bot")
    assert verdict is not None and not verdict.over
    assert verdict.remaining == pytest.approx(0.4)
    budgets.spend("ci-bot", usd=0.4)
    verdict = budgets.verdict("ci-bot")
    assert verdict is not None and verdict.over and verdict.rule.demote_to == "batch"


def test_the_window_resets_after_its_length_counted_from_the_first_spend() -> None:
    clock = FakeClock()
    budgets = book(clock)
    budgets.spend("crawler", tokens=600)
    clock.advance(1800)
    budgets.spend("crawler", tokens=600)
    verdict = budgets.verdict("crawler")
    assert verdict is not None and verdict.over and verdict.rule.action == "reject"
    assert verdict.resets_in_s == pytest.approx(1800)  # Retry-After for a rejection
    clock.advance(1800)
    verdict = budgets.verdict("crawler")
    assert verdict is not None and not verdict.over and verdict.spent == 0


def test_the_unit_of_the_rule_is_counted_and_others_are_free() -> None:
    clock = FakeClock()
    budgets = book(clock)
    budgets.spend("crawler", usd=100.0)  # tokens budget: money does not count
    budgets.spend("alice", usd=100.0, tokens=10**6)  # no budget at all
    assert budgets.verdict("crawler").spent == 0  # type: ignore[union-attr]
    assert budgets.verdict("alice") is None
    assert budgets.snapshot() == {}


def test_snapshot_restores_into_another_clock() -> None:
    clock = FakeClock(start=1000.0)
    budgets = book(clock)
    budgets.spend("ci-bot", usd=2.0)
    clock.advance(20)
    state = budgets.snapshot()
    assert state == {"ci-bot": {"spent": 2.0, "resets_in_s": 40.0}}
    other_clock = FakeClock(start=5.0)
    other = book(other_clock)
    other.restore(state)
    verdict = other.verdict("ci-bot")
    assert verdict is not None and verdict.over and verdict.resets_in_s == pytest.approx(40.0)
    other_clock.advance(40)
    assert not other.verdict("ci-bot").over  # type: ignore[union-attr]


def test_a_demote_rule_needs_a_tier() -> None:
    with pytest.raises(ValueError, match="demote_to"):
        BudgetBook({"x": BudgetRule(1.0, "usd", 60.0, "demote")}, clock=FakeClock())


def test_restore_with_replace_drops_windows_the_snapshot_lacks() -> None:
    clock = FakeClock()
    budgets = book(clock)
    budgets.spend("ci-bot", usd=0.5)
    budgets.spend("crawler", tokens=10)
    budgets.restore({"crawler": {"spent": 700, "resets_in_s": 100.0}}, replace=True)
    assert budgets.snapshot() == {"crawler": {"spent": 700.0, "resets_in_s": 100.0}}


@pytest.mark.parametrize(
    "snapshot",
    [
        ["ci-bot"],
        {"ci-bot": 2.0},
        {"ci-bot": {"spent": "2"}},
        {"ci-bot": {"spent": 2.0}},
        {"ci-bot": {"spent": -1.0, "resets_in_s": 10.0}},
        {"ci-bot": {"spent": float("nan"), "resets_in_s": 10.0}},
        {"ci-bot": {"spent": True, "resets_in_s": 10.0}},
        {"ci-bot": {"spent": 1.0, "resets_in_s": 10.0}, "crawler": None},
    ],
)
def test_a_malformed_snapshot_is_refused_and_changes_nothing(snapshot: object) -> None:
    clock = FakeClock()
    budgets = book(clock)
    budgets.spend("crawler", tokens=10)
    before = budgets.snapshot()
    with pytest.raises(ValueError, match="budget snapshot"):
        budgets.restore(snapshot, replace=True)
    assert budgets.snapshot() == before


def test_the_longest_window_bounds_how_long_a_snapshot_matters() -> None:
    assert book(FakeClock()).longest_window_s() == 3600.0
    assert BudgetBook({}, clock=FakeClock()).longest_window_s() == 0.0


def test_a_snapshot_with_a_number_too_large_for_a_float_is_refused() -> None:
    """`ValueError`, never OverflowError: the snapshot comes from another process."""
    book = BudgetBook({"a": BudgetRule(10.0, "tokens", 60.0, "reject")}, clock=FakeClock())
    with pytest.raises(ValueError):
        book.restore({"a": {"spent": 10**400, "resets_in_s": 5.0}})
