"""One contract, two stores: every test runs against `MemoryStore` and `RedisStore`."""

from __future__ import annotations

import asyncio

from fair_sched_plugin.core import Ticket, TierLimits
from fair_sched_plugin.state import Grant, ModelPolicy, SharedSnapshot, StateStore

TIERS = (
    TierLimits("interactive", waiting_below=3, tpot_below_s=0.15),
    TierLimits("batch", waiting_below=1),
)
NOW = 1_000_000.0
R1, R2 = "replica-1", "replica-2"
URL = "http://e/metrics"


def capped(cap: int = 1, **options: object) -> ModelPolicy:
    """No metrics URL: an in-flight cap decides."""
    return ModelPolicy(tiers=TIERS, unknown_max_inflight=cap, **options)  # type: ignore[arg-type]


def gated(**options: object) -> ModelPolicy:
    return ModelPolicy(
        tiers=TIERS,
        metrics_urls=(URL,),
        stale_after_s=5.0,
        arrival_grace_s=0.3,
        **options,
    )  # type: ignore[arg-type]


def ticket(user: str, tier: str = "interactive", weight: float = 1.0, cost: int = 1) -> Ticket:
    return Ticket(model="m", user=user, tier=tier, weight=weight, cost=cost)


def snapshot(started_at: float, waiting: float = 0, tpot_s: float | None = None) -> SharedSnapshot:
    return SharedSnapshot(URL, started_at, waiting, 0.0, tpot_s, None)


async def test_an_open_gate_grants_at_enqueue_to_the_caller(store: StateStore) -> None:
    queued = await store.enqueue(R1, ticket("alice"), capped(), NOW)
    assert queued.ticket_id is not None and queued.full is None
    assert [g.ticket_id for g in queued.grants] == [queued.ticket_id]
    assert queued.grants[0].model == "m" and queued.grants[0].charged == 1.0


async def test_round_robin_order_across_users(store: StateStore) -> None:
    policy = capped(1)
    owner: dict[str, str] = {}
    grants: list[Grant] = []
    for user in ("A", "A", "A", "B", "B"):
        queued = await store.enqueue(R1, ticket(user), policy, NOW)
        assert queued.ticket_id is not None
        owner[queued.ticket_id] = user
        grants += queued.grants
    order = []
    for _ in range(5):
        assert len(grants) == 1
        grant = grants.pop()
        order.append(owner[grant.ticket_id])
        grants += await store.end(
            R1, "m", grant.lease_id, policy, NOW, tokens_used=None, abandoned=False
        )
    assert order == ["A", "B", "A", "B", "A"]
    assert grants == []
    stats = await store.statistics(["interactive", "batch"])
    assert stats.queued == 0 and not stats.in_flight_by_model


async def test_weighted_fairness_follows_weights(store: StateStore) -> None:
    policy = capped(1, fairness="weighted")
    owner: dict[str, str] = {}
    grants: list[Grant] = []
    for _ in range(6):
        for user, weight in (("heavy", 2.0), ("light", 1.0)):
            queued = await store.enqueue(R1, ticket(user, weight=weight), policy, NOW)
            assert queued.ticket_id is not None
            owner[queued.ticket_id] = user
            grants += queued.grants
    order = []
    for _ in range(9):
        grant = grants.pop()
        order.append(owner[grant.ticket_id])
        grants += await store.end(
            R1, "m", grant.lease_id, policy, NOW, tokens_used=None, abandoned=False
        )
    assert order.count("heavy") == 6 and order.count("light") == 3


