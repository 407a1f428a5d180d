"""Weights hold across `fair-sched proxy` replicas on one real redis-server under skewed ingress.

`fairness: weighted`, a weight-4 principal ("heavy") and a weight-1 one ("light"), both
backlogged behind a one-slot emulator. Every request of the heavy principal enters one replica;
the light principal's are spread over all of them. With one proxy (`memory://`) and with three
on Redis (the leader's core decides for all), the heavy principal gets 4/5 of the releases while
both are backlogged: weights are the leader's, whichever replica a request entered. Counts and
ratios only, from the emulator's log of what it received.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.lab.harness.litellm_proxy import ProxyProcess

from ..state.conftest import RedisServer, unique_prefix
from .conftest import MODEL, emulator
from .test_graceful_drain import fair_sched_proxy

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(300)]

ADMIN_KEY = "fair-sched-test-admin-weights-5b2e"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
HEAVY_REQUESTS = 60
LIGHT_REQUESTS_PER_REPLICA = 10  # 30 in all: both stay backlogged through the releases counted
SKIPPED = 5  # the first releases, while the replicas' tickets are still reaching the leader
COUNTED = 50
ANSWER_TOKENS = 8


def section(emu: RunningEmulator, state: dict[str, Any]) -> dict[str, Any]:
    return {
        "tiers": [{"name": "interactive", "waiting_below": 1}],
        "principals": [
            {"name": "heavy", "keys": ["sk-heavy-w4"], "weight": 4},
            {"name": "light", "keys": ["sk-light-w1"], "weight": 1},
        ],
        "fairness": "weighted",
        "backends": {
            MODEL: {"api_base": f"{emu.base_url}/v1", "metrics_url": f"{emu.base_url}/metrics"}
        },
        "metrics_poll_ms": 50,
        "queue": {"max_wait_s": 300},
        "observability": {"admin_key": ADMIN_KEY},
        **state,
    }


async def flood(emu: RunningEmulator, heavy_url: str, light_urls: list[str]) -> list[str]:
    """Every request of both principals at once (the heavy one's through `heavy_url`, the light
    one's spread over `light_urls`); the principals in the order the engine received them."""

    async def chat(base_url: str, key: str, user: str) -> None:
        async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=120) as client:
            response = await client.post(
                "/v1/chat/completions",
                headers={"authorization": f"Bearer {key}"},
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
                    "max_tokens": ANSWER_TOKENS,
                    "user": user,  # what the emulator logs
                },
            )
            assert response.status_code == 200, response.text

    received_before = len(emu.engine.received)
    sends = [(heavy_url, "sk-heavy-w4", "heavy")] * HEAVY_REQUESTS
    sends += [(url, "sk-light-w1", "light") for url in light_urls] * LIGHT_REQUESTS_PER_REPLICA
    tasks = [asyncio.ensure_future(chat(*send)) for send in sends]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), 240)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [str(request.user) for request in list(emu.engine.received)[received_before:]]


def heavy_share(order: list[str], light_requests: int) -> float:
    assert len(order) == HEAVY_REQUESTS + light_requests
    counted = order[SKIPPED : SKIPPED + COUNTED]
    return counted.count("heavy") / COUNTED


async def leader_settled(proxies: list[ProxyProcess]) -> None:
    """Wait (bounded) until every replica names the same leader."""
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        leaders: set[Any] = set()
        for _ in range(200):
            documents = [
                (await client.get(f"{proxy.base_url}/fair-sched/status", headers=ADMIN)).json()
                for proxy in proxies
            ]
            leaders = {document["state"]["leader"] for document in documents}
            if len(leaders) == 1 and None not in leaders:
                return
            await asyncio.sleep(0.05)
    pytest.fail(f"the replicas never agreed on a leader: {leaders}")


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[RedisServer]:
    directory.mkdir()
    redis = RedisServer(directory)
    redis.start()
    try:
        yield redis
    finally:
        redis.stop()


async def test_a_weight_4_principal_gets_four_fifths_through_one_or_three_replicas(
    tmp_path: Path,
) -> None:
    async with emulator(max_num_seqs=1, base_step_ms=4.0) as emu:
        async with fair_sched_proxy(section(emu, {"state": "memory://"}), tmp_path / "one") as one:
            alone = await flood(emu, one.base_url, [one.base_url] * 3)
            one_share = heavy_share(alone, 3 * LIGHT_REQUESTS_PER_REPLICA)

        with redis_server(tmp_path / "redis") as redis:
            shared = {
                "state": redis.url,
                "state_prefix": unique_prefix(),
                "state_heartbeat_s": 0.2,
                "state_lease_ttl_s": 2.0,
            }
            config = section(emu, shared)
            async with (
                fair_sched_proxy(config, tmp_path / "a") as a,
                fair_sched_proxy(config, tmp_path / "b") as b,
                fair_sched_proxy(config, tmp_path / "c") as c,
            ):
                await leader_settled([a, b, c])
                urls = [a.base_url, b.base_url, c.base_url]
                order = await flood(emu, a.base_url, urls)
                three_share = heavy_share(order, 3 * LIGHT_REQUESTS_PER_REPLICA)
    print(
        f"\nweight-4 principal's share of releases {SKIPPED + 1}..{SKIPPED + COUNTED}: "
        f"one replica {one_share:.3f}, three replicas on Redis (all its requests through one) "
        f"{three_share:.3f}"
    )
    assert 0.75 <= one_share <= 0.85
    assert 0.75 <= three_share <= 0.85
