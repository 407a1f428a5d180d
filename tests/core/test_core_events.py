"""The sans-I/O core driven by events and times only: no event loop, no futures, no timers.

Events in (`submit`, `cancel`, a lease's start and end, `kick`, `tick(now)`), decisions out
(`take_decisions`), and `next_due` saying when the next tick matters.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import fair_sched_plugin.core
from fair_sched_plugin.core import Decision, InflightLimitGate, Lease, SchedulerCore, TierLimits
from fair_sched_plugin.core.queues import Parked
from fair_sched_plugin.errors import QueueFull, QueueTimeout, SchedulerClosed
from fair_sched_plugin.testing import FakeClock, ManualGate, make_ticket

TIERS = (TierLimits("interactive"), TierLimits("batch", promote_after_s=5.0))


def _core(gate: object, clock: FakeClock, **options: object) -> SchedulerCore:
    return SchedulerCore(TIERS, gate, clock=clock, **options)  # type: ignore[arg-type]


def _leases(decisions: list[Decision]) -> list[Lease]:
    return [d.outcome for d in decisions if isinstance(d.outcome, Lease)]


def test_no_module_of_the_core_imports_asyncio_or_io() -> None:
    forbidden = {"asyncio", "socket", "httpx", "starlette", "litellm", "redis", "threading"}
    core_dir = pathlib.Path(fair_sched_plugin.core.__file__).parent
    found = []
    for path in sorted(core_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in forbidden]
    assert not found


def test_grants_are_decisions_in_fair_order_as_capacity_frees() -> None:
    clock = FakeClock()
    core = _core(InflightLimitGate(1), clock)
    first = core.try_acquire(make_ticket("heavy"))
    assert first is not None
    parked = [core.submit(make_ticket(user)) for user in ("heavy", "heavy", "light")]
    assert core.take_decisions() == []  # the only slot is taken: nothing decided yet
    first.release()
    (decision,) = core.take_decisions()
    # Round robin: heavy was charged a turn for its first lease, so light goes next.
    assert decision.parked is parked[2]
    order = [decision.parked]
    for _ in range(2):
        _leases([decision])[0].release()
        (decision,) = core.take_decisions()
        order.append(decision.parked)
    assert order == [parked[2], parked[0], parked[1]]


def test_a_cancelled_ticket_is_never_decided_and_a_gone_waiter_is_skipped() -> None:
    clock = FakeClock()
    gate = ManualGate()

    class Driven(SchedulerCore):
        # A driver's answer for a waiter that went away (the core never reads `ref` itself).
        def _gone(self, parked: Parked) -> bool:
            return parked.ref == "gone"

    core = Driven(TIERS, gate, clock=clock)  # type: ignore[arg-type]
    cancelled = core.submit(make_ticket("a"))
    gone = core.submit(make_ticket("b"), "gone")
    kept = core.submit(make_ticket("c"))
    assert core.cancel(cancelled) and not core.cancel(cancelled)
    gate.allow(2)
    decisions = core.take_decisions()
    assert [d.parked for d in decisions] == [kept]
    assert gone.state != kept.state  # skipped, never granted
    stats = core.statistics()
    assert stats.queued == 0 and stats.cancelled_total == 2 and stats.released_total == 1


def test_deadlines_are_data_the_next_tick_acts_on() -> None:
    clock = FakeClock(start=100.0)
    core = _core(ManualGate(), clock, max_wait_s=10.0)
    assert core.next_due() is None
    early = core.submit(make_ticket("a"))
    clock.advance(4.0)
    late = core.submit(make_ticket("b"))
    assert core.next_due() == 110.0  # one wake-up, for the head's deadline
    core.tick(109.9)
    assert core.take_decisions() == []
    core.tick(110.0)
    (expired,) = core.take_decisions()
    assert expired.parked is early and isinstance(expired.outcome, QueueTimeout)
    assert core.next_due() == 114.0
    core.tick(114.0)
    (expired,) = core.take_decisions()
    assert expired.parked is late and core.next_due() is None
    assert core.statistics().timed_out_total == 2


def test_a_cancelled_head_leaves_an_early_wake_up_that_does_nothing() -> None:
    clock = FakeClock(start=0.0)
    core = _core(ManualGate(), clock, max_wait_s=10.0)
    head = core.submit(make_ticket("a"))
    clock.advance(3.0)
    core.submit(make_ticket("b"))
    core.cancel(head)
    assert core.next_due() == 10.0  # early: the next tick finds nothing due and re-arms
    core.tick(10.0)
    assert core.take_decisions() == [] and core.next_due() == 13.0


@pytest.mark.parametrize("stuck_head", [False, True])
def test_granted_tickets_are_not_kept_until_their_deadline(stuck_head: bool) -> None:
    """Granted tickets leave the deadlines' deque long before the head's deadline (the only
    tick there is): what it holds follows the queue, not the arrivals of `max_wait_s`; also
    behind a head that stays parked (`stuck_head`: a batch ticket that interactive keeps
    behind), where only a rebuild can drop them."""
    clock = FakeClock(start=0.0)
    core = _core(InflightLimitGate(1), clock)
    holder = core.try_acquire(make_ticket("holder"))
    assert holder is not None
    if stuck_head:
        core.submit(make_ticket("batch-user", tier="batch"))
    for user in range(3):
        core.submit(make_ticket(f"u{user}"))
    lease = holder
    for index in range(2_000):
        lease.release()
        (decision,) = core.take_decisions()
        assert isinstance(decision.outcome, Lease)
        lease = decision.outcome
        core.submit(make_ticket(f"u{index % 3}"))
    assert core.statistics().queued == 3 + stuck_head
    assert len(core._deadlines) <= 2 * (3 + stuck_head) + 64 + 1  # no tick ran: clock at 0


def test_promotion_is_a_wake_up_and_moves_the_ticket_one_tier_up() -> None:
    clock = FakeClock(start=0.0)
    gate = ManualGate()
    core = _core(gate, clock, max_wait_s=600.0)
    batch = core.submit(make_ticket("b", tier="batch"))
    clock.advance(1.0)
    interactive = core.submit(make_ticket("i", tier="interactive"))
    clock.advance(2.0)
    later_batch = core.submit(make_ticket("c", tier="batch"))
    assert core.next_due() == 5.0
    core.tick(5.0)
    assert batch.ticket.tier == "interactive" and later_batch.ticket.tier == "batch"
    assert core.next_due() == 8.0  # the next promotion's wake-up
    gate.allow(2)
    decided = {d.parked for d in core.take_decisions()}
    assert decided == {batch, interactive}  # the promoted one goes before the batch tier


def test_close_refuses_every_parked_ticket_and_later_submits() -> None:
    clock = FakeClock()
    core = _core(ManualGate(), clock)
    parked = [core.submit(make_ticket(f"u{i}")) for i in range(3)]
    core.close()
    decisions = core.take_decisions()
    assert [d.parked for d in decisions] == parked
    assert all(isinstance(d.outcome, SchedulerClosed) for d in decisions)
    assert core.next_due() is None
    with pytest.raises(SchedulerClosed):
        core.submit(make_ticket("late"))


def test_caps_refuse_at_submit_before_anything_is_queued() -> None:
    clock = FakeClock()
    core = _core(ManualGate(), clock, max_per_user=2, max_total=3)
    core.submit(make_ticket("a"))
    core.submit(make_ticket("a"))
    with pytest.raises(QueueFull) as per_user:
        core.submit(make_ticket("a"))
    core.submit(make_ticket("b"))
    with pytest.raises(QueueFull) as total:
        core.submit(make_ticket("c"))
    assert (per_user.value.scope, total.value.scope) == ("user", "total")
    assert core.statistics().queued == 3


def test_token_fairness_charges_the_actual_count_at_the_end() -> None:
    clock = FakeClock()
    core = _core(InflightLimitGate(1), clock, fairness="tokens")
    big = core.try_acquire(make_ticket("big", cost=100))
    assert big is not None
    core.submit(make_ticket("big", cost=100))
    core.submit(make_ticket("small", cost=100))
    big.release(tokens_used=10_000)  # used far more than estimated: charged for it
    (decision,) = core.take_decisions()
    assert decision.parked.ticket.user == "small"
