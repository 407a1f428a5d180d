"""FairScheduler: order, tiers, limits and cancellation races (fake clock, no sleeps)."""

from __future__ import annotations

from collections import Counter

import pytest

from fair_sched_plugin.core import InflightLimitGate, TierLimits
from fair_sched_plugin.errors import QueueFull, QueueTimeout, SchedulerClosed
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.testing import (
    FakeClock,
    ManualGate,
    drain,
    make_ticket,
    released_users,
    settle,
    submit,
)

from .conftest import TIERS, make_scheduler


async def test_late_user_goes_right_after_the_current_turn(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock)
    submit(scheduler, "a", 100)
    await settle()
    gate.allow(1)
    submit(scheduler, "b", 1)
    await settle()
    gate.allow(2)
    assert released_users(gate) == ["a", "b", "a"]
    await drain(scheduler)


async def test_three_users_are_served_round_robin(gate: ManualGate, clock: FakeClock) -> None:
    scheduler = make_scheduler(gate, clock)
    for user in ("a", "b", "c"):
        submit(scheduler, user, 3)
    await settle()
    gate.allow(9)
    assert released_users(gate) == ["a", "b", "c"] * 3


async def test_weights_two_to_one_give_two_to_one_releases(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock, fairness="weighted")
    submit(scheduler, "heavy", 60, weight=2.0)
    submit(scheduler, "light", 60, weight=1.0)
    await settle()
    gate.allow(60)
    counts = Counter(released_users(gate))
    assert counts["heavy"] == 40
    assert counts["light"] == 20
    await drain(scheduler)


async def test_round_robin_ignores_weights(gate: ManualGate, clock: FakeClock) -> None:
    scheduler = make_scheduler(gate, clock)
    submit(scheduler, "heavy", 10, weight=5.0)
    submit(scheduler, "light", 10, weight=1.0)
    await settle()
    gate.allow(10)
    assert Counter(released_users(gate)) == {"heavy": 5, "light": 5}


async def test_token_fairness_equalises_served_tokens(clock: FakeClock) -> None:
    """A long-request user and a short-request user end up within one maximum request."""
    gate = InflightLimitGate(1)
    scheduler = FairScheduler(TIERS, gate, clock=clock, fairness="tokens")
    long_tasks = submit(scheduler, "long", 40, cost=1000)
    short_tasks = submit(scheduler, "short", 400, cost=100)
    served: Counter[str] = Counter()
    pending = {task for task in long_tasks + short_tasks}
    for _ in range(200):
        await settle()
        done = [task for task in pending if task.done()]
        assert len(done) == 1
        lease = done[0].result()
        pending.discard(done[0])
        tokens = lease.ticket.cost
        served[lease.ticket.user] += tokens
        lease.release(tokens_used=tokens)
    assert abs(served["long"] - served["short"]) <= 1000
    await drain(scheduler)


async def test_token_fairness_corrects_the_estimate_with_actual_tokens(clock: FakeClock) -> None:
    """Estimates say equal; the actual counts reported at release decide the next turns."""
    gate = InflightLimitGate(1)
    scheduler = FairScheduler(TIERS, gate, clock=clock, fairness="tokens")
    tasks = submit(scheduler, "verbose", 20, cost=100) + submit(scheduler, "terse", 20, cost=100)
    order = []
    remaining = set(tasks)
    for _ in range(20):
        await settle()
        (task,) = [task for task in remaining if task.done()]
        remaining.discard(task)
        lease = task.result()
        order.append(lease.ticket.user)
        lease.release(tokens_used=400 if lease.ticket.user == "verbose" else 100)
    counts = Counter(order)
    assert counts["terse"] >= 3 * counts["verbose"] - 4
    await drain(scheduler)


async def test_idle_user_cannot_bank_credit(gate: ManualGate, clock: FakeClock) -> None:
    scheduler = make_scheduler(gate, clock)
    submit(scheduler, "a", 20)
    submit(scheduler, "b", 20)
    await settle()
    gate.allow(20)
    submit(scheduler, "c", 10)
    await settle()
    gate.allow(6)
    recent = released_users(gate)[-6:]
    assert recent.count("c") == 2
    await drain(scheduler)


async def test_lower_tier_waits_while_a_higher_tier_can_release(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock)
    submit(scheduler, "bot", 5, tier="batch")
    await settle()
    submit(scheduler, "human", 2, tier="interactive")
    await settle()
    gate.allow(3)
    assert released_users(gate) == ["human", "human", "bot"]
    await drain(scheduler)


