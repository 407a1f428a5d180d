"""/fair-sched/metrics and /fair-sched/status over real HTTP on 127.0.0.1.

The standalone proxy and a middleware app in front of the in-process emulator; one real LiteLLM
proxy (skipped without the litellm extra). Orderings and counts are asserted, never durations.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from fair_sched_plugin.asgi import FairSchedulerMiddleware
from fair_sched_plugin.observability import METRICS_PATH, STATUS_PATH, UI_PATH
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.runtime.service import SchedulingService

from .conftest import (
    MODEL,
    assert_idle,
    chat_body,
    emulator,
    fair_config,
    forwarding_handler,
    gate_sees_metrics,
    http_state,
    open_client,
    serve,
    wait_until,
)

ADMIN_KEY = "adm-obs-test-5d1c"
ALICE_KEY = "sk-secret-alice-obs-1"
BOB_KEY = "sk-secret-bob-obs-2"
STRANGER_KEY = "sk-secret-stranger-obs-3"
FLOOD_SIZE = 16
PER_USER_CAP = 8


def config(emu: Any, **overrides: Any) -> dict[str, Any]:
    return fair_config(
        emu,
        principals=[
            {"name": "alice", "keys": [ALICE_KEY]},
            {"name": "bob", "keys": [BOB_KEY]},
        ],
        observability={"admin_key": ADMIN_KEY, "user_labels": "principals"},
        **overrides,
    )


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, frozenset(labels.items())))


def admin_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {ADMIN_KEY}"}


async def test_proxy_endpoints_need_the_admin_key() -> None:
    async with emulator() as emu:
        app = build_proxy_app(config(emu))
        async with serve(app) as url, open_client(url) as client:
            for path in (METRICS_PATH, STATUS_PATH):
                assert (await client.get(path)).status_code == 401
                user = await client.get(path, headers={"authorization": f"Bearer {ALICE_KEY}"})
                assert user.status_code == 401
                assert (await client.get(path, headers=admin_headers())).status_code == 200
            # The page is served to anyone: it holds no data and asks for the key itself.
            page = await client.get(UI_PATH)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "form-action 'none'" in page.headers["content-security-policy"]


async def test_proxy_metrics_and_status_after_a_flood() -> None:
    """Alice floods (some beyond her queue cap), Bob and a stranger send one each; the counts
    in /fair-sched/metrics and /fair-sched/status add up to what the clients saw. The proxy
    refuses the stranger's unknown key (401) before it can queue, so it is counted nowhere."""
    async with emulator(max_num_seqs=2, base_step_ms=8.0) as emu:
        app = build_proxy_app(config(emu, queue={"max_per_user": PER_USER_CAP}, metrics_poll_ms=20))
        service: SchedulingService = app.state.fair_sched
        async with (
            serve(app) as url,
            open_client(url, key=ALICE_KEY) as alice,
            open_client(url, key=BOB_KEY) as bob,
            open_client(url, key=STRANGER_KEY) as stranger,
            open_client(url) as admin,
        ):
            await gate_sees_metrics(service)
            metrics = (await admin.get(METRICS_PATH, headers=admin_headers())).text
            (deployment,) = service.gate.groups()[MODEL].deployments
            assert deployment.key == f"{emu.base_url}/v1"  # its api_base
            where = {"model": MODEL, "deployment": deployment.key}
            assert value(metrics, "fair_sched_gate_mode", **where, mode="metrics") == 1
            assert (
                value(
                    metrics,
                    "fair_sched_metrics_scrapes_total",
                    model=MODEL,
                    url=f"{emu.base_url}/metrics",
                )
                or 0
            ) >= 1

            async def send(client: httpx.AsyncClient) -> int:
                response = await client.post("/v1/chat/completions", json=chat_body(max_tokens=40))
                return response.status_code

            flood = [asyncio.ensure_future(send(alice)) for _ in range(FLOOD_SIZE)]
            await wait_until(lambda: service.scheduler.statistics().queued >= PER_USER_CAP)
            status = (await admin.get(STATUS_PATH, headers=admin_headers())).json()
            backlog = status["models"][MODEL]["backlog"]
            assert backlog[0]["user"] == "alice" and backlog[0]["depth"] >= 1
            assert backlog[0]["oldest_wait_s"] >= 0
            assert status["models"][MODEL]["gate"]["mode"] == "metrics"
            others = [asyncio.ensure_future(send(client)) for client in (bob, stranger)]
            codes = await asyncio.wait_for(asyncio.gather(*flood, *others), 60)
            await assert_idle(service)

            served = codes.count(200)
            rejected = codes.count(429)
            assert served + rejected == FLOOD_SIZE + 1
            assert rejected >= 1 and codes[-2:] == [200, 401]
            metrics = (await admin.get(METRICS_PATH, headers=admin_headers())).text
            tier = {"model": MODEL, "tier": "interactive"}
            assert value(metrics, "fair_sched_released_total") == served
            assert value(metrics, "fair_sched_completed_total") == served
            assert value(metrics, "fair_sched_wait_seconds_count", user="alice", **tier) == (
                served - 1
            )
            assert value(metrics, "fair_sched_wait_seconds_count", user="bob", **tier) == 1
            assert value(metrics, "fair_sched_wait_seconds_count", user="other", **tier) is None
            assert (
                value(
                    metrics,
                    "fair_sched_rejected_total",
                    reason="queue_full_user",
                    user="alice",
                    **tier,
                )
                == rejected
            )
            assert value(metrics, "fair_sched_queued_requests", user="alice", **tier) is None
            assert value(metrics, "fair_sched_in_flight_requests", model=MODEL) == 0
            status = (await admin.get(STATUS_PATH, headers=admin_headers())).json()
            assert status["totals"]["rejected"]["queue_full_user"] == rejected
            assert status["models"][MODEL]["backlog"] == []
            everything = metrics + json.dumps(status)
            for key in (ALICE_KEY, BOB_KEY, STRANGER_KEY):
                assert key not in everything


