"""Replicas on a real redis-server: one leader's core decides, followers hand it their tickets.

Heartbeats are short (50 ms, TTL 300 ms) so elections, expiry and recovery happen quickly; every
wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fair_sched_plugin.core import InflightLimitGate, Lease, TierLimits, estimate_position
from fair_sched_plugin.errors import QueueFull, QueueTimeout, StateStoreError
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.state import ReplicaScheduler, open_state
from fair_sched_plugin.state.redis_replica import RedisReplica
from fair_sched_plugin.state.wire import read_reply
from fair_sched_plugin.testing import ManualGate, make_ticket

from ..support import eventually
from .conftest import RedisServer, unique_prefix, vanish

pytestmark = pytest.mark.redis

TIERS = (TierLimits("interactive", waiting_below=3), TierLimits("batch", waiting_below=1))
HEARTBEAT_S = 0.05
TTL_S = 0.3


class Cluster:
    """Replicas on one Redis prefix, each over its own core with an in-flight cap."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = unique_prefix()
        self.replicas: list[ReplicaScheduler] = []

    def add(
        self, cap: int = 1, name: str | None = None, gate: Any = None, **core: Any
    ) -> ReplicaScheduler:
        replica = open_state(
            self.url,
            FairScheduler(TIERS, gate or InflightLimitGate(cap), **core),
            prefix=self.prefix,
            heartbeat_s=HEARTBEAT_S,
            lease_ttl_s=TTL_S,
            replica=name or f"r{len(self.replicas)}",
        )
        replica.start()
        self.replicas.append(replica)
        return replica

    async def leader(self) -> ReplicaScheduler:
        await eventually(lambda: sum(r.leading for r in self.replicas) == 1)
        leader = next(r for r in self.replicas if r.leading)
        await eventually(
            lambda: all(
                r.state_statistics().leader == leader.replica
                for r in self.replicas
                if r.mode == "shared"
            )
        )
        return leader

    async def aclose(self) -> None:
        await asyncio.gather(*(asyncio.wait_for(r.aclose(), 10) for r in self.replicas))


@pytest.fixture
async def cluster(redis_server: RedisServer) -> AsyncIterator[Cluster]:
    opened = Cluster(redis_server.url)
    yield opened
    await opened.aclose()


async def pair(cluster: Cluster, **core: Any) -> tuple[ReplicaScheduler, ReplicaScheduler]:
    """A leader (started first) and a follower."""
    leader = cluster.add(**core)
    await eventually(lambda: leader.leading)
    follower = cluster.add(**core)
    assert await cluster.leader() is leader
    return leader, follower


async def test_memory_is_its_own_leader_with_no_background_task() -> None:
    replica = open_state("memory://", FairScheduler(TIERS, InflightLimitGate(1)))
    replica.start()
    lease = replica.try_acquire(make_ticket("A"))
    assert lease is not None
    parked = asyncio.ensure_future(replica.acquire(make_ticket("B")))
    await asyncio.sleep(0)
    assert replica.statistics().queued == 1
    lease.release()
    (await asyncio.wait_for(parked, 5)).release()
    assert replica.statistics().completed_total == 2
    assert replica.state_statistics().leader == replica.replica
    await replica.aclose()


async def test_one_leader_decides_round_robin_across_replicas(cluster: Cluster) -> None:
    leader, follower = await pair(cluster)
    holder = await leader.acquire(make_ticket("X"))
    order: list[str] = []

    async def request(replica: ReplicaScheduler, user: str) -> Lease:
        lease = await replica.acquire(make_ticket(user))
        order.append(user)
        return lease

    tasks = [asyncio.ensure_future(request(leader, "A")) for _ in range(3)]
    await follower.barrier()
    tasks += [asyncio.ensure_future(request(follower, "B")) for _ in range(2)]
    await follower.barrier()
    assert leader.statistics().queued == 5
    holder.release()
    for expected in range(1, 6):
        await eventually(lambda n=expected: len(order) == n)  # type: ignore[misc]
        next(t.result() for t in tasks if t.done() and t.result().active).release()
    assert order == ["A", "B", "A", "B", "A"]
    await follower.barrier()
    assert leader.statistics().in_flight == 0
    assert leader.core.statistics().completed_total == 6


