"""The plugin's own metrics, status document and admin endpoints (no engine needed).

Scenarios run a real `SchedulingService`: models without a backend are gated by the in-flight cap
(`unknown_model_max_inflight`), models with one by a `MetricsGate` fed synthetic snapshots.
Metric values are read back with prometheus_client's own parser.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, Router

from fair_sched_plugin.asgi import FairSchedulerMiddleware
from fair_sched_plugin.config import load_settings, safe_url
from fair_sched_plugin.core import (
    BackendSnapshot,
    DeadlineOutcomes,
    FairnessReading,
    GateTransition,
    GroupStatus,
    SchedulerStatistics,
    Ticket,
    TierLimits,
    UserBacklog,
)
from fair_sched_plugin.errors import ConfigError, QueueFull, QueueTimeout, Rejected
from fair_sched_plugin.observability import (
    METRICS_PATH,
    STATUS_PATH,
    UI_PATH,
    BudgetStanding,
    DeploymentReading,
    ServiceMetrics,
    admin_app,
    register_in_default_registry,
)
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.service import ClientDisconnected, SchedulingService
from fair_sched_plugin.state import StateStatistics
from fair_sched_plugin.testing import FakeClock, settle

ALICE_KEY = "sk-secret-alice-0123456789"
BOB_KEY = "sk-secret-bob-0123456789"
STRANGER_KEY = "sk-secret-stranger-0123456789"
ALL_KEYS = (ALICE_KEY, BOB_KEY, STRANGER_KEY)
BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana-dashboard.json"
METRICS_URL = "http://127.0.0.1:9/metrics"  # never scraped: the services below are not started


def make_service(**settings: Any) -> SchedulingService:
    base: dict[str, Any] = {
        "unknown_model_max_inflight": 1,
        "principals": [
            {"name": "alice", "keys": [ALICE_KEY]},
            {"name": "bob", "keys": [BOB_KEY], "tier": "batch"},
        ],
    }
    # Model names the tests use, served under their own names (any other name would be
    # scheduled as the one shared `UNKNOWN_MODELS`).
    return SchedulingService({**base, **settings}, models=("m", "m0", "m1", "m2", "m3"))


def metric_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(text: str, name: str, **labels: str) -> float | None:
    return metric_samples(text).get((name, frozenset(labels.items())))


def label_values(text: str, label: str) -> set[str]:
    return {dict(labels)[label] for (_, labels) in metric_samples(text) if label in dict(labels)}


def scrape(service: SchedulingService) -> str:
    return service.observability.render().decode()


def who(service: SchedulingService, key: str) -> Any:
    return service.identify(Credentials(api_key=key))


async def park(
    service: SchedulingService, key: str, model: str = "m", count: int = 1
) -> list[asyncio.Task[Any]]:
    tasks = [
        asyncio.ensure_future(service.admit(who(service, key), model, BODY)) for _ in range(count)
    ]
    await settle()
    return tasks


async def cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def snapshot(url: str = METRICS_URL, **fields: Any) -> BackendSnapshot:
    fields.setdefault("started_at", asyncio.get_running_loop().time())
    return BackendSnapshot(url=url, ok=True, **fields)


@pytest.fixture
def no_default_registry_leak() -> Iterator[None]:
    before = set(REGISTRY._collector_to_names)
    yield
    for collector in set(REGISTRY._collector_to_names) - before:
        REGISTRY.unregister(collector)


# ----------------------------------------------------------------------------- queues


async def test_queue_depth_backlogged_users_and_in_flight_by_model_and_tier() -> None:
    service = make_service()
    holder = await service.admit(who(service, ALICE_KEY), "m", BODY)
    parked = await park(service, ALICE_KEY, count=2) + await park(service, STRANGER_KEY)
    parked += await park(service, BOB_KEY)  # batch tier
    text = scrape(service)
    assert value(text, "fair_sched_queued_requests", model="m", tier="interactive") == 3
    assert value(text, "fair_sched_queued_requests", model="m", tier="batch") == 1
    assert value(text, "fair_sched_backlogged_users", model="m", tier="interactive") == 2
    assert value(text, "fair_sched_in_flight_requests", model="m") == 1
    assert value(text, "fair_sched_released_total") == 1
    holder.lease.release()
    await cancel(parked)
    await service.aclose()


async def test_configured_models_have_zero_series_before_any_traffic() -> None:
    service = make_service(backends={"big": {"metrics_url": METRICS_URL}})
    text = scrape(service)
    for tier in ("interactive", "batch"):
        assert value(text, "fair_sched_queued_requests", model="big", tier=tier) == 0
        assert (
            value(text, "fair_sched_rejected_total", model="big", tier=tier, reason="timeout") == 0
        )
    assert value(text, "fair_sched_in_flight_requests", model="big") == 0


async def test_lifecycle_counters_follow_scheduler_statistics() -> None:
    service = make_service()
    holder = await service.admit(who(service, ALICE_KEY), "m", BODY)
    gone = asyncio.Event()
    parked = asyncio.ensure_future(
        service.admit(who(service, BOB_KEY), "m", BODY, disconnected=gone)
    )
    await settle()
    gone.set()
    await asyncio.gather(parked, return_exceptions=True)
    holder.lease.release()
    text = scrape(service)
    stats = service.scheduler.statistics()
    assert value(text, "fair_sched_released_total") == stats.released_total == 1
    assert value(text, "fair_sched_completed_total") == stats.completed_total == 1
    assert value(text, "fair_sched_cancelled_total") == stats.cancelled_total == 1
    assert value(text, "fair_sched_abandoned_total") == stats.abandoned_total == 0
    await service.aclose()


# ----------------------------------------------------------------------------- wait histogram


async def test_wait_histogram_counts_each_admission_by_model_and_tier() -> None:
    service = make_service(unknown_model_max_inflight=2)
    first = await service.admit(who(service, ALICE_KEY), "m", BODY)
    second = await service.admit(who(service, BOB_KEY), "m", BODY)
    parked = await park(service, ALICE_KEY)
    first.lease.release()
    third = await parked[0]
    text = scrape(service)
    interactive = {"model": "m", "tier": "interactive"}
    assert value(text, "fair_sched_wait_seconds_count", **interactive) == 2
    assert value(text, "fair_sched_wait_seconds_count", model="m", tier="batch") == 1
    assert value(text, "fair_sched_wait_seconds_bucket", le="+Inf", **interactive) == 2
    assert (value(text, "fair_sched_wait_seconds_sum", **interactive) or 0) >= third.lease.waited_s
    # Buckets are cumulative.
    buckets = [
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "fair_sched_wait_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket") and sample.labels["tier"] == "interactive"
    ]
    assert buckets == sorted(buckets)
    second.lease.release()
    third.lease.release()
    await service.aclose()


async def test_wait_buckets_come_from_the_settings() -> None:
    service = make_service(observability={"wait_buckets_s": [0.5, 2]})
    (await service.admit(who(service, ALICE_KEY), "m", BODY)).lease.release()
    text = scrape(service)
    les = {
        dict(labels).get("le")
        for (name, labels) in metric_samples(text)
        if name.endswith("_bucket")
    }
    assert les == {"0.5", "2.0", "+Inf"}
    await service.aclose()


# ----------------------------------------------------------------------------- rejections


async def test_rejections_are_counted_by_reason() -> None:
    service = make_service(queue={"max_per_user": 1, "max_total": 2, "max_wait_s": 0.05})
    holder = await service.admit(who(service, ALICE_KEY), "m", BODY)
    parked = await park(service, ALICE_KEY)
    with pytest.raises(QueueFull):
        await service.admit(who(service, ALICE_KEY), "m", BODY)  # alice's own queue is full
    parked += await park(service, STRANGER_KEY)
    with pytest.raises(QueueFull):
        await service.admit(who(service, BOB_KEY), "m", BODY)  # the total is full
    results = await asyncio.wait_for(asyncio.gather(*parked, return_exceptions=True), 5)
    assert all(isinstance(result, QueueTimeout) for result in results)
    text = scrape(service)
    reasons = {
        reason: value(text, "fair_sched_rejected_total", model="m", tier=tier, reason=reason)
        for reason, tier in (
            ("queue_full_user", "interactive"),
            ("queue_full_total", "batch"),
            ("timeout", "interactive"),
        )
    }
    assert reasons == {"queue_full_user": 1, "queue_full_total": 1, "timeout": 2}
    assert service.observability.status()["totals"]["rejected"] == {
        "queue_full_user": 1,
        "queue_full_total": 1,
        "deadline_unreachable": 0,
        "timeout": 2,
        "closed": 0,
    }
    holder.lease.release()
    await service.aclose()


async def test_shutdown_rejections_are_counted_as_closed() -> None:
    service = make_service()
    holder = await service.admit(who(service, ALICE_KEY), "m", BODY)
    parked = await park(service, ALICE_KEY)
    await service.aclose()
    assert isinstance((await asyncio.gather(*parked, return_exceptions=True))[0], Rejected)
    text = scrape(service)
    assert (
        value(text, "fair_sched_rejected_total", model="m", tier="interactive", reason="closed")
        == 1
    )
    holder.lease.release()


async def test_a_warning_line_per_kind_of_rejection_naming_principal_not_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    service = make_service(queue={"max_per_user": 1})
    holder = await service.admit(who(service, ALICE_KEY), "m", BODY)
    parked = await park(service, ALICE_KEY)
    caplog.clear()
    with pytest.raises(QueueFull) as rejected:
        await service.admit(who(service, ALICE_KEY), "m", BODY)
    lines = [record for record in caplog.records if record.name == "fair_sched"]
    assert len(lines) == 1
    record = lines[0]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    for part in (
        "principal=alice",
        "model=m",
        "tier=interactive",
        "reason=queue_full_user",
        f"retry_after={rejected.value.retry_after_header}",
    ):
        assert part in message
    assert record.__dict__["reason"] == "queue_full_user"
    assert ALICE_KEY not in message
    # The same rejection again within the minute: counted, not logged again.
    caplog.clear()
    for _ in range(5):
        with pytest.raises(QueueFull):
            await service.admit(who(service, ALICE_KEY), "m", BODY)
    assert not [record for record in caplog.records if record.name == "fair_sched"]
    text = scrape(service)
    assert (
        value(
            text,
            "fair_sched_rejected_total",
            model="m",
            tier="interactive",
            reason="queue_full_user",
        )
        == 6
    )
    await cancel(parked)
    holder.lease.release()
    await service.aclose()


async def test_nothing_is_logged_at_info_for_a_successful_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    service = make_service()
    admission = await service.admit(who(service, ALICE_KEY), "m", BODY)
    admission.lease.release()
    assert not [record for record in caplog.records if record.name.startswith("fair_sched")]
    await service.aclose()


# ----------------------------------------------------------------------------- gate and engine


async def test_gate_and_engine_readings_per_backend() -> None:
    urls = ["http://127.0.0.1:9/metrics", "http://127.0.0.1:10/metrics"]
    service = make_service(
        backends={"big": {"metrics_urls": urls}},
        tiers=[
            {"name": "interactive", "waiting_below": 3, "tpot_below_ms": 150},
            {"name": "batch", "waiting_below": 1},
        ],
    )
    text = scrape(service)
    a, b = ({"model": "big", "deployment": url} for url in urls)  # keyed by their metrics URLs
    assert value(text, "fair_sched_gate_mode", **a, mode="starting") == 1
    assert value(text, "fair_sched_engine_waiting_requests", **a) is None  # unknown
    service.gate.update("big", snapshot(urls[0], waiting=1, running=4, tpot_s=0.04, kv_usage=0.2))
    service.gate.update("big", snapshot(urls[1], waiting=2, running=3, tpot_s=0.08, kv_usage=0.5))
    lease = service.scheduler.try_acquire(Ticket("big", "alice", "interactive"))
    assert lease is not None and lease.deployment == urls[0]  # the less loaded
    text = scrape(service)
    assert value(text, "fair_sched_gate_mode", **a, mode="metrics") == 1
    assert value(text, "fair_sched_gate_mode", **b, mode="starting") == 0
    assert value(text, "fair_sched_gate_deployments", model="big") == 2
    # Each deployment's own readings: never a sum standing for the group.
    assert value(text, "fair_sched_engine_waiting_requests", **a) == 1
    assert value(text, "fair_sched_engine_waiting_requests", **b) == 2
    assert value(text, "fair_sched_engine_running_requests", **b) == 3
    assert value(text, "fair_sched_engine_tpot_seconds", **b) == 0.08
    assert value(text, "fair_sched_engine_kv_cache_usage_ratio", **a) == 0.2
    assert (value(text, "fair_sched_engine_scrape_age_seconds", **a) or -1) >= 0
    assert value(text, "fair_sched_gate_pending_requests", **a) == 1
    assert value(text, "fair_sched_gate_pending_requests", **b) == 0
    assert value(text, "fair_sched_gate_in_flight_requests", **a) == 1
    assert value(text, "fair_sched_gate_free_slots", **a) == 0
    rows = service.observability.status()["models"]["big"]["gate"]["per_deployment"]
    assert [(row["deployment"], row["waiting"], row["pending"]) for row in rows] == [
        (urls[0], 1, 1),
        (urls[1], 2, 0),
    ]
    assert value(text, "fair_sched_tier_waiting_threshold", model="big", tier="interactive") == 6
    assert value(text, "fair_sched_tier_waiting_threshold", model="big", tier="batch") == 2
    assert value(text, "fair_sched_tier_tpot_threshold_seconds", tier="interactive") == 0.15
    lease.release()
    await service.aclose()


async def test_metrics_unavailable_transitions_are_counted() -> None:
    clock = FakeClock()
    service = SchedulingService(
        {
            "backends": {"big": {"metrics_url": METRICS_URL}},
            "metrics_poll_ms": 10,
            "stale_after_ms": 1,
        },
        clock=clock,
    )
    service.gate.update("big", snapshot(started_at=clock.now()))
    clock.advance(1.0)  # older than stale_after_ms
    service.gate.update("big", BackendSnapshot.failed(METRICS_URL, 0.0, "connection refused"))
    text = scrape(service)
    where = {"model": "big", "deployment": METRICS_URL}
    assert value(text, "fair_sched_gate_mode", **where, mode="fallback") == 1
    assert value(text, "fair_sched_metrics_unavailable_total", model="big") == 1
    assert (
        value(
            text,
            "fair_sched_gate_transitions_total",
            model="big",
            **{"from": "metrics", "to": "fallback"},
        )
        == 1
    )
    assert (
        value(
            text,
            "fair_sched_gate_transitions_total",
            model="big",
            **{"from": "starting", "to": "metrics"},
        )
        == 1
    )
    status = service.observability.status()
    assert status["models"]["big"]["gate"]["mode"] == "fallback"
    assert [(t["from"], t["to"]) for t in status["transitions"]] == [
        ("starting", "metrics"),
        ("metrics", "fallback"),
    ]
    await service.aclose()


async def test_scrape_counters_per_deployment_from_a_running_watcher() -> None:
    with socket.socket() as sock:  # a port nobody listens on: every scrape fails fast
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://user:pw@127.0.0.1:{port}/metrics?token=x"
    service = make_service(backends={"big": {"metrics_url": url}}, metrics_poll_ms=10)
    service.start()
    for _ in range(500):  # at most ~5 s
        if service.watchers()["big"][0].failures_total >= 2:
            break
        await asyncio.sleep(0.01)
    text = scrape(service)
    safe = f"http://127.0.0.1:{port}/metrics"
    assert (value(text, "fair_sched_metrics_scrapes_total", model="big", url=safe) or 0) >= 2
    assert (
        value(text, "fair_sched_metrics_scrape_failures_total", model="big", url=safe) or 0
    ) >= 2
    status = json.dumps(service.observability.status())
    for secret in ("user:pw@", "token=x"):
        assert secret not in text and secret not in status
    deployment = service.observability.status()["models"]["big"]["deployments"][0]
    assert deployment["url"] == safe
    assert deployment["last_snapshot"]["ok"] is False
    await service.aclose()


# ----------------------------------------------------------------------------- labels


async def test_no_user_label_by_default() -> None:
    service = make_service()
    (await service.admit(who(service, ALICE_KEY), "m", BODY)).lease.release()
    text = scrape(service)
    assert label_values(text, "user") == set()
    await service.aclose()


async def test_principals_become_labels_only_when_configured_and_strangers_are_other() -> None:
    service = make_service(observability={"user_labels": "principals"}, queue={"max_per_user": 1})
    holder = await service.admit(who(service, ALICE_KEY), "m", BODY)
    parked = await park(service, ALICE_KEY) + await park(service, STRANGER_KEY)
    parked += await park(service, "sk-secret-another-stranger")
    with pytest.raises(QueueFull):
        await service.admit(who(service, STRANGER_KEY), "m", BODY)
    text = scrape(service)
    assert label_values(text, "user") == {"alice", "other"}
    assert (
        value(text, "fair_sched_queued_requests", model="m", tier="interactive", user="other") == 2
    )
    assert (
        value(text, "fair_sched_queued_requests", model="m", tier="interactive", user="alice") == 1
    )
    assert (
        value(text, "fair_sched_wait_seconds_count", model="m", tier="interactive", user="alice")
        == 1
    )
    assert (
        value(
            text,
            "fair_sched_rejected_total",
            model="m",
            tier="interactive",
            reason="queue_full_user",
            user="other",
        )
        == 1
    )
    await cancel(parked)
    holder.lease.release()
    await service.aclose()


async def test_model_labels_are_bounded() -> None:
    service = make_service(unknown_model_max_inflight=10, observability={"max_model_labels": 2})
    for model in ("m0", "m1", "m2", "m3"):
        await service.admit(who(service, ALICE_KEY), model, BODY)
    text = scrape(service)
    assert label_values(text, "model") == {"m0", "m1", "other"}
    assert value(text, "fair_sched_in_flight_requests", model="other") == 2
    assert value(text, "fair_sched_wait_seconds_count", model="other", tier="interactive") == 2
    await service.aclose()


async def test_no_api_key_or_key_hash_in_metrics_status_or_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    service = make_service(
        observability={"user_labels": "principals"}, queue={"max_per_user": 2, "max_wait_s": 0.05}
    )
    holder = await service.admit(who(service, ALICE_KEY), "m", BODY)
    parked = []
    for key in ALL_KEYS:
        parked += await park(service, key, count=2)
    for key in ALL_KEYS:
        with pytest.raises(QueueFull):
            await service.admit(who(service, key), "m", BODY)
    status_while_parked = json.dumps(service.observability.status())
    text_while_parked = scrape(service)
    await asyncio.wait_for(asyncio.gather(*parked, return_exceptions=True), 5)  # time out
    holder.lease.release()
    everything = "\n".join(
        [status_while_parked, text_while_parked, scrape(service), caplog.text]
        + [repr(record.__dict__) for record in caplog.records]
    )
    assert "queue_full_user" in everything and "timeout" in everything
    for key in ALL_KEYS:
        digest = hashlib.sha256(key.encode()).hexdigest()
        assert key not in everything
        assert digest not in everything
        assert digest[:12] not in text_while_parked  # fingerprints: status page only
    assert "sk-secret" not in everything
    await service.aclose()


# ----------------------------------------------------------------------------- status document


async def test_status_lists_backlogged_users_deepest_first_with_oldest_wait() -> None:
    service = make_service(observability={"status_max_users": 2})
    holder = await service.admit(who(service, ALICE_KEY), "m", BODY)
    parked = await park(service, ALICE_KEY, count=3) + await park(service, STRANGER_KEY)
    parked += await park(service, "sk-secret-third") + await park(service, BOB_KEY)
    status = service.observability.status()
    json.dumps(status, allow_nan=False)  # serialisable as is
    model = status["models"]["m"]
    assert model["queued"] == {"interactive": 5, "batch": 1}
    assert model["in_flight"] == 1
    assert model["backlogged_users"] == 4
    assert model["backlog_truncated"] == 2
    first, second = model["backlog"]
    assert (first["user"], first["configured"], first["depth"]) == ("alice", True, 3)
    assert second["user"].startswith("key:") and second["configured"] is False
    assert all(entry["oldest_wait_s"] >= 0 for entry in model["backlog"])
    assert model["gate"] == {"mode": "inflight_cap", "max_inflight": 1}
    assert status["totals"]["queued"] == 6
    assert [tier["name"] for tier in status["tiers"]] == ["interactive", "batch"]
    await cancel(parked)
    holder.lease.release()
    await service.aclose()


async def test_status_shows_gate_state_and_last_snapshot() -> None:
    service = make_service(backends={"big": {"metrics_url": METRICS_URL}})
    service.gate.update("big", snapshot(waiting=2, running=5, tpot_s=0.03))
    gate = service.observability.status()["models"]["big"]["gate"]
    assert (gate["mode"], gate["waiting"], gate["running"], gate["tpot_s"]) == (
        "metrics",
        2,
        5,
        0.03,
    )
    assert gate["last_scrape_age_s"] >= 0
    await service.aclose()


async def test_status_lists_in_flight_requests_per_principal_and_tier() -> None:
    service = make_service(unknown_model_max_inflight=3, observability={"status_max_users": 1})
    first = await service.admit(who(service, ALICE_KEY), "m", BODY)
    second = await service.admit(who(service, ALICE_KEY), "m", BODY)
    third = await service.admit(who(service, BOB_KEY), "m", BODY)
    model = service.observability.status()["models"]["m"]
    assert model["in_flight_by_user"] == [
        {"user": "alice", "configured": True, "tier": "interactive", "in_flight": 2}
    ]
    assert model["in_flight_by_user_truncated"] == 1  # bob, beyond status_max_users
    first.lease.release()
    third.lease.abandon()
    model = service.observability.status()["models"]["m"]
    assert [(e["user"], e["in_flight"]) for e in model["in_flight_by_user"]] == [("alice", 1)]
    assert model["in_flight_by_user_truncated"] == 0
    second.lease.release()
    assert "m" not in service.observability.status()["models"]  # idle and not configured
    await service.aclose()


async def test_a_request_that_leaves_while_parked_is_never_counted_in_flight() -> None:
    """Race: the lease is granted and the client disconnects in the same tick, before the
    parked request wakes up: the lease is given back, and no in-flight entry outlives it."""
    service = make_service()
    holder = await service.admit(who(service, ALICE_KEY), "m", BODY)
    gone = asyncio.Event()
    parked = asyncio.ensure_future(
        service.admit(who(service, BOB_KEY), "m", BODY, disconnected=gone)
    )
    await settle()
    holder.lease.release()  # bob's turn: his lease is granted ...
    gone.set()  # ... and he is gone before his task runs again
    (outcome,) = await asyncio.gather(parked, return_exceptions=True)
    assert isinstance(outcome, ClientDisconnected)
    assert service.scheduler.statistics().abandoned_total == 1
    assert service.scheduler.statistics().in_flight == 0
    assert service.observability.view.in_flight_by_user() == {}
    await service.aclose()


async def test_status_lists_recent_rejections_newest_first_by_principal() -> None:
    service = make_service(queue={"max_per_user": 1, "max_wait_s": 0.05})
    holder = await service.admit(who(service, ALICE_KEY), "m", BODY)
    parked = await park(service, ALICE_KEY)
    with pytest.raises(QueueFull):
        await service.admit(who(service, ALICE_KEY), "m", BODY)
    await asyncio.wait_for(asyncio.gather(*parked, return_exceptions=True), 5)
    status = service.observability.status()
    recent = status["recent_rejections"]
    assert [(r["user"], r["model"], r["tier"], r["reason"]) for r in recent] == [
        ("alice", "m", "interactive", "timeout"),
        ("alice", "m", "interactive", "queue_full_user"),
    ]
    assert recent[0]["age_s"] <= recent[1]["age_s"]
    assert status["totals"]["rejected"]["queue_full_user"] == 1
    assert ALICE_KEY not in json.dumps(status)
    holder.lease.release()
    await service.aclose()


async def test_gate_document_shows_the_engine_queue_each_tier_may_fill() -> None:
    urls = ["http://127.0.0.1:9/metrics", "http://127.0.0.1:10/metrics"]
    service = make_service(backends={"big": {"metrics_urls": urls}})
    gate = service.observability.status()["models"]["big"]["gate"]
    # Per deployment: interactive < 3, batch < 1 (the default tiers), summed over two.
    assert gate["waiting_threshold"] == {"interactive": 6, "batch": 2}
    await service.aclose()


class StaticView:
    """A `ServiceView` written by hand: observability needs nothing else of a service."""

    def __init__(self) -> None:
        self.settings = load_settings(
            {"principals": [{"name": "alice", "keys": [ALICE_KEY]}], "backends": {"big": {}}}
        )

    def scheduler_statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            queued=4,
            in_flight=2,
            released_total=10,
            completed_total=8,
            cancelled_total=0,
            abandoned_total=0,
            rejected_full_total=0,
            timed_out_total=0,
            queued_by_model_tier={("big", "interactive"): 4},
            in_flight_by_model={"big": 2},
        )

    def deadline_outcomes(self) -> dict[str, DeadlineOutcomes]:
        return {"interactive": DeadlineOutcomes(met=3, missed=1, refused=2)}

    def backlog(self) -> list[UserBacklog]:
        return [UserBacklog("big", "interactive", "alice", 4, 0.0, 0.0)]

    def in_flight_by_user(self) -> dict[tuple[str, str, str], int]:
        return {("big", "interactive", "alice"): 2}

    def gate_status(self) -> list[GroupStatus]:
        return []

    def state_statistics(self) -> StateStatistics:
        return StateStatistics("shared", "r1", 0, 0, 0, leader="r2", replicas_alive=2)

    def shares_state(self) -> bool:
        return True

    def waiting_thresholds(self) -> dict[str, dict[str, float]]:
        return {"big": {"interactive": 5, "batch": 1}}  # as a self-tuning gate might say

    def tier_limits(self) -> tuple[TierLimits, ...]:
        return (TierLimits("interactive", 3), TierLimits("batch", 1))

    def configured_models(self) -> frozenset[str]:
        return frozenset({"big"})

    def gated_models(self) -> dict[str, list[str]]:
        return {}

    def deployments(self) -> list[DeploymentReading]:
        scrape = BackendSnapshot("http://user:pw@vllm-a:8000/metrics", 0.0, True, 2, 8, 0.5, 0.04)
        return [DeploymentReading("big", scrape.url, 10, 1, scrape, prefix_cache_hit_rate=0.25)]

    def recent_transitions(self) -> list[GateTransition]:
        return []

    def deployment_name(self, key: str) -> str:
        return safe_url(key)

    def redact(self, text: str) -> str:
        return text

    def budget_standings(self) -> list[BudgetStanding]:
        return [BudgetStanding("alice", "usd", 5.0, 6.0, 0.0, 120.0, True, "reject", None)]

    def fairness(self) -> list[FairnessReading]:
        return [FAIRNESS]


FAIRNESS = FairnessReading(
    "big", "interactive", 2, (("tokens", 0.8), ("requests", 1.0)), 64.0, 2.5, 60
)


async def test_the_fairness_gauges_are_the_views_readings() -> None:
    metrics = ServiceMetrics(StaticView())
    text = metrics.render().decode()  # on the loop: the view's fairness is read
    where = {"model": "big", "tier": "interactive"}
    assert value(text, "fair_sched_fairness_jain_index", unit="tokens", **where) == 0.8
    assert value(text, "fair_sched_fairness_jain_index", unit="requests", **where) == 1.0
    assert value(text, "fair_sched_service_gap_tokens", **where) == 64.0
    assert value(text, "fair_sched_starved_wait_seconds", **where) == 2.5
    assert value(text, "fair_sched_fairness_users", **where) == 2
    fairness = metrics.status()["models"]["big"]["fairness"]["interactive"]
    assert fairness["jain_index"] == {"tokens": 0.8, "requests": 1.0}
    assert fairness["service_gap_tokens"] == 64.0


def test_observability_reads_only_the_service_view() -> None:
    view = StaticView()
    metrics = ServiceMetrics(view)
    text = metrics.render().decode()
    assert value(text, "fair_sched_queued_requests", model="big", tier="interactive") == 4
    assert value(text, "fair_sched_in_flight_requests", model="big") == 2
    assert value(text, "fair_sched_released_total") == 10
    assert value(text, "fair_sched_tier_waiting_threshold", model="big", tier="interactive") == 5
    model = metrics.status()["models"]["big"]
    assert model["backlog"][0]["user"] == "alice" and model["backlog"][0]["depth"] == 4
    assert model["in_flight_by_user"] == [
        {"user": "alice", "configured": True, "tier": "interactive", "in_flight": 2}
    ]
    (deployment,) = model["deployments"]
    assert deployment["url"] == "http://vllm-a:8000/metrics"  # no credentials
    assert deployment["last_snapshot"]["prefix_cache_hit_rate"] == 0.25
    hit_ratio = value(
        text, "fair_sched_engine_prefix_cache_hit_ratio", model="big", url=deployment["url"]
    )
    assert hit_ratio == 0.25
    assert deployment["last_snapshot"]["running"] == 8
    assert value(text, "fair_sched_budget_over_principals", unit="usd") == 1
    assert metrics.status()["budgets"][0]["user"] == "alice"
    tiers = {tier["name"]: tier["deadlines"] for tier in metrics.status()["tiers"]}
    assert tiers["interactive"] == {"met": 3, "missed": 1, "refused": 2}
    assert tiers["batch"] == {"met": 0, "missed": 0, "refused": 0}


# ------------------------------------------------------------------ tiers, budgets and costs

BUDGETS: list[dict[str, Any]] = [
    {
        "name": "alice",
        "keys": [ALICE_KEY],
        "budget": {"tokens": 100, "per": "hour", "action": "reject"},
    },
    {
        "name": "bob",
        "keys": [BOB_KEY],
        "budget": {"tokens": 1000, "per": "minute", "action": "demote", "demote_to": "batch"},
    },
]


async def spend_as_alice(service: SchedulingService, tokens: int) -> None:
    admission = await service.admit(who(service, ALICE_KEY), "m", BODY)
    admission.lease.release(tokens_used=tokens)


async def test_budget_metrics_are_aggregated_without_user_labels() -> None:
    service = make_service(principals=BUDGETS)
    await spend_as_alice(service, 150)
    text = scrape(service)
    assert label_values(text, "user") == set()
    assert value(text, "fair_sched_budget_spent", unit="tokens") == 150
    assert value(text, "fair_sched_budget_limit", unit="tokens") == 1100
    assert value(text, "fair_sched_budget_remaining", unit="tokens") == 1000
    assert value(text, "fair_sched_budget_over_principals", unit="tokens") == 1
    assert not any(
        name == "fair_sched_budget_resets_in_seconds" for name, _ in metric_samples(text)
    )
    await service.aclose()


async def test_budget_metrics_name_principals_only_with_user_labels() -> None:
    service = make_service(principals=BUDGETS, observability={"user_labels": "principals"})
    await spend_as_alice(service, 150)
    text = scrape(service)
    assert value(text, "fair_sched_budget_spent", unit="tokens", user="alice") == 150
    assert value(text, "fair_sched_budget_remaining", unit="tokens", user="alice") == 0
    assert value(text, "fair_sched_budget_over_principals", unit="tokens", user="alice") == 1
    assert value(text, "fair_sched_budget_over_principals", unit="tokens", user="bob") == 0
    resets = value(text, "fair_sched_budget_resets_in_seconds", unit="tokens", user="alice")
    assert resets is not None and 3500 < resets <= 3600
    await service.aclose()


async def test_status_shows_each_principals_budget() -> None:
    service = make_service(principals=BUDGETS)
    await spend_as_alice(service, 150)
    alice, bob = service.observability.status()["budgets"]
    assert alice["user"] == "alice" and alice["unit"] == "tokens" and alice["over"] is True
    assert alice["spent"] == 150 and alice["remaining"] == 0 and alice["action"] == "reject"
    assert bob["spent"] == 0 and bob["remaining"] == 1000 and bob["over"] is False
    assert bob["demote_to"] == "batch" and bob["resets_in_s"] == 60
    await service.aclose()


async def test_tier_shares_delivered_in_metrics_and_status() -> None:
    service = make_service(
        unknown_model_max_inflight=10,
        backends={"m": {}},
        tiers=[
            {"name": "interactive", "waiting_below": 1, "share": 0.8},
            {"name": "batch", "waiting_below": 1, "share": 0.2},
        ],
    )
    for key in (ALICE_KEY, ALICE_KEY, ALICE_KEY, BOB_KEY):  # bob is in the batch tier
        (await service.admit(who(service, key), "m", BODY)).lease.release()
    text = scrape(service)
    assert value(text, "fair_sched_tier_released_total", model="m", tier="interactive") == 3
    assert value(text, "fair_sched_tier_released_total", model="m", tier="batch") == 1
    assert value(text, "fair_sched_tier_share", tier="interactive") == 0.8
    status = service.observability.status()
    interactive, batch = status["tiers"]
    assert (interactive["share"], interactive["released"]) == (0.8, 3)
    assert interactive["delivered_share"] == 0.75 and batch["delivered_share"] == 0.25
    assert status["models"]["m"]["released"] == {"interactive": 3, "batch": 1}
    await service.aclose()


async def test_status_shows_the_running_slots_each_tier_keeps_free() -> None:
    service = make_service(
        backends={"m": {"max_num_seqs": 8}},
        tiers=[{"name": "interactive", "reserve_slots": 1}, {"name": "batch"}],
    )
    interactive, batch = service.observability.status()["tiers"]
    assert (interactive["reserve_slots"], batch["reserve_slots"]) == (1, 0)
    await service.aclose()


async def test_a_demoted_request_counts_in_the_tier_it_ran_in() -> None:
    service = make_service(principals=BUDGETS, unknown_model_max_inflight=10)
    bob = who(service, BOB_KEY)
    (await service.admit(bob, "m", BODY)).lease.release(tokens_used=1000)  # spends it all
    demoted = await service.admit(bob, "m", BODY)
    assert demoted.lease.ticket.tier == "batch"
    demoted.lease.release()
    text = scrape(service)
    assert value(text, "fair_sched_tier_released_total", model="m", tier="interactive") == 1
    assert value(text, "fair_sched_tier_released_total", model="m", tier="batch") == 1
    await service.aclose()


# ----------------------------------------------------------------------------- registries, threads


async def test_each_service_has_its_own_registry_and_none_touches_the_global_one() -> None:
    first, second = make_service(), make_service()
    await first.admit(who(first, ALICE_KEY), "m", BODY)
    assert value(scrape(first), "fair_sched_in_flight_requests", model="m") == 1
    assert value(scrape(second), "fair_sched_in_flight_requests", model="m") is None
    assert first.observability is first.observability
    assert first.observability.registry is not second.observability.registry
    assert b"fair_sched_" not in generate_latest(REGISTRY)
    await first.aclose()
    await second.aclose()


async def test_scrape_from_another_thread_reads_on_the_loop() -> None:
    """LiteLLM renders its /metrics in a worker thread; the gate's clock needs the loop."""
    service = make_service(backends={"big": {"metrics_url": METRICS_URL}})
    service.gate.update("big", snapshot(waiting=1))
    (await service.admit(who(service, ALICE_KEY), "m", BODY)).lease.release()
    text = (await asyncio.to_thread(service.observability.render)).decode()
    where = {"model": "big", "deployment": METRICS_URL}
    assert value(text, "fair_sched_gate_mode", **where, mode="metrics") == 1
    assert value(text, "fair_sched_engine_waiting_requests", **where) == 1
    await service.aclose()


