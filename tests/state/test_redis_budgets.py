"""Budgets with state in Redis: two replicas on a real redis-server keep one budget
book (the leader's), and it survives every replica restarting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from fair_sched_plugin.errors import BudgetExceeded
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.service import SchedulingService

from ..integrations.conftest import wait_until
from .conftest import RedisServer, heartbeats, unique_prefix

pytestmark = pytest.mark.redis

HEARTBEAT_S = 0.1
HOUR_S = 3600.0
BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 10}


def config(url: str, prefix: str) -> dict[str, Any]:
    return {
        "state": url,
        "state_prefix": prefix,
        "state_heartbeat_s": HEARTBEAT_S,
        "state_lease_ttl_s": 1.0,
        "unknown_model_max_inflight": 4,
        "principals": [
            {
                "name": "heavy",
                "keys": ["sk-heavy"],
                "budget": {"tokens": 100, "per": "hour", "action": "reject"},
            }
        ],
    }


@contextlib.asynccontextmanager
async def replicas(url: str, prefix: str, count: int) -> AsyncIterator[list[SchedulingService]]:
    services = [SchedulingService(config(url, prefix)) for _ in range(count)]
    try:
        for service in services:
            service.start()
        await wait_until(lambda: leader_of(services) is not None, timeout_s=15)
        yield services
    finally:
        await asyncio.gather(*(asyncio.wait_for(s.aclose(), 10) for s in services))


def leader_of(services: list[SchedulingService]) -> SchedulingService | None:
    leading = [s for s in services if s.scheduler.leading]
    return leading[0] if len(leading) == 1 else None


def followers_of(services: list[SchedulingService]) -> list[SchedulingService]:
    return [s for s in services if not s.scheduler.leading]


async def spend(service: SchedulingService, tokens: int) -> None:
    heavy = service.identify(Credentials(api_key="sk-heavy"))
    admission = await asyncio.wait_for(service.admit(heavy, "m", BODY), 10)
    admission.lease.release(tokens)


def spent(service: SchedulingService) -> float:
    verdict = service.budgets.verdict("heavy")
    assert verdict is not None
    return verdict.spent


@contextlib.asynccontextmanager
async def redis_client(url: str) -> AsyncIterator[redis_asyncio.Redis]:
    client = redis_asyncio.Redis.from_url(url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


async def test_a_followers_spend_reaches_the_leader_and_every_replica_refuses(
    redis_server: RedisServer,
) -> None:
    async with replicas(redis_server.url, unique_prefix(), 2) as services:
        leader = leader_of(services)
        (follower,) = followers_of(services)
        assert leader is not None
        await spend(follower, 150)
        await wait_until(lambda: spent(leader) == 150)
        # The leader's snapshot comes back to the follower (not counted twice).
        async with redis_client(redis_server.url) as raw:
            await heartbeats(raw, len(services), 5)
        await wait_until(lambda: spent(follower) == 150)
        for service in services:
            with pytest.raises(BudgetExceeded) as refused:
                await spend(service, 1)
            assert 0 < refused.value.retry_after_s <= HOUR_S


async def test_spend_survives_every_replica_restarting(redis_server: RedisServer) -> None:
    prefix = unique_prefix()
    async with replicas(redis_server.url, prefix, 2) as services:
        leader = leader_of(services)
        assert leader is not None
        await spend(leader, 150)
    # Stored on the way out (and on every heartbeat), expiring only after the budget window.
    async with redis_client(redis_server.url) as client:
        stored = json.loads(await client.get(f"{prefix}budgets"))
        assert stored["heavy"]["spent"] == 150
        assert await client.pttl(f"{prefix}budgets") > (HOUR_S - 60) * 1000
    async with replicas(redis_server.url, prefix, 2) as restarted:
        await wait_until(lambda: all(spent(s) == 150 for s in restarted))
        with pytest.raises(BudgetExceeded):
            await spend(restarted[0], 1)


async def stored_budgets(client: redis_asyncio.Redis, prefix: str) -> Any:
    """The stored snapshot; None while absent or still the unreadable value."""
    raw = await client.get(f"{prefix}budgets")
    try:
        return None if raw is None else json.loads(raw)
    except (ValueError, RecursionError):
        return None


async def eventually_stored(client: redis_asyncio.Redis, prefix: str, expected: Any) -> None:
    for _ in range(100):
        if await stored_budgets(client, prefix) == expected:
            return
        await asyncio.sleep(HEARTBEAT_S)
    assert await stored_budgets(client, prefix) == expected


@pytest.mark.parametrize(
    "value",
    [
        "{not json",
        '{"heavy": {"spent": "lots"}}',
        "[1, 2]",
        "[" * 100_000,
        # Before: OverflowError on every heartbeat (a traceback each), the value never replaced.
        '{"heavy": {"spent": %s, "resets_in_s": 60}}' % ("9" * 400),
        '{"heavy": {"spent": 1, "resets_in_s": NaN}}',
    ],
)
async def test_an_unreadable_budget_key_is_logged_and_a_fresh_book_started(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    prefix = unique_prefix()
    async with redis_client(redis_server.url) as client:
        await client.set(f"{prefix}budgets", value)
        with caplog.at_level(logging.ERROR, logger="fair_sched"):
            async with replicas(redis_server.url, prefix, 1) as (service,):
                # The leader's first store replaces the bad value with its fresh book ...
                await eventually_stored(client, prefix, {})
                # ... and it keeps serving and counting.
                await spend(service, 50)
                stored = None
                for _ in range(100):
                    stored = await stored_budgets(client, prefix)
                    if stored:
                        break
                    await asyncio.sleep(HEARTBEAT_S)
                assert stored is not None and stored["heavy"]["spent"] == 50
                assert spent(service) == 50
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert f"{prefix}budgets is unreadable" in errors[0] and "fresh budget book" in errors[0]
    assert "9" * 250 not in errors[0]  # a huge value is cut short
