"""The fair scheduler's core: per-(model, tier, user) FIFOs, a fairness policy across users, strict
tiers. Sans-I/O, in the style of h11 and of vLLM's `Scheduler.schedule()`: synchronous, no event
loop, time read from an injected clock; events in, decisions out.

- **Events**: `submit` (a ticket parks, or `try_acquire` takes a turn at once), `cancel`, a
  lease's first byte and end (`Lease.mark_started` / `Lease.release`, which call back here), the
  gate's capacity changes (a scrape; `kick`), `tick(now)` for deadlines and promotions.
- **Decisions**: `_decided(parked, outcome)`, called once per parked ticket with its `Lease` or
  the `Rejected` error that ends its wait (a timeout, a close). The async driver
  (`fair_sched_plugin.runtime.driver.FairScheduler`) overrides it to resolve the caller's future; a
  test collects them. `next_due()` says when `tick` must next run: deadlines and promotions are
  data the next tick acts on, not timers.

Order inside a tier is start-time fair queuing: each backlogged user sits in a heap keyed
``(virtual_time, arrival_counter)``. Releasing a user's head request charges the user
(1 for round robin, 1/weight for weighted, tokens/weight for token-fair) and moves it back into the
heap at its new virtual time. A user who becomes backlogged is lifted to the tier's current virtual
time, so idleness cannot be banked. Every decision is O(log n) in backlogged users.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Literal, NamedTuple

from ..errors import DeadlineUnreachable, QueueFull, QueueTimeout, Rejected, SchedulerClosed
from .clock import Clock, MonotonicClock
from .deadlines import Deadlines
from .fairness import POLICIES, FairnessPolicy
from .fairness_window import DEFAULT_FAIRNESS_WINDOW_S, FairnessWindow
from .gate import AdmissionGate
from .queues import (
    CANCELLED,
    CLOSED,
    EXPIRED,
    GRANTED,
    QUEUED,
    UNREACHABLE,
    HeapEntry,
    ModelQueues,
    Parked,
    TierQueue,
    UserQueue,
)
from .reads import SchedulerReads
from .release_rate import RUN, start_after_s
from .shares import TierShares
from .ticket import Lease, Ticket, TierLimits

logger = logging.getLogger("fair_sched")

QueueOrder = Literal["fifo", "shortest_first"]

# When the fair head of a tier would be bound away from the deployment that has its prefix
# cached (`AdmissionGate.prefers_elsewhere`), at most this many users after it are considered
# before it goes anyway: each costs a heap pop and push, so a decision stays O(log n).
LOOKAHEAD = 5
# A held head is passed over by the look-ahead at most this many times; then it goes as if
# nobody were behind it (it spills into a free running slot, or waits for its own deployment).
# Without a cap, users whose deployment stays crowded (more prefixes homed there than on the
# others) fall behind the others without bound; with it, at most this many requests, after which
# the head moves to the deployment that frees a slot first and the homes rebalance.
MAX_PASSED_OVER = 8

# The wake-up for the deadlines (one for the earliest): `_wakeups` entries name a tier for its
# promotions, or this for the deadlines.
_DEADLINES = None
# A request is admitted only if its predicted start leaves this share of its wait to spare: the
# prediction cannot see the users who arrive after it and take turns ahead of it, nor the engine
# slowing down, so one admitted near its limit would likely be refused later (or time out).
# Parked, it is refused only once its prediction passes the deadline itself.
ADMIT_WITHIN = 0.6
# Lists rebuilt lazily (the promotions, the wake-ups) are rebuilt once their stale entries pass
# twice the live ones and this many: rare rebuilds, memory that follows the queue.
STALE_SLACK = 64
# A limited request's outcome for its deadline (`SchedulerCore._deadline_outcomes`).
MET, MISSED, REFUSED = range(3)


class Decision(NamedTuple):
    """A parked ticket's wait is over: its lease, or the `Rejected` error that ends it."""

    parked: Parked
    outcome: Lease | Rejected


