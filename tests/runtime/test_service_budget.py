"""Budgets, prices and the tier options through SchedulingService (fake clock, no engine)."""

from __future__ import annotations

from typing import Any

import pytest

from fair_sched_plugin.errors import BudgetExceeded
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.service import SchedulingService
from fair_sched_plugin.testing import FakeClock

BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}
PRICE = {"input_per_mtok": 1.0, "output_per_mtok": 3.0}


def service(clock: FakeClock, budget: dict[str, Any], **settings: Any) -> SchedulingService:
    return SchedulingService(
        {
            "unknown_model_max_inflight": 4,
            "principals": [{"name": "heavy", "keys": ["sk-h"], "budget": budget}],
            **settings,
        },
        clock=clock,
    )


async def test_over_a_reject_budget_answers_429_until_the_window_ends() -> None:
    clock = FakeClock()
    svc = service(clock, {"tokens": 200, "per": "minute", "action": "reject"})
    heavy = svc.identify(Credentials(api_key="sk-h"))
    admission = await svc.admit(heavy, "m", BODY)
    admission.lease.release(tokens_used=250)  # over the 200-token budget
    clock.advance(15)
    with pytest.raises(BudgetExceeded) as rejected:
        await svc.admit(heavy, "m", BODY)
    assert rejected.value.status_code == 429
    assert rejected.value.retry_after_s == pytest.approx(45)
    assert rejected.value.retry_after_header == "45"
    clock.advance(45)  # the window is over
    (await svc.admit(heavy, "m", BODY)).lease.release(tokens_used=10)
    await svc.aclose()


async def test_over_a_demote_budget_runs_in_the_lower_tier_until_the_window_ends() -> None:
    clock = FakeClock()
    svc = service(
        clock,
        {"usd": 0.001, "per": "hour", "action": "demote", "demote_to": "batch"},
        backends={"m": {"price": PRICE}},
    )
    heavy = svc.identify(Credentials(api_key="sk-h"))
    first = await svc.admit(heavy, "m", BODY)
    assert first.lease.ticket.tier == "interactive"
    # 100 prompt + 50 output tokens estimated: 100 * 1 + 50 * 3 = 250 per million.
    assert first.lease.ticket.price == pytest.approx(250 / 1e6)
    first.lease.release(cost_used=0.002)
    second = await svc.admit(heavy, "m", BODY)
    assert second.lease.ticket.tier == "batch"
    second.lease.release()
    clock.advance(3600)
    third = await svc.admit(heavy, "m", BODY)
    assert third.lease.ticket.tier == "interactive"
    third.lease.release()
    await svc.aclose()


async def test_spend_from_tokens_alone_scales_the_estimated_price() -> None:
    clock = FakeClock()
    svc = service(
        clock, {"usd": 1.0, "per": "day"}, backends={"m": {"price": PRICE}}, fairness="cost"
    )
    heavy = svc.identify(Credentials(api_key="sk-h"))
    admission = await svc.admit(heavy, "m", BODY)
    admission.lease.release(tokens_used=75)  # half the 150 estimated
    verdict = svc.budgets.verdict("heavy")
    assert verdict is not None and verdict.spent == pytest.approx(125 / 1e6)
    await svc.aclose()
