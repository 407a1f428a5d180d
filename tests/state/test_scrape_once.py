"""Scrape once per engine: while replicas share state in Redis, only the deciding replica (the
leader) reads each engine's `/metrics`; the others read nothing, and a replica that takes over
reads its engines at once. Counted at the engine (the emulator counts the pages it serves).

Before: every replica ran its metrics watchers, so three replicas asked one engine for three
times the pages (ten replicas at the default 100 ms: 100 pages a second), though only the
leader's gate decided.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.runtime.service import SchedulingService

from ..integrations.conftest import (
    assert_idle,
    chat_body,
    emulator,
    fair_config,
    open_client,
    serve,
    wait_until,
)
from .conftest import RedisServer, unique_prefix

pytestmark = [pytest.mark.redis]

CHAT = "/v1/chat/completions"
REPLICAS = 3
# Scrapes by the leader over which the engine's pages are counted.
WINDOW_SCRAPES = 20


def service_of(app: Any) -> SchedulingService:
    service: SchedulingService = app.state.fair_sched
    return service


def scrapes(service: SchedulingService) -> int:
    return sum(reading.scrapes_total for reading in service.observability.view.deployments())


@contextlib.asynccontextmanager
async def replicas(emu: Any, redis_url: str) -> AsyncIterator[list[tuple[Any, str]]]:
    """`REPLICAS` fair-sched proxies on one Redis, the first one leading."""
    shared = {"state": redis_url, "state_prefix": unique_prefix(), "state_heartbeat_s": 0.2}
    apps = [build_proxy_app(fair_config(emu, **shared)) for _ in range(REPLICAS)]
    async with contextlib.AsyncExitStack() as stack:
        served = []
        for index, app in enumerate(apps):
            url = await stack.enter_async_context(serve(app))
            served.append((app, url))
            if index == 0:
                await wait_until(lambda: service_of(apps[0]).scheduler.leading, 15)
        await wait_until(
            lambda: all(
                service_of(app).scheduler.coordinated and not service_of(app).scheduler.decides
                for app in apps[1:]
            ),
            15,
        )
        yield served


async def engine_pages_per_leader_scrape(
    emu: Any, leader: SchedulingService, followers: list[SchedulingService]
) -> tuple[int, int, list[int]]:
    """(pages the engine served, scrapes by the leader, scrapes by each follower) while the
    leader scrapes `WINDOW_SCRAPES` times."""
    pages_before = emu.emulator.metrics_requests
    leader_before = scrapes(leader)
    followers_before = [scrapes(follower) for follower in followers]
    await wait_until(lambda: scrapes(leader) >= leader_before + WINDOW_SCRAPES, 30)
    return (
        emu.emulator.metrics_requests - pages_before,
        scrapes(leader) - leader_before,
        [
            scrapes(follower) - before
            for follower, before in zip(followers, followers_before, strict=True)
        ],
    )


async def test_only_the_leader_reads_the_engine_idle_and_under_a_flood(
    own_redis_server: RedisServer,
) -> None:
    async with emulator() as emu, replicas(emu, own_redis_server.url) as served:
        services = [service_of(app) for app, _ in served]
        leader, followers = services[0], services[1:]
        idle = await engine_pages_per_leader_scrape(emu, leader, followers)

        async def flood(url: str, key: str) -> int:
            async with open_client(url, key=key) as client:
                answers = await asyncio.gather(
                    *(client.post(CHAT, json=chat_body(max_tokens=40)) for _ in range(12))
                )
            return sum(answer.status_code == 200 for answer in answers)

        flooding = asyncio.gather(
            *(
                flood(url, key)
                for (_, url), key in zip(served, ("sk-a", "sk-b", "sk-c"), strict=True)
            )
        )
        await wait_until(lambda: emu.engine.statistics().running > 0, 15)
        busy = await engine_pages_per_leader_scrape(emu, leader, followers)
        assert await flooding == [12, 12, 12]
        for service in services:
            await assert_idle(service)
    for name, (pages, leader_scrapes, follower_scrapes) in (("idle", idle), ("flood", busy)):
        print(f"\n{name}: engine pages {pages}, leader scrapes {leader_scrapes}")
        assert follower_scrapes == [0] * (REPLICAS - 1), (name, follower_scrapes)
        # One scrape may be in flight at either end of the window.
        assert pages <= 1.2 * leader_scrapes + 1, (name, pages, leader_scrapes)


async def test_a_replica_that_takes_over_reads_its_engines(own_redis_server: RedisServer) -> None:
    """A follower reads nothing while the leader lives; once the leader is gone it takes over
    within the lease's TTL, reads its engine at once and serves."""
    async with emulator() as emu, contextlib.AsyncExitStack() as second_running:
        shared = {
            "state": own_redis_server.url,
            "state_prefix": unique_prefix(),
            "state_heartbeat_s": 0.2,
            "state_lease_ttl_s": 1.0,
        }
        first = build_proxy_app(fair_config(emu, **shared))
        second = build_proxy_app(fair_config(emu, **shared))
        leader, follower = service_of(first), service_of(second)
        async with contextlib.AsyncExitStack() as first_running:
            await first_running.enter_async_context(serve(first))
            await wait_until(lambda: leader.scheduler.leading, 15)
            second_url = await second_running.enter_async_context(serve(second))
            await wait_until(
                lambda: follower.scheduler.coordinated and not follower.scheduler.decides, 15
            )
            _, _, [follower_scrapes] = await engine_pages_per_leader_scrape(emu, leader, [follower])
            assert follower_scrapes == 0
        # The leader is gone (its lease expires within the TTL).
        await wait_until(lambda: follower.scheduler.decides, 15)
        before = scrapes(follower)
        await wait_until(lambda: scrapes(follower) >= before + 3, 15)
        async with open_client(second_url, key="sk-a") as alice:
            answer = await alice.post(CHAT, json=chat_body(max_tokens=4))
        assert answer.status_code == 200
