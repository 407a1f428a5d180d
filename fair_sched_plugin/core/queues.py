"""The core's queues: a parked ticket, a user's FIFO in a tier, a tier's fairness heap, a model's
tiers. Plain data with the O(log n) heap moves that keep them consistent; the rules that decide
who goes next are `SchedulerCore`'s (`core/scheduler.py`).

A tier orders its backlogged users in a heap keyed ``(virtual_time, arrival, generation)``:
bumping a user's generation invalidates its entries (lazy deletion keeps re-keying and removal
O(log n)); stale entries are dropped when they reach the top or outnumber the live ones.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator

from .release_rate import DrainRate, TurnRate
from .standing import DepthIndex
from .ticket import Ticket, TierLimits

# Idle users ahead of their tier's virtual time are remembered (they were served recently and
# must not come back at the front); beyond this many per tier the longest idle are forgotten, so
# memory cannot grow with the number of distinct callers (rotating keys, claimed names).
MAX_IDLE_USERS_REMEMBERED = 10_000

QUEUED, GRANTED, CANCELLED, EXPIRED, CLOSED, UNREACHABLE = range(6)


class Parked:
    """A ticket waiting for its turn: one object per parked ticket. `ref` is the caller's, plain
    data the core never reads (the driver finds its waiter by it when `_decided` runs)."""

    __slots__ = (
        "deadline",
        "enqueued_at",
        "limited",
        "passed_over",
        "ref",
        "state",
        "ticket",
        "tier_since",
        "user_queue",
    )

    def __init__(
        self,
        ticket: Ticket,
        now: float,
        user_queue: UserQueue,
        ref: object = None,
        deadline: float = float("inf"),
        limited: bool = False,
    ) -> None:
        self.ticket = ticket
        self.enqueued_at = now
        # When its wait ends (`queue.max_wait_s`, or a shorter limit of its tier or its client:
        # `limited`, counted as met, missed or refused for its deadline).
        self.deadline = deadline
        self.limited = limited
        self.tier_since = now  # when it entered its current tier (promotion counts from here)
        self.state = QUEUED
        self.user_queue = user_queue
        # Times the look-ahead released someone after it instead (`MAX_PASSED_OVER`).
        self.passed_over = 0
        self.ref = ref

    def still_in(self, tier: TierQueue) -> bool:
        return self.state == QUEUED and self.user_queue.tier_queue is tier


# A tier heap's entry: (virtual time, arrival counter, generation, user).
HeapEntry = tuple[float, int, int, "UserQueue"]


class UserQueue:
    __slots__ = (
        "backlog_since",
        "depth",
        "heap_generation",
        "in_flight",
        "in_heap",
        "lifted",
        "served_tokens",
        "sized",
        "tier_queue",
        "unstarted",
        "user",
        "virtual_time",
        "waiters",
        "waiting_since",
    )

    def __init__(self, user: str, tier_queue: TierQueue, virtual_time: float) -> None:
        self.user = user
        self.tier_queue = tier_queue
        # Arrival order. A cancelled reservation stays in the deque, marked, until it reaches
        # the head or the deque is compacted (O(1) cancellation); `depth` counts the live ones.
        self.waiters: deque[Parked] = deque()
        # `queue.order: shortest_first`: a heap keyed (estimated tokens, arrival) instead, with
        # the same lazy cancellation.
        self.sized: list[tuple[int, int, Parked]] = []
        self.depth = 0
        self.virtual_time = virtual_time
        self.in_flight = 0
        # Of those in flight, released and not yet streaming (the next release's `engine_rank`
        # counts them: `SchedulerCore._engine_round`).
        self.unstarted = 0
        self.heap_generation = 0
        self.in_heap = False
        # For the fairness gauges (`core/fairness_window.py`), kept where the user is touched
        # anyway: the virtual time it got without being served (its start, lifts, clamped
        # corrections: `served` is the rest), the tokens of its ended requests (not divided by
        # its weight: `weight` does that when read), the arrival number that began its current
        # backlog period, and since when it has waited for its next release.
        self.lifted = virtual_time
        self.served_tokens = 0
        self.backlog_since = -1
        self.waiting_since = 0.0

    @property
    def served(self) -> float:
        """The policy's charges to this user (releases and their corrections, / weight): its
        virtual time less what it got without service (no work on a release's path)."""
        return self.virtual_time - self.lifted

    def weight(self) -> float:
        """The weight of its first queued request (a principal's requests share one weight);
        1 when none is queued. Reads only: cancelled entries stay where they are."""
        for _, _, parked in self.sized:
            if parked.state == QUEUED:
                return parked.ticket.weight
        for parked in self.waiters:
            if parked.state == QUEUED:
                return parked.ticket.weight
        return 1.0

    def became_backlogged(self, arrival: int, now: float) -> None:
        """Its first queued request arrived (`arrival`, at `now`): a new backlog period."""
        self.backlog_since = arrival
        self.waiting_since = now

    def head(self) -> Parked:
        """The user's next request in its order (cancelled entries before it are dropped)."""
        sized = self.sized
        if sized:
            while sized[0][2].state != QUEUED:
                heapq.heappop(sized)
            return sized[0][2]
        waiters = self.waiters
        while waiters[0].state != QUEUED:
            waiters.popleft()
        return waiters[0]

    def live(self) -> list[Parked]:
        return [entry[2] for entry in self.sized if entry[2].state == QUEUED] + [
            parked for parked in self.waiters if parked.state == QUEUED
        ]

    def compact(self) -> None:
        """Drop the marked entries (submit-and-cancel abuse must not grow the queue)."""
        self.sized = [entry for entry in self.sized if entry[2].state == QUEUED]
        heapq.heapify(self.sized)
        self.waiters = deque(parked for parked in self.waiters if parked.state == QUEUED)

    def lift(self) -> None:
        # A user coming back from idle starts at the tier's virtual time: no banked credit.
        floor = self.tier_queue.virtual_time
        if floor > self.virtual_time:
            self.lifted += floor - self.virtual_time
            self.virtual_time = floor


class TierQueue:
    __slots__ = (
        "depths",
        "heap",
        "idle",
        "limits",
        "model",
        "model_queues",
        "position",
        "promote_due",
        "promotes",
        "promoting",
        "queued",
        "share_vtime",
        "stale_entries",
        "turns",
        "users",
        "virtual_time",
    )

    def __init__(self, model_queues: ModelQueues, limits: TierLimits, position: int) -> None:
        self.position = position
        # Weighted fair queuing between share tiers: virtual finish time of this tier's service.
        self.share_vtime = 0.0
        # `promote_after_s`: this tier's waiters in the order they entered it, one wake-up for
        # the head (every waiter of a tier has the same promotion delay).
        self.promoting: deque[Parked] = deque()
        self.promote_due: float | None = None
        self.model_queues = model_queues
        self.model = model_queues.model
        self.limits = limits
        # Its waiters move up after `promote_after_s` (never from the most urgent tier).
        self.promotes = limits.promote_after_s is not None and position > 0
        self.users: dict[str, UserQueue] = {}
        # Users kept only for their virtual time, longest idle first (bounded).
        self.idle: OrderedDict[str, UserQueue] = OrderedDict()
        self.heap: list[HeapEntry] = []
        self.stale_entries = 0
        self.virtual_time = 0.0
        self.queued = 0
        # The users' depths, for position estimates in O(log n) (`position_estimate`).
        self.depths = DepthIndex()
        # Releases per round of its fair order (what a deadline's prediction multiplies by).
        self.turns = TurnRate()

    def user_queue(self, user: str) -> UserQueue:
        user_queue = self.users.get(user)
        if user_queue is None:
            user_queue = self.users[user] = UserQueue(user, self, self.virtual_time)
        return user_queue

    def push(self, user_queue: UserQueue, arrival: int) -> None:
        user_queue.heap_generation += 1
        user_queue.in_heap = True
        heapq.heappush(
            self.heap,
            (user_queue.virtual_time, arrival, user_queue.heap_generation, user_queue),
        )

    def unpush(self, user_queue: UserQueue) -> None:
        if not user_queue.in_heap:
            return
        user_queue.in_heap = False
        user_queue.heap_generation += 1
        self.stale_entries += 1
        if self.stale_entries > 64 and self.stale_entries > len(self.heap) // 2:
            self.heap = [
                entry
                for entry in self.heap
                if entry[2] == entry[3].heap_generation and entry[3].in_heap
            ]
            heapq.heapify(self.heap)
            self.stale_entries = 0

    def peek_or_none(self) -> UserQueue | None:
        """The backlogged user with the lowest virtual time (stale entries on top are dropped),
        or None when no entry is left (the look-ahead has taken some off)."""
        heap = self.heap
        while heap:
            _, _, generation, user_queue = heap[0]
            if user_queue.in_heap and generation == user_queue.heap_generation:
                return user_queue
            heapq.heappop(heap)
            self.stale_entries -= 1
        return None

    def peek(self) -> UserQueue:
        """`peek_or_none` of a tier known to have someone queued (on every release's path)."""
        heap = self.heap
        while True:
            _, _, generation, user_queue = heap[0]
            if user_queue.in_heap and generation == user_queue.heap_generation:
                return user_queue
            heapq.heappop(heap)
            self.stale_entries -= 1

    def pop_top(self, user_queue: UserQueue) -> None:
        """Remove the heap's top entry, which is `user_queue`'s (just peeked)."""
        heapq.heappop(self.heap)
        user_queue.in_heap = False

    def requeue_top(self, user_queue: UserQueue, arrival: int) -> None:
        """The top user back in line at its new virtual time: one sift, not a pop and a push."""
        user_queue.heap_generation += 1
        heapq.heapreplace(
            self.heap,
            (user_queue.virtual_time, arrival, user_queue.heap_generation, user_queue),
        )

    def correct(self, user_queue: UserQueue, correction: float, arrival: int) -> None:
        corrected = user_queue.virtual_time + correction
        if corrected < self.virtual_time:
            # Not below the tier's time; the rest of the correction still counts as service.
            user_queue.lifted += self.virtual_time - corrected
            corrected = self.virtual_time
        user_queue.virtual_time = corrected
        if user_queue.in_heap:
            self.unpush(user_queue)
            self.push(user_queue, arrival)

    def leave(self, user_queue: UserQueue) -> bool:
        """One waiter left `user_queue` (its entry is already gone or marked); True while the
        user still has requests queued in this tier, else the user leaves the tier's heap."""
        self.depths.shallower(user_queue.depth)
        user_queue.depth -= 1
        self.queued -= 1
        if user_queue.depth:
            return True
        user_queue.waiters.clear()
        user_queue.sized.clear()
        self.unpush(user_queue)
        self.forget_if_idle(user_queue)
        return False

    def promote(
        self, parked: Parked, now: float, arrivals: Iterator[int], *, shortest_first: bool
    ) -> TierQueue:
        """Move a waiter that waited `promote_after_s` into the same user's queue one tier up,
        in deadline order there (O(depth) of that user's queues, bounded by `max_per_user`);
        the tier it is in now."""
        old_queue = parked.user_queue
        if shortest_first:
            old_queue.sized = [entry for entry in old_queue.sized if entry[2] is not parked]
            heapq.heapify(old_queue.sized)
        else:
            old_queue.waiters.remove(parked)
        self.leave(old_queue)
        upper = self.model_queues.tiers[self.position - 1]
        new_queue = upper.user_queue(parked.ticket.user)
        if not new_queue.depth:
            new_queue.lift()
            arrival = next(arrivals)
            new_queue.became_backlogged(arrival, now)
            upper.push(new_queue, arrival)
        parked.ticket = parked.ticket._replace(tier=upper.limits.name)
        parked.user_queue = new_queue
        parked.tier_since = now
        if shortest_first:
            heapq.heappush(new_queue.sized, (parked.ticket.cost, next(arrivals), parked))
        else:
            waiters = new_queue.waiters
            index = len(waiters)
            while index and waiters[index - 1].deadline > parked.deadline:
                index -= 1
            waiters.insert(index, parked)
        new_queue.depth += 1
        upper.depths.deeper(new_queue.depth)
        upper.queued += 1
        return upper

    def forget_if_idle(self, user_queue: UserQueue) -> None:
        # A user with nothing queued or in flight whose virtual time the tier has caught up with
        # carries no information (it would be lifted anyway): drop it so memory follows load.
        # One still ahead is remembered, but only the most recently idle of them (bounded).
        name = user_queue.user
        if user_queue.depth or user_queue.in_flight or self.users.get(name) is not user_queue:
            return
        if user_queue.virtual_time <= self.virtual_time:
            del self.users[name]
            self.idle.pop(name, None)
            return
        self.idle[name] = user_queue
        self.idle.move_to_end(name)
        while len(self.idle) > MAX_IDLE_USERS_REMEMBERED:
            _, oldest = self.idle.popitem(last=False)
            if not oldest.depth and not oldest.in_flight and self.users.get(oldest.user) is oldest:
                del self.users[oldest.user]


class ModelQueues:
    __slots__ = (
        "closed_gate_passable",
        "dispatching",
        "drain",
        "in_flight",
        "model",
        "newcomers_pass",
        "orders_engine_queue",
        "queued",
        "redispatch",
        "share_clock",
        "tiers",
    )

    def __init__(self, model: str, tiers: Iterable[TierLimits]) -> None:
        self.model = model
        self.tiers = [TierQueue(self, limits, position) for position, limits in enumerate(tiers)]
        # Per group of share tiers: the start tag of the latest release (a tier that comes
        # back to the group is lifted to it, so idleness is not banked).
        self.share_clock: dict[int, float] = {}
        self.queued = 0
        self.in_flight = 0
        # Re-entrancy guard: a gate may notify us from inside a release decision.
        self.dispatching = False
        self.redispatch = False
        # `AdmissionGate.orders_engine_queue(model)`, asked once (`SchedulerCore._model_queues`),
        # and what follows from it there: whether a request may go past a closed gate.
        self.orders_engine_queue = False
        self.newcomers_pass = False
        self.closed_gate_passable = False
        # How fast its backlog drains (what a deadline's prediction divides by).
        self.drain = DrainRate()
