"""The in-process state store: the Lua scripts' semantics in plain Python, for one process.

It proves the algorithm does not depend on Redis (the contract tests run the same functions on
both stores) and lets several `SharedScheduler`s in one process share state in unit tests.
Each method runs without awaiting in the middle, which makes it atomic on one event loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..core.backpressure import engine_queue_estimate
from ..core.ticket import Ticket, TierLimits
from .store import (
    CancelOutcome,
    Enqueued,
    Grant,
    ModelPolicy,
    SharedSnapshot,
    StoreStatistics,
)


@dataclass
class _Ticket:
    ticket_id: str
    model: str
    tier: str
    user: str
    weight: float
    cost: int
    replica: str
    lease_id: int | None = None


@dataclass
class _Lease:
    lease_id: int
    ticket_id: str
    model: str
    tier: str
    user: str
    weight: float
    charged: float
    replica: str


@dataclass
class _Tier:
    queued: int = 0
    virtual_time: float = 0.0
    heap: list[tuple[float, int, str]] = field(default_factory=list)
    member: dict[str, int] = field(default_factory=dict)  # user -> live push sequence
    user_vt: dict[str, float] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    queues: dict[str, deque[str]] = field(default_factory=dict)


@dataclass
class _Model:
    queued: int = 0
    tiers: dict[str, _Tier] = field(default_factory=dict)
    leases: set[int] = field(default_factory=set)
    pending: dict[int, float] = field(default_factory=dict)  # lease id -> released at
    snapshots: dict[str, SharedSnapshot] = field(default_factory=dict)
    # Most requests seen running per deployment (the learned capacity), and the times of the
    # first bytes no deployment's latest scrape was sent after: as in core/backpressure.py.
    capacity: dict[str, float] = field(default_factory=dict)
    first_bytes: dict[int, float] = field(default_factory=dict)  # lease id -> time


class MemoryStore:
    """`StateStore` in this process (`memory://`)."""

    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self._queued = 0
        self._models: dict[str, _Model] = {}
        self._tickets: dict[str, _Ticket] = {}
        self._leases: dict[int, _Lease] = {}
        self._replicas: dict[str, float] = {}
        self._replica_tickets: dict[str, set[str]] = {}
        self._replica_leases: dict[str, set[int]] = {}
        self._grants: dict[str, deque[Grant]] = {}
        self._grant_events: dict[str, asyncio.Event] = {}
        self._policy = ModelPolicy(tiers=())
        self.closed = False

    # ------------------------------------------------------------------ primitives

    async def enqueue(
        self, replica: str, ticket: Ticket, policy: ModelPolicy, now: float
    ) -> Enqueued:
        self._policy = policy
        model = self._model(ticket.model)
        tier = self._tier(model, ticket.tier)
        queue = tier.queues.get(ticket.user)
        depth = len(queue) if queue else 0
        if depth >= policy.max_per_user:
            return Enqueued(None, [], full="user")
        if self._queued >= policy.max_total:
            return Enqueued(None, [], full="total")
        ticket_id = str(next(self._seq))
        self._tickets[ticket_id] = _Ticket(
            ticket_id,
            ticket.model,
            ticket.tier,
            ticket.user,
            float(ticket.weight),
            ticket.cost,
            replica,
        )
        self._replica_tickets.setdefault(replica, set()).add(ticket_id)
        if depth == 0:
            vt = max(self._user_vt(tier, ticket.user), tier.virtual_time)
            tier.user_vt[ticket.user] = vt
            self._push(tier, ticket.user, vt)
        tier.queues.setdefault(ticket.user, deque()).append(ticket_id)
        self._count_queued(model, tier, 1)
        return Enqueued(ticket_id, self._release(replica, ticket.model, policy, now))

    async def release(
        self, replica: str, model: str, policy: ModelPolicy, now: float
    ) -> list[Grant]:
        return self._release(replica, model, policy, now)

    async def started(
        self, replica: str, model: str, lease_id: int, policy: ModelPolicy, now: float
    ) -> list[Grant]:
        state = self._model(model)
        if state.pending.pop(lease_id, None) is not None:
            state.first_bytes[lease_id] = now
            # Older than any fresh scrape can be: they no longer matter (bounded in an outage).
            first_bytes, cutoff = state.first_bytes, now - policy.stale_after_s
            while first_bytes:
                oldest = next(iter(first_bytes))  # insertion order is time order
                if first_bytes[oldest] >= cutoff:
                    break
                del first_bytes[oldest]
        return self._release(replica, model, policy, now)

    async def end(
        self,
        replica: str,
        model: str,
        lease_id: int,
        policy: ModelPolicy,
        now: float,
        *,
        tokens_used: int | None,
        abandoned: bool,
    ) -> list[Grant]:
        self._end_lease(lease_id, policy, -1 if tokens_used is None else tokens_used, abandoned)
        return self._release(replica, model, policy, now)

    async def cancel(self, replica: str, ticket_id: str, now: float) -> CancelOutcome:
        ticket = self._tickets.get(ticket_id)
        if ticket is None:
            return CancelOutcome("gone")
        if ticket.lease_id is not None:
            return CancelOutcome("granted", ticket.lease_id, ticket.model)
        self._unqueue(ticket)
        return CancelOutcome("cancelled")

    async def publish_snapshot(
        self, replica: str, model: str, snapshot: SharedSnapshot, policy: ModelPolicy, now: float
    ) -> list[Grant]:
        state = self._model(model)
        old = state.snapshots.get(snapshot.url)
        if old is None or old.started_at < snapshot.started_at:
            state.snapshots[snapshot.url] = snapshot
            state.capacity[snapshot.url] = max(
                state.capacity.get(snapshot.url, 0.0), snapshot.running
            )
        latest = [state.snapshots.get(url) for url in policy.metrics_urls]
        if latest and all(s is not None for s in latest):
            sent = min(s.started_at for s in latest if s)
            for lease_id, started_at in list(state.first_bytes.items()):
                if started_at <= sent:
                    del state.first_bytes[lease_id]
            seen_until = sent - policy.arrival_grace_s
            for lease_id, released_at in list(state.pending.items()):
                if released_at <= seen_until:
                    del state.pending[lease_id]
        return self._release(replica, model, policy, now)

    async def heartbeat(self, replica: str, now: float, ttl_s: float) -> list[str]:
        self._replicas[replica] = now
        touched: set[str] = set()
        for dead, last in list(self._replicas.items()):
            if last >= now - ttl_s:
                continue
            for ticket_id in list(self._replica_tickets.pop(dead, ())):
                ticket = self._tickets.get(ticket_id)
                if ticket is not None:
                    self._unqueue(ticket)
                    touched.add(ticket.model)
            for lease_id in list(self._replica_leases.pop(dead, ())):
                model = self._end_lease(lease_id, self._policy, -1, False)
                if model is not None:
                    touched.add(model)
            self._grants.pop(dead, None)
            del self._replicas[dead]
        return sorted(touched)

    async def next_grants(self, replica: str, timeout_s: float) -> list[Grant]:
        grants = self._grants.get(replica)
        if not grants:
            event = self._grant_events.setdefault(replica, asyncio.Event())
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                return []
            grants = self._grants.get(replica)
        if not grants:
            return []
        result = list(grants)
        grants.clear()
        return result

    async def statistics(self, tiers: Sequence[str]) -> StoreStatistics:
        return StoreStatistics(
            queued=self._queued,
            replicas=len(self._replicas),
            queued_by_model_tier={
                (name, tier_name): tier.queued
                for name, model in self._models.items()
                for tier_name, tier in model.tiers.items()
                if tier.queued
            },
            in_flight_by_model={n: len(m.leases) for n, m in self._models.items() if m.leases},
            pending_by_model={n: len(m.pending) for n, m in self._models.items() if m.pending},
        )

    async def ping(self) -> None:
        return None

    async def aclose(self) -> None:
        self.closed = True

    # ------------------------------------------------------------------ the algorithm's data

    def _release(self, replica: str, name: str, policy: ModelPolicy, now: float) -> list[Grant]:
        model = self._model(name)
        out: list[Grant] = []
        while model.queued > 0:
            for limits in policy.tiers:
                tier = model.tiers.get(limits.name)
                if (
                    tier is not None
                    and tier.queued > 0
                    and not self._blocked(model, policy, limits, now)
                ):
                    self._grant_next(replica, name, model, limits.name, policy, now, out)
                    break
            else:
                break
        return out

    def _blocked(self, model: _Model, policy: ModelPolicy, limits: TierLimits, now: float) -> bool:
        in_flight = len(model.leases)
        deployments = len(policy.metrics_urls)
        if deployments == 0:
            return in_flight >= policy.unknown_max_inflight
        snapshots = []
        for url in policy.metrics_urls:
            snapshot = model.snapshots.get(url)
            if snapshot is None or now - snapshot.started_at > policy.stale_after_s:
                return in_flight >= policy.fallback_max_inflight * deployments
            snapshots.append(snapshot)
        waiting = sum(s.waiting for s in snapshots)
        free = sum(max(0.0, model.capacity.get(s.url, 0.0) - s.running) for s in snapshots)
        free = max(0.0, free - len(model.first_bytes))
        if (
            engine_queue_estimate(waiting, len(model.pending), free)
            >= limits.waiting_below * deployments
        ):
            return True
        tpot = _worst(s.tpot_s for s in snapshots)
        if limits.tpot_below_s is not None and tpot is not None and tpot >= limits.tpot_below_s:
            return True
        kv = _worst(s.kv_usage for s in snapshots)
        return limits.kv_usage_below is not None and kv is not None and kv >= limits.kv_usage_below

    def _grant_next(
        self,
        caller: str,
        name: str,
        model: _Model,
        tier_name: str,
        policy: ModelPolicy,
        now: float,
        out: list[Grant],
    ) -> None:
        tier = model.tiers[tier_name]
        user = self._pop_user(tier)
        queue = tier.queues[user]
        ticket = self._tickets[queue.popleft()]
        self._count_queued(model, tier, -1)
        vt = self._user_vt(tier, user)
        tier.virtual_time = max(tier.virtual_time, vt)
        charged = _charge(policy.fairness, ticket.weight, ticket.cost)
        vt += charged
        tier.user_vt[user] = vt
        tier.in_flight[user] = tier.in_flight.get(user, 0) + 1
        lease_id = next(self._seq)
        self._leases[lease_id] = _Lease(
            lease_id,
            ticket.ticket_id,
            name,
            tier_name,
            user,
            ticket.weight,
            charged,
            ticket.replica,
        )
        ticket.lease_id = lease_id
        self._replica_tickets.get(ticket.replica, set()).discard(ticket.ticket_id)
        self._replica_leases.setdefault(ticket.replica, set()).add(lease_id)
        model.leases.add(lease_id)
        model.pending[lease_id] = now
        if queue:
            self._push(tier, user, vt)
        else:
            del tier.queues[user]
        grant = Grant(ticket.ticket_id, lease_id, charged, name)
        if ticket.replica == caller:
            out.append(grant)
        else:
            self._grants.setdefault(ticket.replica, deque()).append(grant)
            event = self._grant_events.get(ticket.replica)
            if event is not None:
                event.set()

    def _end_lease(
        self, lease_id: int, policy: ModelPolicy, tokens: int, abandoned: bool
    ) -> str | None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        model = self._models[lease.model]
        tier = model.tiers[lease.tier]
        self._tickets.pop(lease.ticket_id, None)
        model.leases.discard(lease_id)
        model.pending.pop(lease_id, None)
        self._replica_leases.get(lease.replica, set()).discard(lease_id)
        left = tier.in_flight.get(lease.user, 0) - 1
        if left > 0:
            tier.in_flight[lease.user] = left
        else:
            tier.in_flight.pop(lease.user, None)
        correction = 0.0
        if abandoned:
            correction = -lease.charged
        elif tokens >= 0 and policy.fairness == "tokens":
            correction = _charge(policy.fairness, lease.weight, tokens) - lease.charged
        if correction:
            vt = max(tier.virtual_time, self._user_vt(tier, lease.user) + correction)
            tier.user_vt[lease.user] = vt
            if lease.user in tier.member:
                self._push(tier, lease.user, vt)
        self._forget_if_idle(tier, lease.user)
        return lease.model

    def _unqueue(self, ticket: _Ticket) -> None:
        del self._tickets[ticket.ticket_id]
        self._replica_tickets.get(ticket.replica, set()).discard(ticket.ticket_id)
        model = self._models[ticket.model]
        tier = model.tiers[ticket.tier]
        queue = tier.queues.get(ticket.user)
        if queue is None or ticket.ticket_id not in queue:
            return
        queue.remove(ticket.ticket_id)
        self._count_queued(model, tier, -1)
        if not queue:
            del tier.queues[ticket.user]
            tier.member.pop(ticket.user, None)
            self._forget_if_idle(tier, ticket.user)

    # ------------------------------------------------------------------ helpers

    def _model(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            model = self._models[name] = _Model()
        return model

    def _tier(self, model: _Model, name: str) -> _Tier:
        tier = model.tiers.get(name)
        if tier is None:
            tier = model.tiers[name] = _Tier()
        return tier

    def _count_queued(self, model: _Model, tier: _Tier, delta: int) -> None:
        self._queued += delta
        model.queued += delta
        tier.queued += delta

    @staticmethod
    def _user_vt(tier: _Tier, user: str) -> float:
        return tier.user_vt.get(user, tier.virtual_time)

    def _push(self, tier: _Tier, user: str, vt: float) -> None:
        seq = next(self._seq)
        tier.member[user] = seq
        heapq.heappush(tier.heap, (vt, seq, user))
        if len(tier.heap) > 64 and len(tier.heap) > 2 * len(tier.member):
            # Drop the entries re-pushes and cancels left behind (lazy deletion).
            tier.heap = [e for e in tier.heap if tier.member.get(e[2]) == e[1]]
            heapq.heapify(tier.heap)

    @staticmethod
    def _pop_user(tier: _Tier) -> str:
        while True:
            _, seq, user = heapq.heappop(tier.heap)
            if tier.member.get(user) == seq:
                del tier.member[user]
                return user

    @staticmethod
    def _forget_if_idle(tier: _Tier, user: str) -> None:
        if (
            user not in tier.queues
            and tier.in_flight.get(user, 0) <= 0
            and MemoryStore._user_vt(tier, user) <= tier.virtual_time
        ):
            tier.user_vt.pop(user, None)


def _charge(fairness: str, weight: float, tokens: int) -> float:
    if fairness == "round_robin":
        return 1.0
    if fairness == "weighted":
        return 1.0 / weight
    return max(tokens, 1) / weight


def _worst(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