async def test_without_blmpop_as_on_redis_6(cluster: Cluster) -> None:
    """Redis 6 has no BLMPOP: BLPOP, then the rest of the list in one transaction."""
    leader, follower = await pair(cluster)
    for replica in (leader, follower):
        assert replica._link is not None
        replica._link._blmpop = False
    holder = await follower.acquire(make_ticket("A"))
    parked = [asyncio.ensure_future(follower.acquire(make_ticket(user))) for user in "BCD"]
    await follower.barrier()
    assert leader.statistics().queued == 3
    holder.release()
    for task in parked:
        (await asyncio.wait_for(task, 5)).release()
    await follower.barrier()
    assert leader.statistics().completed_total == 4


async def test_followers_status_is_the_leaders_document(cluster: Cluster) -> None:
    leader, follower = await pair(cluster)
    held = await follower.acquire(make_ticket("A"))
    parked = asyncio.ensure_future(follower.acquire(make_ticket("B")))
    await follower.barrier()
    await eventually(
        lambda: follower.statistics().in_flight == 1 and follower.statistics().queued == 1
    )
    stats = follower.state_statistics()
    assert (stats.mode, stats.leader, stats.replicas_alive) == ("shared", leader.replica, 2)
    assert follower.statistics().queued_by_model_tier == {("m", "interactive"): 1}
    held.release()
    (await asyncio.wait_for(parked, 5)).release()


async def test_positions_come_from_counts_on_the_leader_and_on_a_follower(
    cluster: Cluster,
) -> None:
    """`position_estimate` and `queued_of` (O(log n)) answer what `estimate_position` answers
    over `backlog(model)`: the leader's whole queue on the leader, a follower's own parked
    requests on a follower (the leader holds the rest); also after requests leave."""
    leader, follower = await pair(cluster)
    holder = await leader.acquire(make_ticket("X"))
    tasks = [asyncio.ensure_future(leader.acquire(make_ticket(user))) for user in "AAB"]
    tasks += [
        asyncio.ensure_future(follower.acquire(make_ticket(user, tier=tier)))
        for user, tier in [("A", "interactive"), ("C", "batch"), ("C", "interactive")]
    ]
    await follower.barrier()
    await eventually(lambda: leader.statistics().queued == 6)
    tiers = [tier.name for tier in TIERS]

    def agree(replica: ReplicaScheduler) -> None:
        backlog = replica.backlog("m")
        for row in backlog:
            assert replica.queued_of("m", row.tier, row.user) == row.depth
        for tier in tiers:
            for user in "ABCD":
                for k in (1, 2, 3):
                    expected = estimate_position(k, user, tier, backlog, tiers)
                    assert replica.position_estimate("m", tier, user, k) == expected

    for replica in (leader, follower):
        agree(replica)
    assert follower.position_estimate("m", "batch", "C", 1) == 3  # its own two interactive
    assert leader.position_estimate("m", "batch", "C", 1) == 6
    tasks[-1].cancel()
    await asyncio.gather(tasks[-1], return_exceptions=True)
    await follower.barrier()
    agree(follower)
    assert follower.position_estimate("m", "batch", "C", 1) == 2
    holder.release()
    pending = set(tasks[:-1])
    while pending:  # one in flight at a time, in the leader's order
        done, pending = await asyncio.wait(pending, timeout=5, return_when="FIRST_COMPLETED")
        assert done
        for task in done:
            task.result().release()
    await follower.barrier()
    agree(follower)
    assert follower.queued_of("m", "interactive", "A") == 0


async def test_queue_full_comes_back_from_the_leader(cluster: Cluster) -> None:
    _, follower = await pair(cluster, max_per_user=1)
    holder = await follower.acquire(make_ticket("A"))
    parked = asyncio.ensure_future(follower.acquire(make_ticket("A")))
    await follower.barrier()
    with pytest.raises(QueueFull):
        await asyncio.wait_for(follower.acquire(make_ticket("A")), 5)
    holder.release()
    (await asyncio.wait_for(parked, 5)).release()


async def test_queue_timeout_comes_back_from_the_leader(cluster: Cluster) -> None:
    _, follower = await pair(cluster, max_wait_s=0.05)
    holder = await follower.acquire(make_ticket("A"))
    with pytest.raises(QueueTimeout):
        await asyncio.wait_for(follower.acquire(make_ticket("B")), 5)
    holder.release()


