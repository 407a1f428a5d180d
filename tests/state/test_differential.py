"""Differential: the same operations through `memory://` and through `redis://` (entering at a
follower, decided by the leader's core) give the same grants in the same order and the same
final state. One fake clock per deciding core, advanced identically; quiescence after each
operation (a barrier through the leader), so the comparison is deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fair_sched_plugin.core import (
    BackendGroup,
    BackendSnapshot,
    Deployment,
    Lease,
    MetricsGate,
    Ticket,
    TierLimits,
)
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.state import ReplicaScheduler, open_state
from fair_sched_plugin.state.groups import ModelGroups, sum_statistics
from fair_sched_plugin.testing import FakeClock

from .conftest import RedisServer, unique_prefix

pytestmark = pytest.mark.redis

TIERS = (TierLimits("interactive", waiting_below=2), TierLimits("batch", waiting_below=1))
URL = "http://engine/metrics"
# With leadership per model group: model "n" on its own engine, in a group of its own.
URLS = {"m": URL, "n": "http://engine-n/metrics"}
GROUPS = [("m", ["m"]), ("n", ["n"])]

submit = st.tuples(
    st.just("submit"),
    st.sampled_from("abc"),
    st.sampled_from(["interactive", "batch"]),
    st.sampled_from([1, 50, 400]),
)
cancel = st.tuples(st.just("cancel"), st.integers(0, 7))
first_byte = st.tuples(st.just("first_byte"), st.integers(0, 7))
end = st.tuples(st.just("end"), st.integers(0, 7), st.sampled_from([None, 5, 500]))
abandon = st.tuples(st.just("abandon"), st.integers(0, 7))
scrape = st.tuples(st.just("scrape"), st.integers(0, 3), st.integers(0, 4), st.booleans())
advance = st.tuples(st.just("advance"), st.sampled_from([0.2, 0.6, 1.5, 4.0]))
operations = st.lists(
    st.one_of(submit, submit, submit, cancel, first_byte, end, abandon, scrape, advance),
    min_size=10,
    max_size=40,
)
# Two models, each a group with its own leader: (…, price, model), scrapes of either engine.
grouped_submit = st.tuples(
    st.just("submit"),
    st.sampled_from("abc"),
    st.sampled_from(["interactive", "batch"]),
    st.sampled_from([1, 50, 400]),
    st.just(0.0),
    st.sampled_from("mn"),
)
grouped_scrape = st.tuples(
    st.just("scrape"), st.integers(0, 3), st.integers(0, 4), st.booleans(), st.sampled_from("mn")
)
grouped_operations = st.lists(
    st.one_of(
        grouped_submit,
        grouped_submit,
        grouped_submit,
        cancel,
        first_byte,
        end,
        abandon,
        grouped_scrape,
        advance,
    ),
    min_size=10,
    max_size=40,
)
# `fairness: cost`: tickets priced, ends reporting what they cost (or only their tokens, or
# nothing), as `finish_with_usage` does.
priced_submit = st.tuples(
    st.just("submit"),
    st.sampled_from("abc"),
    st.sampled_from(["interactive", "batch"]),
    st.sampled_from([10, 260]),
    st.sampled_from([0.0, 0.002, 0.05]),
)
costed_end = st.tuples(
    st.just("end"),
    st.integers(0, 7),
    st.sampled_from([None, 5, 500]),
    st.sampled_from([None, 0.0005, 0.002, 0.05]),
)
cost_operations = st.lists(
    st.one_of(
        priced_submit,
        priced_submit,
        priced_submit,
        cancel,
        first_byte,
        costed_end,
        costed_end,
        abandon,
        scrape,
        advance,
    ),
    min_size=10,
    max_size=40,
)


class Side:
    """One way of deciding: `entry` is where requests enter, `deciders` whose core decides for
    each model (one replica for every model, or each model's group leader)."""

    def __init__(
        self,
        entry: ReplicaScheduler,
        deciders: dict[str, ReplicaScheduler],
        clocks: list[FakeClock],
    ):
        self.entry = entry
        self.deciders = deciders
        self.clocks = clocks
        replicas = [entry, *deciders.values()]
        self.gates: list[Any] = [
            replica.gate for replica in {id(replica): replica for replica in replicas}.values()
        ]
        self.order: list[str] = []
        self.parked: list[tuple[str, asyncio.Task[Lease]]] = []
        self.held: list[Lease] = []
        self.count = 0

    async def play(self, operation: tuple[Any, ...]) -> None:
        kind = operation[0]
        if kind == "submit":
            self.count += 1
            label = f"{operation[1]}{self.count}"
            price = operation[4] if len(operation) > 4 else 0.0
            model = operation[5] if len(operation) > 5 else "m"
            ticket = Ticket(model, operation[1], operation[2], cost=operation[3], price=price)
            task = asyncio.ensure_future(self._request(label, ticket))
            self.parked.append((label, task))
        elif kind == "cancel" and self.parked:
            _, task = self.parked.pop(operation[1] % len(self.parked))
            task.cancel()
        elif kind == "first_byte" and self.held:
            self.held[operation[1] % len(self.held)].mark_started()
        elif kind == "end" and self.held:
            cost = operation[3] if len(operation) > 3 else None
            self.held.pop(operation[1] % len(self.held)).release(operation[2], cost_used=cost)
        elif kind == "abandon" and self.held:
            self.held.pop(operation[1] % len(self.held)).abandon()
        elif kind == "scrape":
            now = self.clocks[0].now()
            model = operation[4] if len(operation) > 4 else "m"
            url = URLS[model]
            snapshot = BackendSnapshot(url, now, operation[3], operation[1], operation[2])
            if not operation[3]:
                snapshot = BackendSnapshot.failed(url, now, "refused")
            for gate in self.gates:
                gate.update(model, snapshot)
        elif kind == "advance":
            for clock in self.clocks:
                clock.advance(operation[1])
        await self.quiesce()

    async def _request(self, label: str, ticket: Ticket) -> Lease:
        try:
            lease = await self.entry.acquire(ticket)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.order.append(f"{label}:{type(exc).__name__}")
            self.parked = [(name, task) for name, task in self.parked if name != label]
            raise
        self.order.append(label)
        self.parked = [(name, task) for name, task in self.parked if name != label]
        self.held.append(lease)
        return lease

    async def quiesce(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        await self.entry.barrier()
        for _ in range(5):
            await asyncio.sleep(0)

    def final_state(self) -> dict[str, Any]:
        cores = {id(decider): decider.core for decider in self.deciders.values()}.values()
        return {
            "statistics": sum_statistics([core.statistics() for core in cores]),
            "backlog": sorted(row for core in cores for row in core.backlog()),
            "gate": [
                row
                for model, decider in sorted(self.deciders.items())
                for row in decider.core.gate.status()  # type: ignore[attr-defined]
                if row.model == model
            ],
        }

    async def aclose(self) -> None:
        for _, task in self.parked:
            task.cancel()
        await asyncio.gather(*(task for _, task in self.parked), return_exceptions=True)


def deciding_replica(
    url: str, clock: FakeClock, fairness: str = "tokens", *, models: str = "m", **options: Any
) -> ReplicaScheduler:
    gate = MetricsGate(
        [
            BackendGroup(
                model,
                (Deployment(URLS[model], URLS[model]),),
                arrival_grace_s=0.5,
                fallback_max_inflight=2,
            )
            for model in models
        ],
        stale_after_s=1.0,
        clock=clock,
    )
    # `queue.max_total` bounds each deciding core: with a leader per group, each group's
    # (the two models' queues never reach 8 together here, so one core and two agree).
    max_total = 8 if len(models) == 1 else 80
    core = FairScheduler(
        TIERS,
        gate,
        fairness=fairness,
        max_per_user=3,
        max_total=max_total,
        max_wait_s=5.0,
        clock=clock,
    )
    return open_state(url, core, gate, **options)


@contextlib.asynccontextmanager
async def memory_side(fairness: str, models: str = "m") -> AsyncIterator[Side]:
    clock = FakeClock()
    replica = deciding_replica("memory://", clock, fairness, models=models)
    side = Side(replica, dict.fromkeys(models, replica), [clock])
    try:
        yield side
    finally:
        await side.aclose()
        await replica.aclose()


@contextlib.asynccontextmanager
async def redis_side(url: str, fairness: str, models: str = "m") -> AsyncIterator[Side]:
    options: dict[str, Any] = {"prefix": unique_prefix(), "heartbeat_s": 0.05, "lease_ttl_s": 5.0}
    if len(models) > 1:
        # The leader takes both groups, then hands one over after a lease TTL.
        options.update(lease_ttl_s=1.0, model_groups=GROUPS)
    clocks = [FakeClock(), FakeClock()]
    leader = deciding_replica(url, clocks[0], fairness, models=models, replica="leader", **options)
    follower = deciding_replica(
        url, clocks[1], fairness, models=models, replica="follower", **options
    )
    leader.start()
    try:
        for _ in range(400):
            if leader.leading:
                break
            await asyncio.sleep(0.01)
        follower.start()
        if len(models) > 1:
            deciders = await spread_over(leader, follower, models)
        else:
            for _ in range(400):
                if follower.state_statistics().leader == "leader":
                    break
                await asyncio.sleep(0.01)
            assert leader.leading and follower.state_statistics().leader == "leader"
            deciders = {"m": leader}
        side = Side(follower, deciders, clocks)
        try:
            yield side
        finally:
            await side.aclose()
    finally:
        await follower.aclose()
        await leader.aclose()


async def spread_over(
    leader: ReplicaScheduler, follower: ReplicaScheduler, models: str
) -> dict[str, ReplicaScheduler]:
    """Until each replica leads one model's group, both agree, and no new leader holds its
    grants any more (bounded)."""
    assert isinstance(leader, ModelGroups) and isinstance(follower, ModelGroups)
    by_name: dict[str | None, ReplicaScheduler] = {"leader": leader, "follower": follower}
    for _ in range(1000):
        names = {model: {r.leader_for(model) for r in (leader, follower)} for model in models}
        holding = any(
            member._term is not None and member._term.holding
            for replica in (leader, follower)
            for member in replica.members
        )
        if not holding and all(len(found) == 1 for found in names.values()):
            chosen = {model: next(iter(found)) for model, found in names.items()}
            if set(chosen.values()) == {"leader", "follower"}:
                return {model: by_name[name] for model, name in chosen.items()}
        await asyncio.sleep(0.01)
    raise AssertionError(f"the groups' leases did not spread: {names}")


def differential(examples: int) -> Any:
    """Hypothesis settings for these tests: deterministic, no deadline (Redis round trips)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


async def play_both(
    url: str, ops: list[tuple[Any, ...]], fairness: str = "tokens", models: str = "m"
) -> None:
    async with (
        memory_side(fairness, models) as memory,
        redis_side(url, fairness, models) as shared,
    ):
        for index, operation in enumerate(ops):
            await memory.play(operation)
            await shared.play(operation)
            assert shared.order == memory.order, (index, operation)
        assert shared.final_state() == memory.final_state()


@differential(25)
@given(ops=operations)
def test_memory_and_redis_grant_the_same(redis_server: RedisServer, ops: list[Any]) -> None:
    asyncio.run(asyncio.wait_for(play_both(redis_server.url, ops), 60))


@differential(25)
@given(ops=cost_operations)
# Two users backlogged behind an open gate, one asking for dear requests, one for cheap ones,
# ends reporting their cost: the cheap one is served more often between the dear one's turns.
@example(
    ops=[
        ("scrape", 0, 0, True),
        *[("submit", "a", "interactive", 260, 0.05)] * 3,
        *[("submit", "b", "interactive", 10, 0.002)] * 3,
        ("end", 0, 500, 0.05),
        ("end", 0, 5, 0.002),
        ("end", 0, 5, 0.0005),
        ("end", 0, 5, 0.0005),
    ]
)
def test_memory_and_redis_grant_the_same_under_cost_fairness(
    redis_server: RedisServer, ops: list[Any]
) -> None:
    """`fairness: cost` with each end's actual cost: a ticket's price and a lease's cost reach
    the leader's core as they reach a memory:// one. Before: the follower's tickets reached it
    priced at nothing and its ends without their cost, so users were served in turns there."""
    asyncio.run(asyncio.wait_for(play_both(redis_server.url, ops, "cost"), 60))


@differential(10)
@given(ops=grouped_operations)
def test_memory_and_redis_grant_the_same_with_a_leader_per_model(
    redis_server: RedisServer, ops: list[Any]
) -> None:
    """Two models, each its own group (`state_leadership: per_model`), one led by each
    replica: requests entering at one replica, for either model, are granted as one
    `memory://` core grants them (each model's queues and gate are its own)."""
    asyncio.run(asyncio.wait_for(play_both(redis_server.url, ops, models="mn"), 60))