def test_scrape_without_any_event_loop_still_reads_the_queues() -> None:
    service = make_service(backends={"big": {"metrics_url": METRICS_URL}})
    text = scrape(service)
    assert value(text, "fair_sched_queued_requests", model="big", tier="interactive") == 0
    assert value(text, "fair_sched_gate_mode", model="big", mode="starting") is None


# ----------------------------------------------------------------------------- endpoints


def asgi_client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


async def test_admin_endpoints_need_the_admin_key() -> None:
    service = make_service()
    async with asgi_client(admin_app(service, admin_key="adm-key-1")) as client:
        for path in (METRICS_PATH, STATUS_PATH):
            assert (await client.get(path)).status_code == 401
            wrong = await client.get(path, headers={"authorization": "Bearer adm-key-2"})
            assert wrong.status_code == 401
            assert wrong.headers["www-authenticate"] == "Bearer"
            assert "adm-key" not in wrong.text
        auth = {"authorization": "Bearer adm-key-1"}
        metrics = await client.get(METRICS_PATH, headers=auth)
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        assert "fair_sched_released_total" in metrics.text
        status = await client.get(STATUS_PATH, headers=auth)
        assert status.status_code == 200 and "models" in status.json()
    await service.aclose()


async def test_without_an_admin_key_metrics_are_open_and_the_status_page_is_refused() -> None:
    service = make_service()
    async with asgi_client(admin_app(service)) as client:
        assert (await client.get(METRICS_PATH)).status_code == 200
        refused = await client.get(STATUS_PATH)
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "admin_key_not_configured"
    await service.aclose()


