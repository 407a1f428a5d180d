"""The fairness gauges of `/fair-sched/metrics`, read while two users are backlogged through a
`fair-sched proxy` in front of the emulator: one asks 256-token answers, the other 32.

Token-fair scheduling evens out the tokens per user, round robin the requests: the Jain index
in tokens is near 1 under `fairness: tokens` and well below it under `round_robin`, and the
service gap in tokens is smaller. Counts and ratios of the gauges only.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.observability import METRICS_PATH

from .conftest import MODEL, emulator
from .test_graceful_drain import fair_sched_proxy

pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.timeout(300)]

ADMIN_KEY = "fair-sched-test-admin-gauges-41c9"
WINDOW_S = 3.0
BACKLOG_S = 4 * WINDOW_S  # the first window is left out of the medians
CLIENTS_PER_USER = 4  # closed loop: each user keeps this many requests outstanding
MAX_REQUESTS = 400  # a user, whatever the engine's speed
ASKS = {"long": 256, "short": 32}


def section(emu: RunningEmulator, fairness: str) -> dict[str, Any]:
    return {
        "tiers": [{"name": "interactive", "waiting_below": 1}],
        "principals": [{"name": user, "keys": [f"sk-{user}-gauges"]} for user in ASKS],
        "fairness": fairness,
        "backends": {MODEL: {"api_base": f"{emu.base_url}/v1"}},
        "metrics_poll_ms": 50,
        "queue": {"max_wait_s": 300},
        "observability": {"admin_key": ADMIN_KEY, "fairness_window_s": WINDOW_S},
    }


def gauges(text: str) -> dict[str, float]:
    """This model's fairness gauges in one scrape (`jain` in tokens)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != MODEL:
                continue
            if sample.name == "fair_sched_fairness_jain_index":
                if sample.labels["unit"] == "tokens":
                    found["jain"] = sample.value
            elif sample.name == "fair_sched_service_gap_tokens":
                found["gap"] = sample.value
            elif sample.name == "fair_sched_fairness_users":
                found["users"] = sample.value
    return found


async def backlogged_readings(base_url: str) -> list[dict[str, float]]:
    """Both users backlogged for BACKLOG_S; the gauges scraped meanwhile, while both count as
    backlogged throughout the window, after the first window."""
    deadline = time.monotonic() + BACKLOG_S

    async def client_loop(client: httpx.AsyncClient, user: str, sent: list[int]) -> None:
        while time.monotonic() < deadline and sent[0] < MAX_REQUESTS:
            sent[0] += 1
            response = await client.post(
                "/v1/chat/completions",
                headers={"authorization": f"Bearer sk-{user}-gauges"},
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
                    "max_tokens": ASKS[user],
                },
            )
            assert response.status_code == 200, response.text

    readings: list[tuple[float, dict[str, float]]] = []
    async with httpx.AsyncClient(
        base_url=base_url,
        trust_env=False,
        timeout=120,
        limits=httpx.Limits(max_connections=4 * CLIENTS_PER_USER),
    ) as client:
        counts = {user: [0] for user in ASKS}
        tasks = [
            asyncio.ensure_future(client_loop(client, user, counts[user]))
            for _ in range(CLIENTS_PER_USER)
            for user in ASKS
        ]
        try:
            started = time.monotonic()
            while time.monotonic() < deadline:
                await asyncio.sleep(0.25)
                scrape = await client.get(
                    METRICS_PATH, headers={"authorization": f"Bearer {ADMIN_KEY}"}
                )
                readings.append((time.monotonic() - started, gauges(scrape.text)))
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return [found for at, found in readings if at >= WINDOW_S and found.get("users") == 2]


async def test_token_fairness_shows_in_the_jain_gauge_and_the_service_gap(
    tmp_path: Path,
) -> None:
    medians: dict[str, dict[str, float]] = {}
    async with emulator(max_num_seqs=1, base_step_ms=2.0) as emu:
        for fairness in ("round_robin", "tokens"):
            async with fair_sched_proxy(section(emu, fairness), tmp_path / fairness) as proxy:
                readings = await backlogged_readings(proxy.base_url)
            assert len(readings) >= 5, (fairness, readings)
            assert all("gap" in reading for reading in readings)
            medians[fairness] = {
                name: statistics.median(reading[name] for reading in readings)
                for name in ("jain", "gap")
            }
    print(f"\nmedian gauges while both users were backlogged: {medians}")
    assert medians["tokens"]["jain"] >= 0.9
    assert medians["tokens"]["jain"] > medians["round_robin"]["jain"]
    assert medians["tokens"]["gap"] < medians["round_robin"]["gap"]
