"""Property: any interleaving of submit, cancel, release, timeout and gate changes (the
look-ahead's held users included) ends with nothing queued, nothing in flight, and every ticket
ended exactly once."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_sched_plugin.core import InflightLimitGate, Lease, Ticket, TierLimits
from fair_sched_plugin.errors import QueueFull, QueueTimeout, SchedulerClosed
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.testing import FakeClock

from .conftest import TIERS, ticket

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"), st.sampled_from("abcd"), st.sampled_from(["interactive", "batch"])
        ),
        st.tuples(st.just("cancel"), st.integers(0, 40)),
        st.tuples(st.just("release"), st.integers(0, 40), st.integers(0, 500)),
        st.tuples(st.just("advance"), st.floats(0.1, 6.0)),
        st.tuples(st.just("limit"), st.integers(0, 3)),
        # Users whose requests the gate would rather place elsewhere (the look-ahead skips them).
        st.tuples(st.just("held"), st.frozensets(st.sampled_from("abcd"))),
        st.tuples(
            st.just("yield"),
        ),
    ),
    max_size=60,
)


class _AdjustableGate(InflightLimitGate):
    held: frozenset[str] = frozenset()

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        return ticket.user in self.held

    def set_limit(self, limit: int) -> None:
        # 0 closes the gate entirely.
        self._default_limit = limit
        self._notify(None)


async def _play(ops: list[tuple[object, ...]], fairness: str, order: str) -> None:
    clock = FakeClock()
    gate = _AdjustableGate(1)
    scheduler = FairScheduler(
        TIERS,
        gate,
        clock=clock,
        fairness=fairness,  # type: ignore[arg-type]
        max_per_user=5,
        max_total=12,
        max_wait_s=10,
        order=order,  # type: ignore[arg-type]
    )
    outcomes: dict[int, list[str]] = {}
    tasks: list[asyncio.Task[None]] = []
    leases: list[Lease] = []

    async def client(number: int, user: str, tier: str) -> None:
        outcomes[number] = []
        try:
            lease = await scheduler.acquire(ticket(user, tier=tier, cost=50))
        except QueueFull:
            outcomes[number].append("full")
        except QueueTimeout:
            outcomes[number].append("timeout")
        except SchedulerClosed:
            outcomes[number].append("closed")
        except asyncio.CancelledError:
            outcomes[number].append("cancelled")
            raise
        else:
            outcomes[number].append("leased")
            leases.append(lease)

    for op in ops:
        kind = op[0]
        if kind == "submit":
            tasks.append(asyncio.create_task(client(len(tasks), str(op[1]), str(op[2]))))
        elif kind == "cancel" and tasks:
            tasks[int(op[1]) % len(tasks)].cancel()
        elif kind == "release" and leases:
            leases[int(op[1]) % len(leases)].release(tokens_used=int(op[2]))
        elif kind == "advance":
            clock.advance(float(op[1]))  # type: ignore[arg-type]
        elif kind == "limit":
            gate.set_limit(int(op[1]))
        elif kind == "held":
            gate.held = op[1]  # type: ignore[assignment]
        await asyncio.sleep(0)

    # Wind down: open the gate, end every lease, then close.
    gate.set_limit(1000)
    for _ in range(5):
        await asyncio.sleep(0)
    for lease in leases:
        lease.release()
    scheduler.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    for lease in leases:
        lease.release()

    stats = scheduler.statistics()
    assert stats.queued == 0
    assert stats.in_flight == 0
    assert gate.in_flight("m") == 0
    for number, ends in outcomes.items():
        assert len(ends) == 1, (number, ends)
    assert stats.completed_total + stats.abandoned_total == stats.released_total
    ended = {end[0] for end in outcomes.values()}
    assert ended <= {"full", "timeout", "closed", "cancelled", "leased"}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    fairness=st.sampled_from(["round_robin", "weighted", "tokens"]),
    order=st.sampled_from(["fifo", "shortest_first"]),
)
def test_every_ticket_ends_exactly_once(
    ops: list[tuple[object, ...]], fairness: str, order: str
) -> None:
    asyncio.run(_play(ops, fairness, order))