async def test_a_lower_tier_waits_for_its_stricter_threshold(store: StateStore) -> None:
    policy = gated()
    await store.publish_snapshot(R1, "m", snapshot(NOW), policy, NOW)
    first_batch = await store.enqueue(R1, ticket("bot", "batch"), policy, NOW)
    second_batch = await store.enqueue(R1, ticket("bot", "batch"), policy, NOW)
    assert len(first_batch.grants) == 1 and second_batch.grants == []  # 0 waiting + 1 pending
    granted = [
        len((await store.enqueue(R1, ticket(f"u{i}"), policy, NOW)).grants) for i in range(3)
    ]
    assert granted == [1, 1, 0]  # interactive: waiting + pending < 3
    stats = await store.statistics(["interactive", "batch"])
    assert stats.queued_by_model_tier == {("m", "interactive"): 1, ("m", "batch"): 1}
    assert stats.pending_by_model == {"m": 3} and stats.in_flight_by_model == {"m": 3}


async def test_a_scrape_sent_after_the_grace_settles_pending_credits(store: StateStore) -> None:
    policy = gated()
    await store.publish_snapshot(R1, "m", snapshot(NOW), policy, NOW)
    for i in range(4):
        await store.enqueue(R1, ticket(f"u{i}"), policy, NOW)
    assert (await store.statistics(["interactive"])).queued == 1
    # A scrape sent too soon after the releases proves nothing: the credits stay spent.
    assert await store.publish_snapshot(R1, "m", snapshot(NOW + 0.1), policy, NOW + 0.2) == []
    # One sent after the grace must include them; it says one is still waiting: one more goes.
    grants = await store.publish_snapshot(
        R1, "m", snapshot(NOW + 0.5, waiting=2), policy, NOW + 0.6
    )
    assert len(grants) == 1
    assert (await store.statistics(["interactive"])).pending_by_model == {"m": 1}


async def batch_flood_on_four_free_slots(store: StateStore, policy: ModelPolicy) -> list[Grant]:
    """Capacity 8 seen, then 4 running; ten batch requests arrive: the grants they get."""
    await store.publish_snapshot(R1, "m", SharedSnapshot(URL, NOW, 0, 8.0), policy, NOW)
    await store.publish_snapshot(R1, "m", SharedSnapshot(URL, NOW + 0.1, 0, 4.0), policy, NOW + 0.1)
    grants = []
    for i in range(10):
        grants += (
            await store.enqueue(R1, ticket(f"bot{i}", tier="batch"), policy, NOW + 0.1)
        ).grants
    return grants


async def test_pending_requests_fill_the_free_slots_the_engine_was_seen_to_have(
    store: StateStore,
) -> None:
    """As in core/backpressure.py: capacity is the most seen running; pending requests that will
    find a free slot do not count as queued, and slots taken since the scrape are not free."""
    policy = gated()
    grants = await batch_flood_on_four_free_slots(store, policy)
    # Four fill the free slots, one more may wait (waiting_below 1).
    assert len(grants) == 5
    for grant in grants[:4]:
        assert await store.started(R1, "m", grant.lease_id, policy, NOW + 0.2) == []


async def test_a_first_byte_during_a_scrape_is_not_forgotten_by_it(store: StateStore) -> None:
    """As in core/backpressure.py: a scrape sent before a first byte cannot show that slot taken;
    only a scrape sent after it can."""
    policy = gated()
    grants = await batch_flood_on_four_free_slots(store, policy)
    assert len(grants) == 5
    for grant in grants[:4]:
        assert await store.started(R1, "m", grant.lease_id, policy, NOW + 0.15) == []
    sent_before = SharedSnapshot(URL, NOW + 0.12, 0, 4.0)
    assert await store.publish_snapshot(R1, "m", sent_before, policy, NOW + 0.2) == []
    # Sent after the first bytes: six running, two slots free again.
    sent_after = SharedSnapshot(URL, NOW + 0.3, 0, 6.0)
    assert len(await store.publish_snapshot(R1, "m", sent_after, policy, NOW + 0.35)) == 2


