"""The async driver over the core: one future per waiting caller, one timer for the core's next
due wake-up, and a granted-then-cancelled turn handed back once."""

from __future__ import annotations

import asyncio

import pytest

from fair_sched_plugin.core import InflightLimitGate, TierLimits
from fair_sched_plugin.errors import QueueTimeout
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.testing import FakeClock, ManualGate, make_ticket

TIERS = (TierLimits("interactive"), TierLimits("batch", promote_after_s=5.0))


class CountingClock(FakeClock):
    """A fake clock that counts the timers it was asked to arm."""

    def __init__(self) -> None:
        super().__init__(start=0.0)
        self.armed = 0

    def call_at(self, when, callback):  # type: ignore[no-untyped-def]
        self.armed += 1
        return super().call_at(when, callback)


async def test_one_timer_serves_every_deadline_in_arrival_order() -> None:
    clock = CountingClock()
    scheduler = FairScheduler(TIERS, ManualGate(), clock=clock, max_wait_s=10.0)
    reservations = []
    for index in range(100):
        reservations.append(scheduler.enqueue(make_ticket(f"u{index}")))
        clock.advance(0.01)
    assert clock.armed == 1  # later arrivals' deadlines are not earlier: no new timer
    clock.advance(10.0)
    await asyncio.sleep(0)
    assert all(isinstance(r.future.exception(), QueueTimeout) for r in reservations)
    assert clock.armed <= 101  # at most a re-arm per firing, never one per ticket up front
    scheduler.close()


async def test_a_turn_granted_to_a_caller_cancelled_meanwhile_goes_to_the_next() -> None:
    clock = FakeClock()
    gate = InflightLimitGate(1)
    scheduler = FairScheduler(TIERS, gate, clock=clock)
    holder = scheduler.try_acquire(make_ticket("holder"))
    assert holder is not None
    first = asyncio.create_task(scheduler.acquire(make_ticket("a")))
    second = asyncio.create_task(scheduler.acquire(make_ticket("b")))
    await asyncio.sleep(0)
    holder.release()  # grants "a" its lease (its future resolves) ...
    first.cancel()  # ... and "a" is cancelled before it could use it
    with pytest.raises(asyncio.CancelledError):
        await first
    lease = await asyncio.wait_for(second, timeout=5)
    assert lease.ticket.user == "b"
    stats = scheduler.statistics()
    assert stats.abandoned_total == 1 and stats.in_flight == 1
    lease.release()
    scheduler.close()


async def test_a_caller_cancelled_while_queued_leaves_without_a_grant() -> None:
    clock = FakeClock()
    gate = ManualGate()
    scheduler = FairScheduler(TIERS, gate, clock=clock)
    waiting = asyncio.create_task(scheduler.acquire(make_ticket("a")))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    gate.allow(1)
    stats = scheduler.statistics()
    assert stats.queued == 0 and stats.released_total == 0 and stats.cancelled_total == 1
    scheduler.close()


async def test_close_cancels_the_timer_and_fails_waiters() -> None:
    clock = CountingClock()
    scheduler = FairScheduler(TIERS, ManualGate(), clock=clock, max_wait_s=10.0)
    reservation = scheduler.enqueue(make_ticket("a", tier="batch"))
    scheduler.close()
    clock.advance(60.0)  # the cancelled timer must not tick a closed core
    assert reservation.future.done()
    assert scheduler.next_due() is None
