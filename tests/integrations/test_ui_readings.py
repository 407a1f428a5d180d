"""The status document and the live page when an engine's metrics fail: the age of the reading
the gate decides on (none yet, or the last good scrape's), never a failed attempt's 0.0 s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from fair_sched_plugin.asgi import FairSchedulerMiddleware
from fair_sched_plugin.lab.loadtest.browser import chromium_page, log_in
from fair_sched_plugin.observability import STATUS_PATH
from fair_sched_plugin.observability._ui import ARGUMENT_KEY_HINT

from .conftest import MODEL, emulator, serve, wait_until
from .test_ui_browser import require_browser

pytestmark = pytest.mark.slow

ADMIN_KEY = "sk-admin-ui-readings-1"
CAP = 2


def app_for(emu: Any) -> FairSchedulerMiddleware:
    config = {
        "backends": {
            MODEL: {
                "api_base": f"{emu.base_url}/v1",
                "on_metrics_unavailable": {"max_inflight": CAP},
            }
        },
        "metrics_poll_ms": 20,
    }
    return FairSchedulerMiddleware(
        Starlette(), config=config, serve_admin=True, admin_key=ADMIN_KEY
    )


async def deployment_of(client: httpx.AsyncClient) -> dict[str, Any]:
    status = (await client.get(STATUS_PATH)).json()
    (deployment,) = status["models"][MODEL]["deployments"]
    return dict(deployment)


async def test_a_failing_scrape_reports_the_age_of_the_last_good_one() -> None:
    async with emulator() as emu:
        emu.engine.faults.update({"metrics_mode": "error"})
        middleware = app_for(emu)
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        async with (
            serve(middleware) as url,
            httpx.AsyncClient(base_url=url, headers=headers, trust_env=False) as client,
        ):
            watcher = middleware.service.watchers()[MODEL][0]
            await wait_until(lambda: watcher.failures_total >= 2)
            never = await deployment_of(client)
            emu.engine.faults.update({"metrics_mode": "ok"})
            good_before = watcher.scrapes_total - watcher.failures_total
            await wait_until(lambda: watcher.scrapes_total - watcher.failures_total > good_before)
            emu.engine.faults.update({"metrics_mode": "error"})
            failures = watcher.failures_total
            await wait_until(lambda: watcher.failures_total >= failures + 3)
            failing = await deployment_of(client)
    assert never["last_snapshot"]["ok"] is False and never["reading_age_s"] is None
    assert failing["last_snapshot"]["ok"] is False
    # Three failed scrapes came after the good one: its reading is older than the last attempt.
    assert failing["reading_age_s"] > failing["last_snapshot"]["age_s"]


async def test_the_page_says_no_reading_and_shows_the_cap_in_force(tmp_path: Path) -> None:
    require_browser()
    async with emulator() as emu:
        emu.engine.faults.update({"metrics_mode": "error"})
        middleware = app_for(emu)
        async with serve(middleware) as url, chromium_page(tmp_path / "profile") as page:
            watcher = middleware.service.watchers()[MODEL][0]
            await wait_until(lambda: watcher.failures_total >= 2)
            await page.goto(f"{url}/fair-sched/ui")
            prompt = await page.locator("#login p").inner_text()
            await log_in(page, url, ADMIN_KEY)
            card = page.locator(f'[data-model="{MODEL}"]')
            await card.locator("[data-deployment] .age").wait_for()
            waiting = await card.locator('[data-spark="waiting"] figcaption').inner_text()
            allowed = await card.locator(".allowed").inner_text()
            age = await card.locator("[data-deployment] .age").inner_text()
    assert ARGUMENT_KEY_HINT in prompt and "master key" not in prompt
    assert waiting == "engine waiting: no reading yet"
    assert f"at most {CAP} in flight per deployment" in allowed
    assert "engine queue allowed" not in allowed
    assert age == "none yet"