class _TierGate(ManualGate):
    """Open for the named tiers only."""

    def __init__(self, open_tiers: set[str]) -> None:
        super().__init__(is_open=True)
        self.open_tiers = open_tiers

    def may_release(self, model: str, tier: TierLimits) -> bool:
        return tier.name in self.open_tiers


async def test_lower_tier_goes_when_the_higher_tier_is_held_by_its_own_threshold(
    clock: FakeClock,
) -> None:
    gate = _TierGate({"batch"})
    scheduler = make_scheduler(gate, clock)  # type: ignore[arg-type]
    human = submit(scheduler, "human", 1, tier="interactive")
    bot = submit(scheduler, "bot", 1, tier="batch")
    await settle()
    assert bot[0].done() and not human[0].done()
    await drain(scheduler)


async def test_models_are_independent(gate: ManualGate, clock: FakeClock) -> None:
    scheduler = make_scheduler(gate, clock)
    submit(scheduler, "a", 3, model="m1")
    submit(scheduler, "a", 1, model="m2")
    await settle()
    assert scheduler.statistics().queued_by_model_tier == {
        ("m1", "interactive"): 3,
        ("m2", "interactive"): 1,
    }
    await drain(scheduler)


async def test_per_user_cap_rejects_with_retry_hint(gate: ManualGate, clock: FakeClock) -> None:
    scheduler = make_scheduler(gate, clock, max_per_user=2)
    submit(scheduler, "a", 2)
    await settle()
    with pytest.raises(QueueFull) as caught:
        await scheduler.acquire(make_ticket("a"))
    assert caught.value.scope == "user"
    assert caught.value.retry_after_s >= 1
    assert caught.value.status_code == 429
    other = submit(scheduler, "b", 1)
    await settle()
    assert scheduler.statistics().queued == 3
    assert scheduler.statistics().rejected_full_total == 1
    await drain(scheduler)
    assert other[0].done()


async def test_total_cap_rejects(gate: ManualGate, clock: FakeClock) -> None:
    scheduler = make_scheduler(gate, clock, max_total=3)
    for user in "abc":
        submit(scheduler, user)
    await settle()
    with pytest.raises(QueueFull) as caught:
        await scheduler.acquire(make_ticket("d"))
    assert caught.value.scope == "total"
    await drain(scheduler)


async def test_max_wait_raises_queue_timeout_and_frees_the_slot(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock, max_wait_s=10)
    early = submit(scheduler, "a", 1)
    await settle()
    clock.advance(5)
    late = submit(scheduler, "b", 1)
    await settle()
    clock.advance(5.5)
    await settle()
    with pytest.raises(QueueTimeout):
        early[0].result()
    assert not late[0].done()
    assert scheduler.statistics().queued == 1
    assert scheduler.statistics().timed_out_total == 1
    clock.advance(5)
    await settle()
    with pytest.raises(QueueTimeout):
        late[0].result()
    gate.allow(1)
    assert gate.released == []


async def test_release_is_idempotent(gate: ManualGate, clock: FakeClock) -> None:
    gate.open()
    scheduler = make_scheduler(gate, clock)
    lease = await scheduler.acquire(make_ticket("a"))
    assert lease.release() is True
    assert lease.release() is False
    assert lease.release(tokens_used=10) is False
    stats = scheduler.statistics()
    assert (stats.in_flight, stats.completed_total, len(gate.ended)) == (0, 1, 1)


async def test_async_with_releases_on_exit_and_on_error(gate: ManualGate, clock: FakeClock) -> None:
    gate.open()
    scheduler = make_scheduler(gate, clock)
    async with await scheduler.acquire(make_ticket("a")) as lease:
        assert lease.active
    assert not lease.active
    with pytest.raises(RuntimeError):
        async with await scheduler.acquire(make_ticket("a")):
            raise RuntimeError("backend failed")
    assert scheduler.statistics().in_flight == 0


async def test_try_acquire_never_jumps_the_queue(gate: ManualGate, clock: FakeClock) -> None:
    scheduler = make_scheduler(gate, clock)
    assert scheduler.try_acquire(make_ticket("a")) is None  # gate closed
    queued = submit(scheduler, "a", 1)
    await settle()
    gate.open()
    await settle()
    assert queued[0].done()
    lease = scheduler.try_acquire(make_ticket("b"))
    assert lease is not None
    gate.close()
    submit(scheduler, "c", 1, tier="interactive")
    await settle()
    assert scheduler.try_acquire(make_ticket("d", tier="batch")) is None
    lease.release()
    await drain(scheduler)


