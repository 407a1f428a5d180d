"""A hostile follower on a real redis-server: messages with a 400-digit cost or token count, a
NaN, negative values, JSON nested too deeply, pushed into the leader's inbox as a follower sends
them. Before: a 400-digit `tokens_used` in a lease's end made the core's charge raise
OverflowError in the leader's inbox loop, which ended it: the leader kept renewing its lease
and every follower's request waited for good. Now each is refused where it is read, the log
names the field, and the leader keeps serving: a lease whose end carried garbage still ends.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import redis.asyncio as redis_asyncio

from fair_sched_plugin.state import ReplicaScheduler
from fair_sched_plugin.testing import make_ticket

from .conftest import RedisServer
from .test_replicas import Cluster, pair

pytestmark = pytest.mark.redis

HUGE = "9" * 400  # written into the JSON as digits


def raw_messages(follower: ReplicaScheduler, tid: int) -> list[str]:
    """What a hostile follower pushes: each message out of range in one field."""
    head = f"{follower._epoch}, {follower._session}, {json.dumps(follower.replica)}"
    ticket = '"m", "X", "interactive"'
    return [
        f'["s", {head}, 900, {ticket}, 1.0, {HUGE}, [], 0.0]',  # cost
        f'["s", {head}, 901, {ticket}, NaN, 5, [], 0.0]',  # weight
        f'["s", {head}, 902, {ticket}, 1.0, -5, [], 0.0]',  # cost
        f'["s", {head}, 903, {ticket}, 1.0, 5, [], {HUGE}]',  # price
        f'["s", {head}, 904, {ticket}, 1.0, 5, [], NaN]',  # price
        f'["a", {head}, 905, {ticket}, 1.0, {HUGE}, [], true, null, 0.0]',  # adopted cost
        f'["$", {head}, 0, "X", -1.0, 10]',  # spend usd
        f'["$", {head}, 0, "X", 1.0, {HUGE}]',  # spend tokens
        f'["p", {head}, {HUGE}]',  # nonce
        f'["c", {HUGE}, 0, "f", 1]',  # epoch
        "[" * 100_000,  # nested too deeply
        # The follower's own lease ends with a 400-digit token count and a NaN cost.
        f'["e", {head}, {tid}, {HUGE}, false, NaN]',
    ]


async def test_hostile_messages_are_refused_and_the_leader_keeps_serving(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = Cluster(redis_server.url)
    raw = redis_asyncio.Redis.from_url(redis_server.url)
    try:
        leader, follower = await pair(cluster, fairness="tokens")
        lease = await asyncio.wait_for(follower.acquire(make_ticket("A", cost=10)), 10)
        assert leader.statistics().in_flight == 1
        with caplog.at_level(logging.WARNING, logger="fair_sched"):
            await raw.rpush(cluster.prefix + "inbox", *raw_messages(follower, lease.lease_id))
            await asyncio.wait_for(follower.barrier(), 10)
            # Another principal is served, through the follower and on the leader: the cap
            # of one is free again (the garbage end still ended A's lease).
            other = await asyncio.wait_for(follower.acquire(make_ticket("B", cost=10)), 10)
            other.release(12)
            await asyncio.wait_for(follower.barrier(), 10)
            mine = await asyncio.wait_for(leader.acquire(make_ticket("C", cost=10)), 10)
            mine.release(12)
        stats = leader.statistics()
        assert (stats.in_flight, stats.queued) == (0, 0)
        assert {user for _, _, user, *_ in leader.core.backlog()} <= {"B", "C"}
        logged = "\n".join(record.getMessage() for record in caplog.records)
        for field in (
            "ticket cost",
            "ticket weight",
            "ticket price",
            "spend usd",
            "spend tokens",
            "id",
            "epoch",
            "nested too deeply",
            "tokens used",
            "cost used",
        ):
            assert field in logged, field
        assert HUGE[:60] not in logged  # named, not repeated
        assert not any(record.exc_info for record in caplog.records)  # no traceback
        lease.release()  # already ended at the leader: nothing more happens there
        await asyncio.wait_for(follower.barrier(), 10)
        assert leader.statistics().in_flight == 0
    finally:
        await raw.aclose()
        await cluster.aclose()