async def test_an_older_scrape_never_replaces_a_newer_one(store: StateStore) -> None:
    policy = gated()
    await store.publish_snapshot(R1, "m", snapshot(NOW, waiting=5), policy, NOW)
    await store.publish_snapshot(R2, "m", snapshot(NOW - 1, waiting=0), policy, NOW)
    assert (await store.enqueue(R1, ticket("u"), policy, NOW)).grants == []


async def test_first_byte_settles_a_pending_credit(store: StateStore) -> None:
    policy = gated()
    await store.publish_snapshot(R1, "m", snapshot(NOW, waiting=2), policy, NOW)
    first = await store.enqueue(R1, ticket("a"), policy, NOW)
    assert len(first.grants) == 1
    queued = await store.enqueue(R1, ticket("b"), policy, NOW)
    assert queued.grants == []
    grants = await store.started(R1, "m", first.grants[0].lease_id, policy, NOW)
    assert [g.ticket_id for g in grants] == [queued.ticket_id]


async def test_slow_tokens_block_the_tier_that_has_a_ceiling(store: StateStore) -> None:
    policy = gated()
    await store.publish_snapshot(R1, "m", snapshot(NOW, tpot_s=0.2), policy, NOW)
    assert (await store.enqueue(R1, ticket("a"), policy, NOW)).grants == []
    assert len((await store.enqueue(R1, ticket("bot", "batch"), policy, NOW)).grants) == 1


async def test_stale_metrics_fall_back_to_the_in_flight_cap(store: StateStore) -> None:
    policy = gated(fallback_max_inflight=2)
    await store.publish_snapshot(R1, "m", snapshot(NOW, waiting=50), policy, NOW)
    later = NOW + 10  # older than stale_after_s
    granted = [
        len((await store.enqueue(R1, ticket(f"u{i}"), policy, later)).grants) for i in range(3)
    ]
    assert granted == [1, 1, 0]


async def test_cancel_a_queued_ticket_and_a_granted_one(store: StateStore) -> None:
    policy = capped(1)
    holder = await store.enqueue(R1, ticket("a"), policy, NOW)
    queued = await store.enqueue(R1, ticket("b"), policy, NOW)
    assert queued.ticket_id is not None and holder.ticket_id is not None
    assert (await store.cancel(R1, queued.ticket_id, NOW)).state == "cancelled"
    assert (await store.cancel(R1, queued.ticket_id, NOW)).state == "gone"
    outcome = await store.cancel(R1, holder.ticket_id, NOW)
    assert outcome.state == "granted" and outcome.lease_id == holder.grants[0].lease_id
    assert outcome.model == "m"
    assert (await store.statistics(["interactive"])).queued == 0


async def test_ending_a_lease_twice_changes_nothing(store: StateStore) -> None:
    policy = capped(1)
    holder = await store.enqueue(R1, ticket("a"), policy, NOW)
    await store.enqueue(R1, ticket("b"), policy, NOW)
    lease_id = holder.grants[0].lease_id
    assert (
        len(await store.end(R1, "m", lease_id, policy, NOW, tokens_used=None, abandoned=False)) == 1
    )
    assert await store.end(R1, "m", lease_id, policy, NOW, tokens_used=None, abandoned=True) == []
    assert (await store.statistics(["interactive"])).in_flight_by_model == {"m": 1}


async def test_an_abandoned_lease_refunds_the_users_charge(store: StateStore) -> None:
    """Abandoned = never used: A's 100-token charge is refunded, so A does not fall behind."""
    policy = capped(1, fairness="tokens")
    a1 = await store.enqueue(R1, ticket("A", cost=100), policy, NOW)
    b1 = await store.enqueue(R1, ticket("B"), policy, NOW)
    b2 = await store.enqueue(R1, ticket("B"), policy, NOW)
    a2 = await store.enqueue(R1, ticket("A"), policy, NOW)
    a3 = await store.enqueue(R1, ticket("A"), policy, NOW)
    grants = await store.end(
        R1, "m", a1.grants[0].lease_id, policy, NOW, tokens_used=None, abandoned=True
    )
    order = []
    for _ in range(4):
        order.append(grants[0].ticket_id)
        grants = await store.end(
            R1, "m", grants[0].lease_id, policy, NOW, tokens_used=None, abandoned=False
        )
    # Without the refund A would sit at 100: B1, B2, A2, A3.
    assert order == [b1.ticket_id, a2.ticket_id, b2.ticket_id, a3.ticket_id]


