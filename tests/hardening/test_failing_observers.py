"""Property: observers of a lease's end (spend, budgets, metrics, any end listener) and of an
admission may raise at any time; however they fail, every lease ends exactly once in the core,
the gate frees its slot, and nothing stays queued or in flight.

Before: the spend observer ran before the core heard of the end, so a charge that raised (a
400-digit `max_tokens` made it overflow) left the lease counted in flight for good, and an
admission observer that raised lost a granted lease that no request held."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_sched_plugin.core import Lease
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.service import Admission, SchedulingService

CONFIG: dict[str, Any] = {
    "tiers": [{"name": "interactive"}, {"name": "batch"}],
    "principals": [
        {
            "name": "alice",
            "keys": ["sk-a"],
            "tier": "interactive",
            "budget": {"tokens": 10**6, "per": "day"},
        },
        {
            "name": "bob",
            "keys": ["sk-b"],
            "tier": "interactive",
            "budget": {"tokens": 5000, "per": "day", "action": "demote", "demote_to": "batch"},
        },
    ],
    "unknown_model_max_inflight": 2,
    "fairness": "tokens",
}


class Faults:
    """Which observers raise now."""

    def __init__(self) -> None:
        self.failing: set[str] = set()

    def maybe_raise(self, where: str) -> None:
        if where in self.failing:
            raise RuntimeError(f"injected failure in {where}")


operations = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from(["alice", "bob"]), st.integers(1, 300)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("release"), st.integers(0, 30), st.integers(0, 500)),
        st.tuples(st.just("abandon"), st.integers(0, 30)),
        st.tuples(
            st.just("faults"),
            st.frozensets(st.sampled_from(["spend", "end", "admitted", "rejected", "budget"])),
        ),
    ),
    max_size=40,
)


async def _play(ops: list[tuple[Any, ...]], fairness: str) -> None:
    service = SchedulingService({**CONFIG, "fairness": fairness})
    faults = Faults()
    ended: list[Lease] = []

    def end_listener(lease: Lease, abandoned: bool) -> None:
        ended.append(lease)
        faults.maybe_raise("end")

    class Observer:
        def admitted(self, admission: Admission) -> None:
            faults.maybe_raise("admitted")

        def rejected(self, *args: object) -> None:
            faults.maybe_raise("rejected")

    service.scheduler.add_end_listener(end_listener)
    service.add_admission_observer(Observer())
    spend = service.budgets.spend

    def failing_spend(*args: Any, **kwargs: Any) -> None:
        faults.maybe_raise("budget")
        spend(*args, **kwargs)

    service.budgets.spend = failing_spend  # type: ignore[method-assign]
    record = service.scheduler.record_spend

    def failing_record(*args: Any, **kwargs: Any) -> None:
        faults.maybe_raise("spend")
        record(*args, **kwargs)

    service.scheduler.record_spend = failing_record  # type: ignore[method-assign]
    tasks: list[asyncio.Task[Admission]] = []
    async with service:
        for op in ops:
            kind = op[0]
            if kind == "admit":
                principal = service.identify(Credentials(api_key=f"sk-{op[1][0]}"))
                body = {"model": "m", "max_tokens": op[2], "messages": []}
                tasks.append(asyncio.create_task(service.admit(principal, "m", body)))
            elif kind == "cancel" and tasks:
                tasks[op[1] % len(tasks)].cancel()
            elif kind in ("release", "abandon") and tasks:
                task = tasks[op[1] % len(tasks)]
                if task.done() and not task.cancelled() and task.exception() is None:
                    lease = task.result().lease
                    if kind == "release":
                        lease.release(tokens_used=op[2])
                    else:
                        lease.abandon()
            elif kind == "faults":
                faults.failing = set(op[1])
            await asyncio.sleep(0)
        # Wind down with every observer still failing as it was: end what was granted.
        for _ in range(len(tasks) + 2):
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().lease.release()
            await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, Admission):
                result.lease.release()
        stats = service.scheduler.statistics()
        assert (stats.queued, stats.in_flight) == (0, 0)
        assert stats.completed_total + stats.abandoned_total == stats.released_total
        assert len(ended) == stats.released_total  # every end reached every listener once
        assert not service.observability.view.in_flight_by_user()
        # The gate freed every slot: both of the model's two go at once again.
        principal = service.identify(Credentials(api_key="sk-a"))
        ticket = service.ticket_for(principal, "(unknown models)", {"model": "m"})
        again = [service.scheduler.try_acquire(ticket) for _ in range(2)]
        assert all(lease is not None for lease in again)
        faults.failing = set()
        for lease in again:
            assert lease is not None
            lease.release()
        # Admissions whose observer raised still came back as admissions: none was lost.
        for result in results:
            assert isinstance(result, (Admission, asyncio.CancelledError, Exception))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, fairness=st.sampled_from(["round_robin", "weighted", "tokens"]))
def test_failing_observers_leak_no_lease_waiter_or_slot(
    ops: list[tuple[Any, ...]], fairness: str
) -> None:
    asyncio.run(_play(ops, fairness))
