"""Budgets through two real `litellm` proxy processes sharing state in a real redis-server:
a principal that overspends through one proxy is refused by the other. That the spend survives
every replica restarting (stored in Redis, read by the next leader) is the service's, the same
inside LiteLLM: `tests/state/test_redis_budgets.py::test_spend_survives_every_replica_restarting`
proves it without a third LiteLLM start."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fair_sched_plugin.lab.emulator.engine import EmulatorConfig
from fair_sched_plugin.lab.emulator.server import run_emulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
)

from ..state.conftest import RedisServer, unique_prefix
from .litellm_harness import NEEDS_LITELLM

pytestmark = [
    pytest.mark.litellm,
    pytest.mark.redis,
    pytest.mark.slow,
    NEEDS_LITELLM,
]

BUDGET_TOKENS = 150
HEARTBEAT_S = 0.2


@pytest.fixture
def redis_for_proxies(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def section(redis_url: str, prefix: str) -> dict[str, Any]:
    return {
        "state": redis_url,
        "state_prefix": prefix,
        "state_heartbeat_s": HEARTBEAT_S,
        "state_lease_ttl_s": 1.0,
        "principals": [
            {"name": "light", "keys": ["sk-light"]},
            {
                "name": "heavy",
                "keys": ["sk-heavy"],
                "budget": {"tokens": BUDGET_TOKENS, "per": "hour", "action": "reject"},
            },
        ],
        "metrics_poll_ms": 50,
    }


async def chat(base_url: str, key: str, max_tokens: int = 64) -> httpx.Response:
    async with open_client(base_url, key, 60.0) as client:
        return await client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "Spend some tokens."}],
                "max_tokens": max_tokens,
            },
        )


async def refused_within(base_url: str, attempts: int = 10) -> httpx.Response:
    """The heavy principal's first 429 at `base_url` (a replica sees the leader's book within a
    heartbeat or two); fails after `attempts` requests. Each costs ~5 tokens: ten of them could
    not overspend a fresh 150-token budget, so a 429 here means the earlier spend was seen."""
    for _ in range(attempts):
        response = await chat(base_url, "sk-heavy", max_tokens=1)
        if response.status_code == 429:
            return response
        assert response.status_code == 200, response.text
        await asyncio.sleep(HEARTBEAT_S)
    raise AssertionError(f"never refused in {attempts} requests")


async def test_a_budget_spent_through_one_proxy_holds_at_the_other(
    tmp_path: Path, redis_for_proxies: RedisServer
) -> None:
    config = EmulatorConfig(models=("tiny",), base_step_ms=2.0)
    prefix = unique_prefix()
    async with run_emulator(config) as emu:
        litellm_config = proxy_config(
            [model_entry("tiny", f"{emu.base_url}/v1")], section(redis_for_proxies.url, prefix)
        )
        async with contextlib.AsyncExitStack() as exits:
            first, second = await asyncio.gather(
                exits.enter_async_context(litellm_proxy(litellm_config, tmp_path, "replica-a")),
                exits.enter_async_context(litellm_proxy(litellm_config, tmp_path, "replica-b")),
            )
            for proxy in (first, second):  # both replicas join (they start on a request)
                assert (await chat(proxy.base_url, "sk-light", 1)).status_code == 200
            for _ in range(3):  # 3 x (~5 prompt + 64 output) tokens: over 150
                assert (await chat(first.base_url, "sk-heavy")).status_code == 200
            refused = await refused_within(second.base_url)
            assert 3000 < int(refused.headers["retry-after"]) <= 3600
            assert (await chat(second.base_url, "sk-light", 1)).status_code == 200
