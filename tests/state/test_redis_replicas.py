"""Three replicas (three SchedulingServices, each with its own Redis connection) in front of one
emulated engine, sharing state through a real redis-server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from fair_sched_plugin.emulator.server import RunningEmulator
from fair_sched_plugin.identity import Credentials
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.service import SchedulingService
from fair_sched_plugin.state import SharedScheduler

from ..integrations.conftest import MODEL, chat_body, emulator, fair_config, serve, wait_until
from .conftest import RedisServer, unique_prefix

pytestmark = pytest.mark.redis

FLOOD_SIZE = 30
WAITING_BELOW = 2
REPLICAS = 3


def shared(url: str, **overrides: Any) -> dict[str, Any]:
    return {
        "state": url,
        "state_prefix": unique_prefix(),
        "state_heartbeat_s": 0.1,
        "state_lease_ttl_s": 1.0,
        **overrides,
    }


@contextlib.asynccontextmanager
async def replicas(configs: list[dict[str, Any]]) -> AsyncIterator[list[SchedulingService]]:
    services = [SchedulingService(config) for config in configs]
    try:
        for service in services:
            service.start()
        yield services
    finally:
        await asyncio.gather(*(asyncio.wait_for(s.aclose(), 10) for s in services))


async def _flood(services: list[SchedulingService], emu: RunningEmulator) -> dict[str, int]:
    """A floods (spread over every replica); once it is parked, B and C send one request each.
    Returns how many of A's requests finished before B's and C's."""
    order: list[str] = []

    async def request(service: SchedulingService, user: str, client: httpx.AsyncClient) -> None:
        principal = service.identify(Credentials(api_key=f"sk-{user.lower()}"))
        body = chat_body(max_tokens=16, stream=True)
        admission = await service.admit(principal, MODEL, body)
        lease = admission.lease
        try:
            async with client.stream(
                "POST", f"{emu.base_url}/v1/chat/completions", json=body
            ) as response:
                async for _ in response.aiter_raw():
                    lease.mark_started()
        finally:
            service.finish(lease)
        order.append(user)

    def parked() -> bool:
        stats = [service.scheduler.statistics() for service in services]
        return sum(s.queued + s.released_total for s in stats) == FLOOD_SIZE and any(
            s.queued for s in stats
        )

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) as client:
        flood = [
            asyncio.ensure_future(request(services[i % len(services)], "A", client))
            for i in range(FLOOD_SIZE)
        ]
        try:
            await wait_until(parked, timeout_s=15)
            light = [
                asyncio.ensure_future(request(services[1 % len(services)], "B", client)),
                asyncio.ensure_future(request(services[2 % len(services)], "C", client)),
            ]
            await asyncio.wait_for(asyncio.gather(*flood, *light), timeout=60)
        finally:
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
    return {user: order[: order.index(user)].count("A") for user in "BC"}


async def _gates_see_metrics(services: list[SchedulingService]) -> None:
    await wait_until(
        lambda: all(s.mode == "metrics" for svc in services for s in svc.gate.status())
    )


@pytest.mark.slow
async def test_three_replicas_share_the_engines_threshold(redis_server: RedisServer) -> None:
    """With Redis, 3 replicas keep the engine's queue within one threshold and the light users'
    result is that of one replica; with per-replica memory the queue overshoots (~3x)."""
    results: dict[str, tuple[dict[str, int], int]] = {}
    for label, states in (
        ("redis", [shared(redis_server.url)] * REPLICAS),
        ("memory", [{"state": "memory://"}] * REPLICAS),
    ):
        async with emulator(max_num_seqs=4) as emu:
            prefix = unique_prefix()
            configs = [
                fair_config(emu, waiting_below=WAITING_BELOW, **{**state, "state_prefix": prefix})
                for state in states
            ]
            async with replicas(configs) as services:
                await _gates_see_metrics(services)
                ranks = await _flood(services, emu)
                results[label] = (ranks, emu.engine.statistics().max_waiting_seen)
                if label == "redis":
                    assert all(isinstance(s.scheduler, SharedScheduler) for s in services)
                    scheduler = services[0].scheduler
                    assert isinstance(scheduler, SharedScheduler)

                    async def drained(scheduler: SharedScheduler = scheduler) -> bool:
                        stats = await scheduler.shared_statistics()
                        return stats.queued == 0 and not stats.in_flight_by_model

                    for _ in range(200):
                        if await drained():
                            break
                        await asyncio.sleep(0.02)
                    assert await drained()
    print(
        f"\n3 replicas, flood of {FLOOD_SIZE}: A's requests done before B/C and engine max "
        f"waiting: redis {results['redis']}, memory {results['memory']}"
    )
    redis_ranks, redis_waiting = results["redis"]
    _, memory_waiting = results["memory"]
    for user in "BC":
        assert redis_ranks[user] <= 0.3 * FLOOD_SIZE
    assert redis_waiting <= WAITING_BELOW + 1
    # The point of the shared store: separate replicas each spend the whole threshold.
    assert memory_waiting >= WAITING_BELOW + 2
    assert memory_waiting > redis_waiting