async def test_cancel_while_parked_leaves_the_leaders_queue(cluster: Cluster) -> None:
    leader, follower = await pair(cluster)
    holder = await follower.acquire(make_ticket("A"))
    parked = asyncio.ensure_future(follower.acquire(make_ticket("B")))
    await follower.barrier()
    assert leader.statistics().queued == 1
    parked.cancel()
    await asyncio.gather(parked, return_exceptions=True)
    await follower.barrier()
    assert leader.statistics().queued == 0
    assert leader.statistics().cancelled_total == 1
    holder.release()
    await follower.barrier()
    assert leader.statistics().in_flight == 0


async def test_granted_on_the_leader_while_the_follower_cancels(cluster: Cluster) -> None:
    """Race: the leader grants B while B's task is being cancelled at the follower (the grant
    on its way through Redis, the cancel on its way back). The follower hands the grant back
    unused; C gets the slot; nothing leaks."""
    leader, follower = await pair(cluster)
    holder = await follower.acquire(make_ticket("A"))
    parked = asyncio.ensure_future(follower.acquire(make_ticket("B")))
    waiting = asyncio.ensure_future(follower.acquire(make_ticket("C")))
    await follower.barrier()
    holder.release()  # the leader grants B ...
    parked.cancel()  # ... while B goes away
    await asyncio.gather(parked, return_exceptions=True)
    lease = await asyncio.wait_for(waiting, 5)
    assert lease.ticket.user == "C"
    await follower.barrier()
    stats = leader.statistics()
    assert (stats.in_flight, stats.queued) == (1, 0)
    assert stats.abandoned_total + stats.cancelled_total == 1
    lease.release()


async def test_granted_then_cancelled_before_the_task_ran(cluster: Cluster) -> None:
    """Race: the grant resolves B's future, then B's task is cancelled before it runs. The
    lease is abandoned (the next request gets the slot), never leaked."""
    leader, follower = await pair(cluster)
    holder = await follower.acquire(make_ticket("A"))
    parked = asyncio.ensure_future(follower.acquire(make_ticket("B")))
    waiting = asyncio.ensure_future(follower.acquire(make_ticket("C")))
    await follower.barrier()
    on_reply = follower._on_reply

    def reply_then_cancel(reply: Any) -> None:
        on_reply(reply)
        if reply[0] == "g":
            parked.cancel()

    follower._on_reply = reply_then_cancel  # type: ignore[method-assign]
    holder.release()
    await asyncio.gather(parked, return_exceptions=True)
    follower._on_reply = on_reply  # type: ignore[method-assign]
    lease = await asyncio.wait_for(waiting, 5)
    assert lease.ticket.user == "C"
    await follower.barrier()
    assert leader.statistics().abandoned_total == 1
    lease.release()


async def test_a_grant_carries_the_engine_rank_where_the_engine_orders_users(
    cluster: Cluster,
) -> None:
    """With `fair_engine_queue` the priority a follower sends counts its user's requests not
    yet streaming on every replica: the deciding core's count travels with the grant."""
    leader = cluster.add(gate=ManualGate(is_open=True, newcomers=True))
    await eventually(lambda: leader.leading)
    follower = cluster.add(gate=ManualGate(is_open=True, newcomers=True))
    assert await cluster.leader() is leader
    mine = [await follower.acquire(make_ticket("A")) for _ in range(2)]
    on_leader = await leader.acquire(make_ticket("A"))
    mine.append(await follower.acquire(make_ticket("A")))
    assert [lease.engine_rank for lease in mine] == [0, 1, 3]
    assert on_leader.engine_rank == 2
    assert (await follower.acquire(make_ticket("B"))).engine_rank == 0


def test_grants_without_a_rank_or_a_deployment_are_read_as_rank_0() -> None:
    """Only a grant in user order carries the rank (a follower older than the field would
    drop it); an older leader's grant has no deployment either."""
    assert read_reply(json.dumps(["g", 1, 0, 7, 1.0, "http://a/v1", 4])) == (
        "g",
        1,
        0,
        7,
        1.0,
        "http://a/v1",
        4,
    )
    assert read_reply(json.dumps(["g", 1, 0, 7, 1.0, "http://a/v1"]))[-1] == 0
    assert read_reply(json.dumps(["g", 1, 0, 7, 1.0])) == ("g", 1, 0, 7, 1.0, None, 0)
    assert read_reply(json.dumps(["g", 1, 0, 7, 1.0, None, -1])) is None
    assert read_reply(json.dumps(["g", 1, 0, 7, 1.0, None, True])) is None


