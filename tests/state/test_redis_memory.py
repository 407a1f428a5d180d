"""Redis holds no per-user or per-model state: rotating one-shot identities leave its key count
and memory where they were (the leader's core forgets idle users past 10,000 per tier)."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from fair_sched_plugin.core import InflightLimitGate, Ticket, TierLimits
from fair_sched_plugin.core.queues import MAX_IDLE_USERS_REMEMBERED
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.state import ReplicaScheduler, open_state

from .conftest import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TIERS = (TierLimits("interactive"),)
IDENTITIES = 50_000
BATCH = 500


async def one_shot_identities(replica: ReplicaScheduler, start: int, count: int) -> None:
    """`count` new users, one request each, `BATCH` at a time (granted, then ended)."""
    for first in range(start, start + count, BATCH):
        leases = await asyncio.gather(
            *(
                replica.acquire(Ticket("m", f"user-{index}", "interactive"))
                for index in range(first, min(first + BATCH, start + count))
            )
        )
        for lease in leases:
            lease.release()
    await replica.barrier()


async def redis_footprint(client: Redis) -> tuple[int, int]:
    info = await client.info("memory")
    return int(await client.dbsize()), int(info["used_memory"])


async def test_fifty_thousand_one_shot_identities_leave_redis_bounded(
    own_redis_server: RedisServer,
) -> None:
    options = {"prefix": "mem:", "heartbeat_s": 0.2, "lease_ttl_s": 5.0}
    replicas = []
    for name in ("leader", "follower"):
        core = FairScheduler(TIERS, InflightLimitGate(10**6), max_per_user=10, max_total=10**6)
        replica = open_state(own_redis_server.url, core, replica=name, **options)  # type: ignore[arg-type]
        replica.start()
        replicas.append(replica)
        for _ in range(500):
            if replica.state_statistics().leader == "leader":
                break
            await asyncio.sleep(0.01)
    leader, follower = replicas
    client = Redis.from_url(own_redis_server.url)
    try:
        assert leader.leading
        await one_shot_identities(follower, 0, 100)
        before = await redis_footprint(client)
        await one_shot_identities(follower, 100, 4_900)
        at_5k = await redis_footprint(client)
        await one_shot_identities(follower, 5_000, IDENTITIES - 5_000)
        after = await redis_footprint(client)
        keys = sorted(key.decode() for key in await client.keys("*"))
    finally:
        await client.aclose()
        for replica in reversed(replicas):
            await replica.aclose()
    remembered = len(leader.core._models["m"].tiers[0].users)
    print(
        f"\n{IDENTITIES} one-shot identities through redis:// (entering at a follower): "
        f"Redis keys/used_memory before {before}, after 5,000 {at_5k}, after {IDENTITIES:,} "
        f"{after}; keys {keys}; users remembered by the leader's core {remembered}"
    )
    # A few fixed keys (lease, epoch, alive set, statistics, reply lists), never per identity.
    assert after[0] <= 8 and after[0] == at_5k[0]
    # Growth from 5,000 to 50,000 identities is noise (buffers), not a record per identity:
    # even 40 bytes per identity would be 1.8 MB.
    assert after[1] - at_5k[1] < 512 * 1024
    assert remembered <= MAX_IDLE_USERS_REMEMBERED