async def test_middleware_app_serves_the_endpoints_when_asked() -> None:
    async with emulator() as emu:
        service = SchedulingService(config(emu))
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", forwarding_handler(emu.base_url), methods=["POST"])
            ],
            middleware=[Middleware(FairSchedulerMiddleware, service=service, serve_admin=True)],
            lifespan=http_state,
        )
        async with serve(app) as url, open_client(url, key=ALICE_KEY) as client:
            response = await client.post("/v1/chat/completions", json=chat_body())
            assert response.status_code == 200
            await assert_idle(service)
            assert (await client.get(METRICS_PATH)).status_code == 401
            assert (await client.get(UI_PATH)).headers["content-type"].startswith("text/html")
            metrics = (await client.get(METRICS_PATH, headers=admin_headers())).text
            assert (
                value(
                    metrics,
                    "fair_sched_wait_seconds_count",
                    model=MODEL,
                    tier="interactive",
                    user="alice",
                )
                == 1
            )


# ----------------------------------------------------------------------------- LiteLLM


@pytest.mark.litellm
@pytest.mark.litellm_range
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("litellm") is None, reason="needs the litellm extra")
async def test_litellm_proxy_serves_the_routes_to_the_master_key_only(tmp_path: Path) -> None:
    from fair_sched_plugin.lab.harness.litellm_proxy import (
        MASTER_KEY,
        litellm_proxy,
        model_entry,
        proxy_config,
    )

    async with emulator() as emu:
        section = {
            "principals": [{"name": "alice", "keys": [ALICE_KEY]}],
            "observability": {"user_labels": "principals"},
            "metrics_poll_ms": 50,
        }
        litellm_config = proxy_config([model_entry(MODEL, f"{emu.base_url}/v1")], section)
        # LiteLLM's own Prometheus callback: its /metrics (rendered in a worker thread) must show
        # our families too.
        litellm_config["litellm_settings"]["callbacks"].append("prometheus")
        async with (
            litellm_proxy(litellm_config, tmp_path) as proxy,
            open_client(proxy.base_url) as client,
        ):
            alice = {"authorization": f"Bearer {ALICE_KEY}"}
            master = {"authorization": f"Bearer {MASTER_KEY}"}
            for _ in range(2):
                response = await client.post(
                    "/v1/chat/completions", json=chat_body(), headers=alice
                )
                assert response.status_code == 200
            for path in (METRICS_PATH, STATUS_PATH):
                assert (await client.get(path)).status_code == 401
                assert (await client.get(path, headers=alice)).status_code == 401
            assert (await client.get(UI_PATH)).headers["content-type"].startswith("text/html")
            metrics = (await client.get(METRICS_PATH, headers=master)).text
            count = value(
                metrics,
                "fair_sched_wait_seconds_count",
                model=MODEL,
                tier="interactive",
                user="alice",
            )
            assert count == 2
            answered = await client.get(STATUS_PATH, headers=master)
            status = answered.json()
            assert status["models"][MODEL]["gate"]["deployments"] == 1
            # Answered in front of LiteLLM's own middleware (docs/operations.md: through it,
            # polling held up LiteLLM's intake of requests), which marks what passes it.
            assert (await client.get("/health/liveliness")).headers["x-frame-options"] == "DENY"
            assert "x-frame-options" not in answered.headers
            litellm_metrics = (await client.get("/metrics/", headers=master)).text
            assert (
                value(
                    litellm_metrics,
                    "fair_sched_wait_seconds_count",
                    model=MODEL,
                    tier="interactive",
                    user="alice",
                )
                == 2
            )
            # Keyed by the model_list entry's api_base.
            (row,) = status["models"][MODEL]["gate"]["per_deployment"]
            where = {"model": MODEL, "deployment": row["deployment"]}
            assert row["deployment"].endswith("/v1")
            assert value(litellm_metrics, "fair_sched_gate_mode", **where, mode="metrics") == 1
            everything = metrics + litellm_metrics + json.dumps(status) + proxy.log_text()
            assert ALICE_KEY not in everything
