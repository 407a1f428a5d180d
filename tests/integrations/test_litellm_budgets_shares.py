"""End to end: cost fairness, budgets (demote and reject), tier shares and promotion,
through real `litellm` proxy processes in front of emulators (scenarios in
`fair_sched_plugin.lab.harness.tier_scenarios`, which the tier benchmark runs with a 60 s
cost window)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from fair_sched_plugin.lab.harness.tier_scenarios import (
    budget_stack,
    cost_fairness,
    heavy_flood_with_light_user,
    promotion,
    reject_until_429,
    tier_shares,
    warm,
)

from .litellm_harness import NEEDS_LITELLM

pytestmark = [
    pytest.mark.litellm,
    pytest.mark.slow,
    NEEDS_LITELLM,
]


async def test_cost_fairness_delivers_money_three_to_one(tmp_path: Path) -> None:
    result = await cost_fairness(tmp_path, warmup_s=3.0, window_s=12.0)
    print(
        f"\ncost delivered {result.delivered}, requests {result.requests}, ratio {result.ratio:.3f}"
    )
    assert 3 * 0.9 <= result.ratio <= 3 * 1.1


async def test_budgets_demote_to_the_lower_tier_and_reject_until_the_window_ends(
    tmp_path: Path,
) -> None:
    """The smallest flood that shows the tiers' priorities at the engine (no light user: the
    TTFT comparison is `test_budgets_light_user_ttft_with_a_demoted_heavy_user`, --full)."""
    async with budget_stack(tmp_path) as (base_url, emu):
        free = await heavy_flood_with_light_user(base_url, emu, "sk-heavy-free", wave2=8, light=0)
        demoted = await heavy_flood_with_light_user(
            base_url, emu, "sk-heavy-demote", wave2=8, light=0
        )
        demoted_again = await heavy_flood_with_light_user(
            base_url, emu, "sk-heavy-demote", wave2=8, light=0
        )
        rejected, _ = await reject_until_429(base_url)
    # Within budget everything runs in the principal's own tier; overspent, the engine gets the
    # lower tier's priority for every later request (in the second round, for all of them).
    assert set(free.wave1_priorities + free.wave2_priorities) == {0}
    assert demoted.wave1_priorities == [0] * 4
    assert demoted.wave2_priorities == [10] * len(demoted.wave2_priorities) != []
    assert set(demoted_again.wave1_priorities + demoted_again.wave2_priorities) == {10}
    # Reject: Retry-After is within the one-minute window opened by the first spend (the
    # arithmetic of "the rest of the window" is the budget book's, on a fake clock:
    # tests/runtime/test_service_budget.py).
    assert rejected.status_code == 429
    assert 1 <= int(rejected.headers["retry-after"]) <= 60


@pytest.mark.full
async def test_budgets_light_user_ttft_with_a_demoted_heavy_user(tmp_path: Path) -> None:
    """The full-size budget flood with a light user, numbers printed, never asserted."""
    async with budget_stack(tmp_path) as (base_url, emu):
        for key in ("sk-light", "sk-heavy-free"):
            await warm(base_url, key)
        # Interleaved rounds, so drift in the shared machine's load hits both alike.
        free = await heavy_flood_with_light_user(base_url, emu, "sk-heavy-free")
        demoted = await heavy_flood_with_light_user(base_url, emu, "sk-heavy-demote")
        free_again = await heavy_flood_with_light_user(base_url, emu, "sk-heavy-free")
        demoted_again = await heavy_flood_with_light_user(base_url, emu, "sk-heavy-demote")
    free_ttft = statistics.median(free.light_ttft + free_again.light_ttft)
    demoted_ttft = statistics.median(demoted.light_ttft + demoted_again.light_ttft)
    ratio = demoted_ttft / free_ttft
    free_overtaken = free.light_overtaken + free_again.light_overtaken
    demoted_overtaken = demoted.light_overtaken + demoted_again.light_overtaken
    print(
        f"\nlight TTFT median: heavy without overspend {free_ttft:.3f} s, "
        f"heavy demoted {demoted_ttft:.3f} s (ratio {ratio:.2f}); heavy requests the engine "
        f"got between a light request's sending and its arrival: {free_overtaken} without "
        f"overspend, {demoted_overtaken} demoted"
    )
    # Not asserted: the "light TTFT ratio <= 1.2". On the shared two cores the ratio of
    # medians came out 0.76, 0.90 and 1.31 in three runs (proxy CPU time, the same in both
    # cases, dominates a sub-second TTFT). The release-order count printed above (heavy
    # requests reaching the engine while a light request was on its way) summed 0 vs 9 in one
    # run and 4 vs 4 in the next (single bursts of 3-4 when the proxy was slow to take the light
    # request): no stable difference found; reported as open in the h19 report.


async def test_tier_shares_split_eighty_twenty(tmp_path: Path) -> None:
    served = await tier_shares(tmp_path, warmup_s=2.0, window_s=10.0)
    share = served["interactive"] / (served["interactive"] + served["batch"])
    print(f"\nreleased per tier {dict(served)}, interactive share {share:.3f}")
    assert 0.8 * 0.9 <= share <= 0.8 * 1.1
    assert 0.2 * 0.9 <= 1 - share <= 0.2 * 1.1


async def test_promotion_bounds_a_batch_requests_wait(tmp_path: Path) -> None:
    result = await promotion(tmp_path, promote_after_s=1.5, count=3)
    print(
        f"\nreleases between promotion time and the batch request: {result.released_after_promotion}"
    )
    # Strict tiers would starve it while the two interactive users are backlogged; promoted, it
    # goes within one release round of the interactive tier (two users), plus what was already
    # on its way from the proxy to the engine when the test read the engine's log (the
    # proxy's clock and ours are one event-loop hop apart).
    assert all(count <= 2 + 2 for count in result.released_after_promotion)
