"""The bench's fairness numbers on hand-made records: Jain's index, backlogged intervals, the
service gap against VTC's bound."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fair_sched_plugin.lab.loadtest.fairness import (
    backlog_intervals,
    fairness_summary,
    jain_while_backlogged,
    max_service_gap,
    service_over_time,
)
from fair_sched_plugin.lab.loadtest.stats import jain_index


@dataclass
class R:
    user: str
    started: float
    first_token: float | None
    ended: float | None
    tokens: int
    error: str | None = None


def test_jain_index_is_one_for_equal_shares_and_one_over_n_for_one_winner() -> None:
    assert jain_index([5.0, 5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain_index([12.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([3.0, 1.0]) == pytest.approx(16 / 20)
    assert jain_index([]) == 0.0


def test_backlog_is_merged_from_send_to_first_token_or_to_the_end_of_a_failure() -> None:
    records = [
        R("a", 0.0, 2.0, 3.0, 10),
        R("a", 1.0, 4.0, 5.0, 10),  # overlaps the first: one interval 0..4
        R("a", 6.0, 7.0, 8.0, 10),
        R("b", 0.5, None, 1.5, 0, error="HTTP 500"),
    ]
    assert backlog_intervals(records) == {"a": [(0.0, 4.0), (6.0, 7.0)], "b": [(0.5, 1.5)]}


def test_fifo_behind_a_flood_gives_a_gap_of_everything_the_heavy_user_got_meanwhile() -> None:
    # The heavy user's 10 requests of 10 tokens start one a second; the light user waits 0..10.
    records = [R("heavy", 0.0, 0.5 + i, 1.0 + i, 10) for i in range(10)]
    records.append(R("light", 0.0, 10.5, 11.0, 10))
    gap = max_service_gap(records)
    # While both were backlogged (0..10.5): heavy started all 10 requests, light its one at the
    # very end, so the running difference went from 0 to 100 and back to 90.
    assert gap.tokens == 100
    assert gap.users == ("heavy", "light")
    assert gap.tokens > 2 * 10  # beyond VTC's bound


def test_alternating_service_stays_within_one_request() -> None:
    # Round-robin: a, b, a, b ... each 10 tokens, both backlogged throughout.
    records = [R("a" if i % 2 == 0 else "b", 0.0, 1.0 + i, 2.0 + i, 10) for i in range(10)]
    assert max_service_gap(records).tokens == 10


def test_gap_counts_only_the_time_both_were_backlogged() -> None:
    # b arrives after a's work all started: never backlogged together, no gap to speak of.
    records = [R("a", 0.0, 0.1, 5.0, 100), R("b", 1.0, 1.1, 2.0, 1)]
    assert max_service_gap(records).tokens == 0
    assert max_service_gap(records).users is None


def test_gap_compares_only_users_of_the_same_class() -> None:
    records = [R("heavy", 0.0, 0.5 + i, 1.0 + i, 10) for i in range(10)]
    records.append(R("light", 0.0, 10.5, 11.0, 10))
    assert max_service_gap(records, {"heavy": "batch", "light": "interactive"}).tokens == 0


def test_jain_counts_intervals_with_two_users_backlogged_throughout() -> None:
    # Both backlogged 0..4; in each 1 s interval a gets 30 tokens and b 10, then 0..4 b none.
    records = [R("a", 0.0, 0.5 + i, 0.6 + i, 30) for i in range(4)]
    records += [R("b", 0.0, 0.5 + i, 0.6 + i, 10) for i in range(4)]
    index, intervals = jain_while_backlogged(records, 1.0)
    assert intervals == 3  # 0-1, 1-2, 2-3: 3-4 ends at 3.5 for both
    assert index == pytest.approx(jain_index([30.0, 10.0]))


def test_jain_is_none_without_two_users_backlogged_at_once() -> None:
    records = [R("a", 0.0, 0.1, 1.0, 10), R("b", 2.0, 2.1, 3.0, 10)]
    assert jain_while_backlogged(records, 0.5) == (None, 0)
    with pytest.raises(ValueError):
        jain_while_backlogged(records, 0)


def test_service_over_time_spreads_tokens_over_streaming() -> None:
    times, curves = service_over_time([R("a", 0.0, 1.0, 3.0, 20)], 1.0)
    assert times[:4] == [0.0, 1.0, 2.0, 3.0]
    assert curves["a"][:4] == [0, 0, 10, 20]


def test_summary_names_light_and_heavy_and_the_bound() -> None:
    records = [R("heavy", 0.0, 0.5 + i, 1.0 + i, 10) for i in range(10)]
    records.append(R("light", 0.0, 10.5, 11.0, 10))
    summary = fairness_summary(
        records, heavy_users={"heavy"}, largest_request_tokens=10, interval_s=1.0
    )
    assert summary["light_ttft_p50_s"] == pytest.approx(10.5)
    assert summary["heavy_ttft_p50_s"] == pytest.approx(5.0)
    assert summary["vtc_bound_tokens"] == 20
    assert summary["max_service_gap_tokens"] == 100
    assert summary["gap_within_bound"] is False
