"""Tickets (what a request asks for) and leases (what the scheduler grants)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import NamedTuple, Protocol

logger = logging.getLogger("fair_sched")

# The documented ranges of what one request may claim or report. Every number that comes from
# outside (a request body, a header, a Redis message, an engine's `usage`) is checked against
# them where it is read (a 400 naming the field, or a dropped message), so nothing unbounded
# reaches the core: a 400-digit integer there made every later charge raise OverflowError.
# Far above any real model's context (tokens: prompt + output of one request).
MAX_REQUEST_TOKENS = 100_000_000
# Far above any real request's price, in the configured currency (usd).
MAX_REQUEST_COST = 1_000_000.0
# Weights are configured (and carried between replicas): bounded so 1/weight stays finite.
MIN_WEIGHT = 1e-6
MAX_WEIGHT = 1e6
# The longest wait a request may ask for (what `queue.max_wait_s` allows at most).
MAX_WAIT_S = 86_400.0


def _left_out(field: str, value: object) -> None:
    # The value itself may be anything (a 400-digit integer): only its kind and size are shown.
    # (repr() of a huge integer raises ValueError past Python's digit limit.)
    shown = f"an int of {value.bit_length()} bits" if isinstance(value, int) else repr(value)[:40]
    logger.warning(
        "fair_sched: a lease's end reported %s out of range (%s); its estimate stays charged",
        field,
        shown,
    )


def request_tokens_in_range(value: object) -> bool:
    """A token count (a ticket's cost, a lease's `tokens_used`) within [0, MAX_REQUEST_TOKENS]."""
    return (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_REQUEST_TOKENS
    )


def request_cost_in_range(value: object) -> bool:
    """A money amount (a ticket's price, a lease's `cost_used`) within [0, MAX_REQUEST_COST]."""
    # Compared, never converted: NaN and infinities fail the comparison, and so does an
    # integer too large for a float (which `math.isfinite` would raise OverflowError for).
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (0 <= value <= MAX_REQUEST_COST)
    )


class TierLimits(NamedTuple):
    """A tier as the core sees it: its name and the engine thresholds under which it may release."""

    name: str
    waiting_below: int = 3
    tpot_below_s: float | None = None
    kv_usage_below: float | None = None
    # Weighted sharing with the neighbouring tiers that also have a share (None: strict priority
    # over every lower tier).
    share: float | None = None
    # A request parked this long in this tier moves one tier up (None: never).
    promote_after_s: float | None = None
    # `waiting_below: auto`: (minimum, maximum) of the queue the gate's tuner may allow; then
    # `waiting_below` is only where it starts. None: `waiting_below` is fixed.
    auto_waiting_below: tuple[int, int] | None = None
    # Release-to-first-byte target the tuner keeps (and TTFT where the engine exports it).
    ttft_target_s: float | None = None
    # Running slots of an engine with known slots (`max_num_seqs`) that this tier's users who
    # already hold a request in flight leave free: a user who holds none starts at once.
    reserve_slots: int = 0
    # The longest a request of this tier waits for its turn (None: the queue's limit).
    max_wait_s: float | None = None


class _TicketFields(NamedTuple):
    model: str
    user: str
    tier: str
    weight: float = 1.0
    cost: int = 1
    price: float = 0.0
    prefix: tuple[int, ...] = ()
    max_wait_s: float | None = None


class Ticket(_TicketFields):
    """One request waiting for its turn (immutable).

    `cost` is the estimated number of tokens (prompt + max output); the token-fair policy charges
    it at release and corrects it with the actual count when the lease ends, and
    `queue.order: shortest_first` releases a user's smallest first. `price` is the estimated
    money cost (`fairness: cost` charges it, corrected by `Lease.release(cost_used=...)`).
    `prefix` identifies the prompt's leading blocks (`fair_sched_plugin.request.prefix`): a gate
    that places requests on several deployments sends requests that start alike where that start
    went recently, so the engine's prefix cache has it. `max_wait_s` is how long the client will
    wait for its turn (None: its tier's or the queue's limit; a longer one never raises those).

    A named tuple rather than a frozen dataclass: one is built per request on the hot path, and
    a frozen dataclass's `__init__` costs twice as much.
    """

    __slots__ = ()

    def __new__(
        cls,
        model: str,
        user: str,
        tier: str,
        weight: float = 1.0,
        cost: int = 1,
        price: float = 0.0,
        prefix: tuple[int, ...] = (),
        max_wait_s: float | None = None,
    ) -> Ticket:
        if not (
            isinstance(weight, (int, float)) and MIN_WEIGHT <= weight <= MAX_WEIGHT
        ):  # NaN fails both comparisons
            raise ValueError(f"weight must be in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}] (got {weight!r})")
        # A plain int and float in range are the common case: checked inline, without a call.
        if not (
            type(cost) is int and 0 <= cost <= MAX_REQUEST_TOKENS
        ) and not request_tokens_in_range(cost):
            raise ValueError(f"cost must be an int in [0, {MAX_REQUEST_TOKENS}] (got {cost!r:.40})")
        if not (
            type(price) is float and 0.0 <= price <= MAX_REQUEST_COST
        ) and not request_cost_in_range(price):
            raise ValueError(f"price must be in [0, {MAX_REQUEST_COST:g}] (got {price!r:.40})")
        if max_wait_s is not None and not (
            isinstance(max_wait_s, (int, float)) and 0 < max_wait_s <= MAX_WAIT_S
        ):
            raise ValueError(f"max_wait_s must be in (0, {MAX_WAIT_S:g}] (got {max_wait_s!r:.40})")
        return tuple.__new__(cls, (model, user, tier, weight, cost, price, prefix, max_wait_s))


class LeaseOwner(Protocol):
    """Whoever granted a lease and must hear about its first byte and its end (the core's
    `FairScheduler`, or a replica that relays them to the scheduling leader)."""

    def lease_started(self, lease: Lease) -> None: ...

    def lease_ended(self, lease: Lease, tokens_used: int | None, *, abandoned: bool) -> None: ...


class Lease:
    """The right to send one request to the engine, from release until `release()`.

    Ending a lease is idempotent: the first `release()` counts, later ones do nothing, so every
    end-of-request signal (success, failure, stream end, disconnect) may call it.
    """

    __slots__ = (
        "_charged",
        "_ended",
        "_owner",
        "_started",
        "cost_used",
        "deployment",
        "engine_rank",
        "enqueued_at",
        "lease_id",
        "owner_ref",
        "released_at",
        "ticket",
        "tokens_used",
    )

    def __init__(
        self,
        owner: LeaseOwner,
        ticket: Ticket,
        lease_id: int,
        enqueued_at: float,
        released_at: float,
        charged: float,
        owner_ref: object = None,
        deployment: str | None = None,
        engine_rank: int = 0,
    ) -> None:
        self._owner = owner
        # Whatever the owner needs to find its bookkeeping for this lease without a lookup.
        self.owner_ref = owner_ref
        self.ticket = ticket
        # The deployment (its api_base, or its metrics URL where no api_base is known) the gate
        # bound this request to: it must go exactly there. The metrics gate binds a one-engine
        # model's requests too, to that engine. None: the gate does not place
        # (InflightLimitGate), does not know the model, or found no deployment with room at
        # the release (the request goes wherever the adapter routes it).
        self.deployment = deployment
        # How many of its user's requests to this model (same tier) were released before it
        # and had not started streaming (with `fairness: weighted`, that count per the user's
        # weight): its round in the engine's own queue when the backend has `fair_engine_queue`
        # (the priority sent counts it). 0: the engine's first round.
        self.engine_rank = engine_rank
        self.lease_id = lease_id
        self.enqueued_at = enqueued_at
        self.released_at = released_at
        self._charged = charged
        self._started = False
        self._ended = False
        # The actual money cost, when the caller reported it at release (`fairness: cost`).
        self.cost_used: float | None = None
        self.tokens_used: int | None = None

    @property
    def active(self) -> bool:
        return not self._ended

    @property
    def started(self) -> bool:
        return self._started

    @property
    def charged(self) -> float:
        """What the fairness policy charged its user at release (virtual time)."""
        return self._charged

    @property
    def waited_s(self) -> float:
        return self.released_at - self.enqueued_at

    def mark_started(self) -> None:
        """The engine demonstrably took the request (its first byte came back)."""
        if self._started or self._ended:
            return
        self._started = True
        self._owner.lease_started(self)

    def release(self, tokens_used: int | None = None, *, cost_used: float | None = None) -> bool:
        """End the lease; `tokens_used` (prompt + output) corrects the token-fair estimate and
        `cost_used` (money) the cost-fair one.

        Returns True for the call that ended it, False for every later call. A count outside
        the core's range (`MAX_REQUEST_TOKENS`, `MAX_REQUEST_COST`) is taken as not reported:
        the estimate stays charged.
        """
        if self._ended:
            return False
        if (
            tokens_used is not None
            # A plain int in range is the common case: checked inline, without the call.
            and (type(tokens_used) is not int or not 0 <= tokens_used <= MAX_REQUEST_TOKENS)
            and not request_tokens_in_range(tokens_used)
        ):
            _left_out("tokens used", tokens_used)
            tokens_used = None
        if cost_used is not None and not request_cost_in_range(cost_used):
            _left_out("cost used", cost_used)
            cost_used = None
        self._ended = True
        self.cost_used = cost_used
        self.tokens_used = tokens_used
        self._owner.lease_ended(self, tokens_used, abandoned=False)
        return True

    def abandon(self) -> None:
        """Give back a lease that was never used (the engine never saw the request): the turn passes
        on and the user is not charged for it."""
        if self._ended:
            return
        self._ended = True
        self._owner.lease_ended(self, None, abandoned=True)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "ended" if self._ended else ("started" if self._started else "granted")
        return f"<Lease {self.lease_id} {self.ticket.model}/{self.ticket.user} {state}>"


def notify_end_listeners(
    listeners: Iterable[Callable[[Lease, bool], object]], lease: Lease, abandoned: bool
) -> None:
    """Tell each end listener; one that raises is logged and the others still hear."""
    for listener in listeners:
        try:
            listener(lease, abandoned)
        except Exception:
            logger.exception("fair_sched: a lease-end observer failed for %r", lease)
