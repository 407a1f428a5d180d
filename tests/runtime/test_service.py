"""SchedulingService: the path both integrations share."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from fair_sched_plugin.core import MAX_REQUEST_TOKENS, BackendSnapshot
from fair_sched_plugin.errors import ConfigError, QueueFull, QueueTimeout
from fair_sched_plugin.request.body import requested_choices, requested_max_tokens
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.driver import DisconnectSignal
from fair_sched_plugin.runtime.service import ClientDisconnected, SchedulingService
from fair_sched_plugin.testing import FakeClock, settle

BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}


def service(**settings: Any) -> SchedulingService:
    return SchedulingService({"unknown_model_max_inflight": 1, **settings})


async def test_disconnect_while_parked_leaves_the_queue_and_never_gets_a_lease() -> None:
    svc = service()
    principal = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(principal, "m", BODY)
    gone = asyncio.Event()
    parked = asyncio.create_task(svc.admit(principal, "m", BODY, disconnected=gone))
    await settle()
    assert svc.scheduler.statistics().queued == 1
    gone.set()
    with pytest.raises(ClientDisconnected):
        await parked
    await settle()
    holder.lease.release()
    stats = svc.scheduler.statistics()
    assert (stats.queued, stats.in_flight, stats.released_total) == (0, 0, 1)
    await svc.aclose()


@pytest.mark.parametrize("event", [asyncio.Event, DisconnectSignal])
async def test_disconnect_and_release_in_the_same_tick_gives_the_lease_back(
    event: type[asyncio.Event],
) -> None:
    """Race: the lease is granted and the client disconnects before the waiter resumes; the
    disconnect wins and the engine never sees the request (a plain event, watched by a task,
    or the integrations' `DisconnectSignal`, which calls back)."""
    svc = service()
    principal = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(principal, "m", BODY)
    gone = event()
    parked = asyncio.create_task(svc.admit(principal, "m", BODY, disconnected=gone))
    await settle()
    holder.lease.release()  # grants the parked request synchronously
    gone.set()
    with pytest.raises(ClientDisconnected):
        await parked
    for _ in range(3):
        await settle()
    stats = svc.scheduler.statistics()
    assert (stats.in_flight, stats.abandoned_total) == (0, 1)
    await svc.aclose()


async def test_cancelling_the_request_task_leaks_no_lease() -> None:
    """Race: the request's own task is cancelled while parked (server shutdown, timeout)."""
    svc = service()
    principal = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(principal, "m", BODY)
    parked = asyncio.create_task(svc.admit(principal, "m", BODY, disconnected=asyncio.Event()))
    await settle()
    parked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await parked
    await settle()
    holder.lease.release()
    stats = svc.scheduler.statistics()
    assert (stats.queued, stats.in_flight) == (0, 0)
    await svc.aclose()


async def test_queue_full_is_raised_to_the_integration() -> None:
    svc = service(queue={"max_per_user": 1})
    principal = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(principal, "m", BODY)
    parked = asyncio.create_task(svc.admit(principal, "m", BODY))
    await settle()
    with pytest.raises(QueueFull):
        await svc.admit(principal, "m", BODY)
    holder.lease.release()
    (await parked).lease.release()
    await svc.aclose()


async def test_parked_body_bytes_past_the_users_cap_are_a_429_and_given_back() -> None:
    svc = service(queue={"max_bytes_per_user": 1_000})
    principal = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(principal, "m", BODY, body_bytes=900)  # released at once: free
    parked = asyncio.create_task(svc.admit(principal, "m", BODY, body_bytes=600))
    await settle()
    with pytest.raises(QueueFull) as raised:
        await svc.admit(principal, "m", BODY, body_bytes=401)
    assert raised.value.retry_after_header
    holder.lease.release()
    (await parked).lease.release()
    assert svc.parked_bytes.total == 0
    await svc.aclose()


def test_engine_priority_follows_the_backend() -> None:
    svc = SchedulingService(
        {
            "backends": {
                "v": {"metrics_url": "http://127.0.0.1:1/metrics", "priority_scheduling": True},
                "plain": {"metrics_url": "http://127.0.0.1:1/metrics"},
                "s": {
                    "metrics_url": "http://127.0.0.1:1/metrics",
                    "engine": "sglang",
                    "priority_scheduling": True,
                },
                "t": {
                    "metrics_url": "http://127.0.0.1:1/metrics",
                    "engine": "tgi",
                    "priority_scheduling": True,
                },
            }
        }
    )
    assert svc.engine_priority("v", "batch") == 10
    assert svc.engine_priority("plain", "batch") is None
    assert svc.engine_priority("s", "batch") == -10
    assert svc.engine_priority("t", "batch") is None
    assert svc.engine_priority("unknown", "batch") is None
    assert svc.engine_priority("v", "batch", engine_rank=5) == 10  # not in user order


def test_engine_priority_in_user_order_keeps_the_tiers_apart() -> None:
    backend = {"metrics_url": "http://127.0.0.1:1/metrics", "priority_scheduling": True}
    svc = SchedulingService(
        {
            "backends": {
                "v": {**backend, "fair_engine_queue": True},
                "s": {**backend, "engine": "sglang", "fair_engine_queue": True},
            }
        }
    )
    # The default tiers: interactive priority 0, batch 10 (vLLM serves lower values first).
    assert svc.engine_priority("v", "interactive") == 0
    assert svc.engine_priority("v", "interactive", engine_rank=3) == 3
    assert svc.engine_priority("v", "interactive", engine_rank=5000) == 999  # its band's last
    assert svc.engine_priority("v", "batch", engine_rank=3) == 10_003
    assert svc.engine_priority("s", "batch", engine_rank=3) == -10_003  # SGLang: higher first


def test_metrics_urls_default_from_deployments() -> None:
    svc = SchedulingService(
        {"backends": {"m": {"priority_scheduling": True}}},
        deployments={"m": ["http://a:8000/v1", "http://b:8000/v1"], "n": ["http://c:8000/v1"]},
    )
    assert svc.backends["m"].all_metrics_urls() == (
        "http://a:8000/metrics",
        "http://b:8000/metrics",
    )
    assert svc.backends["m"].priority_scheduling
    assert svc.backends["n"].all_metrics_urls() == ("http://c:8000/metrics",)
    # Keyed by LiteLLM's api_bases, so that a lease's deployment names a model_list entry.
    assert [d.key for d in svc.gate.groups()["m"].deployments] == [
        "http://a:8000/v1",
        "http://b:8000/v1",
    ]


def test_placement_settings_reach_the_gate_of_each_model() -> None:
    svc = SchedulingService(
        {
            "backends": {
                "m": {
                    "api_bases": ["http://a:8000/v1", "http://b:8000/v1"],
                    "placement": {"prefix_affinity": False, "load_bound": 2.0},
                }
            }
        }
    )
    group = svc.gate.groups()["m"]
    assert (group.prefix_affinity, group.load_bound) == (False, 2.0)
    assert [(d.key, d.metrics_url) for d in group.deployments] == [
        ("http://a:8000/v1", "http://a:8000/metrics"),
        ("http://b:8000/v1", "http://b:8000/metrics"),
    ]


def test_litellm_deployments_pair_with_configured_metrics_urls_or_fail_naming_the_key() -> None:
    urls = ["http://a:9090/metrics", "http://b:9090/metrics"]
    svc = SchedulingService(
        {"backends": {"m": {"metrics_urls": urls}}},
        deployments={"m": ["http://a:8000/v1/", "http://b:8000/v1"]},
    )
    assert svc.backends["m"].deployments() == (
        ("http://a:8000/v1", urls[0]),
        ("http://b:8000/v1", urls[1]),
    )
    with pytest.raises(ConfigError, match=r"fair_sched\.backends\.m\.metrics_urls: 2 metrics"):
        SchedulingService(
            {"backends": {"m": {"metrics_urls": urls}}},
            deployments={"m": ["http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"]},
        )


async def test_a_deployment_losing_its_metrics_is_logged_by_name_and_only_it_falls_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    bases = ["http://a:8000/v1", "http://b:8000/v1"]
    svc = SchedulingService({"backends": {"m": {"api_bases": bases}}}, clock=clock)
    for base in bases:
        metrics_url = base.replace("/v1", "/metrics")
        svc.gate.update("m", BackendSnapshot(metrics_url, clock.now(), ok=True))
    clock.advance(10.0)
    with caplog.at_level(logging.WARNING, logger="fair_sched"):
        svc.gate.update("m", BackendSnapshot("http://a:8000/metrics", clock.now(), ok=True))
        svc.gate.update("m", BackendSnapshot.failed("http://b:8000/metrics", clock.now(), "down"))
    (record,) = [r for r in caplog.records if "mode=fallback" in r.getMessage()]
    assert "deployment=http://b:8000/v1" in record.getMessage()
    modes = {row.deployment: row.mode for row in svc.scheduler.gate_status()[0].per_deployment}
    assert modes == {bases[0]: "metrics", bases[1]: "fallback"}
    await svc.aclose()


async def test_one_injected_clock_drives_the_gate_the_queue_and_the_rejection_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    svc = SchedulingService(
        {
            "unknown_model_max_inflight": 1,
            "queue": {"max_per_user": 1, "max_wait_s": 30},
            "backends": {"big": {"metrics_url": "http://127.0.0.1:9/metrics"}},
            "stale_after_ms": 500,
        },
        clock=clock,
    )
    principal = svc.identify(Credentials(api_key="sk-a"))
    # The gate: a scrape's age is read on the fake clock.
    url = "http://127.0.0.1:9/metrics"
    svc.gate.update("big", BackendSnapshot(url=url, started_at=clock.now(), ok=True, waiting=0))
    clock.advance(0.25)
    assert [status.last_scrape_age_s for status in svc.gate.status()] == [0.25]
    # The scheduler: a parked request times out when the fake clock passes max_wait_s.
    holder = await svc.admit(principal, "m", BODY)
    parked = asyncio.create_task(svc.admit(principal, "m", BODY))
    await settle()
    with caplog.at_level("WARNING", logger="fair_sched"):
        for _ in range(2):  # the second line within the minute is skipped
            with pytest.raises(QueueFull):
                await svc.admit(principal, "m", BODY)
        clock.advance(30.0)
        with pytest.raises(QueueTimeout):
            await parked
        clock.advance(60.0)  # the log limiter's minute is over: the next line is logged
        parked = asyncio.create_task(svc.admit(principal, "m", BODY))
        await settle()
        with pytest.raises(QueueFull):
            await svc.admit(principal, "m", BODY)
    lines = [r.getMessage() for r in caplog.records if "reason=queue_full" in r.getMessage()]
    assert len(lines) == 2
    holder.lease.release()
    (await asyncio.wait_for(parked, 5)).lease.release()
    await svc.aclose()


def test_counts_in_range_are_taken_and_bound_the_estimate() -> None:
    assert requested_max_tokens({"max_tokens": 100.0}) == 100
    assert requested_max_tokens({"max_tokens": None}) == 256
    assert requested_max_tokens({"max_output_tokens": 9}) == 9
    assert requested_choices({"n": 4, "best_of": 6}) == 6
    service = SchedulingService({"tiers": [{"name": "t"}]})
    principal = service.identify(Credentials(api_key="k"))
    body = {"model": "m", "max_tokens": 10**8, "n": 128, "messages": []}
    ticket = service.ticket_for(principal, "m", body)
    # Capped at the core's range: 10^8 tokens for each of 128 choices is beyond it.
    assert ticket.cost == MAX_REQUEST_TOKENS
    assert service.ticket_for(principal, "m", {"max_tokens": 10, "n": 3}).cost == 1 + 30
