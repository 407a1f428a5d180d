"""SharedScheduler over the in-process MemoryStore: the algorithm without Redis.

Heartbeats are short (50 ms) so expiry and recovery happen quickly; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from fair_sched_plugin.core import FairScheduler, InflightLimitGate, Lease, Ticket, TierLimits
from fair_sched_plugin.errors import QueueFull, QueueTimeout, StateStoreError
from fair_sched_plugin.state import MemoryStore, PolicyBook, SharedScheduler

TIERS = (TierLimits("interactive", waiting_below=3), TierLimits("batch", waiting_below=1))
HEARTBEAT_S = 0.05
TTL_S = 0.3


def ticket(user: str, tier: str = "interactive") -> Ticket:
    return Ticket(model="m", user=user, tier=tier)


def make(store: Any, cap: int = 1, **options: Any) -> SharedScheduler:
    policies = PolicyBook(
        TIERS,
        {},
        fairness="round_robin",
        stale_after_s=1.0,
        unknown_max_inflight=cap,
        max_per_user=options.pop("max_per_user", 100),
        max_total=1000,
        lease_ttl_s=TTL_S,
    )
    local = FairScheduler(TIERS, InflightLimitGate(cap))
    scheduler = SharedScheduler(
        store, policies, local, heartbeat_s=HEARTBEAT_S, lease_ttl_s=TTL_S, **options
    )
    return scheduler


@pytest.fixture
async def closing() -> AsyncIterator[Callable[[SharedScheduler], SharedScheduler]]:
    opened: list[SharedScheduler] = []

    def track(scheduler: SharedScheduler) -> SharedScheduler:
        opened.append(scheduler)
        return scheduler

    yield track
    for scheduler in opened:
        await asyncio.wait_for(scheduler.aclose(), 10)
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    await asyncio.gather(*others, return_exceptions=True)


async def settle(rounds: int = 10) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while not condition():
        assert loop.time() < give_up_at, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_round_robin_across_two_replicas(closing: Any) -> None:
    store = MemoryStore()
    one, two = closing(make(store)), closing(make(store))
    holder = await one.acquire(ticket("X"))
    order: list[str] = []

    async def request(scheduler: SharedScheduler, user: str) -> Lease:
        lease = await scheduler.acquire(ticket(user))
        order.append(user)
        return lease

    tasks = [asyncio.ensure_future(request(one, "A")) for _ in range(3)]
    await settle()
    tasks += [asyncio.ensure_future(request(two, "B")) for _ in range(2)]
    await eventually(lambda: one.statistics().queued == 3 and two.statistics().queued == 2)
    holder.release()
    for _ in range(5):
        await eventually(
            lambda: (
                len(order) == sum(t.done() for t in tasks)
                and any(t.done() and t.result().active for t in tasks)
            )
        )
        active = next(t.result() for t in tasks if t.done() and t.result().active)
        active.release()
    await eventually(lambda: all(t.done() for t in tasks))
    assert order == ["A", "B", "A", "B", "A"]
    stats = await one.shared_statistics()
    await eventually(lambda: one.statistics().in_flight == 0 and two.statistics().in_flight == 0)
    assert stats.queued == 0


async def test_queue_full_is_raised_from_the_shared_cap(closing: Any) -> None:
    store = MemoryStore()
    scheduler = closing(make(store, max_per_user=1))
    holder = await scheduler.acquire(ticket("A"))
    parked = asyncio.ensure_future(scheduler.acquire(ticket("A")))
    await eventually(lambda: scheduler.statistics().queued == 1)
    with pytest.raises(QueueFull):
        await scheduler.acquire(ticket("A"))
    holder.release()
    (await asyncio.wait_for(parked, 5)).release()


async def test_cancel_while_queued_leaves_the_shared_queue(closing: Any) -> None:
    store = MemoryStore()
    scheduler = closing(make(store))
    holder = await scheduler.acquire(ticket("A"))
    parked = asyncio.ensure_future(scheduler.acquire(ticket("B")))
    await eventually(lambda: scheduler.statistics().queued == 1)
    parked.cancel()
    await asyncio.gather(parked, return_exceptions=True)
    await eventually(lambda: store._queued == 0)
    assert scheduler.statistics().cancelled_total == 1
    holder.release()
    await eventually(lambda: not store._models["m"].leases)  # the store update is async


async def test_granted_then_cancelled_before_running_hands_the_lease_back(closing: Any) -> None:
    """Race: the grant resolves the waiter's future, then its task is cancelled before it runs.
    The lease must be abandoned (the next request gets the slot), never leaked."""
    store = MemoryStore()
    scheduler = closing(make(store))
    holder = await scheduler.acquire(ticket("A"))
    parked = asyncio.ensure_future(scheduler.acquire(ticket("B")))
    follower = asyncio.ensure_future(scheduler.acquire(ticket("C")))
    await eventually(lambda: scheduler.statistics().queued == 2)
    deliver = scheduler._deliver

    def deliver_then_cancel(grants: Any) -> None:
        deliver(grants)
        parked.cancel()  # B's future holds a lease; its task has not run yet

    scheduler._deliver = deliver_then_cancel  # type: ignore[method-assign]
    holder.release()
    await asyncio.gather(parked, return_exceptions=True)
    scheduler._deliver = deliver  # type: ignore[method-assign]
    lease = await asyncio.wait_for(follower, 5)
    assert lease.ticket.user == "C"
    assert scheduler.statistics().abandoned_total == 1
    lease.release()


async def test_cancelled_while_its_grant_is_on_the_way_hands_the_lease_back(closing: Any) -> None:
    """Race: the store grants B while B's task is being cancelled (the grant not yet delivered).
    The cancel finds the ticket granted and abandons the lease."""
    store = MemoryStore()
    scheduler = closing(make(store))
    holder = await scheduler.acquire(ticket("A"))
    parked = asyncio.ensure_future(scheduler.acquire(ticket("B")))
    follower = asyncio.ensure_future(scheduler.acquire(ticket("C")))
    await eventually(lambda: scheduler.statistics().queued == 2)
    end = store.end

    async def end_then_cancel(*args: Any, **kwargs: Any) -> Any:
        grants = await end(*args, **kwargs)
        parked.cancel()
        await asyncio.sleep(0)  # B's cleanup runs before the grant is delivered
        return grants

    store.end = end_then_cancel  # type: ignore[method-assign]
    holder.release()
    await asyncio.gather(parked, return_exceptions=True)
    lease = await asyncio.wait_for(follower, 5)
    store.end = end  # type: ignore[method-assign]
    assert lease.ticket.user == "C"
    lease.release()
    await eventually(lambda: not store._models["m"].leases)


async def test_max_wait_raises_queue_timeout_and_leaves_the_queue(closing: Any) -> None:
    store = MemoryStore()
    scheduler = closing(make(store, max_wait_s=0.05))
    holder = await scheduler.acquire(ticket("A"))
    with pytest.raises(QueueTimeout):
        await asyncio.wait_for(scheduler.acquire(ticket("B")), 5)
    await eventually(lambda: store._queued == 0)
    assert scheduler.statistics().timed_out_total == 1
    holder.release()


async def test_a_crashed_replicas_leases_expire_after_the_ttl(closing: Any) -> None:
    store = MemoryStore()
    alive = closing(make(store))
    crashed = make(store)
    crashed.start()
    alive.start()
    await crashed.acquire(ticket("A"))  # holds the only slot
    parked = asyncio.ensure_future(alive.acquire(ticket("B")))
    await eventually(lambda: alive.statistics().queued == 1)
    # Crash: its tasks stop without any cleanup; its lease is never released.
    for task in (crashed._tick_task, crashed._listen_task):
        assert task is not None
        task.cancel()
    crashed._store_closed = True
    lease = await asyncio.wait_for(parked, 10 * TTL_S + 5)
    assert lease.ticket.user == "B"
    lease.release()


class FlakyStore(MemoryStore):
    """A MemoryStore that fails every call while `broken` (what an unreachable Redis does)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        for name in (
            "enqueue",
            "release",
            "started",
            "end",
            "cancel",
            "publish_snapshot",
            "heartbeat",
            "next_grants",
            "statistics",
            "ping",
        ):
            setattr(self, name, self._guard(getattr(self, name)))

    def _guard(self, method: Any) -> Any:
        async def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.broken:
                await asyncio.sleep(0.01)
                try:
                    raise ConnectionError("connection refused")
                except ConnectionError as exc:
                    raise StateStoreError(f"store down: {exc}") from exc
            return await method(*args, **kwargs)

        return guarded