async def test_a_deposed_leader_cannot_grant(cluster: Cluster, redis_server: RedisServer) -> None:
    """Fencing: once the lease names another epoch, the old leader's grants are refused by
    Redis and it steps down."""
    leader, follower = await pair(cluster)
    link = leader._link
    assert link is not None and leader._token is not None
    token = leader._token
    # Someone else takes the lease (as after a network partition of the old leader).
    await link._redis.set(link.leader_key, "999:elsewhere", px=5000)
    assert not await link.deliver(token, {follower.replica: [json.dumps(["g", 1, 0, 1, 1.0])]})
    assert await link._redis.llen(link.replies_key(follower.replica)) == 0
    await eventually(lambda: not leader.leading)
    await link._redis.delete(link.leader_key)
    await cluster.leader()


async def test_a_stale_grant_of_an_earlier_epoch_is_ignored(cluster: Cluster) -> None:
    """Race: a grant written by the previous leader reaches the follower after it re-sent its
    ticket to the new leader. Only the current epoch's grant is used: one lease, never two."""
    leader, follower = await pair(cluster)
    holder = await follower.acquire(make_ticket("A"))
    parked = asyncio.ensure_future(follower.acquire(make_ticket("B")))
    await follower.barrier()
    tid = max(follower._parked)
    follower._on_reply(("g", follower._epoch - 1, follower._session, tid, 1.0, None))
    assert not parked.done()
    holder.release()
    lease = await asyncio.wait_for(parked, 5)
    await follower.barrier()
    assert leader.statistics().in_flight == 1
    lease.release()


async def test_leader_killed_new_leader_adopts_leases_and_parked_tickets(
    cluster: Cluster,
) -> None:
    """Failover: the leader dies without a handover; within the TTL another replica leads, the
    follower's running lease is adopted (still counted) and its parked ticket is granted once."""
    old, follower = await pair(cluster)
    third = cluster.add()
    await cluster.leader()
    held = await follower.acquire(make_ticket("A"))
    parked = asyncio.ensure_future(follower.acquire(make_ticket("B")))
    await follower.barrier()
    await vanish(old)
    # A new leader, once (the bound only ends a hung wait; how soon is Redis's TTL).
    await eventually(lambda: follower.leading or third.leading, timeout_s=5)
    new = follower if follower.leading else third
    await eventually(lambda: follower.state_statistics().leader == new.replica)
    await follower.barrier()
    assert new.statistics().in_flight == 1  # A's lease, adopted
    assert new.statistics().queued == 1  # B, re-sent
    assert not parked.done()
    held.release()
    lease = await asyncio.wait_for(parked, 5)
    await follower.barrier()
    assert new.statistics().in_flight == 1
    lease.release()
    assert not (follower.leading and third.leading)


async def test_leader_closing_hands_over_at_once(cluster: Cluster) -> None:
    old, follower = await pair(cluster)
    lease = await asyncio.wait_for(follower.acquire(make_ticket("A")), 5)
    await old.aclose()
    cluster.replicas.remove(old)
    await eventually(lambda: follower.leading, timeout_s=5)
    assert follower.statistics().in_flight == 1
    lease.release()
    assert follower.statistics().in_flight == 0


async def test_a_silent_followers_leases_are_freed_within_the_ttl(cluster: Cluster) -> None:
    leader, victim = await pair(cluster)
    await victim.acquire(make_ticket("A"))  # holds the only slot, never released
    parked = asyncio.ensure_future(leader.acquire(make_ticket("B")))
    await asyncio.sleep(0)
    await vanish(victim)
    lease = await asyncio.wait_for(parked, 10 * TTL_S + 5)
    assert lease.ticket.user == "B"
    lease.release()