async def test_admin_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIR_SCHED_TEST_ADMIN_KEY", "adm-from-env")
    service = make_service(observability={"admin_key": "os.environ/FAIR_SCHED_TEST_ADMIN_KEY"})
    async with asgi_client(admin_app(service)) as client:
        assert (await client.get(STATUS_PATH)).status_code == 401
        ok = await client.get(STATUS_PATH, headers={"authorization": "Bearer adm-from-env"})
        assert ok.status_code == 200
    await service.aclose()


async def test_ui_page_is_served_without_a_key_and_holds_no_data() -> None:
    service = make_service(observability={"admin_key": "adm-key-1"})
    (await service.admit(who(service, ALICE_KEY), "m", BODY)).lease.release()
    async with asgi_client(admin_app(service)) as client:
        page = await client.get(UI_PATH)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    html = page.text
    # No data: the page reads the status itself, with the key the operator types.
    assert "alice" not in html and "adm-key-1" not in html
    await service.aclose()


def test_ui_page_is_self_contained_and_never_puts_the_key_in_a_url() -> None:
    from fair_sched_plugin.observability import _ui

    html = _ui.page().decode()
    # Nothing loaded from elsewhere: no external script, style, font or image.
    assert re.findall(r"https?://[^\s\"'`]+", html) == ["http://www.w3.org/2000/svg"]
    assert "<link" not in html and " src=" not in html and "@import" not in html
    # The password field has no name, so no form submission could carry it; the CSP forbids
    # submitting forms at all and allows only this page's own inline script and style.
    password = re.search(r"<input[^>]*type=\"password\"[^>]*>", html)
    assert password is not None and "name=" not in password.group(0)
    csp = _ui.HEADERS["content-security-policy"]
    assert "form-action 'none'" in csp and "default-src 'none'" in csp
    assert "connect-src 'self'" in csp and "unsafe-inline" not in csp
    assert 'Authorization: "Bearer " + key' in html
    # The status is read relative to the page, and written with textContent, never as HTML.
    assert 'fetch("status"' in html
    assert "innerHTML" not in html and "insertAdjacentHTML" not in html