class SchedulerCore(SchedulerReads):
    """Fair, tiered admission of requests to engines, behind an `AdmissionGate` (sans-I/O).

    `tiers` are listed most urgent first. A lower tier is served only when no higher tier of the
    same model has a releasable request.
    """

    def __init__(
        self,
        tiers: Iterable[TierLimits],
        gate: AdmissionGate,
        *,
        fairness: FairnessPolicy = "round_robin",
        max_per_user: int = 1000,
        max_total: int = 100_000,
        max_wait_s: float = 600.0,
        order: QueueOrder = "fifo",
        clock: Clock | None = None,
        fairness_window_s: float = DEFAULT_FAIRNESS_WINDOW_S,
    ) -> None:
        self._tiers = _with_reservations_below(tiers)
        if not self._tiers:
            raise ValueError("at least one tier is required")
        self._tier_index = {tier.name: index for index, tier in enumerate(self._tiers)}
        if len(self._tier_index) != len(self._tiers):
            raise ValueError("tier names must be unique")
        if fairness not in ("round_robin", "weighted", "tokens", "cost"):
            raise ValueError(f"unknown fairness policy {fairness!r}")
        if order not in ("fifo", "shortest_first"):
            raise ValueError(f"unknown queue order {order!r}")
        self._shortest_first = order == "shortest_first"
        # Round robin takes turns whatever the weights: each other backlogged user then goes
        # about once per own release, which a deadline's prediction counts on.
        self._takes_turns = fairness == "round_robin"
        self._shares = TierShares(self._tiers)
        self._shared_tiers = self._shares.shared
        self._policy = POLICIES[fairness]
        self._corrects = self._policy.corrects
        self._gate = gate
        self._max_per_user = max_per_user
        self._max_total = max_total
        self._max_wait_s = max_wait_s
        # Some tier keeps running slots free (`TierLimits.reserve_slots`).
        self._reserving = any(tier.reserve_slots for tier in self._tiers)
        # Per tier: how long its requests wait at most (the queue's limit or the tier's
        # shorter one), and whether that is a limit of their own (counted met or missed).
        self._tier_waits = tuple(
            (min(max_wait_s, tier.max_wait_s or max_wait_s), tier.max_wait_s is not None)
            for tier in self._tiers
        )
        self._clock: Clock = clock or MonotonicClock()
        self._models: dict[str, ModelQueues] = {}
        self._arrivals = itertools.count()
        self._lease_ids = itertools.count(1)
        self._queued_total = 0
        # One wake-up for the earliest deadline instead of one per waiter.
        self._deadlines = Deadlines()
        # When `tick` must run: (due, order, the tier to promote in or `_DEADLINES`). An entry
        # whose due no longer matches its tier's (or the deadlines') is stale and skipped.
        self._wakeups: list[tuple[float, int, TierQueue | None]] = []
        self._wakeup_order = itertools.count()
        # Past this many, the stale wake-ups are dropped (`_wake_at`).
        self._wakeups_bound = STALE_SLACK
        self._outbox: list[Decision] = []
        self._closed = False
        self._released_total = 0
        self._completed_total = 0
        self._cancelled_total = 0
        self._abandoned_total = 0
        self._rejected_full_total = 0
        self._timed_out_total = 0
        # Per tier, of the requests with a limit shorter than the queue's (their tier's or their
        # client's): [started in time, waited it out, refused at once as out of reach].
        self._deadline_outcomes: dict[str, list[int]] = {}
        self._end_listeners: list[Callable[[Lease, bool], object]] = []
        self._fairness_window = FairnessWindow(fairness_window_s, fairness)
        gate.set_listener(self._on_capacity)

    # ------------------------------------------------------------------ public API

    @property
    def tiers(self) -> tuple[TierLimits, ...]:
        return self._tiers

    @property
    def gate(self) -> AdmissionGate:
        return self._gate

    def try_acquire(self, ticket: Ticket) -> Lease | None:
        """A lease now if the ticket would be released without waiting, else None.

        It never jumps a queue: anything queued for the same model in this or a higher tier
        comes first.
        """
        if self._closed:
            self._check_open()
        # One method from the ticket to the lease: this runs for every admission.
        tier_index = self._tier_index.get(ticket.tier)
        if tier_index is None:
            tier_index = self._tier_position(ticket.tier)  # raises the ValueError
        model = ticket.model
        queues = self._models.get(model)
        if queues is not None:
            for tier in queues.tiers[: tier_index + 1]:
                if tier.queued:
                    return None
        limits = self._tiers[tier_index]
        gate = self._gate
        if not gate.may_release(model, limits):
            # Past a closed gate only into a reserved slot, or as a newcomer where the engine
            # orders its own queue.
            if queues is None:
                queues = self._model_queues(model)
            known = queues.tiers[tier_index].users.get(ticket.user)
            if not self._may_go_into_reserve(model, limits, known) and (
                not queues.orders_engine_queue
                or not self._may_go_as_newcomer(model, limits, known, ticket.weight)
            ):
                return None
        elif gate.waits_for_home(ticket, limits):
            return None  # parked, it goes when its deployment has room (`_release_next`)
        if queues is None:
            queues = self._model_queues(model)
        tier = queues.tiers[tier_index]
        user_queue = tier.users.get(ticket.user) or tier.user_queue(ticket.user)
        if user_queue.virtual_time < tier.virtual_time:
            user_queue.lift()
        now = self._clock.now()
        deployment = gate.place(ticket, limits)
        if ticket.max_wait_s is not None or limits.max_wait_s is not None:
            self._count_deadline(limits.name, MET)
        return self._make_lease(queues, user_queue, ticket, now, deployment, released_at=now)

    def _may_go_as_newcomer(
        self, model: str, limits: TierLimits, user_queue: UserQueue | None, weight: float
    ) -> bool:
        """Where the gate holds the tier back: the user's next request (None: a user not seen
        yet) would be in the engine's first round (`Fairness.engine_round` 0), whose queue is in
        user order and has room for a newcomer (`AdmissionGate.may_release_newcomer`), so it goes
        first there. Not with tier shares: their releases are counted against each other by the
        same test for everyone."""
        if self._shared_tiers or not self._gate.may_release_newcomer(model, limits):
            return False
        return user_queue is None or self._policy.engine_round(user_queue.unstarted, weight) <= 0

    def _may_go_into_reserve(
        self, model: str, limits: TierLimits, user_queue: UserQueue | None
    ) -> bool:
        """Where the gate holds the tier back: the user holds no slot (None: a user not seen
        yet) and the tier's reserved running slots have room (`reserve_slots`). Not with tier
        shares: their releases are counted against each other by the same test for everyone."""
        if not limits.reserve_slots or self._shared_tiers:
            return False
        if user_queue is not None and user_queue.in_flight:
            return False
        return self._gate.may_release_into_reserve(model, limits)

    def submit(self, ticket: Ticket, ref: object = None) -> Parked:
        """Park `ticket` and run the release decision (which may decide it at once: see
        `_decided`). `ref` is the caller's, kept on the `Parked` unread. Raises `QueueFull`
        at once when a cap is reached, `DeadlineUnreachable` when its place in the queue and the
        measured drain rate say it cannot start before its deadline, `SchedulerClosed` once
        closed."""
        if self._closed:
            self._check_open()
        # One method from the ticket to the decision: this runs for every admission.
        tier_index = self._tier_index.get(ticket.tier)
        if tier_index is None:
            tier_index = self._tier_position(ticket.tier)  # raises the ValueError
        queues = self._models.get(ticket.model) or self._model_queues(ticket.model)
        tier = queues.tiers[tier_index]
        user_queue = tier.users.get(ticket.user)
        if user_queue is not None and user_queue.depth >= self._max_per_user:
            self._rejected_full_total += 1
            raise QueueFull(
                f"too many queued requests for this caller on model {ticket.model!r} "
                f"(limit {self._max_per_user})",
                retry_after_s=self._retry_hint(queues),
                scope="user",
            )
        if self._queued_total >= self._max_total:
            self._rejected_full_total += 1
            raise QueueFull(
                f"the scheduler queue is full (limit {self._max_total})",
                retry_after_s=self._retry_hint(queues),
                scope="total",
            )
        now = self._clock.now()
        # Its deadline: the shortest of the queue's limit, its tier's and its client's.
        wait, limited = self._tier_waits[tier_index]
        client_wait = ticket.max_wait_s
        if client_wait is not None:
            limited = True
            if client_wait < wait:
                wait = client_wait
        deadline = now + wait
        depth = user_queue.depth if user_queue is not None else 0
        # Earliest deadline first inside the user's own queue: almost always behind its tail
        # (the same limit, a later arrival); an earlier deadline walks back past the later ones.
        # Without a limit of its own its deadline is the latest there is: behind its tail.
        insert_at = None
        if limited and depth and not self._shortest_first:
            waiters = user_queue.waiters  # type: ignore[union-attr]
            if waiters[-1].deadline > deadline:
                insert_at = len(waiters)
                while insert_at and waiters[insert_at - 1].deadline > deadline:
                    insert_at -= 1
        # A limit of its own, someone ahead: refuse now what cannot start in time (never
        # without a rate), with room to spare (`ADMIT_WITHIN`). The queue's own limit
        # (minutes) is a bound for everyone, not a deadline worth predicting.
        if limited and queues.queued and (rate := queues.drain.rate(now)):
            if self._shortest_first:
                own_index = 1  # its place among its own depends on sizes: assume the best
            elif insert_at is None:
                own_index = depth + 1
            else:
                # Left entries walked past count too: an index no later than its own.
                own_index = max(1, depth + 1 - (len(waiters) - insert_at))
            position = self._position(tier, user_queue, own_index, ticket)
            if start_after_s(position, rate) > ADMIT_WITHIN * wait:
                self._count_deadline(tier.limits.name, REFUSED)
                raise self._unreachable(ticket, position, rate, deadline - now, 0.0)
        if user_queue is None:
            user_queue = tier.user_queue(ticket.user)
        waiter = Parked(ticket, now, user_queue, ref, deadline, limited)
        if not depth:
            if user_queue.virtual_time < tier.virtual_time:
                user_queue.lift()
            arrival = next(self._arrivals)
            # A new backlog period (`UserQueue.became_backlogged`, inline: on the admission
            # path of every user whose queue was empty).
            user_queue.backlog_since = arrival
            user_queue.waiting_since = waiter.enqueued_at
            tier.push(user_queue, arrival)
        if self._shortest_first:
            heapq.heappush(user_queue.sized, (ticket.cost, next(self._arrivals), waiter))
        elif insert_at is None:
            user_queue.waiters.append(waiter)
        else:
            user_queue.waiters.insert(insert_at, waiter)
        user_queue.depth = depth = depth + 1
        tier.depths.deeper(depth)
        if tier.promotes:
            self._track_promotion(tier, waiter)
        tier.queued += 1
        if not queues.queued:
            queues.drain.backlog_began(now)
        queues.queued += 1
        self._queued_total += 1
        if limited:
            due = self._deadlines.add(waiter, self._queued_total)
        else:
            due = self._deadlines.add_latest(waiter, self._queued_total)
        if due is not None:
            self._wake_at(due, _DEADLINES)
        self._dispatch_queues(queues)
        return waiter

    def cancel(self, parked: Parked) -> bool:
        """The ticket leaves its queue; True if it was still queued (it will never be decided).

        False once it was granted, timed out or failed: a granted lease is the caller's to
        `abandon()` (or use).
        """
        if parked.state != QUEUED:
            return False
        self._remove_waiter(parked, CANCELLED)
        self._cancelled_total += 1
        return True

    def tick(self, now: float) -> None:
        """Act on what is due by `now`: promote waiters that waited `promote_after_s`, refuse
        those past their deadline (`QueueTimeout`). Run it at `next_due()`."""
        wakeups = self._wakeups
        while wakeups and wakeups[0][0] <= now:
            due, _, tier = heapq.heappop(wakeups)
            if tier is _DEADLINES:
                if due == self._deadlines.armed_due:
                    self._deadlines.armed_due = None
                    self._expire_overdue(now)
            elif due == tier.promote_due:
                tier.promote_due = None
                self._promote_due(tier, now)

    def next_due(self) -> float | None:
        """When `tick` must next run (None: nothing is waiting for a deadline or promotion).
        Possibly early (a cancelled head's wake-up): `tick` then does nothing and the next one
        is due later."""
        return self._wakeups[0][0] if self._wakeups else None

    def _wake_at(self, due: float, tier: TierQueue | None) -> None:
        wakeups = self._wakeups
        heapq.heappush(wakeups, (due, next(self._wakeup_order), tier))
        if len(wakeups) > self._wakeups_bound:
            # A deadline earlier than the one armed arms a wake-up of its own and leaves the
            # other stale until its due time (a day at most): clients asking for ever shorter
            # limits, each cancelled, would grow the heap by one per request. At most one is
            # live for the deadlines and one per tier; rebuild once the stale outnumber them.
            armed = self._deadlines.armed_due
            wakeups[:] = [
                entry
                for entry in wakeups
                if entry[0] == (armed if entry[2] is _DEADLINES else entry[2].promote_due)
            ]
            heapq.heapify(wakeups)
            self._wakeups_bound = 2 * len(wakeups) + STALE_SLACK

    def take_decisions(self) -> list[Decision]:
        """The decisions made since the last call, in order (what `_decided` collects when no
        driver overrides it)."""
        decisions, self._outbox = self._outbox, []
        return decisions

    def _gone(self, parked: Parked) -> bool:
        """Whether `parked`'s waiting side went away before the core heard of it (a cancelled
        task whose cleanup has not run yet): nothing to grant. Only a driver knows its waiters;
        without one, a grant is always taken."""
        return False

    def _decided(self, parked: Parked, outcome: Lease | Rejected) -> None:
        """A parked ticket's wait is over: `outcome` is its lease, or why it will never get one.
        Collected for `take_decisions`; the driver overrides this to resolve the waiting side's
        future at once."""
        self._outbox.append(Decision(parked, outcome))

    def adopt(self, ticket: Ticket, *, started: bool, deployment: str | None = None) -> Lease:
        """A lease for a request already in the engine that this scheduler did not grant (a
        replica reporting its live requests to a new leader): counted in flight and by the
        gate (against `deployment`, where it was bound), never queued, and not charged
        (fairness history restarts with the new leader)."""
        self._check_open()
        queues = self._model_queues(ticket.model)
        user_queue = queues.tiers[self._tier_position(ticket.tier)].user_queue(ticket.user)
        now = self._clock.now()
        lease = self._make_lease(
            queues, user_queue, ticket, enqueued_at=now, charge=0.0, deployment=deployment
        )
        if started:
            lease.mark_started()
        return lease

    def add_end_listener(self, listener: Callable[[Lease, bool], object]) -> None:
        """Call `listener(lease, abandoned)` whenever a lease ends."""
        self._end_listeners.append(listener)

    def close(self) -> None:
        """Refuse new tickets and fail every queued waiter with `SchedulerClosed`.

        Leases already granted stay valid until released.
        """
        if self._closed:
            return
        self._closed = True
        self._wakeups.clear()
        for queues in self._models.values():
            for tier in queues.tiers:
                tier.promote_due = None
                tier.promoting.clear()
                for user_queue in list(tier.users.values()):
                    for parked in user_queue.live():
                        self._remove_waiter(parked, CLOSED)
                        if not self._gone(parked):
                            self._decided(
                                parked,
                                SchedulerClosed("the scheduler is shutting down", retry_after_s=1),
                            )
        self._deadlines.clear()

    def kick(self, model: str | None = None) -> None:
        """Re-run release decisions (what a gate's listener does)."""
        self._on_capacity(model)

    # ------------------------------------------------------------------ waiting

    def _remove_waiter(self, waiter: Parked, new_state: int) -> None:
        """Take a queued waiter out of every structure (idempotent through `state`)."""
        if waiter.state != QUEUED:
            return
        waiter.state = new_state
        user_queue = waiter.user_queue
        tier = user_queue.tier_queue
        queues = self._models[tier.model]
        queues.queued -= 1
        self._queued_total -= 1
        still_queued = user_queue.tier_queue.leave(user_queue)
        if still_queued and len(user_queue.waiters) + len(user_queue.sized) > (
            2 * user_queue.depth + 16
        ):
            # Marked entries outnumber the live ones: rebuild, so submit-and-cancel abuse
            # cannot grow the queue (amortised O(1) per cancellation).
            user_queue.compact()
        self._deadlines.compact(self._queued_total)

    # ------------------------------------------------------------------ releasing

    def _on_capacity(self, model: str | None) -> None:
        names = list(self._models) if model is None else [model]
        for name in names:
            queues = self._models.get(name)
            if queues is not None:
                self._dispatch_queues(queues)

    def _dispatch_queues(self, queues: ModelQueues) -> None:
        if not queues.queued:
            return
        if queues.dispatching:
            # Called back from inside a release (a gate notified us): run once more afterwards.
            queues.redispatch = True
            return
        queues.dispatching = True
        gate = self._gate
        model = queues.model
        passable = queues.closed_gate_passable
        try:
            while True:
                queues.redispatch = False
                # Release while some tier, most urgent first, has a request the gate lets go.
                while queues.queued:
                    if self._shared_tiers:
                        chosen = self._shares.next_tier(queues, gate.may_release)
                        if chosen is None or not self._release_next(queues, chosen[0]):
                            break
                        self._shares.charge(queues, *chosen)
                        continue
                    for tier in queues.tiers:
                        if not tier.queued:
                            continue
                        if gate.may_release(model, tier.limits):
                            released = self._release_next(queues, tier)
                            break
                        if not passable:
                            continue
                        if self._reserving and self._may_go_into_reserve(
                            model, tier.limits, tier.peek()
                        ):
                            # No look-ahead: it is the head, the fair next one.
                            released = self._release_next(queues, tier, look_ahead=False)
                            break
                        if not queues.newcomers_pass:
                            continue
                        head = tier.peek()
                        weight = head.head().ticket.weight
                        if self._may_go_as_newcomer(model, tier.limits, head, weight):
                            # No look-ahead: it is the head, the fair next one.
                            released = self._release_next(queues, tier, look_ahead=False)
                            break
                    else:
                        break
                    if not released:
                        # The tier's head waits for its deployment (`waits_for_home`): no
                        # lower tier goes before it; the next end or scrape decides again.
                        break
                if not queues.redispatch:
                    break
        finally:
            queues.dispatching = False

    def _release_next(
        self, queues: ModelQueues, tier: TierQueue, *, look_ahead: bool = True
    ) -> bool:
        """Release the tier's next request; False when it waits for its deployment instead.
        `look_ahead=False`: the head goes, wherever its prefix is (a newcomer past a closed
        gate). One method from the choice to the lease: this runs for every release."""
        user_queue = tier.peek()
        head = user_queue.head()
        # The start tag of the request now in service: the head's virtual time, also when the
        # look-ahead releases a user after it (see below).
        start_tag = user_queue.virtual_time
        off_heap_entry: HeapEntry | None = None
        if (
            look_ahead
            and self._gate.prefers_elsewhere(head.ticket, tier.limits)
            and not self._gone(head)
        ):
            # Releasing the fair head now would bind it away from the deployment that has its
            # prefix cached (a miss, which also evicts others' prefixes there), and holding
            # everybody back would idle the deployment that has room: a later user whose own
            # deployment has room goes first. The head keeps its virtual time, so it is first
            # again at the next decision. None found: the head goes and its prefix spills, unless
            # the spill would only queue where it is sent (`waits_for_home`): then it waits for
            # its own deployment, which frees a slot about as soon and has its prefix cached.
            found = self._look_ahead(tier) if head.passed_over < MAX_PASSED_OVER else None
            if found is not None:
                head.passed_over += 1
                # The user found is off the heap (`off_heap_entry`), the head's entry back on it.
                user_queue, off_heap_entry = found
                head = user_queue.head()
            elif self._gate.waits_for_home(head.ticket, tier.limits):
                return False
        # Computed before anything changes: a release either happens whole or not at all.
        charge = self._policy.release_charge(head.ticket)
        if self._shortest_first:
            waiter = heapq.heappop(user_queue.sized)[2]
        else:
            waiter = user_queue.waiters.popleft()
        depth = user_queue.depth
        tier.depths.shallower(depth)
        user_queue.depth = depth = depth - 1
        if not depth:
            user_queue.waiters.clear()
            user_queue.sized.clear()
        tier.queued -= 1
        queues.queued -= 1
        self._queued_total -= 1
        if self._gone(waiter):
            # Its task was cancelled and has not run its cleanup yet: nothing to grant. The
            # user's position is unchanged: its heap entry stays if it still has requests.
            waiter.state = CANCELLED
            self._cancelled_total += 1
            if off_heap_entry is not None:
                if depth:
                    user_queue.in_heap = True
                    heapq.heappush(tier.heap, off_heap_entry)
            elif not depth:
                tier.pop_top(user_queue)
            if not depth:
                tier.forget_if_idle(user_queue)
            return True
        waiter.state = GRANTED
        now = self._clock.now()
        tier.turns.releases += 1
        drain = queues.drain  # `DrainRate.released`, inline
        drain.in_run += 1
        if drain.in_run >= RUN:
            self._drain_run_ended(queues, now)
        if waiter.limited:
            self._count_deadline(tier.limits.name, MET if now <= waiter.deadline else MISSED)
        # The tier's time must not pass a backlogged user's, or a correction (`_correct`) or a
        # newcomer's lift would cost the users the look-ahead passed over their place.
        if start_tag > tier.virtual_time:
            tier.virtual_time = start_tag
        ticket = waiter.ticket
        deployment = self._gate.place(ticket, tier.limits)
        lease = self._make_lease(
            queues, user_queue, ticket, waiter.enqueued_at, deployment, charge, now
        )
        if off_heap_entry is not None:
            if depth:
                tier.push(user_queue, next(self._arrivals))
        elif depth:
            tier.requeue_top(user_queue, next(self._arrivals))
        else:
            tier.pop_top(user_queue)
        self._decided(waiter, lease)
        # The user's turn came: a look at its most-at-risk request (once per turn, so each
        # backlogged user's tail is looked at once per round, never a scan of every queue).
        # Only a tail with a limit of its own: the queue's limit (minutes) bounds everyone.
        if depth and not self._shortest_first and user_queue.waiters[-1].limited:
            self._refuse_unreachable_tail(tier, user_queue, now)
        return True

    def _look_ahead(self, tier: TierQueue) -> tuple[UserQueue, HeapEntry] | None:
        """The first of the next `LOOKAHEAD` backlogged users after the head (fairness order)
        whose head request is not held back for its prefix, taken off the heap with its entry;
        the users passed over are put back unchanged. O(LOOKAHEAD log n)."""
        heap = tier.heap
        prefers_elsewhere = self._gate.prefers_elsewhere
        passed_over = [heapq.heappop(heap)]  # the head's entry (valid: it was just peeked)
        try:
            while len(passed_over) <= LOOKAHEAD:
                user_queue = tier.peek_or_none()
                if user_queue is None:
                    return None
                waiter = user_queue.head()
                # A waiter whose task was cancelled (not yet cleaned up) is taken too: the
                # release path then discards it, as it would at the head.
                if self._gone(waiter) or not prefers_elsewhere(waiter.ticket, tier.limits):
                    entry = heapq.heappop(heap)
                    user_queue.in_heap = False
                    return user_queue, entry
                passed_over.append(heapq.heappop(heap))
            return None
        finally:
            # Back exactly as they were (same key, arrival and generation): lazy deletion
            # still recognises them, and their order among themselves is unchanged.
            for entry in passed_over:
                heapq.heappush(heap, entry)

    def _make_lease(
        self,
        queues: ModelQueues,
        user_queue: UserQueue,
        ticket: Ticket,
        enqueued_at: float,
        deployment: str | None,
        charge: float | None = None,
        released_at: float | None = None,
    ) -> Lease:
        if charge is None:
            charge = self._policy.release_charge(ticket)
        if released_at is None:
            released_at = self._clock.now()
        user_queue.virtual_time += charge
        user_queue.waiting_since = released_at  # for the starved-wait gauge
        user_queue.in_flight += 1
        unstarted = user_queue.unstarted
        user_queue.unstarted = unstarted + 1
        queues.in_flight += 1
        self._released_total += 1
        lease = Lease(
            self,
            ticket,
            next(self._lease_ids),
            enqueued_at,
            released_at,
            charge,
            user_queue,
            deployment,
            # Its round in an engine queue in user order (0 where the engine has none).
            self._policy.engine_round(unstarted, ticket.weight)
            if queues.orders_engine_queue
            else 0,
        )
        self._gate.on_released(lease)
        return lease

    def lease_started(self, lease: Lease) -> None:
        user_queue: UserQueue = lease.owner_ref  # type: ignore[assignment]
        user_queue.unstarted -= 1
        self._gate.on_started(lease)

    def lease_ended(self, lease: Lease, tokens_used: int | None, *, abandoned: bool) -> None:
        # Never forgotten while it has a lease in flight, so the reference is still its queue.
        user_queue: UserQueue = lease.owner_ref  # type: ignore[assignment]
        tier = user_queue.tier_queue
        queues = tier.model_queues
        queues.in_flight -= 1
        user_queue.in_flight -= 1
        if not lease._started:  # the owner reads it without the property: on every end
            user_queue.unstarted -= 1
        if abandoned:
            self._abandoned_total += 1
            if lease.charged:
                tier.correct(user_queue, -lease.charged, next(self._arrivals))
        else:
            self._completed_total += 1
            # The fairness gauges' tokens served: as reported, else as estimated (divided by
            # the weight when the gauges are read, not here on every end).
            user_queue.served_tokens += tokens_used or lease.ticket.cost
            if self._corrects:
                correction = self._policy.end_correction(lease, tokens_used)
                if correction:
                    tier.correct(user_queue, correction, next(self._arrivals))
        if not user_queue.depth and not user_queue.in_flight:
            tier.forget_if_idle(user_queue)
        # The core and the gate have heard of the end before any observer runs: an observer's
        # failure (a spend that cannot be counted) is logged and can leave nothing half-ended.
        self._gate.on_ended(lease)
        for listener in self._end_listeners:  # `notify_end_listeners`, inline (every end)
            try:
                listener(lease, abandoned)
            except Exception:
                logger.exception("fair_sched: a lease-end observer failed for %r", lease)
        if queues.queued:
            self._dispatch_queues(queues)

    # ------------------------------------------------------------------ promotion

    def _track_promotion(self, tier: TierQueue, waiter: Parked) -> None:
        tier.promoting.append(waiter)
        if tier.promote_due is None:
            self._arm_promotion(tier)
        elif len(tier.promoting) > 2 * tier.queued + STALE_SLACK:
            # Granted and cancelled waiters are dropped lazily; rebuild before they pile up.
            tier.promoting = deque(w for w in tier.promoting if w.still_in(tier))

    def _arm_promotion(self, tier: TierQueue) -> None:
        promoting = tier.promoting
        while promoting and not promoting[0].still_in(tier):
            promoting.popleft()
        delay = tier.limits.promote_after_s
        if not promoting or delay is None:
            tier.promote_due = None
            return
        tier.promote_due = promoting[0].tier_since + delay
        self._wake_at(tier.promote_due, tier)

    def _promote_due(self, tier: TierQueue, now: float) -> None:
        delay = tier.limits.promote_after_s
        if self._closed or delay is None:
            return
        promoting = tier.promoting
        moved = False
        while promoting:
            waiter = promoting[0]
            if not waiter.still_in(tier):
                promoting.popleft()
                continue
            if waiter.tier_since + delay > now:
                break
            promoting.popleft()
            self._move_up(waiter, now)
            moved = True
        self._arm_promotion(tier)
        if moved:
            self._dispatch_queues(tier.model_queues)

    def _move_up(self, waiter: Parked, now: float) -> None:
        upper = waiter.user_queue.tier_queue.promote(
            waiter, now, self._arrivals, shortest_first=self._shortest_first
        )
        if upper.promotes:
            self._track_promotion(upper, waiter)

    # ------------------------------------------------------------------ deadlines

    def _expire_overdue(self, now: float) -> None:
        for waiter in self._deadlines.overdue(now):
            self._remove_waiter(waiter, EXPIRED)
            self._timed_out_total += 1
            if waiter.limited:
                self._count_deadline(waiter.user_queue.tier_queue.limits.name, MISSED)
            if not self._gone(waiter):
                waited = waiter.deadline - waiter.enqueued_at
                limit = f"{waited:g} s"
                if waiter.ticket.max_wait_s == waited:
                    limit = f"its client's limit of {limit} (x-fair-sched-max-wait-s)"
                self._decided(
                    waiter,
                    QueueTimeout(
                        f"waited {limit} without being scheduled on model "
                        f"{waiter.ticket.model!r}; the engine is saturated",
                        retry_after_s=self._retry_hint(self._models[waiter.ticket.model]),
                    ),
                )
        due = self._deadlines.arm()
        if due is not None:
            self._wake_at(due, _DEADLINES)

    def _refuse_unreachable_tail(self, tier: TierQueue, user_queue: UserQueue, now: float) -> None:
        """Refuse, from the back of the user's queue, the requests that can no longer start
        before their deadline (the latest there has the most ahead of it and, in deadline
        order, no earlier deadline than those before it); stop at the first that can."""
        rate = tier.model_queues.drain.rate(now)
        if rate is None:
            return
        waiters = user_queue.waiters
        while user_queue.depth:
            tail = waiters[-1]
            if tail.state != QUEUED:
                waiters.pop()  # left already: nothing counts it
                continue
            position = self._position(tier, user_queue, user_queue.depth, tail.ticket)
            if now + start_after_s(position, rate) <= tail.deadline:
                return
            self._remove_waiter(tail, UNREACHABLE)
            if tail.limited:
                self._count_deadline(tier.limits.name, REFUSED)
            if not self._gone(tail):
                self._decided(
                    tail,
                    self._unreachable(
                        tail.ticket, position, rate, tail.deadline - now, now - tail.enqueued_at
                    ),
                )

    def _drain_run_ended(self, queues: ModelQueues, now: float) -> None:
        """A run of the model's releases ended: sample its drain rate and each tier's turns."""
        queues.drain.run_ended(now)
        arrival = next(self._arrivals)
        for tier in queues.tiers:
            tier.turns.sample(tier.virtual_time, arrival)

    def _position(
        self, tier: TierQueue, user_queue: UserQueue | None, own_index: int, ticket: Ticket
    ) -> int:
        """How many releases of the model, it included, come no later than the `own_index`-th
        of the user's requests in `tier` (1: its next). O(tiers + log n).

        Strict tiers: all queued above. In its tier, from its start tag: a request `d` above
        the tier's virtual time has about `d - 1/2` rounds of the tier before it (it comes part
        way into the last), each as many releases as the tier's rounds measured lately
        (`TurnRate`: the users who come back between rounds included), plus the user's own
        share of a round where its backlog is newer than that measure; under round robin, at
        least one per user backlogged now; with tier shares, divided by the tier's measured part
        of the model's releases. Until a round was measured: each other backlogged user about
        once per own release, counted as one fewer (the tier's next turn may be ours)."""
        ahead = 0
        if not self._shared_tiers:
            for upper in tier.model_queues.tiers[: tier.position]:
                ahead += upper.depths.total
        turns = tier.turns
        charge = self._policy.release_charge(ticket)
        if turns.per_unit and charge > 0:
            per_unit = turns.per_unit
            if user_queue is None or user_queue.backlog_since > turns.arrival_mark:
                per_unit += 1.0 / charge
            if self._takes_turns:
                # At least one turn per user backlogged now (the measure lags a new one).
                backlogged = tier.depths.capped_total(1)
                if user_queue is None or not user_queue.depth:
                    backlogged += 1
                per_unit = max(per_unit, backlogged)
            own_depth = user_queue.depth if user_queue is not None else 0
            if tier.queued > own_depth:
                own_time = user_queue.virtual_time if user_queue is not None else tier.virtual_time
                start_tag = max(own_time, tier.virtual_time) + (own_index - 1) * charge
                # A tag `d` rounds up is reached part way into the last of them (the users
                # whose turn in it has passed go after it): half of it, on average.
                rounds = start_tag - tier.virtual_time
                if rounds > 0.5 * charge:
                    rounds -= 0.5 * charge
                in_tier = rounds * per_unit
            else:
                # Nobody else is queued in the tier: only its own requests come before it (its
                # start tag may lie rounds ahead of the tier's, from its last releases, with
                # nobody left to take those rounds).
                in_tier = own_index - 1
            if self._shared_tiers and turns.share > 0:
                in_tier /= turns.share  # the other share tiers' releases come between
            return ahead + 1 + round(in_tier)
        if self._takes_turns and own_index > 1:
            own_depth = user_queue.depth if user_queue is not None else 0
            turns_ahead = own_index - 1
            ahead += tier.depths.capped_total(turns_ahead) - min(own_depth, turns_ahead)
        return ahead + own_index

    def _unreachable(
        self, ticket: Ticket, position: int, rate: float, left_s: float, waited_s: float
    ) -> DeadlineUnreachable:
        expected_s = start_after_s(position, rate)
        return DeadlineUnreachable(
            f"cannot start within its limit on model {ticket.model!r}: {position} requests are "
            f"released no later than it, about {expected_s:.1f} s at the measured rate, "
            f"{max(0.0, left_s):.1f} s left",
            retry_after_s=min(60.0, max(1.0, expected_s - left_s)),
            waited_s=waited_s,
        )

    def _count_deadline(self, tier: str, outcome: int) -> None:
        counts = self._deadline_outcomes.get(tier)
        if counts is None:
            counts = self._deadline_outcomes[tier] = [0, 0, 0]
        counts[outcome] += 1

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise SchedulerClosed("the scheduler is shutting down", retry_after_s=1)

    def _tier_position(self, tier: str) -> int:
        try:
            return self._tier_index[tier]
        except KeyError:
            raise ValueError(f"unknown tier {tier!r}; tiers are {list(self._tier_index)}") from None

    def _model_queues(self, model: str) -> ModelQueues:
        queues = self._models.get(model)
        if queues is None:
            queues = self._models[model] = ModelQueues(model, self._tiers)
            # Whether its engine orders its own queue by user: fixed per model for a gate.
            queues.orders_engine_queue = self._gate.orders_engine_queue(model)
            # Newcomers may go past a closed gate only where the engine orders its own queue by
            # user (`AdmissionGate.may_release_newcomer`), and a tier's reserved slots may be
            # taken past it: elsewhere the head is not even looked at.
            queues.newcomers_pass = not self._shared_tiers and queues.orders_engine_queue
            queues.closed_gate_passable = queues.newcomers_pass or self._reserving
        return queues

    def _retry_hint(self, queues: ModelQueues) -> float:
        # A rough hint: a second per queued request per in-flight slot, between 1 s and 60 s.
        return min(60.0, max(1.0, queues.queued / max(queues.in_flight, 1)))


def _with_reservations_below(tiers: Iterable[TierLimits]) -> tuple[TierLimits, ...]:
    """The tiers, each keeping free at least the running slots every tier above it reserves: a
    lower tier served while a higher one is held back must not take the slots kept for it."""
    inherited = 0
    kept = []
    for tier in tiers:
        inherited = max(inherited, tier.reserve_slots)
        kept.append(
            tier if tier.reserve_slots == inherited else tier._replace(reserve_slots=inherited)
        )
    return tuple(kept)