async def test_redis_outage_falls_back_locally_then_rejoins(
    own_redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = Cluster(own_redis_server.url)
    try:
        leader, follower = await pair(cluster)
        holder = await follower.acquire(make_ticket("A"))
        parked = asyncio.ensure_future(follower.acquire(make_ticket("B")))
        await follower.barrier()
        with caplog.at_level(logging.WARNING, logger="fair_sched"):
            own_redis_server.stop()
            await eventually(lambda: follower.mode == "local" and leader.mode == "local")
            # The follower's own core now decides: A's lease was adopted (its cap of 1 is
            # taken), so B waits for it.
            assert follower.statistics().in_flight == 1
            assert not parked.done()
            holder.release()
            lease = await asyncio.wait_for(parked, 5)
            assert follower.state_statistics().fallbacks_total == 1
            assert any("falls back to in-memory" in r.getMessage() for r in caplog.records)
            own_redis_server.start()
            await eventually(lambda: follower.mode == "shared" and leader.mode == "shared", 10)
            await cluster.leader()
        assert follower.state_statistics().recoveries_total == 1
        deciding = leader if leader.leading else follower
        await follower.barrier()
        await leader.barrier()
        await eventually(lambda: deciding.statistics().in_flight == 1)  # B's lease, re-counted
        lease.release()
        await follower.barrier()
        assert deciding.statistics().in_flight == 0
    finally:
        with contextlib.suppress(Exception):
            await cluster.aclose()


def own_pair(
    server: RedisServer, *, heartbeat_s: float, lease_ttl_s: float
) -> list[ReplicaScheduler]:
    """Two replicas r0 and r1 (not started) with an in-flight cap of 1 on `server`."""
    prefix = unique_prefix()
    return [
        open_state(
            server.url,
            FairScheduler(TIERS, InflightLimitGate(1)),
            prefix=prefix,
            heartbeat_s=heartbeat_s,
            lease_ttl_s=lease_ttl_s,
            replica=f"r{index}",
        )
        for index in range(2)
    ]


async def test_a_leader_after_redis_lost_its_data_holds_like_any_later_leader(
    own_redis_server: RedisServer,
) -> None:
    """Race: Redis restarted without persistence counts epochs from 1 again, and the replica
    that led first after the outage took epoch 1 for a fresh cluster: it granted at once, at the
    whole threshold, while the others still spent their local shares for up to a heartbeat (the
    engine's queue went one over in test_redis_stopped_mid_flood_each_replica_spends_its_share).
    Now any leader but the first of a fresh cluster holds new grants for a heartbeat."""
    # A heartbeat of 0.5 s: the hold, long enough to look at it.
    replicas = own_pair(own_redis_server, heartbeat_s=0.5, lease_ttl_s=1.5)
    try:
        for replica in replicas:
            replica.start()
        await eventually(lambda: any(r.leading for r in replicas), 10)
        first = next(r for r in replicas if r.leading)
        lease = first.try_acquire(make_ticket("A"))  # a fresh cluster's first leader: no hold
        assert lease is not None
        lease.release()
        own_redis_server.stop()
        await eventually(lambda: all(r.mode == "local" for r in replicas), 10)
        own_redis_server.start()  # empty: the next election takes epoch 1
        await eventually(lambda: any(r.leading for r in replicas), 10)
        leader = next(r for r in replicas if r.leading)
        assert leader.try_acquire(make_ticket("A")) is None  # holding
        lease = await asyncio.wait_for(leader.acquire(make_ticket("A")), 5)
        lease.release()
    finally:
        await asyncio.gather(*(asyncio.wait_for(r.aclose(), 10) for r in replicas))


async def test_back_from_an_outage_a_replica_keeps_its_share_until_the_others_are_back(
    own_redis_server: RedisServer,
) -> None:
    """After an outage each replica must not take the whole threshold back as it rejoins. The
    first leader's hold ends whether or not the others have rejoined, and one still local keeps
    spending its share beside it (which put the engine's queue one over the threshold). The share
    stays until each replica it shared with has sent the leader's term a message."""
    # The wait for the others: a hold (a heartbeat, 0.1 s) and a lease TTL (3 s).
    replicas = own_pair(own_redis_server, heartbeat_s=0.1, lease_ttl_s=3.0)
    late = replicas[1]
    assert isinstance(late, RedisReplica) and late._link is not None
    beat = late._link.beat
    cut_off = True

    async def beat_unless_cut_off() -> Any:
        if cut_off:
            raise StateStoreError("still cut off from Redis")
        return await beat()

    try:
        for replica in replicas:
            replica.start()
        # Safety nets, not measures: a CPU-starved parallel phase can take more than 10 s.
        await eventually(lambda: any(r.leading for r in replicas), 30)
        await eventually(lambda: all(r.alive_replicas == ("r0", "r1") for r in replicas), 30)
        own_redis_server.stop()
        await eventually(lambda: all(r.mode == "local" for r in replicas), 10)
        assert all(r.local_sharers == 2 for r in replicas)
        late._link.beat = beat_unless_cut_off  # type: ignore[method-assign]
        own_redis_server.start()
        first = replicas[0]
        await eventually(lambda: first.leading, 10)
        assert first.local_sharers == 2  # r1 may still spend its share
        parked = asyncio.ensure_future(late.acquire(make_ticket("B")))
        cut_off = False
        await eventually(lambda: late.mode == "shared" and first.local_sharers == 1, 10)
        (await asyncio.wait_for(parked, 10)).release()
    finally:
        await asyncio.gather(*(asyncio.wait_for(r.aclose(), 10) for r in replicas))


async def test_a_leader_back_from_a_brief_fallback_leads_a_new_epoch(cluster: Cluster) -> None:
    """A leader whose Redis call failed once falls back to a local term and is back before its
    lease's TTL. It led the same epoch again, which the followers already followed: they
    re-sent nothing, a ticket they had parked in its ended term waited for good, and their
    grants on the way to the engine went uncounted. It now resigns that lease, and
    every replica re-sends to the next epoch's leader."""
    first, second = cluster.add(), cluster.add()
    leader = await cluster.leader()
    follower = second if leader is first else first
    assert isinstance(leader, RedisReplica)
    held = await asyncio.wait_for(leader.acquire(make_ticket("A")), 10)  # the cap is 1
    parked = asyncio.ensure_future(follower.acquire(make_ticket("B")))
    await eventually(lambda: leader.statistics().queued == 1)
    epoch = leader._epoch
    leader._store_failed(StateStoreError("a read failed once"))
    await eventually(lambda: leader.mode == "shared" and any(r.leading for r in cluster.replicas))
    held.release()
    (await asyncio.wait_for(parked, 10)).release()
    assert max(r._epoch for r in cluster.replicas if isinstance(r, RedisReplica)) > epoch


def _as_before_placement(message: list[Any]) -> list[Any]:
    """A follower message as a replica of the version before placement wrote it: tickets
    without `prefix`, adopted leases without their deployment."""
    if message[0] == "s":
        return message[:10]
    if message[0] == "a":
        return [*message[:10], message[11]]
    return message


async def test_an_older_leaders_grant_without_a_deployment_is_used(cluster: Cluster) -> None:
    """Rolling upgrade: a leader of the version before placement grants `["g", epoch, session,
    tid, charged]`. Before: the follower skipped it as malformed, its request stayed parked
    until its wait ran out, and the leader counted the lease in flight for good."""
    leader, follower = await pair(cluster)
    assert leader._term is not None
    reply = leader._term._reply

    def older_reply(replica: str, message: Any) -> None:
        reply(replica, message[:5] if message[0] == "g" else message)

    leader._term._reply = older_reply
    lease = await asyncio.wait_for(follower.acquire(make_ticket("A")), 5)
    assert lease.deployment is None
    lease.release()
    await follower.barrier()
    stats = leader.statistics()
    assert (stats.in_flight, stats.completed_total) == (0, 1)


async def test_an_older_followers_tickets_and_adopted_leases_are_accepted(
    cluster: Cluster,
) -> None:
    """Rolling upgrade: a follower of the version before placement sends 5-field tickets and
    adopted leases without a deployment. Before: the leader skipped both as malformed (the
    request waited out its limit; an adopted lease was not counted, so the cap was exceeded)."""
    leader, follower = await pair(cluster)
    send = follower._send
    follower._send = lambda message: send(_as_before_placement(message))  # type: ignore[method-assign]
    lease = await asyncio.wait_for(follower.acquire(make_ticket("A")), 5)
    await follower.barrier()
    assert leader.statistics().in_flight == 1
    lease.release()
    await follower.barrier()
    assert leader.statistics().in_flight == 0
    # A lease an older replica reports to a new leader (what it re-sends after a failover).
    adopted = ["a", follower._epoch, follower._session, follower.replica, 10_000]
    follower._send([*adopted, "m", "B", "interactive", 1.0, 1, [], True, None])
    await follower.barrier()
    assert leader.statistics().in_flight == 1
    assert follower.try_acquire(make_ticket("C")) is None  # the cap of one holds
    follower._send(["e", follower._epoch, follower._session, follower.replica, 10_000, -1, True])
    await follower.barrier()
    assert leader.statistics().in_flight == 0