async def _app_says_hello(request: Any) -> PlainTextResponse:
    return PlainTextResponse("from the app", status_code=404)


async def test_middleware_serves_admin_endpoints_only_when_asked() -> None:
    inner = Starlette(routes=[Route("/{path:path}", _app_says_hello)])
    service = make_service()
    plain = FairSchedulerMiddleware(inner, service=service)
    async with asgi_client(plain) as client:
        assert (await client.get(STATUS_PATH)).text == "from the app"
    admin = FairSchedulerMiddleware(inner, service=service, serve_admin=True, admin_key="adm")
    async with asgi_client(admin) as client:
        assert (await client.get(STATUS_PATH)).status_code == 401
        ok = await client.get(STATUS_PATH, headers={"authorization": "Bearer adm"})
        assert ok.status_code == 200 and "totals" in ok.json()
        assert (await client.get(UI_PATH)).headers["content-type"].startswith("text/html")
        assert (await client.get("/other")).text == "from the app"
    await service.aclose()


async def test_litellm_routes_need_the_master_key_and_join_the_default_registry(
    no_default_registry_leak: None,
) -> None:
    pytest.importorskip("litellm")
    from fair_sched_plugin.litellm._routes import litellm_admin_routes

    service = make_service()
    litellm_app = FastAPI()

    @litellm_app.get(STATUS_PATH)
    async def shadowed() -> str:
        return "from LiteLLM's app"

    proxy_server = SimpleNamespace(app=litellm_app, master_key=None)
    # In front of LiteLLM's app, as install_request_watch puts it: the app never sees them.
    in_front = FairSchedulerMiddleware(
        litellm_app, service=service, admin=Router(litellm_admin_routes(proxy_server, service))
    )
    async with asgi_client(in_front) as client:
        # No master key configured: nobody gets in.
        assert (
            await client.get(STATUS_PATH, headers={"authorization": "Bearer x"})
        ).status_code == 401
        proxy_server.master_key = "sk-master-test-9f8e"  # read at request time
        for headers in ({}, {"authorization": f"Bearer {ALICE_KEY}"}):
            assert (await client.get(STATUS_PATH, headers=headers)).status_code == 401
            assert (await client.get(METRICS_PATH, headers=headers)).status_code == 401
        master = {"authorization": "Bearer sk-master-test-9f8e"}
        assert (await client.get(STATUS_PATH, headers=master)).json()["totals"]["queued"] == 0
        metrics = await client.get(
            METRICS_PATH, headers={"x-litellm-api-key": "sk-master-test-9f8e"}
        )
        assert metrics.status_code == 200 and "fair_sched_wait_seconds" in metrics.text
        assert (await client.get(UI_PATH)).headers["content-type"].startswith("text/html")
    assert b"fair_sched_released_total" in generate_latest(REGISTRY)
    assert not register_in_default_registry(service.observability)  # guarded
    await service.aclose()


