"""Leadership per model group (`state_leadership: per_model`): each group of models elects its
own fenced leader, so the fleet's decisions are spread over several replicas' event loops and a
leader's failure stalls only its group's models.

A group is a `RedisReplica` of its own (its own lease, epoch, inbox, reply lists, alive set and
statistics under `<prefix>g:<group>:`), all of one replica's groups over the replica's one core
and gate: a ticket goes to the group of its model, and a core that decides for two groups holds
both groups' tickets, each group's in its own term. The first group is the *home* group: it
owns what spans models (the budget book and its `$` spends) and every model no group names.
One group is the special case: `open_state` then builds a plain `RedisReplica` on today's keys.

Leases spread over the live replicas: a replica that already leads its share of the groups
(groups / replicas seen alive within a lease TTL's worth of heartbeats, rounded up) lets a free
lease wait two heartbeats for a replica that leads fewer, and a replica that leads two more
groups than another live one hands one over (resigns it) once it has led it for a lease TTL,
at most one a TTL. A free lease is still taken by somebody within the TTL plus a few
heartbeats.

Redis unreachable, each group falls back to a local term and rejoins on its own heartbeat; the
replica's one gate spends 1/n of each threshold of a group's models while that group is local,
and after it rejoined until the replicas it shared with are back too
(`MetricsGate.share_with(n, models)`; `RedisReplica._rejoin`).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable, Sequence

from ..core.backpressure import GroupStatus, MetricsGate
from ..core.budget import BudgetBook
from ..core.fairness_window import FairnessReading
from ..core.reads import SchedulerStatistics, UserBacklog
from ..core.ticket import Lease, Ticket
from ..runtime.driver import FairScheduler, Waiter
from .redis_replica import RedisReplica
from .replica import ReplicaScheduler, StateMode, StateStatistics

ModelGroup = tuple[str, tuple[str, ...]]  # (group name, its models)
# SchedulerStatistics: its counts, then the two per-key mappings.
_COUNTS = len(SchedulerStatistics._fields) - 2


def sum_statistics(parts: Sequence[SchedulerStatistics]) -> SchedulerStatistics:
    """Several deciding cores' statistics as one (counts added, per-key counts merged)."""
    counts = [sum(column) for column in zip(*(part[:_COUNTS] for part in parts), strict=True)]
    counts = counts or [0] * _COUNTS
    by_tier: dict[tuple[str, str], int] = {}
    by_model: dict[str, int] = {}
    for part in parts:
        for key, count in part.queued_by_model_tier.items():
            by_tier[key] = by_tier.get(key, 0) + count
        for model, count in part.in_flight_by_model.items():
            by_model[model] = by_model.get(model, 0) + count
    return SchedulerStatistics._make([*counts, by_tier, by_model])


