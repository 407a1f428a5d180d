"""Settings of the self-tuning threshold: `waiting_below: auto` in its three forms, `ttft_target_ms`, and the
backend keys `max_num_seqs` and `metrics_lag_ms`; what the service makes of them."""

from __future__ import annotations

from typing import Any

import pytest

from fair_sched_plugin.config import load_settings
from fair_sched_plugin.core import BackendSnapshot
from fair_sched_plugin.errors import ConfigError
from fair_sched_plugin.runtime.service import SchedulingService
from fair_sched_plugin.testing import FakeClock


def tier(**keys: Any) -> dict[str, Any]:
    return {"tiers": [{"name": "interactive", **keys}]}


@pytest.mark.parametrize(
    ("keys", "bounds", "start"),
    [
        ({"waiting_below": "auto", "ttft_target_ms": 1000}, (1, 32), 3),
        ({"waiting_below": "auto", "waiting_below_min": 2, "tpot_below_ms": 150}, (2, 32), 3),
        ({"waiting_below": {"auto": {"min": 2, "max": 9}}, "ttft_target_ms": 800}, (2, 9), 3),
        ({"waiting_below": {"auto": {"min": 5, "max": 9}}, "ttft_target_ms": 800}, (5, 9), 5),
        ({"waiting_below": {"auto": {"min": 0, "max": 2}}, "ttft_target_ms": 800}, (0, 2), 2),
        ({"waiting_below": {"auto": {}}, "ttft_target_ms": 800}, (1, 32), 3),
        ({"waiting_below": {"auto": {"min": 0, "max": 8}}, "ttft_target_ms": 800}, (0, 8), 3),
        ({"waiting_below": "auto", "waiting_below_min": 0, "ttft_target_ms": 800}, (0, 32), 3),
        ({"waiting_below": 3}, None, 3),
        ({"waiting_below": 3, "ttft_target_ms": 800}, None, 3),  # a number stays a number
        ({}, None, 3),  # no target: the fixed default
        ({"tpot_below_ms": 150}, None, 3),  # a release condition, not a target for `auto`
        ({"ttft_target_ms": 800}, (1, 32), 3),  # a TTFT target and no threshold: `auto`
        ({"ttft_target_ms": 800, "waiting_below_max": 8}, (1, 8), 3),
        ({"waiting_below_min": 2, "tpot_below_ms": 150}, (2, 32), 3),
        ({"waiting_below": 0}, None, 0),
        ({"waiting_below": 4.0}, None, 4),  # YAML `4.0`
    ],
)
def test_the_forms_of_waiting_below(
    keys: dict[str, Any], bounds: tuple[int, int] | None, start: int
) -> None:
    """`auto` starts at the fixed default (3) within its bounds; a number is where it stays."""
    settings = load_settings(tier(**keys))
    assert settings.tiers[0].auto_bounds() == bounds
    assert settings.tiers[0].initial_waiting_below() == start


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"waiting_below": "auto"}, "tiers[0].waiting_below: auto needs ttft_target_ms or"),
        (
            {"waiting_below": "auto", "ttft_target_ms": 1, "waiting_below_min": 5,
             "waiting_below_max": 2},
            "tiers[0].waiting_below: auto needs min <= max (got min 5, max 2)",
        ),
        ({"waiting_below": 3, "waiting_below_min": 2}, "only with waiting_below: auto"),
        ({"waiting_below_min": 2}, "tiers[0].waiting_below: auto needs ttft_target_ms or"),
        (
            {"waiting_below": {"auto": {"min": 2}}, "waiting_below_max": 4, "ttft_target_ms": 1},
            "give them in one place",
        ),
        (
            {"waiting_below": {"auto": {"min": -1}}, "ttft_target_ms": 1},
            "tiers[0].waiting_below.auto.min: Input should be greater than or equal to 0",
        ),
        ({"waiting_below": "sometimes"}, "tiers[0].waiting_below: must be a whole number, auto or"),
        ({"waiting_below": 2.5}, "tiers[0].waiting_below: must be a whole number of requests (got 2.5)"),
        ({"waiting_below": -1.0}, "tiers[0].waiting_below: must be 0 or more (got -1)"),
        ({"waiting_below": -1}, "tiers[0].waiting_below: must be 0 or more (got -1)"),
        (
            {"waiting_below": "auto", "waiting_below_min": -1, "ttft_target_ms": 1},
            "tiers[0].waiting_below_min: Input should be greater than or equal to 0",
        ),
        (
            {"waiting_below": {"auto": {"max": 0}}, "ttft_target_ms": 1},
            "tiers[0].waiting_below.auto.max: Input should be greater than 0",
        ),
        ({"waiting_below": "auto", "ttft_target_ms": -5}, "tiers[0].ttft_target_ms"),
    ],
)  # fmt: skip
def test_bad_auto_settings_name_the_key(keys: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(tier(**keys))
    assert expected in str(caught.value)


def test_bad_backend_keys_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"backends\.m\.max_num_seqs"):
        load_settings({"backends": {"m": {"api_base": "http://127.0.0.1:9/v1", "max_num_seqs": 0}}})
    with pytest.raises(ConfigError, match=r"backends\.m\.metrics_lag_ms"):
        load_settings({"backends": {"m": {"metrics_lag_ms": -1}}})