async def test_token_fairness_corrects_the_estimate_at_the_end(store: StateStore) -> None:
    policy = capped(1, fairness="tokens")
    big = await store.enqueue(R1, ticket("A", cost=1000), policy, NOW)
    a2 = await store.enqueue(R1, ticket("A", cost=10), policy, NOW)
    b1 = await store.enqueue(R1, ticket("B", cost=500), policy, NOW)
    # A's 1000-token estimate turned out to be 10 tokens: A (10) goes before B (0)? No: B is
    # at the tier's virtual time 0 and A at 10, so B first; with no correction A would be at 1000.
    grants = await store.end(
        R1, "m", big.grants[0].lease_id, policy, NOW, tokens_used=10, abandoned=False
    )
    assert [g.ticket_id for g in grants] == [b1.ticket_id]
    grants = await store.end(
        R1, "m", grants[0].lease_id, policy, NOW, tokens_used=None, abandoned=False
    )
    assert [g.ticket_id for g in grants] == [a2.ticket_id]


async def test_queue_caps_per_user_and_in_total(store: StateStore) -> None:
    policy = capped(1, max_per_user=2, max_total=3)
    await store.enqueue(R1, ticket("a"), policy, NOW)  # granted: not queued
    assert (await store.enqueue(R1, ticket("a"), policy, NOW)).full is None
    assert (await store.enqueue(R1, ticket("a"), policy, NOW)).full is None
    assert (await store.enqueue(R1, ticket("a"), policy, NOW)).full == "user"
    assert (await store.enqueue(R1, ticket("b"), policy, NOW)).full is None
    assert (await store.enqueue(R1, ticket("c"), policy, NOW)).full == "total"


async def test_grants_for_another_replica_reach_it_through_its_channel(store: StateStore) -> None:
    policy = capped(1)
    holder = await store.enqueue(R1, ticket("a"), policy, NOW)
    theirs = await store.enqueue(R2, ticket("b"), policy, NOW)
    waiting = asyncio.ensure_future(store.next_grants(R2, 5.0))
    await asyncio.sleep(0)
    assert (
        await store.end(
            R1, "m", holder.grants[0].lease_id, policy, NOW, tokens_used=None, abandoned=False
        )
        == []
    )
    grants = await asyncio.wait_for(waiting, 5)
    assert [g.ticket_id for g in grants] == [theirs.ticket_id]
    assert await store.next_grants(R2, 0.05) == []


async def test_a_silent_replica_loses_its_tickets_and_leases_after_the_ttl(
    store: StateStore,
) -> None:
    policy = capped(1)
    await store.heartbeat(R2, NOW, 2.0)
    await store.heartbeat(R1, NOW, 2.0)
    await store.enqueue(R2, ticket("dead"), policy, NOW)  # granted: holds the only slot
    await store.enqueue(R2, ticket("dead"), policy, NOW)  # queued
    mine = await store.enqueue(R1, ticket("alive"), policy, NOW)
    assert mine.grants == []
    assert await store.heartbeat(R1, NOW + 1.0, 2.0) == []  # R2 not silent long enough yet
    assert await store.heartbeat(R1, NOW + 3.0, 2.0) == ["m"]
    stats = await store.statistics(["interactive"])
    assert stats.queued == 1 and not stats.in_flight_by_model and stats.replicas == 1
    grants = await store.release(R1, "m", policy, NOW + 3.0)
    assert [g.ticket_id for g in grants] == [mine.ticket_id]
