"""The fair scheduler for several replicas: queues and the gate's credits live in a `StateStore`.

The algorithm is the one of `core.scheduler` and `core.backpressure`, run inside the store where
every replica sees the same queues: enqueueing, a lease's first byte or end, and a new engine
scrape each run the release decision atomically in the store. A replica keeps only what cannot be
shared: the futures its own requests wait on. Grants for its tickets come back from its own calls
or, when another replica released them, from the store's per-replica grant channel, so nothing
polls for decisions. A background tick (every `heartbeat_s`) only keeps this replica alive in the
store, purges replicas silent for `lease_ttl_s` (their tickets and leases), and probes a failed
store.

When the store fails, the replica falls back to its own in-memory `FairScheduler` (the same
metrics gate, thresholds per replica), logs a WARNING and counts it; waiting requests move over.
When the store answers again the replica rejoins under a fresh replica id, so whatever it left in
the store during the outage expires with the old id.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Literal, NamedTuple

from ..core.backpressure import BackendGroup
from ..core.scheduler import FairScheduler, SchedulerStatistics, UserBacklog
from ..core.snapshot import BackendSnapshot
from ..core.ticket import Lease, Ticket, TierLimits
from ..errors import QueueFull, QueueTimeout, SchedulerClosed, StateStoreError
from .store import Grant, ModelPolicy, SharedSnapshot, StateStore, StoreStatistics

logger = logging.getLogger("fair_sched")

StateMode = Literal["shared", "local"]


class StateStatistics(NamedTuple):
    """How this replica uses the shared store (for metrics and the status page)."""

    mode: StateMode
    replica: str
    fallbacks_total: int  # times the store failed and this replica went local
    recoveries_total: int  # times it rejoined the store
    store_errors_total: int


class _Fallback:
    """Sentinel result: the store failed while this request waited; queue it locally."""


_FALLBACK = _Fallback()


class _Waiter:
    __slots__ = ("deadline", "enqueued_at", "future", "ticket", "ticket_id")

    def __init__(
        self,
        ticket: Ticket,
        ticket_id: str,
        future: asyncio.Future[Lease | _Fallback],
        enqueued_at: float,
    ) -> None:
        self.ticket = ticket
        self.ticket_id = ticket_id
        self.future = future
        self.enqueued_at = enqueued_at
        self.deadline: asyncio.TimerHandle | None = None


class PolicyBook:
    """The `ModelPolicy` of each model, built once from the gate's groups and the settings."""

    def __init__(
        self,
        tiers: tuple[TierLimits, ...],
        groups: Mapping[str, BackendGroup],
        *,
        fairness: str,
        stale_after_s: float,
        unknown_max_inflight: int,
        max_per_user: int,
        max_total: int,
        lease_ttl_s: float,
    ) -> None:
        self._common = {
            "tiers": tiers,
            "fairness": fairness,
            "stale_after_s": stale_after_s,
            "unknown_max_inflight": unknown_max_inflight,
            "max_per_user": max_per_user,
            "max_total": max_total,
            "lease_ttl_s": lease_ttl_s,
        }
        self._groups = dict(groups)
        self._policies: dict[str, ModelPolicy] = {}
        self._unknown = ModelPolicy(**self._common)  # type: ignore[arg-type]

    def __call__(self, model: str) -> ModelPolicy:
        policy = self._policies.get(model)
        if policy is not None:
            return policy
        group = self._groups.get(model)
        if group is None:
            return self._unknown
        policy = self._policies[model] = ModelPolicy(
            metrics_urls=group.metrics_urls,
            arrival_grace_s=group.arrival_grace_s,
            fallback_max_inflight=group.fallback_max_inflight,
            **self._common,  # type: ignore[arg-type]
        )
        return policy