async def test_cancelled_waiter_leaves_the_queue_at_once(
    gate: ManualGate, clock: FakeClock
) -> None:
    """Race: cancelled while queued -> removed from its user's FIFO immediately."""
    scheduler = make_scheduler(gate, clock)
    (first,) = submit(scheduler, "a", 1)
    (second,) = submit(scheduler, "a", 1)
    await settle()
    first.cancel()
    await settle()
    stats = scheduler.statistics()
    assert (stats.queued, stats.cancelled_total) == (1, 1)
    gate.allow(1)
    await settle()
    assert second.done() and second.result().active


async def test_cancel_then_release_in_the_same_tick_skips_the_cancelled_waiter(
    gate: ManualGate, clock: FakeClock
) -> None:
    """Race: the task is cancelled (its future is cancelled) but its cleanup has not run yet when
    the gate opens; the release must skip it, not grant a lease nobody will use."""
    scheduler = make_scheduler(gate, clock)
    (doomed,) = submit(scheduler, "a", 1)
    (other,) = submit(scheduler, "b", 1)
    await settle()
    doomed.cancel()
    gate.allow(1)  # synchronously, before the cancelled task runs its except block
    await settle()
    assert doomed.cancelled()
    assert other.done() and other.result().ticket.user == "b"
    stats = scheduler.statistics()
    assert (stats.queued, stats.in_flight, stats.cancelled_total) == (0, 1, 1)


async def test_woken_then_cancelled_waiter_passes_its_turn_on(clock: FakeClock) -> None:
    """Race: the lease was granted (future resolved) and the task is cancelled before it resumes;
    the lease must go back and the next waiter get the capacity."""
    gate = InflightLimitGate(1)
    scheduler = FairScheduler(TIERS, gate, clock=clock)
    holder = await scheduler.acquire(make_ticket("x"))
    (woken,) = submit(scheduler, "a", 1)
    (next_in_line,) = submit(scheduler, "b", 1)
    await settle()
    holder.release()  # grants "a" synchronously
    woken.cancel()  # before "a" ever runs
    await settle()
    assert woken.cancelled()
    assert next_in_line.done() and next_in_line.result().ticket.user == "b"
    stats = scheduler.statistics()
    assert (stats.in_flight, stats.abandoned_total) == (1, 1)
    assert gate.in_flight("m") == 1


async def test_abandoned_turn_is_not_charged(clock: FakeClock) -> None:
    """Race: a woken-then-cancelled request must not cost its user a round-robin turn."""
    gate = InflightLimitGate(1)
    scheduler = FairScheduler(TIERS, gate, clock=clock)
    holder = await scheduler.acquire(make_ticket("x"))
    a_tasks = submit(scheduler, "a", 3)
    b_tasks = submit(scheduler, "b", 3)
    await settle()
    holder.release()
    a_tasks[0].cancel()
    await settle()
    # "b" got the freed slot; "a" is still first in line for the next one.
    assert b_tasks[0].done()
    b_tasks[0].result().release()
    await settle()
    assert a_tasks[1].done()
    await drain(scheduler)


async def test_timeout_and_cancel_do_not_double_count(gate: ManualGate, clock: FakeClock) -> None:
    """Race: a waiter that timed out is then cancelled by its caller: it ends once, as a timeout."""
    scheduler = make_scheduler(gate, clock, max_wait_s=1)
    (task,) = submit(scheduler, "a", 1)
    await settle()
    clock.advance(2)
    task.cancel()
    await settle()
    stats = scheduler.statistics()
    assert stats.timed_out_total + stats.cancelled_total == 1
    assert stats.queued == 0


async def test_close_fails_waiters_and_refuses_new_tickets(
    gate: ManualGate, clock: FakeClock
) -> None:
    gate.allow(1)
    scheduler = make_scheduler(gate, clock)
    held = await scheduler.acquire(make_ticket("a"))
    waiting = submit(scheduler, "b", 2)
    await settle()
    await drain(scheduler)
    for task in waiting:
        with pytest.raises(SchedulerClosed):
            task.result()
    with pytest.raises(SchedulerClosed):
        await scheduler.acquire(make_ticket("c"))
    assert held.release() is True
    assert scheduler.statistics().in_flight == 0


async def test_unknown_tier_is_a_value_error(gate: ManualGate, clock: FakeClock) -> None:
    scheduler = make_scheduler(gate, clock)
    with pytest.raises(ValueError, match="unknown tier"):
        await scheduler.acquire(make_ticket("a", tier="gold"))


