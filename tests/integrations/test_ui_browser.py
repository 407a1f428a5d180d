"""`/fair-sched/ui` in a real headless Chromium, on a real LiteLLM proxy under a small flood.

Debian's `chromium` driven by playwright's Python client (no browser download). Without Chromium
or playwright this skips on a developer's machine and fails under CI (`CI=true`), where
`scripts/test` installs Chromium. Set `FAIR_SCHED_UI_SCREENSHOTS=DIR` to keep the screenshots.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fair_sched_plugin.lab.loadtest.browser import chromium_page, log_in, missing_browser_parts
from fair_sched_plugin.observability import STATUS_PATH, UI_PATH

from ..support import eventually, in_ci
from .conftest import MODEL, chat_body, emulator

FLOODER_KEY = "sk-secret-flooder-ui-1"
LIGHT_KEY = "sk-secret-light-ui-2"
FLOOD_SIZE = 30
LIGHT_REQUESTS = 2
FLOOD_TIMEOUT_S = 120.0


def require_browser() -> None:
    """Skip without Chromium or playwright on a developer's machine; fail under CI."""
    missing = missing_browser_parts()
    if missing is not None:
        if in_ci():
            pytest.fail(f"the UI browser test cannot run under CI: {missing}", pytrace=False)
        pytest.skip(missing)


@pytest.fixture
def browser_ready() -> Iterator[None]:
    require_browser()
    yield


def test_a_missing_browser_fails_under_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FAIR_SCHED_CHROMIUM", str(tmp_path / "no-chromium-here"))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"no Chromium binary|playwright"):
        require_browser()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"no Chromium binary|playwright"):
        require_browser()


def keep(path: Path) -> None:
    directory = os.environ.get("FAIR_SCHED_UI_SCREENSHOTS")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(directory) / path.name)


async def page_numbers(page: Any) -> dict[str, str]:
    """The numbers the page shows for the flooder, the engine and the totals."""
    return dict(
        await page.evaluate(
            """() => {
              const text = (selector) => {
                const el = document.querySelector(selector);
                return el ? el.textContent.trim() : null;
              };
              const model = `[data-model="tiny"]`;
              return {
                flooder_queued: text(`${model} tr[data-user="flooder"] .queued`),
                flooder_in_flight: text(`${model} tr[data-user="flooder"] .in-flight`),
                engine_waiting: text(`${model} [data-deployment] .waiting`),
                engine_running: text(`${model} [data-deployment] .running`),
                engine_tpot: text(`${model} [data-deployment] .tpot`),
                gate_mode: text(`${model} [data-gate-mode]`),
                deployment_gate: text(`${model} [data-gate-deployment] .in-flight`),
                completed: text(`[data-total="completed"] b`),
                released: text(`[data-total="released"] b`),
              };
            }"""
        )
    )


