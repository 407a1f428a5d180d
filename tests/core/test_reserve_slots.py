"""A tier's `reserve_slots`: running slots its users who already hold one leave free, so the next
user starts at once instead of waiting for a slot to end (sans-I/O: FakeClock, no sleeps)."""

from __future__ import annotations

from fair_sched_plugin.core import (
    BackendGroup,
    Deployment,
    Lease,
    MetricsGate,
    SchedulerCore,
    TierLimits,
)
from fair_sched_plugin.testing import FakeClock, make_ticket, snapshot

URL = "http://engine/metrics"


def _core(
    clock: FakeClock,
    *,
    reserve: int,
    max_num_seqs: int | None = 8,
    batch_reserve: int = 0,
) -> tuple[SchedulerCore, MetricsGate]:
    group = BackendGroup(
        "m", (Deployment(URL, URL),), arrival_grace_s=0.3, max_num_seqs=max_num_seqs
    )
    gate = MetricsGate([group], stale_after_s=1.0, clock=clock)
    tiers = (
        TierLimits("interactive", waiting_below=3, reserve_slots=reserve),
        TierLimits("batch", waiting_below=1, reserve_slots=batch_reserve),
    )
    core = SchedulerCore(tiers, gate, clock=clock)
    gate.update("m", snapshot(clock, URL, waiting=0, running=0))
    return core, gate


def _submit(core: SchedulerCore, user: str, count: int = 1, tier: str = "interactive") -> None:
    for _ in range(count):
        core.submit(make_ticket(user, tier=tier))


def _granted(core: SchedulerCore) -> list[Lease]:
    return [d.outcome for d in core.take_decisions() if isinstance(d.outcome, Lease)]


def _users(leases: list[Lease]) -> list[str]:
    return [lease.ticket.user for lease in leases]


def test_a_flooding_user_leaves_the_reserved_slot_free() -> None:
    clock = FakeClock()
    core, _ = _core(clock, reserve=1)
    _submit(core, "flood", 20)
    assert len(_granted(core)) == 7  # 8 slots, 1 kept free


def test_a_user_who_holds_no_slot_starts_in_the_reserved_one() -> None:
    clock = FakeClock()
    core, _ = _core(clock, reserve=1)
    _submit(core, "flood", 20)
    core.take_decisions()
    _submit(core, "light")
    assert _users(_granted(core)) == ["light"]


def test_without_a_reservation_the_flood_takes_every_slot_and_the_queue() -> None:
    clock = FakeClock()
    core, _ = _core(clock, reserve=0)
    _submit(core, "flood", 20)
    assert len(_granted(core)) == 11  # 8 free slots and a queue of 3
    _submit(core, "light")
    assert _granted(core) == []


def test_a_user_who_holds_a_slot_does_not_take_the_reserved_one() -> None:
    clock = FakeClock()
    core, _ = _core(clock, reserve=1)
    _submit(core, "light")
    _submit(core, "flood", 20)
    assert len(_granted(core)) == 7  # light's one and six of the flood's
    _submit(core, "light")
    assert _granted(core) == []


def test_try_acquire_takes_the_reserved_slot_for_a_user_who_holds_none() -> None:
    clock = FakeClock()
    core, _ = _core(clock, reserve=1)
    leases = [core.try_acquire(make_ticket("flood")) for _ in range(8)]
    assert sum(lease is not None for lease in leases) == 7
    assert core.try_acquire(make_ticket("light")) is not None
    assert core.try_acquire(make_ticket("light-2")) is None  # the reservation is taken


def test_the_reserved_slot_is_kept_again_once_its_user_ends() -> None:
    clock = FakeClock()
    core, _ = _core(clock, reserve=1)
    _submit(core, "flood", 20)
    core.take_decisions()
    _submit(core, "light")
    (light,) = _granted(core)
    light.release()
    assert _granted(core) == []  # the flood does not take it back
    _submit(core, "light-2")
    assert _users(_granted(core)) == ["light-2"]


def test_a_lower_tier_keeps_the_reservation_of_the_tiers_above() -> None:
    clock = FakeClock()
    core, _ = _core(clock, reserve=1)
    # Batch releases while the engine's queue is empty: 8 free slots, then the reservation.
    _submit(core, "flood", 20, tier="batch")
    assert len(_granted(core)) == 7
    _submit(core, "light")
    assert _users(_granted(core)) == ["light"]


def test_a_reservation_needs_the_engines_slots_given() -> None:
    """Counted against the learned capacity, the reservation would lower it window by window
    (the engine never runs more than capacity minus the reservation): without `max_num_seqs`
    nothing is reserved."""
    clock = FakeClock()
    core, gate = _core(clock, reserve=1, max_num_seqs=None)
    gate.update("m", snapshot(clock, URL, waiting=0, running=8))
    clock.advance(1.0)
    gate.update("m", snapshot(clock, URL, waiting=0, running=0))
    _submit(core, "flood", 20)
    assert len(_granted(core)) == 11


def test_the_gate_says_the_tier_is_held_for_its_reservation() -> None:
    clock = FakeClock()
    core, gate = _core(clock, reserve=1)
    _submit(core, "flood", 20)
    (group,) = gate.status()
    assert group.blocked_reason == "reserved"