async def test_the_service_tunes_an_auto_tier_and_reports_what_it_allows() -> None:
    """The gate gets the tier as auto (starting at its minimum), `max_num_seqs` and the lag; the
    service's thresholds (the `fair_sched_tier_waiting_threshold` metric and the status page)
    report what the tuner allows now, per model (summed over deployments)."""
    clock = FakeClock()
    svc = SchedulingService(
        {
            **tier(waiting_below={"auto": {"min": 2, "max": 9}}, ttft_target_ms=500),
            "backends": {
                "m": {
                    "metrics_urls": ["http://a:8000/metrics", "http://b:8000/metrics"],
                    "max_num_seqs": 8,
                    "metrics_lag_ms": 1500,
                }
            },
        },
        clock=clock,
    )
    (limits,) = svc.scheduler.tiers
    assert (limits.waiting_below, limits.auto_waiting_below) == (3, (2, 9))
    assert limits.ttft_target_s == 0.5
    spec = svc.gate.groups()["m"]
    assert (spec.max_num_seqs, spec.metrics_lag_s) == (8, 1.5)
    assert svc.observability.view.waiting_thresholds() == {
        "m": {"interactive": 6}
    }  # 3 per deployment
    for url in spec.metrics_urls:
        svc.gate.update("m", BackendSnapshot(url, clock.now(), ok=True, running=8))
    svc.gate.may_release("m", limits)  # the tuner starts with the tier's first decision
    assert [t["interactive"].allowed for t in svc.gate.tuning("m").values()] == [3, 3]
    assert svc.observability.view.waiting_thresholds() == {"m": {"interactive": 6}}
    # The engine's queue is at the allowed 3 + 3 and its TTFT well within the target: it grows.
    for url in spec.metrics_urls:
        svc.gate.update("m", BackendSnapshot(url, clock.now(), ok=True, waiting=3, running=8))
    assert not svc.gate.may_release("m", limits)  # held back by the queue: the limit binds
    clock.advance(1.1)
    for url in spec.metrics_urls:
        snapshot = BackendSnapshot(url, clock.now(), ok=True, waiting=3, running=8, ttft_s=0.1)
        svc.gate.update("m", snapshot)
    assert svc.observability.view.waiting_thresholds() == {"m": {"interactive": 8}}
    text = svc.observability.render().decode()
    assert 'fair_sched_tier_waiting_threshold{model="m",tier="interactive"} 8.0' in text
    status = svc.scheduler.gate_status()[0]
    assert status.allowed_queue == (("interactive", 8.0),)
    await svc.aclose()