class SharedScheduler:
    """Duck-compatible with `FairScheduler` where the service uses it (`acquire`, `try_acquire`,
    `statistics`, `backlog`, `close`, leases), plus `start`/`aclose`/`on_snapshot`."""

    def __init__(
        self,
        store: StateStore,
        policies: Callable[[str], ModelPolicy],
        local: FairScheduler,
        *,
        max_wait_s: float = 600.0,
        heartbeat_s: float = 1.0,
        lease_ttl_s: float = 10.0,
        wall_clock: Callable[[], float] = time.time,
        replica_name: str | None = None,
    ) -> None:
        if lease_ttl_s <= heartbeat_s:
            raise ValueError("lease_ttl_s must be longer than heartbeat_s")
        self._store = store
        self._policies = policies
        self._local = local
        self._max_wait_s = max_wait_s
        self._heartbeat_s = heartbeat_s
        self._lease_ttl_s = lease_ttl_s
        self._wall = wall_clock
        self._name = replica_name or uuid.uuid4().hex[:12]
        self._epoch = 0
        self._replica = f"{self._name}.{self._epoch}"
        self._mode: StateMode = "shared"
        self._registered = False
        self._registering: asyncio.Future[None] | None = None
        self._waiters: dict[str, _Waiter] = {}
        self._leases: dict[int, Lease] = {}
        # Grants that arrived before the enqueue that created their ticket returned.
        self._orphans: dict[str, Grant] = {}
        self._enqueues_in_flight = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._tick_task: asyncio.Task[None] | None = None
        self._listen_task: asyncio.Task[None] | None = None
        self._publishing: dict[tuple[str, str], SharedSnapshot] = {}
        self._end_listeners: list[Callable[[Lease, bool], None]] = []
        self._closed = False
        self._store_closed = False
        self._counters = dict.fromkeys(
            (
                "released",
                "completed",
                "cancelled",
                "abandoned",
                "rejected_full",
                "timed_out",
                "fallbacks",
                "recoveries",
                "store_errors",
            ),
            0,
        )

    # ------------------------------------------------------------------ FairScheduler's surface

    @property
    def tiers(self) -> tuple[TierLimits, ...]:
        return self._local.tiers

    @property
    def gate(self) -> Any:
        return self._local.gate

    @property
    def scheduler(self) -> SharedScheduler:
        return self

    @property
    def mode(self) -> StateMode:
        return self._mode

    @property
    def replica(self) -> str:
        return self._replica

    async def acquire(self, ticket: Ticket) -> Lease:
        """Wait for this ticket's turn among every replica's tickets; see `FairScheduler`."""
        self._check_open()
        self._check_tier(ticket.tier)
        if self._mode == "shared" and not self._registered:
            await self._register()
        if self._mode == "local":
            return await self._local.acquire(ticket)
        outcome = await self._wait_shared(ticket)
        if isinstance(outcome, _Fallback):
            return await self._local.acquire(ticket)
        return outcome

    def try_acquire(self, ticket: Ticket) -> Lease | None:
        """Shared: always None (a decision needs the store, which `acquire` asks in one round
        trip). Local fallback: the local scheduler's answer."""
        self._check_open()
        self._check_tier(ticket.tier)
        if self._mode == "local":
            return self._local.try_acquire(ticket)
        return None

    def add_end_listener(self, listener: Callable[[Lease, bool], None]) -> None:
        self._end_listeners.append(listener)
        self._local.add_end_listener(listener)

    def statistics(self) -> SchedulerStatistics:
        """This replica's requests (shared and local fallback); `shared_statistics()` for all."""
        local = self._local.statistics()
        by_tier: dict[tuple[str, str], int] = dict(local.queued_by_model_tier)
        for waiter in self._waiters.values():
            key = (waiter.ticket.model, waiter.ticket.tier)
            by_tier[key] = by_tier.get(key, 0) + 1
        by_model: dict[str, int] = dict(local.in_flight_by_model)
        for lease in self._leases.values():
            by_model[lease.ticket.model] = by_model.get(lease.ticket.model, 0) + 1
        c = self._counters
        return SchedulerStatistics(
            queued=local.queued + len(self._waiters),
            in_flight=local.in_flight + len(self._leases),
            released_total=local.released_total + c["released"],
            completed_total=local.completed_total + c["completed"],
            cancelled_total=local.cancelled_total + c["cancelled"],
            abandoned_total=local.abandoned_total + c["abandoned"],
            rejected_full_total=local.rejected_full_total + c["rejected_full"],
            timed_out_total=local.timed_out_total + c["timed_out"],
            queued_by_model_tier=by_tier,
            in_flight_by_model=by_model,
        )

    def state_statistics(self) -> StateStatistics:
        c = self._counters
        return StateStatistics(
            self._mode, self._replica, c["fallbacks"], c["recoveries"], c["store_errors"]
        )

    async def shared_statistics(self) -> StoreStatistics:
        """Every replica's queues and leases, as the store sees them (raises StateStoreError)."""
        return await self._store.statistics([tier.name for tier in self.tiers])

    def backlog(self, model: str | None = None) -> list[UserBacklog]:
        """This replica's waiting requests by user (virtual times live in the store: 0.0 here)."""
        rows: dict[tuple[str, str, str], list[float]] = {}
        for waiter in self._waiters.values():
            t = waiter.ticket
            if model is None or t.model == model:
                rows.setdefault((t.model, t.tier, t.user), []).append(waiter.enqueued_at)
        result = [
            UserBacklog(m, tier, user, len(times), min(times), 0.0)
            for (m, tier, user), times in rows.items()
        ]
        return result + self._local.backlog(model)

    def close(self) -> None:
        """Refuse new tickets, fail waiting ones with `SchedulerClosed`, stop background tasks."""
        if self._closed:
            return
        self._closed = True
        self._local.close()
        for waiter in list(self._waiters.values()):
            if not waiter.future.done():
                waiter.future.set_exception(
                    SchedulerClosed("the scheduler is shutting down", retry_after_s=1)
                )
        for task in (self._tick_task, self._listen_task):
            if task is not None:
                task.cancel()

    def kick(self, model: str | None = None) -> None:
        if model is not None:
            self._spawn(self._release(model))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the heartbeat tick and the grant listener. Needs a running loop; idempotent."""
        if self._closed or self._tick_task is not None:
            return
        self._tick_task = asyncio.get_running_loop().create_task(
            self._tick(), name="fair-sched-state-tick"
        )

    async def aclose(self) -> None:
        """Close, let pending store updates (lease ends, cancels) finish briefly, disconnect."""
        self.close()
        await asyncio.sleep(0)  # let cancelled waiters queue their store cancels
        pending = [t for t in (*self._tasks, self._tick_task, self._listen_task) if t is not None]
        if pending:
            _, still = await asyncio.wait(pending, timeout=2.0)
            for task in still:
                task.cancel()
            await asyncio.gather(*still, return_exceptions=True)
        self._store_closed = True
        await self._store.aclose()

    def on_snapshot(self, model: str, snapshot: BackendSnapshot) -> None:
        """A watcher's scrape (loop-clock `started_at`): publish it and re-run decisions."""
        if self._closed or self._mode != "shared":
            return
        if not snapshot.ok:
            # No news for the others, but time passed: stale metrics may now mean the cap.
            self._spawn(self._release(model))
            return
        loop = asyncio.get_running_loop()
        shared = SharedSnapshot(
            url=snapshot.url,
            started_at=snapshot.started_at - loop.time() + self._wall(),
            waiting=snapshot.waiting,
            running=snapshot.running,
            tpot_s=snapshot.tpot_s,
            kv_usage=snapshot.kv_usage,
        )
        key = (model, snapshot.url)
        # Coalesce: while one publication of this deployment is on its way, keep only the newest.
        busy = key in self._publishing
        self._publishing[key] = shared
        if not busy:
            self._spawn(self._publish(model, key))

    # ------------------------------------------------------------------ waiting

    async def _wait_shared(self, ticket: Ticket) -> Lease | _Fallback:
        loop = asyncio.get_running_loop()
        enqueued_at = loop.time()
        policy = self._policies(ticket.model)
        replica = self._replica
        self._enqueues_in_flight += 1
        enqueue = asyncio.ensure_future(self._store.enqueue(replica, ticket, policy, self._wall()))
        try:
            result = await asyncio.shield(enqueue)
        except StateStoreError as exc:
            self._store_failed(exc)
            return _FALLBACK
        except BaseException:
            # Cancelled while the store queues the ticket: take it out again once we know it.
            enqueue.add_done_callback(self._undo_enqueue)
            raise
        finally:
            self._enqueues_in_flight -= 1
        if result.ticket_id is None:
            self._enqueue_done()
            self._counters["rejected_full"] += 1
            raise QueueFull(
                f"too many queued requests {'for this caller ' if result.full == 'user' else ''}"
                f"on model {ticket.model!r} (limit "
                f"{policy.max_per_user if result.full == 'user' else policy.max_total})",
                retry_after_s=1.0,
                scope=result.full or "user",
            )
        future: asyncio.Future[Lease | _Fallback] = loop.create_future()
        waiter = _Waiter(ticket, result.ticket_id, future, enqueued_at)
        self._waiters[result.ticket_id] = waiter
        orphan = self._orphans.pop(result.ticket_id, None)
        self._deliver([*result.grants, *([orphan] if orphan else [])])
        self._enqueue_done()
        if not future.done():
            waiter.deadline = loop.call_at(enqueued_at + self._max_wait_s, self._expire, waiter)
        try:
            return await future
        except BaseException as exc:
            if future.done() and not future.cancelled() and future.exception() is None:
                # Woken with a lease, then cancelled before it could be used: hand it back.
                outcome = future.result()
                if isinstance(outcome, Lease):
                    outcome.abandon()
            elif self._waiters.get(waiter.ticket_id) is waiter:
                if not isinstance(exc, (QueueTimeout, SchedulerClosed)):
                    self._counters["cancelled"] += 1
                self._spawn(self._cancel(replica, waiter.ticket_id))
            raise
        finally:
            if waiter.deadline is not None:
                waiter.deadline.cancel()
            if self._waiters.get(waiter.ticket_id) is waiter:
                del self._waiters[waiter.ticket_id]

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._counters["timed_out"] += 1
        waiter.future.set_exception(
            QueueTimeout(
                f"waited {self._max_wait_s:g} s without being scheduled on model "
                f"{waiter.ticket.model!r}; the engine is saturated",
                retry_after_s=1.0,
            )
        )

    def _undo_enqueue(self, enqueue: asyncio.Future[Any]) -> None:
        if enqueue.cancelled() or enqueue.exception() is not None:
            return
        result = enqueue.result()
        if result.ticket_id is not None:
            self._spawn(self._cancel(self._replica, result.ticket_id))
        for grant in result.grants:
            self._orphans[grant.ticket_id] = grant
        self._enqueue_done()

    def _enqueue_done(self) -> None:
        # Grants nobody claimed once no enqueue is outstanding belong to requests that are gone.
        if self._enqueues_in_flight == 0 and self._orphans:
            orphans, self._orphans = list(self._orphans.values()), {}
            for grant in orphans:
                self._spawn(self._abandon_grant(grant))

    def _deliver(self, grants: list[Grant]) -> None:
        loop = asyncio.get_running_loop()
        for grant in grants:
            waiter = self._waiters.get(grant.ticket_id)
            if waiter is None or waiter.future.done():
                if waiter is None and self._enqueues_in_flight:
                    self._orphans[grant.ticket_id] = grant
                else:
                    self._spawn(self._abandon_grant(grant))
                continue
            del self._waiters[grant.ticket_id]
            lease = Lease(
                self,
                waiter.ticket,
                grant.lease_id,
                enqueued_at=waiter.enqueued_at,
                released_at=loop.time(),
                charged=grant.charged,
            )
            self._leases[grant.lease_id] = lease
            self._counters["released"] += 1
            waiter.future.set_result(lease)

    # ------------------------------------------------------------------ leases (called by Lease)

    def lease_started(self, lease: Lease) -> None:
        model = lease.ticket.model
        self._spawn(self._store_call(self._store.started, model, lease.lease_id))

    def lease_ended(self, lease: Lease, tokens_used: int | None, *, abandoned: bool) -> None:
        self._leases.pop(lease.lease_id, None)
        self._counters["abandoned" if abandoned else "completed"] += 1
        for listener in self._end_listeners:
            listener(lease, abandoned)
        self._spawn(self._end(lease.ticket.model, lease.lease_id, tokens_used, abandoned))

    # ------------------------------------------------------------------ store calls

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        if self._store_closed:
            coroutine.close()
            return
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _store_call(self, method: Callable[..., Any], model: str, *args: Any) -> None:
        policy = self._policies(model)
        try:
            grants = await method(self._replica, model, *args, policy, self._wall())
        except StateStoreError as exc:
            self._store_failed(exc)
            return
        self._deliver(grants)

    async def _release(self, model: str) -> None:
        if self._mode == "shared":
            await self._store_call(self._store.release, model)

    async def _end(self, model: str, lease_id: int, tokens: int | None, abandoned: bool) -> None:
        policy = self._policies(model)
        try:
            grants = await self._store.end(
                self._replica,
                model,
                lease_id,
                policy,
                self._wall(),
                tokens_used=tokens,
                abandoned=abandoned,
            )
        except StateStoreError as exc:
            # The lease stays in the store until this replica id expires (lease_ttl_s).
            self._store_failed(exc)
            return
        self._deliver(grants)

    async def _abandon_grant(self, grant: Grant) -> None:
        # A grant for a request that is gone: end it unused (ends are idempotent in the store).
        await self._end(grant.model, grant.lease_id, None, True)

    async def _cancel(self, replica: str, ticket_id: str) -> None:
        try:
            outcome = await self._store.cancel(replica, ticket_id, self._wall())
        except StateStoreError as exc:
            self._store_failed(exc)
            return
        if outcome.state == "granted" and outcome.lease_id is not None and outcome.model:
            # Granted before the cancel arrived: the lease is handed back unused.
            await self._end(outcome.model, outcome.lease_id, None, True)

    async def _publish(self, model: str, key: tuple[str, str]) -> None:
        try:
            while self._mode == "shared":
                snapshot = self._publishing.get(key)
                if snapshot is None:
                    return
                try:
                    grants = await self._store.publish_snapshot(
                        self._replica, model, snapshot, self._policies(model), self._wall()
                    )
                except StateStoreError as exc:
                    self._store_failed(exc)
                    return
                self._deliver(grants)
                if self._publishing.get(key) is snapshot:
                    return  # nothing newer arrived meanwhile
        finally:
            self._publishing.pop(key, None)

    # ------------------------------------------------------------------ liveness and failures

    async def _register(self) -> None:
        if self._registering is None:
            self._registering = asyncio.ensure_future(self._heartbeat_once())
        await asyncio.shield(self._registering)

    async def _heartbeat_once(self) -> None:
        try:
            touched = await self._store.heartbeat(self._replica, self._wall(), self._lease_ttl_s)
        except StateStoreError as exc:
            self._store_failed(exc)
            return
        finally:
            self._registering = None
        if not self._registered:
            self._registered = True
            self._start_listener()
        for model in touched:
            self._spawn(self._release(model))

    def _start_listener(self) -> None:
        if self._closed:
            return
        if self._listen_task is None or self._listen_task.done():
            self._listen_task = asyncio.get_running_loop().create_task(
                self._listen(self._replica), name="fair-sched-grants"
            )
        self.start()

    async def _listen(self, replica: str) -> None:
        # Bounded waits (the store's block timeout); ends when this replica id is retired.
        while not self._closed and self._mode == "shared" and self._replica == replica:
            try:
                grants = await self._store.next_grants(replica, self._heartbeat_s)
            except StateStoreError as exc:
                self._store_failed(exc)
                return
            self._deliver(grants)

    async def _tick(self) -> None:
        while not self._closed:
            if self._mode == "shared":
                await self._heartbeat_once()
            else:
                await self._try_recover()
            await asyncio.sleep(self._heartbeat_s)

    async def _try_recover(self) -> None:
        try:
            await self._store.ping()
        except StateStoreError:
            return
        # Rejoin under a new id: tickets and leases left under the old one expire with it.
        self._epoch += 1
        self._replica = f"{self._name}.{self._epoch}"
        self._mode = "shared"
        self._registered = False
        self._counters["recoveries"] += 1
        logger.warning(
            "fair_sched state store is back: replica %s schedules through the shared store again",
            self._replica,
        )
        await self._heartbeat_once()

    def _store_failed(self, exc: StateStoreError) -> None:
        self._counters["store_errors"] += 1
        if self._mode == "local" or self._closed:
            return
        self._mode = "local"
        self._registered = False
        self._counters["fallbacks"] += 1
        logger.warning(
            "fair_sched state store unavailable (%s): replica %s falls back to in-memory "
            "scheduling (fairness and engine thresholds per replica) until it is back",
            exc,
            self._replica,
        )
        # Requests waiting in the store queue move to the local scheduler.
        for waiter in list(self._waiters.values()):
            if waiter.deadline is not None:
                waiter.deadline.cancel()
            if not waiter.future.done():
                waiter.future.set_result(_FALLBACK)
        self._waiters.clear()
        self._publishing.clear()

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise SchedulerClosed("the scheduler is shutting down", retry_after_s=1)

    def _check_tier(self, tier: str) -> None:
        if tier not in {t.name for t in self.tiers}:
            names = [t.name for t in self.tiers]
            raise ValueError(f"unknown tier {tier!r}; tiers are {names}")
