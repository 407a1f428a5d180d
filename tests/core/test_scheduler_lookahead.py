"""The scheduler's bounded look-ahead: when the fair head of a tier would be bound away from the
deployment that has its prefix cached (`AdmissionGate.prefers_elsewhere`), one of the next
`LOOKAHEAD` users goes first (fake clock, no sleeps)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, OrderedDict

import pytest

from fair_sched_plugin.core import BackendGroup, Deployment, Lease, MetricsGate, Ticket, TierLimits
from fair_sched_plugin.core import scheduler as scheduler_module
from fair_sched_plugin.core.placement import Candidate, Placer
from fair_sched_plugin.core.scheduler import LOOKAHEAD, MAX_PASSED_OVER
from fair_sched_plugin.lab.harness.engine_sim import EngineSim
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.testing import (
    FakeClock,
    ManualGate,
    drain,
    released_users,
    settle,
    snapshot,
    submit,
)

from .conftest import TIERS, make_scheduler


class HeldGate(ManualGate):
    """A `ManualGate` whose `prefers_elsewhere` is scripted: True for the users in `held`."""

    def __init__(self, held: set[str] | None = None) -> None:
        super().__init__()
        self.held = set(held or ())
        self.asked: list[str] = []

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        self.asked.append(ticket.user)
        return ticket.user in self.held


async def test_a_later_user_whose_deployment_has_room_goes_before_the_held_head(
    clock: FakeClock,
) -> None:
    gate = HeldGate({"a"})
    scheduler = make_scheduler(gate, clock)
    for user in ("a", "b", "c"):
        submit(scheduler, user, 2)
    await settle()
    gate.allow(1)
    assert released_users(gate) == ["b"]
    assert gate.asked == ["a", "b"]
    # The head kept its virtual time: once its deployment has room it is first again (then
    # everyone has had one turn, and b's second comes first: it went back in line first).
    gate.held.clear()
    gate.allow(3)
    assert released_users(gate) == ["b", "a", "c", "b"]
    await drain(scheduler)


async def test_no_look_ahead_when_the_head_is_not_held(clock: FakeClock) -> None:
    gate = HeldGate({"b"})
    scheduler = make_scheduler(gate, clock)
    for user in ("a", "b"):
        submit(scheduler, user, 1)
    await settle()
    gate.allow(1)
    assert released_users(gate) == ["a"]
    assert gate.asked == ["a"]
    await drain(scheduler)


async def test_never_passes_over_more_than_lookahead_users(clock: FakeClock) -> None:
    users = [f"u{index}" for index in range(LOOKAHEAD + 3)]
    # The head and the next LOOKAHEAD - 1 are held: the last one looked at goes.
    gate = HeldGate(set(users[:LOOKAHEAD]))
    scheduler = make_scheduler(gate, clock)
    for user in users:
        submit(scheduler, user, 2)
    await settle()
    gate.allow(1)
    assert released_users(gate) == [users[LOOKAHEAD]]
    assert gate.asked == users[: LOOKAHEAD + 1]
    # The head and all LOOKAHEAD after it held (users[LOOKAHEAD] has had its turn, so the
    # one after the first LOOKAHEAD is users[LOOKAHEAD + 1]): the head goes (it spills).
    looked_at = [*users[:LOOKAHEAD], users[LOOKAHEAD + 1]]
    gate.held = set(looked_at)
    gate.asked.clear()
    gate.allow(1)
    assert released_users(gate) == [users[LOOKAHEAD], users[0]]
    assert gate.asked == looked_at
    await drain(scheduler)


async def test_a_held_head_is_passed_over_at_most_max_passed_over_times(clock: FakeClock) -> None:
    """Fairness bound: a head whose deployment stays full is passed over MAX_PASSED_OVER times,
    then goes as if nobody were behind it (here: released, so the gate spills it), so users
    homed on a crowded deployment fall behind by a bounded number of requests (measured in a
    small shared-prefix e2e run without the bound: Jain's index 0.946)."""
    gate = HeldGate({"a"})
    scheduler = make_scheduler(gate, clock)
    submit(scheduler, "a", 2)
    submit(scheduler, "b", MAX_PASSED_OVER + 2)
    await settle()
    gate.allow(MAX_PASSED_OVER + 1)
    assert released_users(gate) == ["b"] * MAX_PASSED_OVER + ["a"]
    # Its next request starts a new count: passed over again while a stays held.
    gate.allow(1)
    assert released_users(gate)[-1] == "b"
    await drain(scheduler)


async def test_held_users_keep_their_order_among_themselves(clock: FakeClock) -> None:
    gate = HeldGate({"a", "b", "c"})
    scheduler = make_scheduler(gate, clock)
    for user in ("a", "b", "c", "d"):
        submit(scheduler, user, 3)
    await settle()
    gate.allow(2)  # d, then d again (a, b, c still held)
    gate.held.clear()
    gate.allow(4)
    assert released_users(gate) == ["d", "d", "a", "b", "c", "a"]
    await drain(scheduler)


async def test_only_users_of_the_same_tier_are_looked_at(clock: FakeClock) -> None:
    gate = HeldGate({"a"})
    scheduler = make_scheduler(gate, clock)
    submit(scheduler, "a", 1)
    submit(scheduler, "bot", 1, tier="batch")
    await settle()
    gate.allow(1)
    # Nobody else in the tier: the head goes; the batch user is not an alternative.
    assert released_users(gate) == ["a"]
    await drain(scheduler)


async def test_shortest_first_order_holds_with_the_look_ahead(clock: FakeClock) -> None:
    gate = HeldGate({"a"})
    scheduler = make_scheduler(gate, clock, order="shortest_first")
    for cost in (50, 5, 20):
        submit(scheduler, "a", 1, cost=cost)
    for cost in (30, 3):
        submit(scheduler, "b", 1, cost=cost)
    await settle()
    gate.allow(1)
    gate.held.clear()
    gate.allow(4)
    released = [(lease.ticket.user, lease.ticket.cost) for lease in gate.released]
    assert released == [("b", 3), ("a", 5), ("b", 30), ("a", 20), ("a", 50)]
    await drain(scheduler)


async def test_share_tiers_keep_sharing_with_the_look_ahead(clock: FakeClock) -> None:
    tiers = (
        TierLimits("interactive", waiting_below=3, share=3.0),
        TierLimits("batch", waiting_below=1, share=1.0),
    )
    gate = HeldGate({"a", "x"})
    scheduler = make_scheduler(gate, clock, tiers=tiers)
    for user in ("a", "b"):
        submit(scheduler, user, 6)
    for user in ("x", "y"):
        submit(scheduler, user, 6, tier="batch")
    await settle()
    gate.allow(8)
    tiers_released = Counter(lease.ticket.tier for lease in gate.released)
    assert tiers_released == {"interactive": 6, "batch": 2}
    # Inside each tier the held user waited while the other one had requests.
    assert {lease.ticket.user for lease in gate.released} == {"b", "y"}
    await drain(scheduler)


async def test_passed_over_users_keep_their_place_through_corrections_and_newcomers(
    clock: FakeClock,
) -> None:
    """The tier's virtual time follows the passed-over head, not the later user released
    instead: a token correction of the head's earlier request, or a newcomer's lift, must not
    move anyone past it."""
    gate = HeldGate()
    scheduler = make_scheduler(gate, clock, fairness="tokens")
    submit(scheduler, "b", 3, cost=10)
    submit(scheduler, "a", 2, cost=10)
    await settle()
    gate.allow(3)  # b, a, b: b at 20, a at 10 with one request in flight and one queued
    assert released_users(gate) == ["b", "a", "b"]
    gate.held.add("a")
    gate.allow(1)  # a's deployment is full: b goes (b at 30)
    assert released_users(gate)[-1] == "b"
    a_lease = next(lease for lease in gate.released if lease.ticket.user == "a")
    a_lease.release(tokens_used=5)  # 5 tokens less than charged
    submit(scheduler, "c", 1, cost=10)
    await settle()
    times = {row.user: row.virtual_time for row in scheduler.backlog()}
    # a is not lifted past where it was passed over (20 or 30 would put it behind b's work).
    assert times == {"a": 10.0, "c": 10.0}
    gate.held.clear()
    gate.allow(2)
    assert released_users(gate)[-2:] == ["a", "c"]
    await drain(scheduler)


async def test_a_passed_over_user_cancelled_after_the_look_ahead_leaves_cleanly(
    clock: FakeClock,
) -> None:
    """Race: the look-ahead put the held head's heap entry back; its only waiter is then
    cancelled. The entry must read as stale (nothing granted to it, nothing counted twice)."""
    gate = HeldGate({"a"})
    scheduler = make_scheduler(gate, clock)
    (a_task,) = submit(scheduler, "a", 1)
    submit(scheduler, "b", 2)
    submit(scheduler, "c", 1)
    await settle()
    gate.allow(1)
    assert released_users(gate) == ["b"]
    a_task.cancel()
    await settle()
    assert scheduler.statistics().queued == 2
    gate.allow(2)
    assert released_users(gate) == ["b", "c", "b"]
    stats = scheduler.statistics()
    assert (stats.queued, stats.cancelled_total) == (0, 1)
    await drain(scheduler)


async def test_a_candidate_cancelled_but_not_yet_cleaned_up_is_discarded_not_granted(
    clock: FakeClock,
) -> None:
    """Race: the look-ahead reaches a user whose waiting task was just cancelled (its future is
    done, its cleanup has not run yet). It must not get a lease; the next user does."""
    gate = HeldGate({"a"})
    scheduler = make_scheduler(gate, clock)
    submit(scheduler, "a", 1)
    (b_task,) = submit(scheduler, "b", 1)
    submit(scheduler, "c", 1)
    await settle()
    b_task.cancel()  # the future is cancelled now; the task's cleanup runs on the next turn
    gate.allow(1)  # the release decision runs synchronously, before that cleanup
    assert released_users(gate) == ["c"]
    await settle()
    assert b_task.cancelled()
    stats = scheduler.statistics()
    assert (stats.queued, stats.cancelled_total, stats.in_flight) == (1, 1, 1)
    gate.held.clear()
    gate.allow(1)
    assert released_users(gate) == ["c", "a"]
    await drain(scheduler)


async def test_a_gate_notifying_from_inside_the_look_ahead_is_safe(clock: FakeClock) -> None:
    """Race: the gate's `prefers_elsewhere` calls the capacity listener while the look-ahead has
    users off the heap; the nested decision must wait until the heap is whole again."""

    class NotifyingGate(HeldGate):
        def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
            self._notify()
            return super().prefers_elsewhere(ticket, tier)

    gate = NotifyingGate({"a", "b"})
    scheduler = make_scheduler(gate, clock)
    for user in ("a", "b", "c"):
        submit(scheduler, user, 2)
    await settle()
    gate.allow(2)
    assert released_users(gate) == ["c", "c"]
    gate.held.clear()
    gate.allow(4)
    assert released_users(gate) == ["c", "c", "a", "b", "a", "b"]
    assert scheduler.statistics().queued == 0
    await drain(scheduler)


class TwoDeploymentGate:
    """A scripted gate over deployments with fixed slots, placing with the real `Placer`: a
    deployment has room while its in-flight count is below its slots; each keeps an LRU prefix
    cache of `cached_prompts` prompts to count hits."""

    def __init__(self, slots: dict[str, int], cached_prompts: int = 11) -> None:
        self.slots = slots
        # Each engine's prefix cache as an LRU of whole prompt prefixes, holding a little more
        # than half of the 20 users' prompts (the issue's shared-prefix scenario).
        self.cached_prompts = cached_prompts
        self.caches = {name: OrderedDict[tuple[int, ...], None]() for name in slots}
        self.cache_hits = 0
        self.in_flight: Counter[str] = Counter()
        self.placer = Placer()
        self.leases: list[Lease] = []
        self.affinity = Counter[bool]()
        self.held_back = 0
        self._listener: object = None

    def set_listener(self, listener: object) -> None:
        self._listener = listener

    def _candidates(self) -> list[Candidate]:
        return [
            Candidate(name, self.in_flight[name], slots, self.in_flight[name] < slots)
            for name, slots in self.slots.items()
        ]

    def may_release(self, model: str, tier: TierLimits) -> bool:
        return any(candidate.has_room for candidate in self._candidates())

    def orders_engine_queue(self, model: str) -> bool:
        return False

    def may_release_newcomer(self, model: str, tier: TierLimits) -> bool:
        return False

    def place(self, ticket: Ticket, tier: TierLimits) -> str | None:
        placement = self.placer.choose(ticket.prefix, self._candidates())
        assert placement is not None
        self.placer.record(ticket.prefix, placement.deployment)
        self.affinity[placement.affinity] += 1
        return placement.deployment

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        candidates = self._candidates()
        held = self.placer.spills(ticket.prefix, candidates)
        self.held_back += held
        return held

    def waits_for_home(self, ticket: Ticket, tier: TierLimits) -> bool:
        # Room here is a free slot, so a spill always starts at once: never True.
        return self.placer.waits(ticket.prefix, self._candidates())

    def on_released(self, lease: Lease) -> None:
        assert lease.deployment is not None
        self.in_flight[lease.deployment] += 1
        self.leases.append(lease)
        cache = self.caches[lease.deployment]
        prefix = lease.ticket.prefix
        if prefix in cache:
            self.cache_hits += 1
            cache.move_to_end(prefix)
        else:
            cache[prefix] = None
            if len(cache) > self.cached_prompts:
                cache.popitem(last=False)

    def on_started(self, lease: Lease) -> None:
        pass

    def on_ended(self, lease: Lease) -> None:
        assert lease.deployment is not None
        self.in_flight[lease.deployment] -= 1


def jain(values: list[int]) -> float:
    return sum(values) ** 2 / (len(values) * sum(value * value for value in values))


async def _play_backlogged(
    seed: int, slots: dict[str, int], users: int = 20, releases: int = 4000
) -> tuple[list[int], TwoDeploymentGate]:
    rng = random.Random(seed)
    gate = TwoDeploymentGate(slots)
    scheduler = FairScheduler(TIERS, gate, clock=FakeClock(), max_per_user=10)
    # Each user has its own prompt prefix (its own system prompt), as in the scenario.
    prefixes = {f"u{index}": (index * 100 + 1, index * 100 + 2) for index in range(users)}
    futures = []

    def enqueue(user: str) -> None:
        ticket = Ticket(model="m", user=user, tier="interactive", prefix=prefixes[user])
        futures.append(scheduler.enqueue(ticket).future)

    for user in prefixes:
        for _ in range(3):
            enqueue(user)
    replenished = 0
    active: list[Lease] = []
    while len(gate.leases) < releases:
        # Every user stays backlogged: each release is replaced by a new request.
        while replenished < len(gate.leases):
            active.append(gate.leases[replenished])
            enqueue(gate.leases[replenished].ticket.user)
            replenished += 1
        # A random request ends (seeded): the deployment that frees a slot is random too.
        index = rng.randrange(len(active))
        active[index], active[-1] = active[-1], active[index]
        active.pop().release()
    counts = Counter(lease.ticket.user for lease in gate.leases[:releases])
    scheduler.close()
    for future in futures:
        if future.done() and not future.cancelled():
            future.exception()
    for lease in gate.leases:
        lease.release()
    return [counts[user] for user in prefixes], gate


def affinity_share(gate: TwoDeploymentGate) -> float:
    return gate.affinity[True] / sum(gate.affinity.values())


def hit_rate(gate: TwoDeploymentGate) -> float:
    return gate.cache_hits / len(gate.leases)


@pytest.mark.parametrize("slots", [{"a": 8, "b": 8}, {"small": 8, "large": 24}])
async def test_backlogged_users_on_two_deployments_stay_fair_with_affinity(
    slots: dict[str, int],
) -> None:
    """20 backlogged users, each with its own prefix, on two deployments; requests end at random
    (seeded). Over 4,000 releases per seed, Jain's index of per-user releases stays >= 0.95
    while the look-ahead keeps >= 90 % of requests on their prefix's deployment (measured over
    10 seeds: 0.94 on 8+8 slots, 0.99 on 8+24; without the look-ahead 0.49 and 0.62)."""
    for seed in range(5):
        counts, gate = await _play_backlogged(seed, slots)
        assert jain(counts) >= 0.95, (seed, counts)
        assert gate.held_back > 0  # the look-ahead had work to do
        assert affinity_share(gate) >= 0.9, (seed, gate.affinity)


async def test_the_look_ahead_keeps_prefix_caches_warm() -> None:
    """The same runs on 8+8 slots, each engine's prefix cache an LRU of 11 of the 20 prompts
    (the issue's shared-prefix scenario): measured over 10 seeds, hit rate 0.83 (0.81-0.85)
    against 0.34 without the look-ahead. The best possible is 0.995 (each user's first request
    misses): each spill puts a stranger into an LRU cache that its own users cycle through, and
    evicts one of them on every later turn until the stranger ages out."""
    for seed in range(3):
        _, gate = await _play_backlogged(seed, {"a": 8, "b": 8})
        assert hit_rate(gate) >= 0.75, (seed, hit_rate(gate))


async def test_without_the_look_ahead_fair_order_scatters_prefixes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control for the two tests above: the same runs with no look-ahead."""
    monkeypatch.setattr(scheduler_module, "LOOKAHEAD", 0)
    for seed in range(3):
        counts, gate = await _play_backlogged(seed, {"a": 8, "b": 8})
        assert jain(counts) >= 0.95
        assert affinity_share(gate) <= 0.7, (seed, gate.affinity)
        assert hit_rate(gate) <= 0.45, (seed, hit_rate(gate))


A_KEY, A_METRICS = "http://a/v1", "http://a/metrics"
B_KEY, B_METRICS = "http://b/v1", "http://b/metrics"


async def test_with_the_metrics_gate_a_full_home_lets_another_user_go_first() -> None:
    """End to end in the core: the per-deployment MetricsGate places with the Placer and tells
    the scheduler when a ticket's home is full; the look-ahead serves a user whose home has room,
    and a held user whose turn comes with nobody else to serve waits for its home while the
    other deployment could only queue it, and spills once a running slot is free there."""
    clock = FakeClock()
    tier = TierLimits("interactive", waiting_below=3)
    group = BackendGroup(
        "m",
        (Deployment(A_KEY, A_METRICS), Deployment(B_KEY, B_METRICS)),
        arrival_grace_s=0.3,
        max_num_seqs=4,
    )
    gate = MetricsGate([group], stale_after_s=5.0, clock=clock)
    scheduler = FairScheduler([tier], gate, clock=clock)
    gate.update("m", snapshot(clock, A_METRICS, waiting=0, running=0))
    gate.update("m", snapshot(clock, B_METRICS, waiting=0, running=0))
    prefixes = {"alice": (1,), "bob": (2,), "carol": (3,)}

    def make(user: str) -> Ticket:
        return Ticket("m", user, "interactive", prefix=prefixes[user])

    # Homes: new prefixes go least loaded per slot, ties to the lower key.
    first = [scheduler.try_acquire(make(user)) for user in ("alice", "carol", "bob")]
    homes = {lease.ticket.user: lease.deployment for lease in first if lease is not None}
    assert homes == {"alice": A_KEY, "carol": B_KEY, "bob": A_KEY}
    for lease in first:
        assert lease is not None
        lease.release()

    clock.advance(0.5)
    gate.update("m", snapshot(clock, A_METRICS, waiting=3, running=4))  # both full
    gate.update("m", snapshot(clock, B_METRICS, waiting=3, running=4))
    futures = [scheduler.enqueue(make(user)).future for user in ["alice", "bob", "carol"] * 2]
    assert not any(future.done() for future in futures)

    def granted() -> list[tuple[str, str | None]]:
        done = [future.result() for future in futures if future.done()]
        done.sort(key=lambda lease: lease.lease_id)
        return [(lease.ticket.user, lease.deployment) for lease in done]

    clock.advance(0.5)
    gate.update("m", snapshot(clock, B_METRICS, waiting=2, running=4))  # room for one on B
    assert granted() == [("carol", B_KEY)]  # alice and bob wait for A: their prefixes are there

    clock.advance(0.5)
    gate.update("m", snapshot(clock, B_METRICS, waiting=1, running=4))  # room for two on B
    # carol again; then only alice and bob are left, both held, and B has queue room but no
    # free running slot: spilled there they would only queue, so they wait for A.
    assert granted() == [("carol", B_KEY), ("carol", B_KEY)]

    clock.advance(0.5)
    gate.update("m", snapshot(clock, A_METRICS, waiting=2, running=4))  # room for one on A
    assert granted()[2:] == [("alice", A_KEY)]  # alice kept her turn and her home

    clock.advance(0.5)
    gate.update("m", snapshot(clock, B_METRICS, waiting=0, running=2))  # free slots on B
    # bob's home is still full, and on B he starts at once: he spills, and his next request
    # follows his prefix there.
    assert granted()[3:] == [("bob", B_KEY), ("bob", B_KEY)]
    scheduler.close()
    for future in futures:
        if future.done() and future.exception() is None:
            future.result().release()


async def test_a_home_over_its_load_bound_lets_a_user_at_home_elsewhere_go_first() -> None:
    """#16's shared-prefix bench through LiteLLM: one engine full (8 running, 3 waiting), the
    other nearly idle because its users' requests reached the plugin a moment later. The full
    home is then over the load bound too; a held head used to spill at once (the bound said
    "spill"), moving its home and evicting a prompt there, while a user whose home was the idle
    engine queued right behind it. Now the bound, like a full home, first lets the look-ahead
    find that user; the head spills only when no one else can use the room."""
    clock = FakeClock()
    tier = TierLimits("interactive", waiting_below=3)
    group = BackendGroup(
        "m",
        (Deployment(A_KEY, A_METRICS), Deployment(B_KEY, B_METRICS)),
        arrival_grace_s=0.3,
        max_num_seqs=8,
    )
    gate = MetricsGate([group], stale_after_s=5.0, clock=clock)
    scheduler = FairScheduler([tier], gate, clock=clock)
    gate.update("m", snapshot(clock, A_METRICS, waiting=0, running=0))
    gate.update("m", snapshot(clock, B_METRICS, waiting=0, running=0))
    prefixes = {"alice": (1,), "bob": (2,)}

    def make(user: str) -> Ticket:
        return Ticket("m", user, "interactive", prefix=prefixes[user])

    first = [scheduler.try_acquire(make(user)) for user in ("alice", "bob")]
    assert [(lease.ticket.user, lease.deployment) for lease in first if lease] == [
        ("alice", A_KEY),
        ("bob", B_KEY),
    ]
    for lease in first:
        assert lease is not None
        lease.release()

    clock.advance(0.5)
    gate.update("m", snapshot(clock, A_METRICS, waiting=3, running=8))  # both full
    gate.update("m", snapshot(clock, B_METRICS, waiting=3, running=8))
    futures = [scheduler.enqueue(make(user)).future for user in ("alice", "bob")]
    assert not any(future.done() for future in futures)
    clock.advance(0.5)
    # b drained to 2 running: a (11 of 8 slots) is over 1.25 x its share of 11 + 2 + 1.
    gate.update("m", snapshot(clock, B_METRICS, waiting=0, running=2))
    granted = [future.result() for future in futures if future.done()]
    granted.sort(key=lambda lease: lease.lease_id)
    # bob first, at home; then alice, the fair head, with nobody else to serve: it spills.
    assert [(lease.ticket.user, lease.deployment) for lease in granted] == [
        ("bob", B_KEY),
        ("alice", B_KEY),
    ]
    scheduler.close()
    for lease in granted:
        lease.release()


async def test_a_lone_request_whose_spill_would_only_queue_waits_for_its_home() -> None:
    """The same bench's other way to lose a prefix: a user's next request reaches the plugin
    alone (nothing queued, so no look-ahead), its home full, the other engine with queue room
    but no free running slot. `try_acquire` used to bind it there at once (a miss, and its
    prefix's home moved); now it parks and goes home when a slot frees there, or spills once the
    other engine has a free running slot."""
    clock = FakeClock()
    tier = TierLimits("interactive", waiting_below=3)
    group = BackendGroup(
        "m",
        (Deployment(A_KEY, A_METRICS), Deployment(B_KEY, B_METRICS)),
        arrival_grace_s=0.3,
        max_num_seqs=8,
    )
    gate = MetricsGate([group], stale_after_s=5.0, clock=clock)
    scheduler = FairScheduler([tier], gate, clock=clock)
    gate.update("m", snapshot(clock, A_METRICS, waiting=0, running=0))
    gate.update("m", snapshot(clock, B_METRICS, waiting=0, running=0))
    alice = Ticket("m", "alice", "interactive", prefix=(1,))
    first = scheduler.try_acquire(alice)
    assert first is not None and first.deployment == A_KEY
    first.release()

    clock.advance(0.5)
    gate.update("m", snapshot(clock, A_METRICS, waiting=3, running=8))  # full
    gate.update("m", snapshot(clock, B_METRICS, waiting=1, running=8))  # queue room only
    assert scheduler.try_acquire(alice) is None
    parked = scheduler.enqueue(alice).future
    assert not parked.done()
    clock.advance(0.5)
    gate.update("m", snapshot(clock, A_METRICS, waiting=2, running=8))  # room at home
    assert parked.done() and parked.result().deployment == A_KEY

    clock.advance(0.5)
    gate.update("m", snapshot(clock, A_METRICS, waiting=3, running=8))
    gate.update("m", snapshot(clock, B_METRICS, waiting=0, running=5))  # free running slots
    spilled = scheduler.try_acquire(alice)
    assert spilled is not None and spilled.deployment == B_KEY
    scheduler.close()
    parked.result().release()
    spilled.release()


async def _shared_prefixes_through_engines(seconds: float = 120.0) -> tuple[int, int, float]:
    """The issue's shared-prefix scenario in the core: 20 users, each with its own system prompt
    and 3 requests parked at all times, the per-deployment MetricsGate in front of two scripted
    engines (8 slots, 1 s per request, scrapes every 0.1 s), each engine's prefix cache an LRU
    of 11 of the 20 prompts. Returns (requests, cache hits, Jain's index of per-user releases)."""
    clock = FakeClock()
    tier = TierLimits("interactive", waiting_below=3)
    urls = {A_KEY: A_METRICS, B_KEY: B_METRICS}
    group = BackendGroup(
        "m",
        tuple(Deployment(key, url) for key, url in urls.items()),
        arrival_grace_s=0.3,
        max_num_seqs=8,
    )
    gate = MetricsGate([group], stale_after_s=5.0, clock=clock)
    scheduler = FairScheduler([tier], gate, clock=clock)
    engines = {key: EngineSim(gate, clock, max_num_seqs=8, url=url) for key, url in urls.items()}
    caches = {key: OrderedDict[tuple[int, ...], None]() for key in urls}
    prefixes = {f"u{index}": (index * 100 + 1, index * 100 + 2) for index in range(20)}
    released: Counter[str] = Counter()
    hits = 0
    waiting: list[asyncio.Future[Lease]] = []

    def enqueue(user: str) -> None:
        ticket = Ticket("m", user, "interactive", prefix=prefixes[user])
        waiting.append(scheduler.enqueue(ticket).future)

    for engine in engines.values():
        engine.step(clock.now())
    for user in prefixes:
        for _ in range(3):
            enqueue(user)
    end = clock.now() + seconds
    while clock.now() < end:
        for engine in engines.values():
            engine.step(clock.now())  # scrapes and ends, which release the next requests
        granted = [future for future in waiting if future.done()]
        waiting = [future for future in waiting if not future.done()]
        for future in granted:
            lease = future.result()
            assert lease.deployment is not None
            cache = caches[lease.deployment]
            if lease.ticket.prefix in cache:
                hits += 1
                cache.move_to_end(lease.ticket.prefix)
            else:
                cache[lease.ticket.prefix] = None
                if len(cache) > 11:
                    cache.popitem(last=False)
            released[lease.ticket.user] += 1
            engines[lease.deployment].admit(lease, tier.name)
            enqueue(lease.ticket.user)  # every user stays backlogged
        clock.advance(0.01)
    scheduler.close()
    for future in waiting:
        future.exception()
    return sum(released.values()), hits, jain(list(released.values()))


async def test_shared_prefixes_hit_the_cache_nearly_as_often_as_possible() -> None:
    """Measured: 1,910 requests, hit rate 0.989 against the best possible 0.9895 (each user's
    first request misses; 0.986 before held heads waited for their home rather than spill into
    a queue), Jain's index 0.9998."""
    requests, hits, fairness = await _shared_prefixes_through_engines()
    best = 1 - 20 / requests
    assert hits / requests >= best - 0.01, (hits, requests)
    assert fairness >= 0.99


async def test_shared_prefixes_without_the_look_ahead_miss_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: fair interleaving alone holds the head until its home has room (while the
    other engine could only queue it) and idles nothing, but spills more (measured 0.933, with
    the same 1,900 requests served)."""
    monkeypatch.setattr(scheduler_module, "LOOKAHEAD", 0)
    requests, hits, fairness = await _shared_prefixes_through_engines()
    assert hits / requests <= 0.96, (hits, requests)
    assert requests >= 1850
    assert fairness >= 0.99


async def test_shared_prefixes_spilling_into_queues_miss_half_the_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control for the wait: with no look-ahead and every held head spilled into the other
    engine's queue (the rule before `waits_for_home`), a user's requests land on either engine."""
    monkeypatch.setattr(scheduler_module, "LOOKAHEAD", 0)
    monkeypatch.setattr(MetricsGate, "waits_for_home", lambda self, ticket, tier: False)
    requests, hits, fairness = await _shared_prefixes_through_engines()
    assert hits / requests <= 0.6, (hits, requests)
    assert fairness >= 0.99
