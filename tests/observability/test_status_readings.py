"""What the status document (and the live page reading it) says when the engine's metrics are
missing or failing: which reading the gate decides on, its age, and the in-flight cap in force."""

from __future__ import annotations

from typing import Any

import httpx

from fair_sched_plugin.core import BackendSnapshot
from fair_sched_plugin.litellm._routes import LITELLM_KEY_HINT
from fair_sched_plugin.observability import UI_PATH, admin_app
from fair_sched_plugin.observability._ui import (
    ARGUMENT_KEY_HINT,
    SETTINGS_KEY_HINT,
    page,
)
from fair_sched_plugin.runtime.service import SchedulingService
from fair_sched_plugin.testing import FakeClock

METRICS_URL = "http://127.0.0.1:9/metrics"  # never scraped: these services are not started


def service_with_cap(clock: FakeClock, cap: int = 2) -> SchedulingService:
    return SchedulingService(
        {
            "backends": {
                "big": {"metrics_url": METRICS_URL, "on_metrics_unavailable": {"max_inflight": cap}}
            },
            "on_metrics_unavailable": {"max_inflight": 7},  # the backend's own cap wins
            "stale_after_ms": 1000,
        },
        clock=clock,
    )


def model_status(service: SchedulingService) -> dict[str, Any]:
    status: dict[str, Any] = service.observability.status()["models"]["big"]
    return status


async def test_without_a_reading_the_gate_shows_the_in_flight_cap_in_force() -> None:
    clock = FakeClock()
    service = service_with_cap(clock)
    service.gate.update("big", BackendSnapshot.failed(METRICS_URL, clock.now(), "refused"))
    gate = model_status(service)["gate"]
    assert gate["mode"] == "fallback"
    assert gate["waiting"] is None  # no scrape ever succeeded: no engine queue to show
    assert gate["fallback_max_inflight"] == 2
    await service.aclose()


async def test_the_login_prompt_names_the_key_of_each_integration() -> None:
    assert b"general_settings.master_key" in page(LITELLM_KEY_HINT)
    for hint in (SETTINGS_KEY_HINT, ARGUMENT_KEY_HINT):
        assert b"master key" not in page(hint)
    service = SchedulingService({})
    for admin_key, hint in ((None, SETTINGS_KEY_HINT), ("adm", ARGUMENT_KEY_HINT)):
        transport = httpx.ASGITransport(app=admin_app(service, admin_key=admin_key))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            text = (await client.get(UI_PATH)).text
        assert f"Type the admin key: {hint}." in text
    await service.aclose()
