"""One replica's scheduler: the unchanged core decides, wherever the deciding core runs.

A replica has two halves:

- **Its requests** (every replica): the tickets it parked and the leases it handed out. It tells
  *the acting leader* about each ticket, cancel, first byte and end, and waits for grants.
- **A leadership term** (only the acting leader; `term.py`): the core (`FairScheduler` + the
  replica's own `MetricsGate`) with every replica's tickets and leases in it, keyed by
  (replica, session, ticket id).

With `memory://` the replica is its own acting leader for good: its requests go straight into
its own term. With `redis://` one replica holds a fenced lease in Redis and is the acting leader
of all; the others send their messages through Redis and wait on their own reply list. When the
leader changes (a new epoch), every replica re-sends what it has (its in-flight leases, adopted
by the new leader's core, then its parked tickets) and ignores replies of older epochs, so
nothing is lost and nothing is granted twice. When Redis fails, the replica becomes the acting
leader of a local term over its own core, spending 1/n of the engine's thresholds (n: the
replicas it last saw alive), until Redis answers again.

This module is the replica on its own (`memory://`) and its requests wherever the acting
leader is; `redis_replica.py` adds the leader lease, the heartbeat and the message loops.
What travels through Redis, and how each value is read back, is `wire.py`; the budget book that
every replica shares is `budgets.py`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from ..core.backpressure import GroupStatus, MetricsGate
from ..core.budget import BudgetBook
from ..core.fairness_window import FairnessReading
from ..core.gate import AdmissionGate
from ..core.reads import DeadlineOutcomes, SchedulerStatistics, UserBacklog
from ..core.standing import BacklogIndex
from ..core.ticket import Lease, Ticket, TierLimits, notify_end_listeners
from ..errors import DeadlineUnreachable, QueueFull, SchedulerClosed
from ..runtime.driver import (
    Admissions,
    FairScheduler,
    Waiter,
    abandon_if_granted,
    grant,
    granted,
    new_wait,
    refuse,
)
from .budgets import SharedBudgets
from .term import Term
from .wire import (
    Published,
    Reply,
    adopted_body,
    end_body,
    error_from,
    follower_message,
    ticket_body,
    usage_in_range,
)

logger = logging.getLogger("fair_sched")

StateMode = Literal["shared", "local"]

# The epoch of a local term (memory://, or Redis unreachable); Redis epochs start at 1.
LOCAL_EPOCH = 0
# No leader known yet: messages are not sent (the re-send on learning the leader covers them).
NO_EPOCH = -1


class StateStatistics(NamedTuple):
    """How this replica takes part (for metrics and the status page)."""

    mode: StateMode
    replica: str
    fallbacks_total: int  # times Redis failed and this replica went local
    recoveries_total: int  # times it rejoined
    store_errors_total: int
    leader: str | None = None  # the replica whose core decides (this one when local)
    replicas_alive: int = 1
    # With leadership per model group (`state_model_groups`): (group, its leader) for each.
    leaders: tuple[tuple[str, str | None], ...] = ()


class _Parked:
    """One of this replica's tickets waiting for its grant (`ReplicaScheduler.enqueue`)."""

    __slots__ = ("_replica", "enqueued_at", "future", "ticket", "tid")

    def __init__(
        self,
        replica: ReplicaScheduler,
        ticket: Ticket,
        tid: int,
        future: asyncio.Future[Lease],
        enqueued_at: float,
    ) -> None:
        self._replica = replica
        self.ticket = ticket
        self.tid = tid
        self.future = future
        self.enqueued_at = enqueued_at

    def cancel(self) -> bool:
        """Leave the queue; True if the ticket was still parked here (a grant already on its
        way is handed back when it arrives)."""
        replica = self._replica
        if replica._unpark(self.tid) is None:
            return False
        replica._cancel(self.tid)
        return True

    def withdraw(self) -> None:
        """The caller will not use its turn: leave the queue, or hand back the lease it was
        granted and never used."""
        if not self.cancel():
            abandon_if_granted(self.future)