async def test_store_failure_falls_back_locally_then_recovers(
    closing: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = FlakyStore()
    scheduler = closing(make(store))
    scheduler.start()
    holder = await scheduler.acquire(ticket("A"))
    parked = asyncio.ensure_future(scheduler.acquire(ticket("B")))
    await eventually(lambda: scheduler.statistics().queued == 1)
    with caplog.at_level(logging.WARNING, logger="fair_sched"):
        store.broken = True
        # The parked request moves to the local scheduler (its own cap: 1 slot free there).
        lease = await asyncio.wait_for(parked, 5)
        assert scheduler.mode == "local"
        assert scheduler.state_statistics().fallbacks_total == 1
        assert any("falls back to in-memory" in r.getMessage() for r in caplog.records)
        lease.release()
        holder.release()  # its store update fails: it expires with the old replica id
        old_replica = scheduler.replica
        store.broken = False
        await eventually(lambda: scheduler.mode == "shared")
    assert scheduler.replica != old_replica
    assert scheduler.state_statistics().recoveries_total == 1
    assert any("is back" in r.getMessage() for r in caplog.records)
    # The old id's lease expires; then the shared store grants again.
    again = await asyncio.wait_for(scheduler.acquire(ticket("C")), 10 * TTL_S + 5)
    assert again.lease_id in scheduler._leases
    again.release()