async def test_litellm_routes_go_into_litellms_app_where_nothing_can_go_in_front(
    no_default_registry_leak: None,
) -> None:
    pytest.importorskip("litellm")
    from fair_sched_plugin.litellm._routes import add_routes_to_litellm_app, litellm_admin_routes

    service = make_service()
    proxy_server = SimpleNamespace(app=FastAPI(), master_key="sk-master-test-9f8e")
    routes = litellm_admin_routes(proxy_server, service)
    add_routes_to_litellm_app(proxy_server, routes)
    add_routes_to_litellm_app(proxy_server, routes)  # a second import adds nothing
    paths = [getattr(route, "path", None) for route in proxy_server.app.routes]
    assert [paths.count(path) for path in (METRICS_PATH, STATUS_PATH, UI_PATH)] == [1, 1, 1]
    async with asgi_client(proxy_server.app) as client:
        assert (await client.get(STATUS_PATH)).status_code == 401
        master = {"authorization": "Bearer sk-master-test-9f8e"}
        assert (await client.get(STATUS_PATH, headers=master)).json()["totals"]["queued"] == 0
    await service.aclose()


# ----------------------------------------------------------------------------- settings


def test_observability_settings_are_validated_with_key_paths() -> None:
    with pytest.raises(ConfigError, match=r"fair_sched\.observability\.user_labels"):
        load_settings({"observability": {"user_labels": "everyone"}})
    with pytest.raises(ConfigError, match=r"fair_sched\.observability\.wait_buckets_s"):
        load_settings({"observability": {"wait_buckets_s": [2, 1]}})
    with pytest.raises(ConfigError) as error:
        load_settings({"observability": {"admin_key": ["sk-secret-admin"]}})
    assert "sk-secret-admin" not in str(error.value)
    assert load_settings({}).observability.user_labels == "none"