class ReplicaScheduler:
    """`FairScheduler`'s surface (`acquire`, `try_acquire`, `statistics`, `backlog`, `close`,
    `add_end_listener`, `tiers`, `gate`) for one replica, plus `start`/`aclose`.

    On its own (`memory://`) the replica is its own acting leader for good and nothing else
    runs; `RedisReplica` (`redis_replica.py`) follows the replica that holds the lease.
    """

    def __init__(
        self,
        core: FairScheduler,
        gate: MetricsGate | None = None,
        *,
        replica: str | None = None,
    ) -> None:
        self._core = core
        self._gate = gate
        self.replica = replica or uuid.uuid4().hex[:12]
        self._tids = itertools.count(1)
        self._session = 0
        self._parked: dict[int, _Parked] = {}
        # Their depths per (model, tier, user): a follower's position estimates, O(log n).
        self._parked_index = BacklogIndex([tier.name for tier in core.tiers])
        self._held: dict[int, Lease] = {}
        self._end_listeners: list[Callable[[Lease, bool], object]] = []
        self._closed = False
        # Whose core decides: our own term (`_term`), or the leader of `_epoch` through Redis.
        self._term: Term | None = None
        self._epoch = NO_EPOCH
        self._leader: str | None = None
        self._mode: StateMode = "local"
        self._alive: list[str] = [self.replica]
        self._published: Published | None = None
        self._decider_listeners: list[Callable[[], None]] = []
        self._counters = dict.fromkeys(("fallbacks", "recoveries", "store_errors"), 0)
        self._budgets: SharedBudgets | None = None
        if not self.coordinated:
            self._decide(Term(core, LOCAL_EPOCH, self._reply))

    # ------------------------------------------------------------------ FairScheduler's surface

    @property
    def tiers(self) -> tuple[TierLimits, ...]:
        return self._core.tiers

    @property
    def gate(self) -> AdmissionGate:
        return self._core.gate

    @property
    def core(self) -> FairScheduler:
        return self._core

    def deadline_outcomes(self) -> dict[str, DeadlineOutcomes]:
        """This process's core's: a follower's requests are counted by its leader's core."""
        return self._core.deadline_outcomes()

    @property
    def mode(self) -> StateMode:
        return self._mode

    @property
    def coordinated(self) -> bool:
        """True when replicas coordinate through Redis (`redis://`), False for `memory://`."""
        return False

    @property
    def leading(self) -> bool:
        """True while this replica's core decides for every replica on its Redis."""
        return False

    @property
    def admissions(self) -> Admissions:
        """Where this process's requests ask for their turn (`try_acquire`, `enqueue`): the
        replica itself, which relays them to the acting leader (`LocalScheduler`: the core)."""
        return self

    async def acquire(self, ticket: Ticket) -> Lease:
        """Wait for this ticket's turn among every replica's tickets; see `FairScheduler`."""
        return await granted(self.enqueue(ticket))

    def enqueue(self, ticket: Ticket) -> Waiter:
        """Park `ticket` among every replica's tickets; its `future` resolves to the lease.
        Raises `QueueFull` (or, where this replica leads, `DeadlineUnreachable`) at once."""
        self._check_open()
        self._check_tier(ticket.tier)
        now = self._core.clock.now()  # the service's time base, as the core's own leases
        parked = _Parked(self, ticket, next(self._tids), new_wait(), now)
        self._park(parked)
        self._submit(parked, raise_full=True)
        return parked

    def try_acquire(self, ticket: Ticket) -> Lease | None:
        """A lease now if this replica decides and the ticket would be released without
        waiting; None otherwise (a follower always asks the leader through `acquire`)."""
        self._check_open()
        self._check_tier(ticket.tier)
        term = self._term
        if term is None:
            return None
        tid = next(self._tids)
        granted = term.try_acquire((self.replica, self._session, tid), ticket)
        if granted is None:
            return None
        now = self._core.clock.now()
        lease = Lease(
            self,
            ticket,
            tid,
            enqueued_at=now,
            released_at=now,
            charged=granted.charged,
            deployment=granted.deployment,
            engine_rank=granted.engine_rank,
        )
        self._held[tid] = lease
        return lease

    def add_end_listener(self, listener: Callable[[Lease, bool], object]) -> None:
        """Call `listener(lease, abandoned)` when one of this replica's leases ends."""
        self._end_listeners.append(listener)

    def statistics(self) -> SchedulerStatistics:
        """The deciding core's statistics: ours while we decide, else the leader's latest
        published document (`state_statistics().leader` names it), else this replica's own."""
        if self._term is not None:
            return self._term.statistics()
        if self._published is None:
            return self._own_statistics()
        return self._published.scheduler

    def published_statistics(self) -> SchedulerStatistics | None:
        """The leader's latest published statistics (None: none read, or we decide)."""
        if self._term is not None or self._published is None:
            return None
        return self._published.scheduler

    def gate_status(self) -> list[GroupStatus]:
        """The deciding gate's status: ours while we decide, else the leader's published one."""
        if self._term is None and self._published is not None:
            return list(self._published.gate)
        return self._gate.status() if self._gate is not None else []

    def fairness(self) -> list[FairnessReading]:
        """The deciding core's fairness gauges: ours while we decide, else the leader's latest
        published ones (every replica exports the same values), else none."""
        if self._term is not None:
            return self._core.fairness()
        return list(self._published.fairness) if self._published is not None else []

    def backlog(self, model: str | None = None) -> list[UserBacklog]:
        """Backlogged users with their virtual times while we decide; a follower lists its own
        parked requests (virtual time 0.0: the leader holds it)."""
        if self._term is not None:
            return self._core.backlog(model)
        rows: dict[tuple[str, str, str], list[float]] = {}
        for parked in self._parked.values():
            t = parked.ticket
            if model is None or t.model == model:
                rows.setdefault((t.model, t.tier, t.user), []).append(parked.enqueued_at)
        return [
            UserBacklog(m, tier, user, len(times), min(times), 0.0)
            for (m, tier, user), times in rows.items()
        ]

    def queued_of(self, model: str, tier: str, user: str) -> int:
        """How many requests `user` has queued in `tier` of `model`: in the deciding core
        while we decide, else this replica's own (O(1))."""
        if self._term is not None:
            return self._core.queued_of(model, tier, user)
        return self._parked_index.depth(model, tier, user)

    def position_estimate(self, model: str, tier: str, user: str, own_index: int) -> int:
        """`waiting.estimate_position` over what `backlog(model)` lists, in O(tiers + log n)
        (`FairScheduler.position_estimate`)."""
        if self._term is not None:
            return self._core.position_estimate(model, tier, user, own_index)
        return self._parked_index.position(model, tier, user, own_index)

    @property
    def alive_replicas(self) -> tuple[str, ...]:
        """The replicas this one last saw alive (itself included)."""
        return tuple(self._alive)

    def state_statistics(self) -> StateStatistics:
        c = self._counters
        return StateStatistics(
            self._mode,
            self.replica,
            c["fallbacks"],
            c["recoveries"],
            c["store_errors"],
            leader=self.replica if self._term is not None else self._leader,
            replicas_alive=len(self._alive),
        )

    def close(self) -> None:
        """Refuse new tickets and fail waiting ones with `SchedulerClosed`. A leader's term
        ends without replies: the other replicas re-send their tickets to the next leader."""
        if self._closed:
            return
        self._closed = True
        for parked in list(self._parked.values()):
            if self._term is None:
                self._cancel(parked.tid)
            refuse(
                parked.future, SchedulerClosed("the scheduler is shutting down", retry_after_s=1)
            )
        self._parked.clear()
        self._parked_index.clear()
        self._resign()
        self._core.close()

    def _resign(self) -> None:
        """Closing: a leader of other replicas ends its term (see `close`)."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start what runs in the background (only a replica on Redis has any). Idempotent."""

    async def aclose(self) -> None:
        """Close (a replica on Redis also hands over and disconnects)."""
        self.close()

    async def barrier(self) -> None:
        """Return once the acting leader has handled everything this replica sent before and
        its replies have arrived (tests and benchmarks wait for quiescence with it)."""
        for _ in range(3):
            await asyncio.sleep(0)

    # ------------------------------------------------------------------ our requests

    def _submit(self, parked: _Parked, *, raise_full: bool) -> None:
        term = self._term
        if term is not None:
            try:
                term.submit((self.replica, self._session, parked.tid), parked.ticket)
            except (QueueFull, DeadlineUnreachable) as exc:
                self._unpark(parked.tid)
                if raise_full:
                    raise
                refuse(parked.future, exc)
            return
        self._tell("s", parked.tid, *ticket_body(parked.ticket))

    def _park(self, parked: _Parked) -> None:
        self._parked[parked.tid] = parked
        t = parked.ticket
        self._parked_index.add(t.model, t.tier, t.user)

    def _unpark(self, tid: int) -> _Parked | None:
        parked = self._parked.pop(tid, None)
        if parked is not None:
            t = parked.ticket
            self._parked_index.remove(t.model, t.tier, t.user)
        return parked

    def _cancel(self, tid: int) -> None:
        if self._term is not None:
            self._term.cancel((self.replica, self._session, tid))
        else:
            self._tell("c", tid)

    def lease_started(self, lease: Lease) -> None:
        if self._term is not None:
            self._term.started((self.replica, self._session, lease.lease_id))
        else:
            self._tell("b", lease.lease_id)

    def lease_ended(self, lease: Lease, tokens_used: int | None, *, abandoned: bool) -> None:
        self._held.pop(lease.lease_id, None)
        # The deciding core hears of the end first: an observer that raises (a spend that cannot
        # be counted) must not leave the lease counted in flight there for good.
        self._end(lease.lease_id, tokens_used, abandoned=abandoned, cost_used=lease.cost_used)
        notify_end_listeners(self._end_listeners, lease, abandoned)

    def _end(
        self,
        tid: int,
        tokens_used: int | None,
        *,
        abandoned: bool,
        cost_used: float | None = None,
    ) -> None:
        """Tell the deciding core that a lease ended, with what it used (tokens and money:
        `fairness: tokens` and `cost` correct the user's charge by them)."""
        tokens, cost, dropped = usage_in_range(tokens_used, cost_used)
        if dropped:
            logger.warning(
                "fair_sched replica %s: a lease ended with %s out of range; it is charged its "
                "estimate for that",
                self.replica,
                " and ".join(dropped),
            )
        if self._term is not None:
            key = (self.replica, self._session, tid)
            self._term.end(key, tokens, abandoned=abandoned, cost_used=cost)
        else:
            self._tell("e", tid, *end_body(tokens, abandoned=abandoned, cost_used=cost))

    def _on_reply(self, reply: Reply) -> None:
        """A grant or rejection of one of our tickets (from our own term, or from Redis)."""
        kind, epoch = reply[0], reply[1]
        if epoch != self._epoch or reply[2] != self._session:
            return  # an earlier leader's or an earlier session's: already re-sent
        tid = reply[3]
        parked = self._unpark(tid)
        if kind != "g":
            if parked is not None:
                refuse(parked.future, error_from(reply))
            return
        if parked is None or parked.future.done():
            if tid not in self._held:
                # Its request went away while the grant was on its way: hand it back unused.
                self._end(tid, None, abandoned=True)
            return
        lease = Lease(
            self,
            parked.ticket,
            tid,
            enqueued_at=parked.enqueued_at,
            released_at=self._core.clock.now(),
            charged=reply[4],
            deployment=reply[5],
            engine_rank=reply[6] if len(reply) > 6 else 0,  # sent only where it is not 0
        )
        self._held[tid] = lease
        grant(parked.future, lease)

    def _resend(self) -> None:
        """Tell a new acting leader everything we have: running leases first (so their
        capacity is counted before anything else is granted), then parked tickets in order."""
        term = self._term
        for tid, lease in list(self._held.items()):
            key = (self.replica, self._session, tid)
            if term is not None:
                term.adopt(key, lease.ticket, started=lease.started, deployment=lease.deployment)
            else:
                body = adopted_body(
                    lease.ticket, started=lease.started, deployment=lease.deployment
                )
                self._tell("a", tid, *body)
        for parked in sorted(self._parked.values(), key=lambda p: p.tid):
            self._submit(parked, raise_full=False)

    def _own_statistics(self) -> SchedulerStatistics:
        by_tier: dict[tuple[str, str], int] = {}
        for parked in self._parked.values():
            key = (parked.ticket.model, parked.ticket.tier)
            by_tier[key] = by_tier.get(key, 0) + 1
        by_model: dict[str, int] = {}
        for lease in self._held.values():
            by_model[lease.ticket.model] = by_model.get(lease.ticket.model, 0) + 1
        return SchedulerStatistics(
            queued=len(self._parked),
            in_flight=len(self._held),
            released_total=0,
            completed_total=0,
            cancelled_total=0,
            abandoned_total=0,
            rejected_full_total=0,
            timed_out_total=0,
            queued_by_model_tier=by_tier,
            in_flight_by_model=by_model,
        )

    # ------------------------------------------------------------------ terms

    @property
    def decides(self) -> bool:
        """Whether this replica's core decides now: with memory://, as the leader, or in a local
        term while Redis is unreachable. Only a deciding replica needs its engines' metrics."""
        return self._term is not None

    def decides_for(self, model: str) -> bool:
        """Whether this replica's core decides for `model` now (its engines' metrics are
        needed here); with one leader for every model, `decides`."""
        return self.decides

    def add_decider_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` each time this replica starts deciding."""
        self._decider_listeners.append(listener)

    def _decide(self, term: Term) -> None:
        """Decide from now on, in `term`: our running leases go into it, then our tickets."""
        self._term = term
        self._epoch = term.epoch
        self._leader = self.replica
        self._resend()
        for listener in self._decider_listeners:
            listener()

    # ------------------------------------------------------------------ messages

    def _tell(self, kind: str, tid: int, *body: Any) -> None:
        """Send the acting leader a message about our ticket or lease `tid`."""
        self._send(follower_message(kind, self._epoch, self._session, self.replica, tid, *body))

    def _send(self, message: list[Any]) -> None:
        """Queue `message` for the acting leader, another replica: only a replica on Redis
        (`RedisReplica`) follows one; a replica on its own always decides."""

    def _reply(self, replica: str, reply: Reply) -> None:
        """A term's grant or rejection for `replica`'s ticket (on its own: always ours)."""
        if replica == self.replica:
            self._on_reply(reply)

    # ------------------------------------------------------------------ budgets

    def share_budgets(self, book: BudgetBook) -> None:
        """Keep `book` the same on every replica (see `budgets.py`): the followers send the
        leader their spends (`record_spend`), the leader stores its book in Redis on every
        heartbeat and the followers load it."""
        self._budgets = SharedBudgets(book, self.replica)

    def record_spend(self, principal: str, *, usd: float, tokens: int) -> None:
        """What one of this replica's requests spent: into our book, and to the leader."""
        if self._budgets is None:
            return
        if self._budgets.spend(principal, usd=usd, tokens=tokens) and self._term is None:
            # A fact, not a request: the leader counts it whatever epoch it was sent in.
            self._tell("$", 0, principal, usd, tokens)

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise SchedulerClosed("the scheduler is shutting down", retry_after_s=1)

    def _check_tier(self, tier: str) -> None:
        if tier not in {t.name for t in self.tiers}:
            names = [t.name for t in self.tiers]
            raise ValueError(f"unknown tier {tier!r}; tiers are {names}")


class LocalScheduler(ReplicaScheduler):
    """`memory://`: this process's core decides for good, so its requests go to the core
    itself (`admissions`) and hold the core's own lease, with no replica bookkeeping between:
    one lease per request, from grant to end, carrying its actual usage. The replica's surface
    (statistics, backlog, close) reads the same core."""

    @property
    def admissions(self) -> Admissions:
        return self._core

    def try_acquire(self, ticket: Ticket) -> Lease | None:
        return self._core.try_acquire(ticket)

    def enqueue(self, ticket: Ticket) -> Waiter:
        return self._core.enqueue(ticket)

    def add_end_listener(self, listener: Callable[[Lease, bool], object]) -> None:
        """Told by the core when one of its leases ends, after the core and the gate heard."""
        self._core.add_end_listener(listener)
