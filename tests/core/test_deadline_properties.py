"""Property: requests with limits of their own (the client's, down to a nanosecond; a tier's),
under any fairness policy, order, weights from 1e-6 to 1e6, tier shares and promotions, a clock
that may not move between releases, and any interleaving of submits, cancels and ends: nothing
but a `Rejected` escapes the core, every parked ticket is decided exactly once (or cancelled),
a request refused on arrival had someone queued in its tier or above, and the deadlines' bookkeeping
stays bounded by the live queue."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_sched_plugin.core import InflightLimitGate, Lease, SchedulerCore, Ticket, TierLimits
from fair_sched_plugin.core.queues import QUEUED, Parked
from fair_sched_plugin.errors import DeadlineUnreachable, QueueFull, Rejected
from fair_sched_plugin.testing import FakeClock

WAITS = [None, 1e-9, 0.001, 0.5, 3.0, 86_400.0]
WEIGHTS = [1e-6, 1.0, 1e6]

TIER_SETS = {
    "strict": (TierLimits("interactive", max_wait_s=2.0), TierLimits("batch")),
    "shares": (TierLimits("interactive", share=3.0), TierLimits("batch", share=1.0)),
    "promoting": (
        TierLimits("interactive"),
        TierLimits("batch", promote_after_s=1.0, max_wait_s=5.0),
    ),
}

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.sampled_from(["a", "b", "flood"]),
            st.sampled_from(["interactive", "batch"]),
            st.sampled_from(WAITS),
            st.sampled_from(WEIGHTS),
            st.sampled_from([1, 100_000_000]),
        ),
        st.tuples(st.just("cancel"), st.integers(0, 60)),
        st.tuples(st.just("release"), st.integers(0, 60)),
        # Often no time at all between events: every release at the same instant.
        st.tuples(st.just("advance"), st.sampled_from([0.0, 0.0, 1e-9, 0.05, 0.7, 4.0])),
        st.tuples(st.just("limit"), st.integers(0, 3)),
        # A flood user's backlog drained for a while, one release per step (a measured rate).
        st.tuples(
            st.just("drain"),
            st.integers(1, 40),
            st.sampled_from([0.0, 0.01, 0.3, 2.0]),
            st.sampled_from(["interactive", "batch"]),
            st.integers(0, 2),
        ),
    ),
    max_size=60,
)


class _Gate(InflightLimitGate):
    def set_limit(self, limit: int) -> None:
        self._default_limit = limit  # 0 closes it
        self._notify(None)


def _play(ops: list[tuple[object, ...]], fairness: str, order: str, tiers: str) -> None:
    clock = FakeClock()
    gate = _Gate(1)
    core = SchedulerCore(
        TIER_SETS[tiers],
        gate,
        clock=clock,
        fairness=fairness,  # type: ignore[arg-type]
        order=order,  # type: ignore[arg-type]
        max_per_user=20,
        max_total=40,
        max_wait_s=10.0,
    )
    parked: list[Parked] = []
    ends: dict[int, list[str]] = {}
    leases: list[Lease] = []

    def collect() -> None:
        for decision in core.take_decisions():
            ends[id(decision.parked)].append(type(decision.outcome).__name__)
            if isinstance(decision.outcome, Lease):
                leases.append(decision.outcome)
            else:
                assert isinstance(decision.outcome, Rejected), decision.outcome

    for op in ops:
        kind = op[0]
        if kind == "submit":
            _, user, tier, wait, weight, cost = op
            ticket = Ticket("m", str(user), str(tier), weight=weight, cost=cost, max_wait_s=wait)  # type: ignore[arg-type]
            rank = ["interactive", "batch"]
            ahead = sum(
                b.depth for b in core.backlog() if rank.index(b.tier) <= rank.index(str(tier))
            )
            try:
                waiter = core.submit(ticket)
            except DeadlineUnreachable:
                assert ahead, "refused on arrival with nobody queued in its tier or above"
            except QueueFull:
                pass
            else:
                parked.append(waiter)
                ends[id(waiter)] = []
        elif kind == "cancel" and parked:
            waiter = parked[int(op[1]) % len(parked)]  # type: ignore[call-overload]
            if core.cancel(waiter):
                ends[id(waiter)].append("cancelled")
        elif kind == "release" and leases:
            leases.pop(int(op[1]) % len(leases)).release()  # type: ignore[call-overload]
        elif kind == "advance":
            clock.advance(float(op[1]))  # type: ignore[arg-type]
            core.tick(clock.now())
        elif kind == "limit":
            gate.set_limit(int(op[1]))  # type: ignore[call-overload]
        elif kind == "drain":
            for _ in range(int(op[1])):  # type: ignore[call-overload]
                for _ in range(int(op[4])):  # type: ignore[call-overload]
                    try:
                        waiter = core.submit(Ticket("m", "flood", str(op[3])))
                    except (QueueFull, DeadlineUnreachable):
                        break
                    parked.append(waiter)
                    ends[id(waiter)] = []
                clock.advance(float(op[2]))  # type: ignore[arg-type]
                core.tick(clock.now())
                collect()
                if leases:
                    leases.pop(0).release()
                collect()
        collect()
        queued = core.statistics().queued
        assert len(core._deadlines) <= 2 * queued + 65 + 1

    gate.set_limit(1000)
    collect()
    while leases:
        leases.pop().release()
        collect()
    clock.advance(100_000.0)
    core.tick(clock.now())
    collect()
    assert core.statistics().queued == 0
    assert core.statistics().in_flight == 0
    for waiter in parked:
        assert waiter.state != QUEUED
        assert len(ends[id(waiter)]) == 1, ends[id(waiter)]


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    fairness=st.sampled_from(["round_robin", "weighted", "tokens", "cost"]),
    order=st.sampled_from(["fifo", "shortest_first"]),
    tiers=st.sampled_from(sorted(TIER_SETS)),
)
def test_limited_requests_end_exactly_once_and_only_rejections_escape(
    ops: list[tuple[object, ...]], fairness: str, order: str, tiers: str
) -> None:
    _play(ops, fairness, order, tiers)
