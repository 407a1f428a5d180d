"""A tier's `reserve_slots`: running slots its users who already hold one leave free, so the next
user starts at once instead of waiting for a slot to end (sans-I/O: FakeClock, no sleeps)."""

from __future__ import annotations

from typing import NamedTuple

from fair_sched_plugin.core import (
    BackendGroup,
    Deployment,
    Lease,
    MetricsGate,
    SchedulerCore,
    TierLimits,
)
from fair_sched_plugin.lab.harness.engine_sim import EngineSim
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


def test_the_reservation_holds_while_the_engines_metrics_lag_behind_our_releases() -> None:
    """A scrape sent after the arrival grace settles our releases as arrived; one that lags
    shows none of them running: our requests in flight still count as the slots they hold."""
    clock = FakeClock()
    core, gate = _core(clock, reserve=1)
    _submit(core, "flood", 20)
    assert len(_granted(core)) == 7
    clock.advance(1.0)
    gate.update("m", snapshot(clock, URL, waiting=0, running=0))
    assert _granted(core) == []
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


# ----------------------------------------------------------------------------- a flood, simulated

FLOOD = 100
# The engine of fair_sched_plugin/lab/harness/engine_sim.py with the demo's shape: 8 slots, a request ends 1 s after
# it started, its first token 20 ms after; requests take 50 ms to reach it, scrapes every 50 ms.
SIM = {"max_num_seqs": 8, "service_s": 1.0, "transit_s": 0.05, "poll_s": 0.05, "prefill_s": 0.02}
IDLE_FIRST_BYTE_S = SIM["transit_s"] + SIM["prefill_s"]


class FloodRun(NamedTuple):
    light_first_byte_s: float  # from the light user's submit
    flood_makespan_s: float  # until the flood's last request ended


def _flood_with_a_light_user(reserve: int, light_at: float) -> FloodRun:
    """One user submits `FLOOD` requests at 0, a second user one at `light_at`; the scheduler's
    decisions go to a simulated engine (FakeClock time, 10 ms ticks)."""
    clock = FakeClock()
    core, gate = _core(clock, reserve=reserve)
    sim = EngineSim(gate, clock, finished_counter=True, **SIM)  # type: ignore[arg-type]
    _submit(core, "flood", FLOOD)
    light: Lease | None = None
    light_first_byte = None
    submitted = False
    start = clock.now()
    while sim.completed < FLOOD + 1 and clock.now() < start + 60:
        now = clock.now()
        if not submitted and now >= start + light_at:
            _submit(core, "light")
            submitted = True
        for decision in core.take_decisions():
            lease = decision.outcome
            assert isinstance(lease, Lease)
            if lease.ticket.user == "light":
                light = lease
            sim.admit(lease, "interactive")
        sim.step(now)
        if light is not None and light.started and light_first_byte is None:
            light_first_byte = clock.now() - start - light_at
        clock.advance(0.01)
    assert light_first_byte is not None and sim.completed == FLOOD + 1
    return FloodRun(light_first_byte, clock.now() - start)


# Where the light user arrives among the flood's completions: through a whole round of slots.
PHASES = [1.0 + i / 10 for i in range(10)]


def test_with_a_reserved_slot_a_light_user_under_a_flood_starts_as_on_an_idle_engine() -> None:
    waits = sorted(_flood_with_a_light_user(1, at).light_first_byte_s for at in PHASES)
    assert waits[len(waits) // 2] <= 1.5 * IDLE_FIRST_BYTE_S + 0.02  # one 10 ms tick each way


def test_without_one_it_waits_for_a_flood_request_to_end() -> None:
    waits = sorted(_flood_with_a_light_user(0, at).light_first_byte_s for at in PHASES)
    assert waits[len(waits) // 2] > 3 * IDLE_FIRST_BYTE_S


def test_a_reserved_slot_costs_a_lone_flood_its_share_of_slots_and_a_refill_per_request() -> None:
    """Not work-conserving: the flood runs on 7 of 8 slots, and with no engine queue left to
    refill from, each freed slot idles for the way there (60 ms of each 1 s request here)."""
    without = _flood_with_a_light_user(0, PHASES[0]).flood_makespan_s
    reserved = _flood_with_a_light_user(1, PHASES[0]).flood_makespan_s
    way_there = SIM["transit_s"] + 0.01  # and the tick that sees the slot free
    assert 7 / 8 * (1 - 2 * way_there) <= without / reserved <= 7 / 8
