"""Tickets and leases: the core's ranges for what one request may claim or report."""

from __future__ import annotations

import pytest

from fair_sched_plugin.core import MAX_REQUEST_COST, MAX_REQUEST_TOKENS, TierLimits
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.testing import FakeClock, ManualGate, make_ticket


@pytest.mark.parametrize(
    "fields",
    [
        {"cost": 10**400},
        {"cost": MAX_REQUEST_TOKENS + 1},
        {"cost": -1},
        {"price": float("inf")},
        {"price": float("nan")},
        {"price": 1e300},
        {"price": 10**400},
        {"weight": float("nan")},
        {"weight": 0.0},
        {"weight": 1e300},
    ],
    ids=repr,
)
def test_a_ticket_out_of_the_cores_range_is_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        make_ticket("a", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("fairness", ["round_robin", "weighted", "tokens", "cost"])
async def test_extreme_reports_at_a_leases_end_charge_the_estimate(fairness: str) -> None:
    """Before: a 400-digit `tokens_used` made the end's correction raise OverflowError after the
    lease was marked ended, before the core and the gate heard of it."""
    gate = ManualGate(is_open=True)
    scheduler = FairScheduler(
        [TierLimits("interactive")],
        gate,
        fairness=fairness,
        clock=FakeClock(),  # type: ignore[arg-type]
    )
    biggest = make_ticket("a", cost=MAX_REQUEST_TOKENS, price=MAX_REQUEST_COST, weight=1e-6)
    for tokens_used, cost_used in ((10**400, float("inf")), (-5, float("nan")), (None, 1e300)):
        lease = scheduler.try_acquire(biggest)
        assert lease is not None
        assert lease.release(tokens_used, cost_used=cost_used)  # type: ignore[arg-type]
        assert (lease.tokens_used, lease.cost_used) == (None, None)
    stats = scheduler.statistics()
    assert (stats.in_flight, stats.completed_total) == (0, 3)
    assert len(gate.ended) == 3
    assert scheduler.try_acquire(make_ticket("b")) is not None
