"""The indexes behind position estimates answer what the O(n) definitions answer.

Differential (hypothesis): random queues changed one request at a time; after every change
the fast answer equals the reference (`estimate_position` over the backlog, a list's index)."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_sched_plugin.core import (
    InflightLimitGate,
    Lease,
    TierLimits,
    UserBacklog,
    estimate_position,
)
from fair_sched_plugin.core.standing import ArrivalRanks, BacklogIndex, DepthIndex
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.testing import FakeClock, make_ticket

TIER_NAMES = ("interactive", "batch", "background")
USERS = "abcde"


def _check_against_reference(
    position: object, depths: dict[tuple[str, str, str], int], models: str
) -> None:
    """`position(model, tier, user, k)` for every (model, tier, user) and k in 1..depth+2."""
    for model in models:
        backlog = [
            UserBacklog(m, tier, user, depth, 0.0, 0.0)
            for (m, tier, user), depth in depths.items()
            if m == model and depth
        ]
        for tier in TIER_NAMES:
            for user in USERS:
                for k in range(1, depths.get((model, tier, user), 0) + 3):
                    expected = estimate_position(k, user, tier, backlog, TIER_NAMES)
                    assert position(model, tier, user, k) == expected, (model, tier, user, k)  # type: ignore[operator]


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.booleans(),
            st.sampled_from("mn"),
            st.sampled_from(TIER_NAMES),
            st.sampled_from(USERS),
        ),
        max_size=80,
    )
)
def test_backlog_index_positions_equal_estimate_position(
    ops: list[tuple[bool, str, str, str]],
) -> None:
    index = BacklogIndex(TIER_NAMES)
    depths: dict[tuple[str, str, str], int] = {}
    for add, model, tier, user in ops:
        key = (model, tier, user)
        if add:
            index.add(model, tier, user)
            depths[key] = depths.get(key, 0) + 1
        else:
            index.remove(model, tier, user)  # a request that is not there: nothing changes
            if depths.get(key):
                depths[key] -= 1
        assert index.depth(model, tier, user) == depths.get(key, 0)
        _check_against_reference(index.position, depths, "mn")


@given(st.lists(st.integers(0, 40), max_size=30), st.integers(1, 50))
def test_depth_index_capped_total_is_the_sum_of_capped_depths(depths: list[int], k: int) -> None:
    index = DepthIndex()
    for depth in depths:  # each queue grows one request at a time, as the scheduler's do
        for level in range(1, depth + 1):
            index.deeper(level)
    assert index.total == sum(depths)
    assert index.capped_total(k) == sum(min(depth, k) for depth in depths)
    for depth in depths:  # and shrinks the same way
        for level in range(depth, 0, -1):
            index.shallower(level)
    assert index.total == 0 and index.capped_total(k) == 0


@settings(max_examples=200)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 60)), max_size=300))
def test_arrival_ranks_equal_the_index_in_arrival_order(ops: list[tuple[bool, int]]) -> None:
    """Enough adds and discards to compact several times (slots are renumbered)."""
    ranks: ArrivalRanks[int] = ArrivalRanks()
    reference: list[int] = []
    for add, item in ops:
        if add:
            ranks.add(item)
            if item not in reference:
                reference.append(item)
        else:
            ranks.discard(item)
            if item in reference:
                reference.remove(item)
        assert list(ranks) == reference and len(ranks) == len(reference)
        for expected, present in enumerate(reference, start=1):
            assert ranks.rank(present) == expected


operations = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from(USERS), st.sampled_from(TIER_NAMES)),
        st.tuples(st.just("cancel"), st.integers(0, 60)),
        st.tuples(st.just("release"), st.integers(0, 60)),
        st.tuples(st.just("promote"), st.floats(0.5, 3.0)),
        st.tuples(st.just("limit"), st.integers(0, 3)),
    ),
    max_size=60,
)


class _Gate(InflightLimitGate):
    def set_limit(self, limit: int) -> None:
        self._default_limit = limit
        self._notify(None)


async def _play(ops: list[tuple[object, ...]], order: str) -> None:
    clock = FakeClock()
    gate = _Gate(1)
    gate.set_limit(0)  # closed until an operation opens it: requests queue
    tiers = (
        TierLimits("interactive", waiting_below=3),
        TierLimits("batch", waiting_below=1, promote_after_s=2.0),
        TierLimits("background", waiting_below=1, promote_after_s=2.0),
    )
    scheduler = FairScheduler(
        tiers,
        gate,
        clock=clock,
        max_per_user=6,
        max_wait_s=1000,
        order=order,  # type: ignore[arg-type]
    )
    tasks: list[asyncio.Task[Lease]] = []
    leases: list[Lease] = []
    for op in ops:
        kind = op[0]
        if kind == "submit":
            ticket = make_ticket(str(op[1]), tier=str(op[2]), cost=int(len(tasks) % 7 + 1))
            tasks.append(asyncio.ensure_future(scheduler.acquire(ticket)))
        elif kind == "cancel" and tasks:
            tasks[int(op[1]) % len(tasks)].cancel()
        elif kind == "release":
            done = [t for t in tasks if t.done() and not t.cancelled() and not t.exception()]
            leases.extend(t.result() for t in done if t.result() not in leases)
            live = [lease for lease in leases if lease.active]
            if live:
                live[int(op[1]) % len(live)].release()
        elif kind == "promote":
            clock.advance(float(op[1]))  # type: ignore[arg-type]
        elif kind == "limit":
            gate.set_limit(int(op[1]))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        depths = {(row.model, row.tier, row.user): row.depth for row in scheduler.backlog()}
        for (model, tier, user), depth in depths.items():
            assert scheduler.queued_of(model, tier, user) == depth
        _check_against_reference(scheduler.position_estimate, depths, "m")
    scheduler.close()
    for task in tasks:
        task.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, Lease):
            result.release()
    for lease in leases:
        lease.release()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, order=st.sampled_from(["fifo", "shortest_first"]))
def test_the_schedulers_position_estimate_equals_estimate_position_over_its_backlog(
    ops: list[tuple[object, ...]], order: str
) -> None:
    """Through submits, cancels, releases and promotions between tiers."""
    asyncio.run(_play(ops, order))