async def test_backlog_reports_depth_and_oldest(gate: ManualGate, clock: FakeClock) -> None:
    scheduler = make_scheduler(gate, clock)
    submit(scheduler, "a", 3)
    await settle()
    clock.advance(1)
    submit(scheduler, "b", 1)
    await settle()
    backlog = {entry.user: entry for entry in scheduler.backlog()}
    assert backlog["a"].depth == 3 and backlog["b"].depth == 1
    assert backlog["a"].oldest_enqueued_at < backlog["b"].oldest_enqueued_at
    await drain(scheduler)


async def test_memory_follows_load_under_submit_and_cancel_abuse(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock)
    for _ in range(20):
        tasks = submit(scheduler, "abuser", 50)
        await settle()
        for task in tasks:
            task.cancel()
        await settle()
    assert scheduler.statistics().queued == 0
    assert len(scheduler._deadlines) <= 128
    assert all(not tier.users for q in scheduler._models.values() for tier in q.tiers)


async def test_a_reservation_is_granted_through_its_future(
    gate: ManualGate, clock: FakeClock
) -> None:
    scheduler = make_scheduler(gate, clock)
    reservation = scheduler.enqueue(make_ticket("a"))
    assert not reservation.future.done()
    gate.allow(1)
    lease = reservation.future.result()
    assert lease.ticket.user == "a"
    assert not reservation.cancel()  # granted: the lease is the caller's to use or abandon
    lease.release()
    assert scheduler.statistics().in_flight == 0


async def test_a_cancelled_reservation_is_never_granted(gate: ManualGate, clock: FakeClock) -> None:
    """Race: cancelled by callback (no task) while queued, then capacity opens."""
    scheduler = make_scheduler(gate, clock)
    first = scheduler.enqueue(make_ticket("a"))
    second = scheduler.enqueue(make_ticket("b"))
    assert first.cancel()
    assert not first.cancel()  # once
    gate.allow(2)
    assert not first.future.done()
    assert second.future.result().ticket.user == "b"
    stats = scheduler.statistics()
    assert (stats.queued, stats.cancelled_total, stats.released_total) == (0, 1, 1)
    await drain(scheduler)


async def test_an_adopted_lease_counts_in_flight_and_is_not_charged(clock: FakeClock) -> None:
    gate = InflightLimitGate(2)
    scheduler = make_scheduler(gate, clock)  # type: ignore[arg-type]
    adopted = scheduler.adopt(make_ticket("a"), started=True)
    assert adopted.started and adopted.charged == 0.0
    assert gate.in_flight("m") == 1
    tasks = submit(scheduler, "a", 1) + submit(scheduler, "b", 2)
    await settle()
    # One slot left: "a" and "b" start level (the adopted lease charged nothing), "a" came first.
    assert [task.done() for task in tasks] == [True, False, False]
    adopted.release()
    await settle()
    assert [task.done() for task in tasks] == [True, True, False]
    await drain(scheduler)


# ---------------------------------------------------------------- the engine's queue in user order


async def test_engine_rank_counts_the_users_earlier_requests_not_yet_started(
    clock: FakeClock,
) -> None:
    gate = ManualGate(is_open=True, newcomers=True)  # its engine orders its queue by user
    scheduler = make_scheduler(gate, clock)
    first, second, third = [await scheduler.acquire(make_ticket("a")) for _ in range(3)]
    assert [first.engine_rank, second.engine_rank, third.engine_rank] == [0, 1, 2]
    assert (await scheduler.acquire(make_ticket("b"))).engine_rank == 0  # per user
    assert (await scheduler.acquire(make_ticket("a", tier="batch"))).engine_rank == 0  # per tier
    first.mark_started()  # streaming: no longer in the engine's queue
    assert (await scheduler.acquire(make_ticket("a"))).engine_rank == 2
    second.release()  # ended without a first byte (an error, a client gone)
    third.mark_started()
    assert (await scheduler.acquire(make_ticket("a"))).engine_rank == 1  # the one before
    await drain(scheduler)


