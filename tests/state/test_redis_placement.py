"""Placement across replicas (#16): the leader's core binds each request to a deployment, and the
follower that asked holds a lease naming that deployment; a new leader adopts it there."""

from __future__ import annotations

import collections

import pytest

from fair_sched_plugin.identity import Credentials
from fair_sched_plugin.service import SchedulingService

from ..integrations.conftest import MODEL, emulator, fair_config, wait_until
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
                follower.finish(lease)
            await wait_until(lambda: not in_flight_per_deployment(follower))
