"""In the core: short-first inside a user, tier shares, promotion, cost fairness."""

from __future__ import annotations

import random
from collections import Counter

from fair_sched_plugin.core import Ticket, TierLimits
from fair_sched_plugin.runtime.driver import FairScheduler, Reservation
from fair_sched_plugin.testing import FakeClock, ManualGate

from .conftest import make_scheduler


def park(scheduler: FairScheduler, user: str, **fields: object) -> Reservation:
    return scheduler.enqueue(Ticket(model="m", user=user, **{"tier": "interactive", **fields}))  # type: ignore[arg-type]


def released(gate: ManualGate, field: str) -> list[object]:
    return [getattr(lease.ticket, field) for lease in gate.released]


async def test_shortest_first_releases_a_users_smallest_request_first(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock, order="shortest_first")
    for cost in (500, 10, 300, 20):
        park(scheduler, "a", cost=cost)
    gate.allow(4)
    assert released(gate, "cost") == [10, 20, 300, 500]
    scheduler.close()


async def test_fifo_keeps_arrival_order_inside_a_user(gate: ManualGate, clock: FakeClock) -> None:
    scheduler = make_scheduler(gate, clock)
    for cost in (500, 10, 300, 20):
        park(scheduler, "a", cost=cost)
    gate.allow(4)
    assert released(gate, "cost") == [500, 10, 300, 20]
    scheduler.close()


async def test_shortest_first_leaves_fairness_between_users_alone(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock, order="shortest_first")
    for cost in (900, 800, 1):
        park(scheduler, "long", cost=cost)
    for cost in (5, 6):
        park(scheduler, "short", cost=cost)
    gate.allow(5)
    assert released(gate, "user") == ["long", "short", "long", "short", "long"]
    assert released(gate, "cost") == [1, 5, 800, 6, 900]
    scheduler.close()


async def test_shortest_first_cancelled_request_is_skipped(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock, order="shortest_first")
    reservations = [park(scheduler, "a", cost=cost) for cost in (30, 10, 20)]
    assert reservations[1].cancel()
    gate.allow(3)
    assert released(gate, "cost") == [20, 30]
    assert scheduler.statistics().queued == 0
    scheduler.close()


SHARED = (
    TierLimits("interactive", waiting_below=3, share=0.8),
    TierLimits("batch", waiting_below=3, share=0.2),
)


async def test_shares_split_releases_eighty_twenty_when_both_tiers_are_backlogged(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock, SHARED, max_per_user=1000)
    for index in range(300):
        park(scheduler, f"i{index % 3}", tier="interactive")
        park(scheduler, f"b{index % 2}", tier="batch")
    gate.allow(200)
    shares = Counter(released(gate, "tier"))
    assert 160 * 0.9 <= shares["interactive"] <= 160 * 1.1
    assert 40 * 0.9 <= shares["batch"] <= 40 * 1.1
    scheduler.close()


async def test_a_tier_without_share_keeps_strict_priority_over_share_tiers(
    gate: ManualGate, clock: FakeClock
) -> None:
    tiers = (TierLimits("urgent", waiting_below=3), *SHARED)
    scheduler = make_scheduler(gate, clock, tiers)
    for _ in range(5):
        park(scheduler, "b", tier="batch")
        park(scheduler, "i", tier="interactive")
    for _ in range(3):
        park(scheduler, "u", tier="urgent")
    gate.allow(3)
    assert released(gate, "tier") == ["urgent"] * 3
    scheduler.close()


async def test_a_share_tier_coming_back_does_not_bank_its_idle_time(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock, SHARED)
    for _ in range(100):
        park(scheduler, "i", tier="interactive")
    gate.allow(50)  # batch idle meanwhile
    for _ in range(20):
        park(scheduler, "b", tier="batch")
    gate.allow(10)
    # Back at the group's current virtual time: its share of the next ten, not a burst.
    assert Counter(released(gate, "tier")[50:])["batch"] <= 3
    scheduler.close()


async def test_promotion_bounds_the_wait_of_a_starved_lower_tier_request(
    gate: ManualGate, clock: FakeClock
) -> None:
    tiers = (
        TierLimits("interactive", waiting_below=3),
        TierLimits("batch", waiting_below=3, promote_after_s=10.0),
    )
    scheduler = make_scheduler(gate, clock, tiers, max_per_user=1000)
    users = ("i0", "i1", "i2")
    for _ in range(100):
        for user in users:
            park(scheduler, user)
    starved = park(scheduler, "b", tier="batch")
    for _ in range(40):  # one release per second, interactive always backlogged
        clock.advance(1.0)
        gate.allow(1)
        if starved.future.done():
            break
    lease = starved.future.result()
    # Promoted at 10 s, then served within one round of the interactive tier's users.
    assert lease.released_at - lease.enqueued_at <= 10.0 + len(users) + 1
    assert lease.ticket.tier == "interactive"
    scheduler.close()


async def test_without_promotion_strict_tiers_starve_the_lower_tier(
    gate: ManualGate, clock: FakeClock
) -> None:
    tiers = (TierLimits("interactive", waiting_below=3), TierLimits("batch", waiting_below=3))
    scheduler = make_scheduler(gate, clock, tiers, max_per_user=1000)
    for _ in range(100):
        park(scheduler, "i0")
    starved = park(scheduler, "b", tier="batch")
    for _ in range(40):
        clock.advance(1.0)
        gate.allow(1)
    assert not starved.future.done()
    scheduler.close()


async def test_cost_fairness_delivers_money_in_the_ratio_of_the_weights(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock, fairness="cost", max_per_user=1000)
    rng = random.Random(19)
    delivered: Counter[str] = Counter()
    for _ in range(400):
        for user, weight in (("heavy", 3.0), ("light", 1.0)):
            park(scheduler, user, weight=weight, price=rng.choice((0.001, 0.01, 0.05)))
    for _ in range(300):
        gate.allow(1)
        lease = gate.released[-1]
        # The actual cost differs from the estimate (shorter answers than requested).
        actual = lease.ticket.price * rng.uniform(0.3, 1.0)
        delivered[lease.ticket.user] += actual
        lease.release(cost_used=actual)
    assert 3 * 0.9 <= delivered["heavy"] / delivered["light"] <= 3 * 1.1
    scheduler.close()


class _HomeWaitGate(ManualGate):
    """Scripted `waits_for_home`: the interactive tier's head waits while `waiting` is set."""

    waiting = True

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        return tier.name == "interactive" and self.waiting

    def waits_for_home(self, ticket: Ticket, tier: TierLimits) -> bool:
        return self.prefers_elsewhere(ticket, tier)


async def test_a_share_tier_whose_head_waits_for_its_deployment_is_not_charged(
    clock: FakeClock,
) -> None:
    """A head that waits for its deployment releases nothing, so its tier's share clock must not
    advance: charged for each decision it waited through, interactive would fall behind batch
    by one request per scrape while held."""
    gate = _HomeWaitGate()
    scheduler = make_scheduler(gate, clock, SHARED, max_per_user=1000)
    for _ in range(20):
        park(scheduler, "i", tier="interactive")
    park(scheduler, "b", tier="batch")
    gate.allow(1)  # room, but interactive's head waits for its deployment, and batch after it
    for _ in range(10):
        gate.allow(0)  # ten more decisions (scrapes) while it waits: nothing goes
    assert released(gate, "tier") == []
    gate.waiting = False
    for _ in range(20):
        park(scheduler, "b", tier="batch")
    gate.allow(9)
    # Its 80 % of the next ten, as if it had not waited.
    assert Counter(released(gate, "tier"))["interactive"] >= 7
    scheduler.close()