@pytest.mark.parametrize(
    ("fairness", "expected"),
    [
        (
            "weighted",
            {"double": [0, 0, 1, 1, 2], "single": [0, 1, 2, 3, 4], "half": [0, 2, 4, 6, 8]},
        ),
        ("round_robin", {name: [0, 1, 2, 3, 4] for name in ("double", "single", "half")}),
    ],
)
async def test_under_weighted_fairness_the_engine_rank_counts_rounds_of_the_users_weight(
    clock: FakeClock, fairness: str, expected: dict[str, list[int]]
) -> None:
    """Weight 2 has two requests in each round of the engine's queue, as it has two turns to
    others' one in ours; round robin ignores weights in both."""
    gate = ManualGate(is_open=True, newcomers=True)
    scheduler = make_scheduler(gate, clock, fairness=fairness)
    weights = {"double": 2.0, "single": 1.0, "half": 0.5}
    ranks = {
        name: [
            (await scheduler.acquire(make_ticket(name, weight=weight))).engine_rank
            for _ in range(5)
        ]
        for name, weight in weights.items()
    }
    assert ranks == expected
    # A weight that is not a power of two: 3 requests at weight 0.1 are in round 30, not 29.
    tenth = [await scheduler.acquire(make_ticket("tenth", weight=0.1)) for _ in range(4)]
    assert tenth[-1].engine_rank == (30 if fairness == "weighted" else 3)
    await drain(scheduler)


async def test_under_weighted_fairness_a_heavier_user_goes_as_a_newcomer_while_in_the_first_round(
    clock: FakeClock,
) -> None:
    """Past a closed gate, a user goes as a newcomer while its next request would be in the
    engine's first round: one of weight 2 with one request there still is, one of weight 1 is
    not."""
    gate = ManualGate(newcomers=True)
    scheduler = make_scheduler(gate, clock, fairness="weighted")
    double = [scheduler.try_acquire(make_ticket("double", weight=2.0)) for _ in range(3)]
    single = [scheduler.try_acquire(make_ticket("single")) for _ in range(2)]
    assert [lease is not None for lease in double] == [True, True, False]
    assert [lease is not None for lease in single] == [True, False]
    # The same through the queue: the parked head of weight 2 goes once one of its two streams.
    parked = submit(scheduler, "double", 1, weight=2.0)
    await settle()
    assert not parked[0].done()
    double[0].mark_started()  # type: ignore[union-attr]
    gate.allow(0)
    await settle()
    assert parked[0].done() and parked[0].result().engine_rank == 0
    await drain(scheduler)


async def test_engine_rank_is_0_where_the_engine_does_not_order_its_queue(
    gate: ManualGate, clock: FakeClock
) -> None:
    gate.open()
    scheduler = make_scheduler(gate, clock)
    leases = [await scheduler.acquire(make_ticket("a")) for _ in range(3)]
    assert [lease.engine_rank for lease in leases] == [0, 0, 0]
    await drain(scheduler)


@pytest.mark.parametrize("orders_its_queue", [True, False])
async def test_a_user_with_nothing_in_the_engine_passes_a_full_queue_only_where_it_orders_it(
    clock: FakeClock, orders_its_queue: bool
) -> None:
    gate = ManualGate(newcomers=orders_its_queue)
    scheduler = make_scheduler(gate, clock)
    gate.allow(1)
    power = await scheduler.acquire(make_ticket("power"))  # in the engine, not yet streaming
    # Nothing queued: the fast path lets a newcomer go past the closed gate, not the power user.
    assert scheduler.try_acquire(make_ticket("power")) is None
    assert (scheduler.try_acquire(make_ticket("newcomer")) is not None) is orders_its_queue
    parked = submit(scheduler, "power", 3)
    await settle()
    assert not any(task.done() for task in parked)  # its own request is still queued there
    light = submit(scheduler, "light")
    await settle()
    assert light[0].done() is orders_its_queue
    assert not any(task.done() for task in parked)
    # Once the power user's request streams, it has nothing queued in the engine either: one
    # more of its requests may go (the next decision: here the gate's next notification).
    power.mark_started()
    gate.allow(0)
    await settle()
    assert sum(task.done() for task in parked) == (1 if orders_its_queue else 0)
    if orders_its_queue:
        assert next(task for task in parked if task.done()).result().engine_rank == 0
    await drain(scheduler)


async def test_with_tier_shares_newcomers_wait_for_the_threshold_like_everyone(
    clock: FakeClock,
) -> None:
    gate = ManualGate(newcomers=True)
    shares = (
        TierLimits("interactive", waiting_below=3, share=0.8),
        TierLimits("batch", waiting_below=3, share=0.2),
    )
    scheduler = make_scheduler(gate, clock, tiers=shares)
    assert scheduler.try_acquire(make_ticket("newcomer")) is None
    parked = submit(scheduler, "light")
    await settle()
    assert not parked[0].done()
    gate.allow(1)
    await settle()
    assert parked[0].done()
    await drain(scheduler)
