"""Placement across replicas: the leader's core binds each request to a deployment, and the
follower that asked holds a lease naming that deployment; a new leader adopts it there."""

from __future__ import annotations

import asyncio
import collections

import pytest

from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.service import SchedulingService

from ..integrations.conftest import (
    MODEL,
    chat_body,
    emulator,
    fair_config,
    open_client,
    serve,
    wait_until,
)
from .conftest import RedisServer
from .test_redis_replicas import cut_off, replicas, settled, shared

pytestmark = pytest.mark.redis

HELD = 4


def in_flight_per_deployment(service: SchedulingService) -> dict[str, int]:
    (group,) = [group for group in service.gate.status() if group.model == MODEL]
    return {row.deployment: row.in_flight for row in group.per_deployment if row.in_flight}


async def test_a_followers_lease_names_the_deployment_the_leader_chose(
    redis_server: RedisServer,
) -> None:
    async with emulator(max_num_seqs=4) as first, emulator(max_num_seqs=4) as second:
        keys = {f"{first.base_url}/v1", f"{second.base_url}/v1"}
        config = fair_config(
            first,
            waiting_below=HELD,
            backend={"api_bases": sorted(keys)},
            **shared(redis_server.url),
        )
        async with replicas([config] * 2) as services:
            leader = await settled(services)
            follower = next(service for service in services if service is not leader)
            principal = follower.identify(Credentials(api_key="sk-a"))
            leases = []
            for index in range(HELD):
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"question {index} " * 40}],
                    "max_tokens": 8,
                }
                leases.append((await follower.admit(principal, MODEL, body)).lease)
            bound = collections.Counter(lease.deployment for lease in leases)
            assert set(bound) <= keys and len(bound) == 2, bound
            # The leader counts each of them on the deployment the follower's lease names.
            await wait_until(lambda: in_flight_per_deployment(leader) == bound, timeout_s=10)

            # The leader vanishes: the follower leads, and adopts its leases where they run.
            await cut_off(leader)
            await wait_until(lambda: follower.scheduler.leading, timeout_s=10)
            await wait_until(lambda: in_flight_per_deployment(follower) == bound, timeout_s=10)
            for lease in leases:
                lease.release()
            await wait_until(lambda: not in_flight_per_deployment(follower))


async def test_a_proxy_refuses_a_grant_for_a_deployment_it_does_not_serve(
    redis_server: RedisServer,
) -> None:
    """Mid-rollout of a config change: one replica serves the model on A and B, the other on A
    and C. A grant for the deployment only the leader knows reaches the other proxy. Before: it
    went to that proxy's first api_base (A), which the leader had not counted it on. Now it is
    refused with a 502 naming the deployment, its lease abandoned."""
    steps = {"base_step_ms": 20.0, "step_ms_per_running_seq": 0.0, "prefill_ms_per_token": 0.0}
    async with (
        emulator(max_num_seqs=2, **steps) as a,
        emulator(max_num_seqs=2, **steps) as b,
        emulator(max_num_seqs=2, **steps) as c,
    ):
        prefix = shared(redis_server.url)
        configs = [
            fair_config(
                a,
                waiting_below=1,
                backend={"api_bases": [f"{a.base_url}/v1", f"{other.base_url}/v1"]},
                **prefix,
            )
            for other in (b, c)
        ]
        async with replicas(configs) as services:
            leader = await settled(services)
            follower = next(service for service in services if service is not leader)
            theirs = set(follower.settings.backends[MODEL].all_api_bases())
            async with (
                serve(build_proxy_app(service=follower)) as url,
                open_client(url, key="sk-a") as client,
            ):
                responses = await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=chat_body()) for _ in range(8))
                )
            await wait_until(lambda: leader.scheduler.statistics().in_flight == 0, timeout_s=10)
    placed = collections.Counter(r.headers["x-fair-sched-deployment"] for r in responses)
    foreign = [r for r in responses if r.headers["x-fair-sched-deployment"] not in theirs]
    assert foreign, placed
    assert {r.status_code for r in foreign} == {502}
    assert all("does not serve" in r.json()["error"]["message"] for r in foreign)
    assert all(r.status_code == 200 for r in responses if r not in foreign)
    # Each engine received exactly what was bound to it (nothing re-routed to A).
    received = {f"{emu.base_url}/v1": len(emu.engine.received) for emu in (a, b, c)}
    assert {k: n for k, n in received.items() if n} == {
        k: n for k, n in placed.items() if k in theirs
    }
