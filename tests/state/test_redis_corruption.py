"""Garbage in each Redis key the replicas share, on a real redis-server.

Before: a corrupt value made a replica flap between shared and local every heartbeat (an epoch
that INCR refuses: every election failed, the next heartbeat rejoined), kill its reply listener
(a reply that is not JSON), or follow a leader that never answers (a token without a TTL). Now
each corrupt value is logged once with its key's name, replaced or skipped (every key holds only
the replicas' own transient state), and the replicas keep scheduling: a cap of one is never
exceeded, and nothing is granted without the deciding core.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from fair_sched_plugin.state import ReplicaScheduler
from fair_sched_plugin.testing import make_ticket, settle

from .conftest import RedisServer, heartbeats
from .test_replicas import Cluster, eventually, pair

pytestmark = pytest.mark.redis

NON_UTF8 = b"\xff\xfe\x80 not utf-8"
HUGE = b"9" * 2_000_000  # digits: also what a careless parser would take for an epoch
# How many heartbeats the replicas run on a corrupt value before the checks (counted, not slept:
# `heartbeats`).
HEARTBEATS = 5

Write = Callable[[redis_asyncio.Redis, str, ReplicaScheduler], Any]


async def _hash(client: redis_asyncio.Redis, key: str) -> None:
    async with client.pipeline(transaction=True) as replace:  # a replica may write in between
        replace.delete(key)
        replace.hset(key, "x", "1")
        await replace.execute()


async def _list(client: redis_asyncio.Redis, key: str, *values: bytes) -> None:
    async with client.pipeline(transaction=True) as replace:
        replace.delete(key)
        replace.rpush(key, *values)
        await replace.execute()


# (key suffix, what is written). The reply list is the follower's.
CASES: dict[str, tuple[str, Write]] = {
    "leader wrong type": ("leader", lambda c, k, f: _list(c, k, b"x")),
    "leader not utf-8": ("leader", lambda c, k, f: c.set(k, NON_UTF8)),
    "leader bad format": ("leader", lambda c, k, f: c.set(k, b"not-a-token")),
    "leader huge": ("leader", lambda c, k, f: c.set(k, HUGE)),
    "leader without ttl": ("leader", lambda c, k, f: c.set(k, b"999:ghost")),
    "epoch wrong type": ("epoch", lambda c, k, f: _hash(c, k)),
    "epoch not utf-8": ("epoch", lambda c, k, f: c.set(k, NON_UTF8)),
    "epoch bad format": ("epoch", lambda c, k, f: c.set(k, b"1.5")),
    "epoch huge": ("epoch", lambda c, k, f: c.set(k, HUGE)),
    "inbox wrong type": ("inbox", lambda c, k, f: c.set(k, b"x")),
    "inbox not utf-8": ("inbox", lambda c, k, f: _list(c, k, NON_UTF8)),
    "inbox bad messages": (
        "inbox",
        lambda c, k, f: _list(c, k, b"{}", b"[1]", b'["s", 1, 0, "r9", 1, 5, "u", "t", 1, 1]'),
    ),
    "inbox huge": ("inbox", lambda c, k, f: _list(c, k, HUGE)),
    "replicas wrong type": ("replicas", lambda c, k, f: c.set(k, b"x")),
    "replicas not utf-8": ("replicas", lambda c, k, f: c.zadd(k, {NON_UTF8: 1e15})),
    "replicas huge": ("replicas", lambda c, k, f: c.zadd(k, {HUGE: 1e15})),
    "stats wrong type": ("stats", lambda c, k, f: _list(c, k, b"x")),
    "stats not utf-8": ("stats", lambda c, k, f: c.set(k, NON_UTF8)),
    "stats bad format": ("stats", lambda c, k, f: c.set(k, b'{"scheduler": 1, "gate": 2}')),
    "stats huge": ("stats", lambda c, k, f: c.set(k, HUGE)),
    "replies wrong type": ("r:", lambda c, k, f: c.set(k + f.replica, b"x")),
    "replies not utf-8": ("r:", lambda c, k, f: _list(c, k + f.replica, NON_UTF8)),
    "replies bad format": (
        "r:",
        lambda c, k, f: _list(c, k + f.replica, b"{}", b'["g", "x"]', b'["g", 1, 0, 1, "y"]'),
    ),
    "replies huge": ("r:", lambda c, k, f: _list(c, k + f.replica, HUGE)),
}


async def schedules_with_a_cap_of_one(
    follower: ReplicaScheduler, raw: redis_asyncio.Redis, cluster: Cluster
) -> None:
    """Two requests at the follower: the second waits for the first (the cap is 1)."""
    first = await asyncio.wait_for(follower.acquire(make_ticket("A")), 10)
    second = asyncio.ensure_future(follower.acquire(make_ticket("B")))
    # A few heartbeats, then every reply the leader sent has arrived: still parked.
    await heartbeats(raw, len(cluster.replicas), 3)
    await follower.barrier()
    await settle()
    assert not second.done()
    first.release()
    (await asyncio.wait_for(second, 10)).release()


@pytest.mark.parametrize("case", list(CASES))
async def test_a_corrupt_value_is_named_and_does_not_stop_scheduling(
    case: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    suffix, write = CASES[case]
    cluster = Cluster(redis_server.url)
    raw = redis_asyncio.Redis.from_url(redis_server.url)
    key = cluster.prefix + suffix
    try:
        leader, follower = await pair(cluster)
        await schedules_with_a_cap_of_one(follower, raw, cluster)
        with caplog.at_level(logging.WARNING, logger="fair_sched"):
            # Written a few times: the leader rewrites `stats` every heartbeat.
            for _ in range(3):
                await write(raw, key, follower)
                if suffix == "epoch":
                    await raw.delete(cluster.prefix + "leader")  # an election reads the epoch
                await heartbeats(raw, len(cluster.replicas), 1)
            await heartbeats(raw, len(cluster.replicas), HEARTBEATS)
            await eventually(lambda: all(r.mode == "shared" for r in cluster.replicas), 10)
            deciding = await cluster.leader()
            await schedules_with_a_cap_of_one(follower, raw, cluster)
            await schedules_with_a_cap_of_one(leader, raw, cluster)
            errors = [r.state_statistics().store_errors_total for r in cluster.replicas]
            await heartbeats(
                raw, len(cluster.replicas), HEARTBEATS
            )  # and no error comes back every heartbeat
            assert [r.state_statistics().store_errors_total for r in cluster.replicas] == errors
        for replica in cluster.replicas:
            assert replica.state_statistics().fallbacks_total <= 1, replica.replica
        named = [r.getMessage() for r in caplog.records if key in r.getMessage()]
        assert named, [r.getMessage() for r in caplog.records]
        assert not any(record.exc_info for record in caplog.records)  # no traceback
        assert deciding.statistics().in_flight == 0
    finally:
        await raw.delete(*(cluster.prefix + name for name in ("leader", "epoch", "inbox")))
        await raw.aclose()
        await cluster.aclose()


async def test_a_redis_error_names_the_server_without_its_password() -> None:
    """Before: a failed Redis call's error (logged, and in the replica's state) quoted the whole
    `state` URL, password included."""
    from fair_sched_plugin.errors import StateStoreError
    from fair_sched_plugin.state.redis_link import RedisLink

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    link = RedisLink(f"redis://:pw-LEAKCHECK-41aa@127.0.0.1:{port}/0", "r1", timeout_s=1.0)
    try:
        with pytest.raises(StateStoreError) as failed:
            await link.load_budgets()
    finally:
        await link.aclose()
    assert f"redis://127.0.0.1:{port}/0" in str(failed.value)
    assert "LEAKCHECK" not in str(failed.value)