@pytest.mark.litellm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("litellm") is None, reason="needs the litellm extra")
async def test_the_page_shows_a_flood_live_and_nothing_without_the_key(
    tmp_path: Path, browser_ready: None
) -> None:
    from fair_sched_plugin.lab.harness.litellm_proxy import (
        MASTER_KEY,
        litellm_proxy,
        model_entry,
        proxy_config,
    )

    # Two slots and slow steps: the flood lasts long enough to be watched.
    async with emulator(max_num_seqs=2, base_step_ms=25.0) as emu:
        section = {
            # Shares change nothing here (only interactive users): the page shows them.
            "tiers": [
                {"name": "interactive", "waiting_below": 3, "tpot_below_ms": 150, "share": 0.8},
                {"name": "batch", "waiting_below": 1, "vllm_priority": 10, "share": 0.2},
            ],
            "principals": [
                # A budget far from spent: the page shows what the flood spends of it.
                {
                    "name": "flooder",
                    "keys": [FLOODER_KEY],
                    "budget": {"tokens": 10**9, "per": "hour", "action": "reject"},
                },
                {"name": "light", "keys": [LIGHT_KEY]},
            ],
            "metrics_poll_ms": 50,
            # Short: the flooder is backlogged throughout a window while the page is watched.
            "observability": {"fairness_window_s": 1},
        }
        config = proxy_config([model_entry(MODEL, f"{emu.base_url}/v1")], section)
        async with (
            litellm_proxy(config, tmp_path) as proxy,
            httpx.AsyncClient(
                base_url=proxy.base_url,
                timeout=FLOOD_TIMEOUT_S,
                trust_env=False,
                limits=httpx.Limits(max_connections=100),
            ) as client,
            chromium_page(tmp_path / "chromium-profile") as page,
        ):
            # Every request the browser makes: (URL, Authorization header).
            sent: list[tuple[str, str | None]] = []
            page.on("request", lambda r: sent.append((r.url, r.headers.get("authorization"))))
            # The fairness readings of every status document the page received: its cells must
            # show one of them (what they are worth is tests/integrations/
            # test_proxy_fairness_gauges.py's: here a 1 s window holds about one request each).
            readings: list[tuple[int, float]] = []

            async def keep_reading(response: Any) -> None:
                if response.url.endswith(STATUS_PATH) and response.status == 200:
                    try:
                        document = await response.json()
                    except Exception:  # a body the page did not get either
                        return
                    fairness = document["models"].get(MODEL, {}).get("fairness", {})
                    tier = fairness.get("interactive") or {}
                    if "tokens" in tier.get("jain_index", {}):
                        readings.append((tier["users"], tier["jain_index"]["tokens"]))

            page.on("response", keep_reading)
            # The page is served to anyone; it holds no data and shows only the prompt.
            answer = await client.get(UI_PATH)
            assert answer.status_code == 200
            assert "connect-src 'self'" in answer.headers["content-security-policy"]
            await page.goto(f"{proxy.base_url}{UI_PATH}")
            await page.locator("#key").wait_for()
            assert await page.locator("#login").is_visible()
            assert not await page.locator("#app").is_visible()
            assert await page.locator("#dashboard").inner_html() == ""
            prompt = tmp_path / "ui-prompt.png"
            await page.screenshot(path=str(prompt))
            keep(prompt)

            async def send(key: str) -> int:
                body = chat_body(max_tokens=40)
                headers = {"authorization": f"Bearer {key}"}
                response = await client.post("/v1/chat/completions", json=body, headers=headers)
                return response.status_code

            flood = [asyncio.ensure_future(send(FLOODER_KEY)) for _ in range(FLOOD_SIZE)]
            light = [asyncio.ensure_future(send(LIGHT_KEY)) for _ in range(LIGHT_REQUESTS)]
            try:
                master = {"authorization": f"Bearer {MASTER_KEY}"}

                async def flooder_queued() -> int:
                    status = (await client.get(STATUS_PATH, headers=master)).json()
                    backlog = status["models"][MODEL]["backlog"]
                    return sum(e["depth"] for e in backlog if e["user"] == "flooder")

                for _ in range(400):  # bounded: ~20 s
                    if await flooder_queued() >= 5:
                        break
                    await asyncio.sleep(0.05)
                else:
                    pytest.fail("the flood never queued")

                # A wrong key: an error on the prompt, still no data.
                await page.locator("#key").fill("sk-not-the-master-key")
                await page.locator("#login button[type=submit]").click()
                await page.locator("#login-error").filter(has_text="not accepted").wait_for()
                assert await page.locator("#dashboard").inner_html() == ""
                assert not await page.locator("#app").is_visible()

                await log_in(page, proxy.base_url, MASTER_KEY)
                flooder_row = page.locator(f'[data-model="{MODEL}"] tr[data-user="flooder"]')
                await flooder_row.wait_for()
                await page.locator(f'[data-model="{MODEL}"] [data-deployment]').wait_for()
                first = await page_numbers(page)
                shot_1 = tmp_path / "ui-flood-1.png"
                await page.screenshot(path=str(shot_1), full_page=True)
                keep(shot_1)
                # The page polls: wait (bounded) until it shows more requests completed.
                second = first

                async def page_moved_on() -> bool:
                    nonlocal second
                    second = await page_numbers(page)
                    return int(second["completed"] or 0) > int(first["completed"] or 0)

                await eventually(page_moved_on, 30, interval_s=0.1, what="the page's next poll")
                shot_2 = tmp_path / "ui-flood-2.png"
                await page.screenshot(path=str(shot_2), full_page=True)
                keep(shot_2)
                # The fairness gauges beside the tier, with their sparklines: the flooder,
                # backlogged for more than a window, is the one user the index is over.
                fairness_row = page.locator(
                    f'[data-model="{MODEL}"] tr[data-fairness-tier="interactive"]'
                )
                jain_cell = fairness_row.locator('.jain[data-unit="tokens"]')

                async def fairness_shown() -> bool:
                    return bool(await jain_cell.count()) and (await jain_cell.inner_text()) not in (
                        "",
                        "\u2013",
                    )

                await eventually(fairness_shown, 30, interval_s=0.1, what="the fairness gauges")
                fairness_jain = await jain_cell.inner_text()
                fairness_users = await fairness_row.locator(".users").inner_text()
                fairness_sparks = await page.locator(
                    f'[data-model="{MODEL}"] [data-fairness-spark="interactive"] figure'
                ).count()
                fairness_starved = await fairness_row.locator(".starved").inner_text()
                budget_row = page.locator('#budgets tr[data-user="flooder"]')
                budget_spent = await budget_row.locator(".spent").inner_text()
                budget_over = await budget_row.locator(".over").inner_text()
                delivered = page.locator('#tiers tr[data-tier="interactive"] .delivered')
                interactive_delivered = await delivered.inner_text()
            finally:
                codes = await asyncio.wait_for(
                    asyncio.gather(*flood, *light, return_exceptions=True), FLOOD_TIMEOUT_S
                )

            assert codes.count(200) == FLOOD_SIZE + LIGHT_REQUESTS, codes
            # The flooder's queue and the engine's gauges are on the page.
            assert int(first["flooder_queued"] or 0) >= 1, first
            assert first["gate_mode"] == "metrics", first
            # The deployment's own gate: what it counts in flight.
            assert first["deployment_gate"] not in (None, "\u2013"), first
            assert first["engine_running"] not in (None, "\u2013"), first
            assert float(first["engine_running"] or 0) >= 1, first
            assert first["engine_waiting"] not in (None, "\u2013"), first
            assert first["engine_tpot"] not in (None, "\u2013"), first
            # The page polls: between the two screenshots requests completed.
            assert int(second["completed"] or 0) > int(first["completed"] or 0), (first, second)
            assert first != second
            # The flooder's budget: what completed so far is spent of it, and it is not over.
            assert not budget_spent.startswith("0 of"), budget_spent
            assert budget_over == "no", budget_over
            assert interactive_delivered == "100 %", interactive_delivered
            # The cells show a reading the page received, not a number of their own.
            assert any(
                users == int(fairness_users) and abs(index - float(fairness_jain)) <= 0.005
                for users, index in readings
            ), (fairness_users, fairness_jain, readings[-5:])
            assert fairness_sparks == 2, fairness_sparks
            assert fairness_starved.endswith(" s"), fairness_starved

            # "Forget key" drops the data and the key; a reload asks again.
            await page.locator("#forget").click()
            assert await page.locator("#dashboard").inner_html() == ""
            await page.reload()
            await page.locator("#key").wait_for()
            assert await page.locator("#dashboard").inner_html() == ""
            assert not await page.locator("#app").is_visible()
            # The key never went into a URL, only into the status requests' Authorization; the
            # page asked nothing of any other origin, nor before a key was typed.
            log = proxy.log_text()
            assert MASTER_KEY not in log and "sk-not-the-master-key" not in log
            assert page.url == f"{proxy.base_url}{UI_PATH}"
            assert all(url.startswith(proxy.base_url) for url, _ in sent), sent
            assert all(MASTER_KEY not in url and "sk-not" not in url for url, _ in sent)
            status_calls = [auth for url, auth in sent if url.endswith(STATUS_PATH)]
            assert f"Bearer {MASTER_KEY}" in status_calls
            assert set(status_calls) == {f"Bearer {MASTER_KEY}", "Bearer sk-not-the-master-key"}
            assert {url for url, _ in sent} == {
                f"{proxy.base_url}{UI_PATH}",
                f"{proxy.base_url}{STATUS_PATH}",
            }
