"""The replay's plan and limits: what a run against somebody else's endpoint may send."""

from __future__ import annotations

import pytest

from fair_sched_plugin.lab.loadtest.replay import (
    Identity,
    Limits,
    OpenTarget,
    PlanError,
    ReplayRecord,
    assign_keys,
    errors_by_status,
    make_plan,
    replay,
    request_body,
)
from fair_sched_plugin.lab.loadtest.trace import TraceRequest, TraceShape, make_trace

TRACE = [TraceRequest(float(i), f"u{i % 3}", 10 + i, prompt_tokens=5) for i in range(10)]


def test_plan_sums_requests_tokens_and_bounds_the_time() -> None:
    plan = make_plan(TRACE, Limits(request_timeout_s=30), speed=2.0)
    assert plan.requests == 10
    assert plan.output_tokens == sum(10 + i for i in range(10))
    assert plan.prompt_tokens == 50
    assert plan.users == 3
    assert plan.arrivals_s == pytest.approx(4.5)  # the last arrival at 9 s, twice as fast
    assert plan.duration_bound_s == pytest.approx(34.5)
    assert "10 requests from 3 users" in plan.describe()


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (Limits(max_requests=9), "10 requests exceed --max-requests 9"),
        (Limits(max_output_tokens=100), "output tokens exceed --max-total-tokens 100"),
        (Limits(max_duration_s=9), "do not fit --max-duration 9"),
    ],
)
def test_a_trace_beyond_a_limit_is_refused_before_anything_is_sent(
    limits: Limits, message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(TRACE, limits)


def test_plan_caps_the_duration_at_the_limit() -> None:
    plan = make_plan(TRACE, Limits(max_duration_s=20, request_timeout_s=120))
    assert plan.duration_bound_s == 20


def test_bad_limits_and_speeds_are_refused() -> None:
    with pytest.raises(ValueError):
        Limits(concurrency=0)
    with pytest.raises(ValueError):
        Limits(stop_after_errors=0)
    with pytest.raises(PlanError, match="speed"):
        make_plan(TRACE, Limits(), speed=0)
    with pytest.raises(PlanError, match="empty"):
        make_plan([], Limits())


async def test_replay_refuses_a_trace_larger_than_its_plan() -> None:
    plan = make_plan(TRACE[:5], Limits())
    with pytest.raises(PlanError, match="larger than its plan"):
        await replay(OpenTarget("t", "http://127.0.0.1:9/v1"), TRACE, plan, model="m")


def test_the_heavy_user_gets_the_first_key_and_tiers_their_own() -> None:
    trace = make_trace(TraceShape("flood", requests=30, users=4))
    keys = assign_keys(trace, Identity(keys=("k-heavy", "k2")))
    assert keys["u0"] == "k-heavy"
    assert sorted(keys.values()) == ["k-heavy", "k-heavy", "k2", "k2"]  # round-robin
    tiers = make_trace(TraceShape("tiers", requests=20, users=3, batch_users=1))
    by_tier = assign_keys(tiers, Identity(keys=("k",), tier_keys={"batch": ("kb",)}))
    assert by_tier == {"u0": "kb", "u1": "k", "u2": "k"}


def test_the_body_carries_the_user_only_when_asked() -> None:
    body = request_body(TRACE[0], 0, "m", Identity(), ignore_eos=True)
    assert body["user"] == "u0" and body["max_tokens"] == 10 and body["ignore_eos"] is True
    bare = request_body(TRACE[0], 0, "m", Identity(user_field=False), ignore_eos=False)
    assert "user" not in bare and "ignore_eos" not in bare


def test_errors_are_grouped_by_status() -> None:
    def record(status: int | None, error: str | None) -> ReplayRecord:
        return ReplayRecord(0, "u", None, 0.0, 1, status=status, error=error)

    records = [
        record(200, None),
        record(429, "HTTP 429"),
        record(429, "HTTP 429"),
        record(None, "ConnectError"),
        record(200, "ReadError"),  # the stream broke after its 200
        record(200, "cancelled: the plan's time bound"),
    ]
    assert errors_by_status(records) == {"429": 2, "cancelled": 1, "connection": 2}