async def test_a_killed_replicas_leases_are_freed_within_the_ttl(redis_server: RedisServer) -> None:
    config = {"unknown_model_max_inflight": 2, **shared(redis_server.url)}
    async with replicas([config, config]) as (survivor, victim):
        principal = victim.identify(Credentials(api_key="sk-a"))
        held = [await victim.admit(principal, "other", {}) for _ in range(2)]
        parked = asyncio.ensure_future(survivor.admit(principal, "other", {}))
        await wait_until(lambda: survivor.scheduler.statistics().queued == 1)
        # Kill: the victim's background tasks stop and its connection closes, with no cleanup
        # (its leases are never released: the process is gone).
        scheduler = victim.scheduler
        assert isinstance(scheduler, SharedScheduler)
        for task in (scheduler._tick_task, scheduler._listen_task):
            assert task is not None
            task.cancel()
        scheduler._store_closed = True
        await scheduler._store.aclose()
        loop = asyncio.get_running_loop()
        killed_at = loop.time()
        admission = await asyncio.wait_for(parked, 10)
        freed_after = loop.time() - killed_at
        print(f"\nkilled replica's leases freed after {freed_after:.2f} s (ttl 1.0 s)")
        survivor.finish(admission.lease)
        assert len(held) == 2
        survivor_scheduler = survivor.scheduler
        assert isinstance(survivor_scheduler, SharedScheduler)
        stats = await survivor_scheduler.shared_statistics()
        assert stats.replicas == 1


async def test_redis_restart_falls_back_then_recovers(
    own_redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    config = {"unknown_model_max_inflight": 1, **shared(own_redis_server.url)}
    async with replicas([config]) as (service,):
        scheduler = service.scheduler
        assert isinstance(scheduler, SharedScheduler)
        principal = service.identify(Credentials(api_key="sk-a"))
        holder = await service.admit(principal, "other", {})
        parked = asyncio.ensure_future(service.admit(principal, "other", {}))
        await wait_until(lambda: scheduler.statistics().queued == 1)
        with caplog.at_level(logging.WARNING, logger="fair_sched"):
            own_redis_server.stop()
            # The waiting request moves to this replica's own scheduler (its own slot).
            admission = await asyncio.wait_for(parked, 10)
            assert scheduler.mode == "local"
            assert scheduler.state_statistics().fallbacks_total == 1
            assert any("falls back to in-memory" in r.getMessage() for r in caplog.records)
            # While Redis is down, requests are still served (never a deadlock).
            service.finish(admission.lease)
            service.finish(holder.lease)
            during = await asyncio.wait_for(service.admit(principal, "other", {}), 10)
            service.finish(during.lease)
            own_redis_server.start()
            await wait_until(lambda: scheduler.mode == "shared", timeout_s=10)
        assert scheduler.state_statistics().recoveries_total == 1
        after = await asyncio.wait_for(service.admit(principal, "other", {}), 10)
        assert after.lease.lease_id in scheduler._leases  # granted by the shared store
        stats = await scheduler.shared_statistics()
        assert stats.in_flight_by_model == {"other": 1}
        service.finish(after.lease)


@pytest.mark.slow
async def test_three_proxy_replicas_behind_a_load_balancer(redis_server: RedisServer) -> None:
    """Three `fair-sched proxy` apps served by uvicorn, requests spread over them round-robin as
    a load balancer would: the light users still overtake the flood and the engine's queue stays
    within one threshold."""
    async with emulator(max_num_seqs=4) as emu:
        config = fair_config(emu, waiting_below=WAITING_BELOW, **shared(redis_server.url))
        apps = [build_proxy_app(config) for _ in range(REPLICAS)]
        async with contextlib.AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(serve(app)) for app in apps]
            services: list[SchedulingService] = [app.state.fair_sched for app in apps]
            await _gates_see_metrics(services)
            order: list[str] = []
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
            client = await stack.enter_async_context(
                httpx.AsyncClient(limits=limits, timeout=60, trust_env=False)
            )

            async def request(replica: int, user: str) -> None:
                response = await client.post(
                    f"{urls[replica % REPLICAS]}/v1/chat/completions",
                    json=chat_body(max_tokens=16),
                    headers={"authorization": f"Bearer sk-{user.lower()}"},
                )
                assert response.status_code == 200, response.text
                order.append(user)

            flood = [asyncio.ensure_future(request(i, "A")) for i in range(FLOOD_SIZE)]
            try:
                await wait_until(
                    lambda: (
                        emu.engine.statistics().requests_received >= 1
                        and sum(s.scheduler.statistics().queued for s in services) > 0
                    ),
                    timeout_s=15,
                )
                light = [
                    asyncio.ensure_future(request(1, "B")),
                    asyncio.ensure_future(request(2, "C")),
                ]
                await asyncio.wait_for(asyncio.gather(*flood, *light), timeout=60)
            finally:
                for task in flood:
                    task.cancel()
                await asyncio.gather(*flood, return_exceptions=True)
    ranks = {user: order[: order.index(user)].count("A") for user in "BC"}
    max_waiting = emu.engine.statistics().max_waiting_seen
    print(
        f"\n3 proxy replicas: A's requests done before B/C {ranks}, engine max waiting {max_waiting}"
    )
    for user in "BC":
        assert ranks[user] <= 0.3 * FLOOD_SIZE
    assert max_waiting <= WAITING_BELOW + 1