class ModelGroups(ReplicaScheduler):
    """One replica's scheduler with a leader per model group: `ReplicaScheduler`'s surface,
    each ticket routed to its model's group (`member_for`)."""

    def __init__(
        self,
        core: FairScheduler,
        gate: MetricsGate | None,
        *,
        replica: str,
        groups: Sequence[ModelGroup],
        member: Callable[[str, ModelGroups], RedisReplica],
        tenure_s: float,
        heartbeat_s: float,
    ) -> None:
        if len(groups) < 2:
            raise ValueError("leadership per model group needs at least two groups")
        super().__init__(core, gate, replica=replica)
        self._mode = "shared"
        self.group_names = tuple(name for name, _ in groups)
        self._route = {model: index for index, (_, models) in enumerate(groups) for model in models}
        self._group_models = [models for _, models in groups]
        self.members = [member(name, self) for name in self.group_names]
        self._tenure_s = tenure_s
        self._handed_over_at = -math.inf
        # Replica -> the heartbeat (any group's, counted) that last saw it alive.
        self._seen: dict[str, int] = {}
        self._beats = 0
        self._beats_per_ttl = max(1, math.ceil(tenure_s / heartbeat_s))

    @property
    def coordinated(self) -> bool:
        return True

    @property
    def leading(self) -> bool:
        """True while this replica leads at least one group."""
        return any(member.leading for member in self.members)

    @property
    def mode(self) -> StateMode:
        return "local" if any(member.mode == "local" for member in self.members) else "shared"

    def group_of(self, model: str) -> int:
        """The index of `model`'s group (the home group, 0, for a model no group names)."""
        return self._route.get(model, 0)

    def member_for(self, model: str) -> RedisReplica:
        return self.members[self.group_of(model)]

    def leader_for(self, model: str) -> str | None:
        """The replica whose core decides for `model` (None: not known yet)."""
        return self.member_for(model).state_statistics().leader

    # ------------------------------------------------------------------ routed by model

    def enqueue(self, ticket: Ticket) -> Waiter:
        self._check_open()
        return self.member_for(ticket.model).enqueue(ticket)

    def try_acquire(self, ticket: Ticket) -> Lease | None:
        self._check_open()
        return self.member_for(ticket.model).try_acquire(ticket)

    def queued_of(self, model: str, tier: str, user: str) -> int:
        return self.member_for(model).queued_of(model, tier, user)

    def position_estimate(self, model: str, tier: str, user: str, own_index: int) -> int:
        return self.member_for(model).position_estimate(model, tier, user, own_index)

    def decides_for(self, model: str) -> bool:
        return self.member_for(model).decides

    # ------------------------------------------------------------------ every group

    @property
    def decides(self) -> bool:
        return any(member.decides for member in self.members)

    def add_end_listener(self, listener: Callable[[Lease, bool], object]) -> None:
        for member in self.members:
            member.add_end_listener(listener)

    def add_decider_listener(self, listener: Callable[[], None]) -> None:
        for member in self.members:
            member.add_decider_listener(listener)

    def share_budgets(self, book: BudgetBook) -> None:
        """The home group's leader keeps the book (spends of every model go there)."""
        self.members[0].share_budgets(book)

    def record_spend(self, principal: str, *, usd: float, tokens: int) -> None:
        self.members[0].record_spend(principal, usd=usd, tokens=tokens)

    def statistics(self) -> SchedulerStatistics:
        """Every deciding core's statistics added up, each core once: this replica's own for
        the groups it decides, each other leader's latest document once however many groups
        it leads, a group's own parked requests where no document is known."""
        by_core: dict[str, SchedulerStatistics] = {}
        for index, member in enumerate(self.members):
            if member.decides:
                by_core[self.replica] = member.statistics()
                continue
            leader = member.state_statistics().leader
            published = member.published_statistics()
            if leader is None or published is None:
                by_core[f" group {index}"] = member.statistics()
            else:
                by_core.setdefault(leader, published)
        return sum_statistics(list(by_core.values()))

    def gate_status(self) -> list[GroupStatus]:
        """Each model's row from the gate that decides for it (ours, or its leader's)."""
        own = self._gate.status() if self._gate is not None else []
        rows = []
        for index, member in enumerate(self.members):
            source = own if member.decides else member.gate_status()
            rows += [row for row in source if self.group_of(row.model) == index]
        return rows

    def backlog(self, model: str | None = None) -> list[UserBacklog]:
        if model is not None:
            return self.member_for(model).backlog(model)
        return [
            row
            for index, member in enumerate(self.members)
            for row in member.backlog()
            if self.group_of(row.model) == index
        ]

    def fairness(self) -> list[FairnessReading]:
        """Each model's fairness gauges from the core that decides for it."""
        return [
            reading
            for index, member in enumerate(self.members)
            for reading in member.fairness()
            if self.group_of(reading.model) == index
        ]

    def state_statistics(self) -> StateStatistics:
        """The home group's leader as `leader`, every group's in `leaders`; counters added up
        over the groups (each group falls back and rejoins on its own)."""
        parts = [member.state_statistics() for member in self.members]
        return StateStatistics(
            self.mode,
            self.replica,
            sum(part.fallbacks_total for part in parts),
            sum(part.recoveries_total for part in parts),
            sum(part.store_errors_total for part in parts),
            leader=parts[0].leader,
            replicas_alive=max(part.replicas_alive for part in parts),
            leaders=tuple(
                (name, part.leader) for name, part in zip(self.group_names, parts, strict=True)
            ),
        )

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Every term ends (its tickets left for the next leaders) before the shared core
        # closes: closing it first would refuse the other groups' tickets.
        for member in self.members:
            member._resign()
        for member in self.members:
            member.close()

    def start(self) -> None:
        for member in self.members:
            member.start()

    async def aclose(self) -> None:
        self.close()
        await asyncio.gather(*(member.aclose() for member in self.members))

    async def barrier(self) -> None:
        await asyncio.gather(*(member.barrier() for member in self.members))

    # ------------------------------------------------------------------ spreading (`Spread`)

    def _led(self) -> Counter[str]:
        """How many groups each replica leads in Redis, as this replica last saw them (a local
        term, while Redis was unreachable, is nobody's lease)."""
        led: Counter[str] = Counter()
        for member in self.members:
            if member.leading:
                led[self.replica] += 1
            elif member.mode == "shared" and not member.decides:
                leader = member.state_statistics().leader
                if leader is not None:
                    led[leader] += 1
        return led

    def saw_alive(self, group: RedisReplica) -> None:
        # Counted in heartbeats that reached Redis, not in seconds: after Redis restarted
        # empty, the first heartbeats see only themselves, and a replica that counted only
        # those would take every group and hand them out again one by one.
        self._beats += 1
        self._seen.update(dict.fromkeys(group.alive_replicas, self._beats))
        forget = self._beats - self._beats_per_ttl * len(self.members)
        self._seen = {name: beat for name, beat in self._seen.items() if beat >= forget}

    def may_contend(self, group: RedisReplica) -> bool:
        share = math.ceil(len(self.members) / max(1, len(self._seen)))
        return self._led()[self.replica] < share

    def shares_changed(self) -> None:
        # Each group's models their group's share: a group that rejoined first must not give
        # a group still local the whole threshold back, nor keep a group it leads again at a
        # local share. The home group's is every other model's (models nobody named).
        if self._gate is None:
            return
        self._gate.share_with(self.members[0].local_sharers)
        for index, member in enumerate(self.members[1:], start=1):
            self._gate.share_with(member.local_sharers, self._group_models[index])

    def hand_over(self, group: RedisReplica) -> bool:
        now = asyncio.get_running_loop().time()
        if group.led_since is None or now - group.led_since < self._tenure_s:
            return False
        if now - self._handed_over_at < self._tenure_s:
            return False
        led = self._led()
        if led[self.replica] - min(led[replica] for replica in group.alive_replicas) < 2:
            return False
        self._handed_over_at = now
        return True