# ----------------------------------------------------------------------------- the dashboard


def exported_sample_names(metrics: ServiceMetrics) -> set[str]:
    """Every sample name the collector's families can export (whether or not a series has a
    value now: the fairness gauges appear only while users are backlogged)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    return {
        family.name + suffix
        for family in metrics.collector.describe()
        for suffix in suffixes.get(family.type, ("",))
    }


async def test_grafana_dashboard_uses_only_metrics_we_export() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())
    ]
    expressions += [variable["definition"] for variable in dashboard["templating"]["list"][1:]]
    used = {name for expr in expressions for name in re.findall(r"fair_sched_[a-z_]+", expr)}
    service = make_service(backends={"big": {"metrics_url": METRICS_URL}})
    service.gate.update("big", snapshot(waiting=1, running=1, tpot_s=0.01, kv_usage=0.1))
    (await service.admit(who(service, ALICE_KEY), "m", BODY)).lease.release()
    exported = exported_sample_names(service.observability)
    # What a scrape shows is among what the families describe (the describe is not stale).
    assert {name for name, _ in metric_samples(scrape(service))} <= exported
    assert used and used <= exported, used - exported
    assert {
        "fair_sched_fairness_jain_index",
        "fair_sched_service_gap_tokens",
        "fair_sched_starved_wait_seconds",
        "fair_sched_budget_spent",
    } <= used
    await service.aclose()
