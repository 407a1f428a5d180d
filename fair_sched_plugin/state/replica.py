"""One replica's scheduler: the unchanged core decides, wherever the deciding core runs.

A replica has two halves:

- **Its requests** (every replica): the tickets it parked and the leases it handed out. It tells
  *the acting leader* about each ticket, cancel, first byte and end, and waits for grants.
- **A leadership term** (only the acting leader): the core (`FairScheduler` + the replica's own
  `MetricsGate`) with every replica's tickets and leases in it, keyed by (replica, session,
  ticket id).

With `memory://` the replica is its own acting leader for good: its requests go straight into
its own term. With `redis://` one replica holds a fenced lease in Redis and is the acting leader
of all; the others send their messages through Redis and wait on their own reply list. When the
leader changes (a new epoch), every replica re-sends what it has (its in-flight leases, adopted
by the new leader's core, then its parked tickets) and ignores replies of older epochs, so
nothing is lost and nothing is granted twice. When Redis fails, the replica becomes the acting
leader of a local term over its own core, spending 1/n of the engine's thresholds (n: the
replicas it last saw alive), until Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeGuard

from ..core.backpressure import GroupStatus, MetricsGate
from ..core.budget import BudgetBook
from ..core.gate import AdmissionGate
from ..core.reads import SchedulerStatistics, UserBacklog
from ..core.standing import BacklogIndex
from ..core.ticket import (
    MAX_REQUEST_COST,
    MAX_REQUEST_TOKENS,
    MAX_WEIGHT,
    MIN_WEIGHT,
    Lease,
    Ticket,
    TierLimits,
    notify_end_listeners,
    request_cost_in_range,
    request_tokens_in_range,
)
from ..driver import FairScheduler, Reservation
from ..errors import QueueFull, QueueTimeout, Rejected, SchedulerClosed, StateStoreError
from ._values import (
    MAX_EPOCH,
    MAX_SERIAL,
    OutOfRange,
    corrupt_value,
    parse_token,
    short_text,
    shown,
    whole,
)

if TYPE_CHECKING:  # redis is an optional extra: imported only by `open_state` for redis://
    from .redis_link import Beat, RedisLink

logger = logging.getLogger("fair_sched")

StateMode = Literal["shared", "local"]

# The epoch of a local term (memory://, or Redis unreachable); Redis epochs start at 1.
LOCAL_EPOCH = 0
# No leader known yet: messages are not sent (the re-send on learning the leader covers them).
NO_EPOCH = -1

_Key = tuple[str, int, int]  # (replica, session, ticket id)
_Reply = tuple[Any, ...]


class StateStatistics(NamedTuple):
    """How this replica takes part (for metrics and the status page)."""

    mode: StateMode
    replica: str
    fallbacks_total: int  # times Redis failed and this replica went local
    recoveries_total: int  # times it rejoined
    store_errors_total: int
    leader: str | None = None  # the replica whose core decides (this one when local)
    replicas_alive: int = 1


class _Parked:
    __slots__ = ("enqueued_at", "future", "ticket", "tid")

    def __init__(
        self, ticket: Ticket, tid: int, future: asyncio.Future[Lease], enqueued_at: float
    ) -> None:
        self.ticket = ticket
        self.tid = tid
        self.future = future
        self.enqueued_at = enqueued_at


class _Term:
    """One leadership term over the core: every replica's tickets and leases in it.

    `reply(replica, message)` carries grants and rejections back. A term ends with `drain()`:
    its tickets leave the core without a reply (their replicas re-send them to the next acting
    leader) and its leases end unused.
    """

    def __init__(
        self, core: FairScheduler, epoch: int, reply: Callable[[str, _Reply], None]
    ) -> None:
        self.core = core
        self.epoch = epoch
        self._reply = reply
        self.reservations: dict[_Key, Reservation] = {}
        self.leases: dict[_Key, Lease] = {}
        self._cancelled: set[_Key] = set()
        self._sessions: dict[str, int] = {}
        self.over = False
        # While holding, tickets wait here (in arrival order) instead of in the core.
        self.holding = False
        self._held_back: dict[_Key, Ticket] = {}
        self._callbacks_pending = 0

    # ------------------------------------------------------------------ from replicas

    def accepts(self, replica: str, session: int) -> bool:
        """False for a replica's older session; a newer one replaces everything of the old."""
        known = self._sessions.get(replica)
        if known is None or session > known:
            if known is not None:
                self.drop_replica(replica)
            self._sessions[replica] = session
            return True
        return session == known

    def submit(self, key: _Key, ticket: Ticket) -> None:
        """Queue a ticket (raises `QueueFull`); a ticket already known is not queued again."""
        if key in self.reservations or key in self.leases:
            return
        if self.holding:
            self._held_back[key] = ticket
            return
        reservation = self.core.enqueue(ticket)
        self.reservations[key] = reservation
        if reservation.future.done() and not self._callbacks_pending:
            # Granted (or refused) at once and nothing granted earlier is still on its way:
            # answer now, in order, without a loop hop.
            self._resolved(key, reservation.future)
            return
        self._callbacks_pending += 1
        reservation.future.add_done_callback(lambda future: self._on_done(key, future))

    def statistics(self) -> SchedulerStatistics:
        """The core's, with the tickets held back during a hold counted as queued."""
        stats = self.core.statistics()
        if not self._held_back:
            return stats
        by_tier = dict(stats.queued_by_model_tier)
        for ticket in self._held_back.values():
            by_tier[(ticket.model, ticket.tier)] = by_tier.get((ticket.model, ticket.tier), 0) + 1
        return stats._replace(
            queued=stats.queued + len(self._held_back), queued_by_model_tier=by_tier
        )

    def end_hold(self) -> None:
        self.holding = False
        held_back, self._held_back = self._held_back, {}
        for key, ticket in held_back.items():
            if self.over:
                return
            try:
                self.submit(key, ticket)
            except QueueFull as exc:
                self._reply(key[0], _rejection(self.epoch, key, exc))

    def try_acquire(self, key: _Key, ticket: Ticket) -> Lease | None:
        if self.holding:
            return None
        lease = self.core.try_acquire(ticket)
        if lease is not None:
            self.leases[key] = lease
        return lease

    def cancel(self, key: _Key) -> None:
        if self._held_back.pop(key, None) is not None:
            return
        reservation = self.reservations.get(key)
        if reservation is None:
            return  # granted already: the replica hands the grant back unused
        if reservation.cancel():
            del self.reservations[key]
        else:
            self._cancelled.add(key)  # granted, its callback not run yet: abandon it there

    def started(self, key: _Key) -> None:
        lease = self.leases.get(key)
        if lease is not None:
            lease.mark_started()

    def end(
        self,
        key: _Key,
        tokens_used: int | None,
        *,
        abandoned: bool,
        cost_used: float | None = None,
    ) -> None:
        """A lease's end with its usage (each value checked to its range by the caller)."""
        lease = self.leases.pop(key, None)
        if lease is None:
            return
        if abandoned:
            lease.abandon()
        else:
            lease.release(tokens_used, cost_used=cost_used)

    def adopt(
        self, key: _Key, ticket: Ticket, *, started: bool, deployment: str | None = None
    ) -> None:
        """A lease granted by an earlier term (or locally) that is still running."""
        if key in self.leases:
            return
        self._held_back.pop(key, None)
        reservation = self.reservations.pop(key, None)
        if reservation is not None:
            reservation.cancel()
        self.leases[key] = self.core.adopt(ticket, started=started, deployment=deployment)

    # ------------------------------------------------------------------ endings

    def replicas(self) -> set[str]:
        return {key[0] for key in (*self.reservations, *self.leases, *self._held_back)}

    def drop_replica(self, replica: str) -> None:
        """A replica that went silent (or restarted its session): its tickets leave the queue,
        its leases end unused, so its capacity comes back."""
        for key in [key for key in self._held_back if key[0] == replica]:
            del self._held_back[key]
        reservations = [key for key in self.reservations if key[0] == replica]
        self._drop(reservations, [key for key in self.leases if key[0] == replica])

    def drain(self) -> None:
        self.over = True
        self._held_back.clear()
        self._drop(list(self.reservations), list(self.leases))

    def _drop(self, reservations: list[_Key], leases: list[_Key]) -> None:
        # Queued tickets first, so ending the leases cannot grant them.
        for key in reservations:
            self.reservations.pop(key).cancel()
        for key in leases:
            self.leases.pop(key).abandon()

    def _on_done(self, key: _Key, future: asyncio.Future[Lease]) -> None:
        self._callbacks_pending -= 1
        self._resolved(key, future)

    def _resolved(self, key: _Key, future: asyncio.Future[Lease]) -> None:
        reservation = self.reservations.pop(key, None)
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            if reservation is not None and isinstance(error, Rejected) and not self.over:
                self._reply(key[0], _rejection(self.epoch, key, error))
            return
        lease = future.result()
        if reservation is None or self.over or key in self._cancelled:
            self._cancelled.discard(key)
            lease.abandon()
            return
        self.leases[key] = lease
        grant: _Reply = ("g", self.epoch, key[1], key[2], lease.charged, lease.deployment)
        # The rank only where the engine's queue is in user order (`fair_engine_queue`): a
        # follower older than the field drops a grant that has it, so it is never sent otherwise.
        self._reply(key[0], (*grant, lease.engine_rank) if lease.engine_rank else grant)


def _rejection(epoch: int, key: _Key, error: Rejected) -> _Reply:
    kind = "f" if isinstance(error, QueueFull) else "t" if isinstance(error, QueueTimeout) else "x"
    scope = error.scope if isinstance(error, QueueFull) else ""
    return (kind, epoch, key[1], key[2], str(error), error.retry_after_s, scope)


def _error_from(reply: _Reply) -> Rejected:
    kind, _, _, _, message, retry_after_s, scope = reply
    if kind == "f":
        return QueueFull(message, retry_after_s=retry_after_s, scope=scope)
    if kind == "t":
        return QueueTimeout(message, retry_after_s=retry_after_s)
    return SchedulerClosed(message, retry_after_s=retry_after_s)


_TICKET_FIELDS = 6
# A replica of the version before placement (#16) sends tickets without `prefix`, adopted leases
# without their deployment, and grants without a deployment: during a rolling upgrade those
# still mean what they meant (no prefix, not placed), rather than being skipped as malformed,
# which left a follower's request parked until its wait ran out while the leader counted its
# lease in flight for good.
_OLDER_TICKET_FIELDS = 5
# More leading blocks than any replica of this version sends (prefix.DEFAULT_MAX_BLOCKS).
_MAX_PREFIX_BLOCKS = 1024
_MAX_PREFIX_HASH = 1 << 52
# The most one grant may charge: a whole request's tokens at the smallest weight (a money
# charge, MAX_REQUEST_COST / MIN_WEIGHT, and a turn, 1 / MIN_WEIGHT, are below it).
_MAX_CHARGE = MAX_REQUEST_TOKENS / MIN_WEIGHT
# The longest Retry-After a rejection may carry: the core's hints stay within 60 s; a day (the
# longest budget window, `per: day`) leaves room for hints to come.
_MAX_RETRY_AFTER_S = 86_400.0


def _ticket_fields(ticket: Ticket) -> list[Any]:
    # `price` is not among them: it travels last in its message (see `_read_message`), so a
    # leader older than the field reads the message as before.
    return [ticket.model, ticket.user, ticket.tier, ticket.weight, ticket.cost, list(ticket.prefix)]


def _ticket_from(fields: list[Any], price: object = 0.0) -> Ticket:
    """The ticket a message carries; `OutOfRange` (a ValueError) naming the first field that is
    not what a replica sends (the core must never hold a field of the wrong type or out of its
    documented range: its heaps compare them later, for everyone)."""
    if len(fields) == _OLDER_TICKET_FIELDS:
        fields = [*fields, []]
    if len(fields) != _TICKET_FIELDS:
        raise OutOfRange("ticket", f"{len(fields)} fields")
    model, user, tier, weight, cost, prefix = fields
    for field, text in (("ticket model", model), ("ticket user", user), ("ticket tier", tier)):
        if not short_text(text):
            raise OutOfRange(field, text)
    # NaN fails both comparisons.
    if not (_number(weight) and MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise OutOfRange("ticket weight", weight)
    if not request_tokens_in_range(cost):
        raise OutOfRange("ticket cost", cost)
    if not _money(price):
        raise OutOfRange("ticket price", price)
    if not isinstance(prefix, list) or len(prefix) > _MAX_PREFIX_BLOCKS:
        raise OutOfRange("ticket prefix", prefix)
    if not all(whole(block, 0, _MAX_PREFIX_HASH - 1) for block in prefix):
        raise OutOfRange("ticket prefix", "not 52-bit block hashes")
    return Ticket(model, user, tier, weight, cost, float(price), prefix=tuple(prefix))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _money(value: object) -> TypeGuard[int | float]:
    """A money amount within [0, MAX_REQUEST_COST] (compared first: `request_cost_in_range`
    raises OverflowError on an integer too large for a float)."""
    return (
        _number(value)
        and 0 <= value <= MAX_REQUEST_COST  # type: ignore[operator]
        and request_cost_in_range(value)
    )


def _usage(tokens: object, cost: object) -> tuple[int | None, float | None, list[str]]:
    """A lease's reported usage with every value outside its documented range left out (the
    lease still ends: charged its estimate for what is left out), and the names of those."""
    tokens_used = tokens if isinstance(tokens, int) and request_tokens_in_range(tokens) else None
    cost_used = float(cost) if _money(cost) else None
    dropped = []
    if tokens is not None and tokens_used is None:
        dropped.append(f"tokens used {shown(tokens)}")
    if cost is not None and cost_used is None:
        dropped.append(f"cost used {shown(cost)}")
    return tokens_used, cost_used, dropped


class _Inbound(NamedTuple):
    """A follower's message, read and checked: `body` by kind — "s": (ticket,); "a": (ticket,
    started, deployment); "e": (tokens_used, cost_used, abandoned); "$": (principal, usd,
    tokens); the others: ()."""

    kind: str
    epoch: int
    session: int
    replica: str
    tid: int
    body: tuple[Any, ...] = ()


_MESSAGE_KINDS = frozenset("scbeap$")


def _read_message(text: str, tiers: tuple[TierLimits, ...]) -> _Inbound:
    """A follower's message from the inbox: JSON `[kind, epoch, session, replica, tid, ...]`.
    Raises `OutOfRange` (naming the field), ValueError or TypeError if it is not one that a
    replica of this version (or an older one) sends: the leader drops it.

    Fields added since the first version go last, so a leader older than them reads the
    message as before, and a message without them still reads here: a ticket's `price` (0.0
    without), a lease end's `cost_used` (unknown without).
    """
    try:
        message = json.loads(text)
    except RecursionError:  # absurdly deep JSON
        raise ValueError("nested too deeply") from None
    if not isinstance(message, list) or len(message) < 5:
        raise OutOfRange("message", text[:40])
    kind, epoch, session, replica, tid = message[:5]
    if not (isinstance(kind, str) and kind in _MESSAGE_KINDS):
        raise OutOfRange("kind", kind)
    for field, value, high in (("epoch", epoch, MAX_EPOCH), ("session", session, MAX_SERIAL)):
        if not whole(value, 0, high):
            raise OutOfRange(field, value)
    if not short_text(replica):
        raise OutOfRange("replica", replica)
    if not whole(tid, 0, MAX_SERIAL):
        raise OutOfRange("id", tid)
    header = (kind, epoch, session, replica, tid)
    rest = message[5:]
    if kind == "s":
        # [ticket..., price]; older: [ticket (5 or 6 fields)].
        if len(rest) not in (_OLDER_TICKET_FIELDS, _TICKET_FIELDS, _TICKET_FIELDS + 1):
            raise OutOfRange("ticket", f"{len(rest)} fields")
        price = rest[_TICKET_FIELDS] if len(rest) > _TICKET_FIELDS else 0.0
        return _Inbound(*header, (_known_tier(_ticket_from(rest[:_TICKET_FIELDS], price), tiers),))
    if kind == "a":
        # [ticket..., started, deployment, price]; older: without the price, or [ticket (5
        # fields), started].
        if len(rest) == _OLDER_TICKET_FIELDS + 1:
            fields, started, deployment, price = rest[:-1], rest[-1], None, 0.0
        elif len(rest) in (_TICKET_FIELDS + 2, _TICKET_FIELDS + 3):
            fields, (started, deployment) = rest[:_TICKET_FIELDS], rest[_TICKET_FIELDS:][:2]
            price = rest[_TICKET_FIELDS + 2] if len(rest) > _TICKET_FIELDS + 2 else 0.0
        else:
            raise OutOfRange("adopted lease", f"{len(rest)} fields")
        if not isinstance(started, bool):
            raise OutOfRange("started", started)
        if deployment is not None and not short_text(deployment):
            raise OutOfRange("deployment", deployment)
        ticket = _known_tier(_ticket_from(fields, price), tiers)
        return _Inbound(*header, (ticket, started, deployment))
    if kind == "e":
        # [tokens_used (-1: unknown), abandoned, cost_used (null: unknown)]; older: without
        # the cost.
        if len(rest) not in (2, 3):
            raise OutOfRange("lease end", f"{len(rest)} fields")
        tokens, abandoned, cost = (*rest, None)[:3]
        if not isinstance(abandoned, bool):
            raise OutOfRange("abandoned", abandoned)
        return _Inbound(*header, (None if tokens == -1 else tokens, cost, abandoned))
    if kind == "$":
        if len(rest) != 3:
            raise OutOfRange("spend", f"{len(rest)} fields")
        principal, usd, tokens = rest
        if not short_text(principal):
            raise OutOfRange("spend principal", principal)
        if not _money(usd):
            raise OutOfRange("spend usd", usd)
        if not request_tokens_in_range(tokens):
            raise OutOfRange("spend tokens", tokens)
        return _Inbound(*header, (principal, float(usd), tokens))
    return _Inbound(*header)


def _known_tier(ticket: Ticket, tiers: tuple[TierLimits, ...]) -> Ticket:
    if ticket.tier not in {tier.name for tier in tiers}:
        raise OutOfRange("ticket tier", ticket.tier)
    return ticket


def _serial(value: object) -> bool:
    return whole(value, 0, MAX_SERIAL)


def _retry_after(value: object) -> bool:
    return value is None or (_number(value) and 0 <= value <= _MAX_RETRY_AFTER_S)  # type: ignore[operator]


# Fields of each reply kind after (kind, epoch, session): each one's name and its check.
_REPLY_SHAPES: dict[str, tuple[tuple[str, Callable[[Any], bool]], ...]] = {
    "g": (
        ("id", _serial),
        ("charged", lambda charged: _number(charged) and 0 <= charged <= _MAX_CHARGE),
        ("deployment", lambda deployment: deployment is None or short_text(deployment)),
        ("engine rank", _serial),
    ),
    "p": (("nonce", _serial),),
    "h": (("leader", short_text),),
    **{
        kind: (
            ("id", _serial),
            ("message", lambda message: isinstance(message, str)),
            ("retry after", _retry_after),
            ("scope", lambda scope: isinstance(scope, str)),
        )
        for kind in "ftx"
    },
}


def _parse_reply(text: str) -> _Reply:
    """A reply from the leader's list; `OutOfRange` naming the field (or ValueError) if it is
    not one (the follower skips it)."""
    try:
        reply = json.loads(text)
    except RecursionError:  # absurdly deep JSON
        raise ValueError("nested too deeply") from None
    if not isinstance(reply, list) or len(reply) < 3:
        raise OutOfRange("reply", text[:40])
    kind, epoch, session, *rest = reply
    missing = len(_REPLY_SHAPES["g"]) - len(rest) if kind == "g" else 0
    if 0 < missing <= 2:
        # Without the rank: a grant where the engine's queue is not in user order (or from an
        # older leader), rank 0. Without the deployment too: an older leader's (see
        # _OLDER_TICKET_FIELDS), which did not place the request.
        defaults = (None, 0)[-missing:]
        rest.extend(defaults)
        reply.extend(defaults)
    shape = _REPLY_SHAPES.get(kind) if isinstance(kind, str) else None
    if shape is None:
        raise OutOfRange("kind", kind)
    if len(rest) != len(shape):
        raise OutOfRange(f"{kind!r} reply", f"{len(rest)} fields")
    for (field, check), value in zip(shape, rest, strict=True):
        if not check(value):
            raise OutOfRange(field, value)
    if not whole(epoch, 0, MAX_EPOCH):
        raise OutOfRange("epoch", epoch)
    if not whole(session, 0, MAX_SERIAL):
        raise OutOfRange("session", session)
    return tuple(reply)


def _read_reply(text: str) -> _Reply | None:
    """A reply from the leader's list, or None if it is not one (skipped)."""
    try:
        return _parse_reply(text)
    except ValueError:
        return None


class _Published(NamedTuple):
    """The leader's statistics document, read by a follower."""

    scheduler: SchedulerStatistics
    gate: tuple[GroupStatus, ...]


# A leader older than `GroupStatus.to_wire` published each gate row as a list in this order (the
# older still, without the last fields); a follower reads those by these names during a rolling
# upgrade. Frozen: fields added to the types since then travel by name only.
_POSITIONAL_DEPLOYMENT = (
    "deployment",
    "mode",
    "waiting",
    "running",
    "tpot_s",
    "kv_usage",
    "pending",
    "free_slots",
    "in_flight",
    "last_scrape_age_s",
    "blocked_reason",
    "allowed_queue",
)
_POSITIONAL_GROUP = (
    "model",
    "mode",
    "deployments",
    *_POSITIONAL_DEPLOYMENT[2:],
    "per_deployment",
)


def _by_name(row: object, names: tuple[str, ...]) -> object:
    """An older leader's positional row keyed by name; anything else as it came."""
    if not isinstance(row, list):
        return row
    if len(row) > len(names):
        raise ValueError(f"a positional gate row has {len(row)} fields, more than {len(names)}")
    return dict(zip(names, row, strict=False))


def _group_status(row: object) -> GroupStatus:
    """A `GroupStatus` from the leader's document: by name, or an older leader's list."""
    group = _by_name(row, _POSITIONAL_GROUP)
    if isinstance(group, dict) and isinstance(group.get("per_deployment"), list):
        group["per_deployment"] = [
            _by_name(deployment, _POSITIONAL_DEPLOYMENT) for deployment in group["per_deployment"]
        ]
    return GroupStatus.from_wire(group)


def _read_published(text: str) -> _Published:
    """The leader's statistics document from `stats`; ValueError says why it is not one."""
    try:
        document = json.loads(text)
        scheduler = dict(document["scheduler"])
        scheduler["queued_by_model_tier"] = {
            (model, tier): count for model, tier, count in scheduler["queued_by_model_tier"]
        }
        scheduler["in_flight_by_model"] = dict(scheduler["in_flight_by_model"])
        statistics = SchedulerStatistics(**scheduler)
        gate = tuple(_group_status(row) for row in document["gate"])
    except RecursionError:  # absurdly deep JSON
        raise ValueError("nested too deeply") from None
    except KeyError as exc:
        raise ValueError(f"no {exc}") from None
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    counts = [value for value in statistics[:8]]
    counts += [*statistics.queued_by_model_tier.values(), *statistics.in_flight_by_model.values()]
    for count in counts:
        if not whole(count, 0, MAX_SERIAL):
            raise OutOfRange("a scheduler count", count)
    if not all(isinstance(row.model, str) and isinstance(row.mode, str) for row in gate):
        raise ValueError("a gate row's model or mode is not a string")
    return _Published(statistics, gate)


class ReplicaScheduler:
    """`FairScheduler`'s surface (`acquire`, `try_acquire`, `statistics`, `backlog`, `close`,
    `add_end_listener`, `tiers`, `gate`) for one replica, plus `start`/`aclose`.

    `link` is None for `memory://`: the replica is its own acting leader and nothing else runs.
    """

    def __init__(
        self,
        core: FairScheduler,
        gate: MetricsGate | None = None,
        *,
        link: RedisLink | None = None,
        replica: str | None = None,
        heartbeat_s: float = 1.0,
    ) -> None:
        self._core = core
        self._gate = gate
        self._link = link
        if gate is not None and link is not None:
            gate.ends_arrive_out_of_step()
        self.replica = replica or (link.replica if link else uuid.uuid4().hex[:12])
        self._heartbeat_s = heartbeat_s
        self._tids = itertools.count(1)
        self._session = 0
        self._parked: dict[int, _Parked] = {}
        # Their depths per (model, tier, user): a follower's position estimates, O(log n).
        self._parked_index = BacklogIndex([tier.name for tier in core.tiers])
        self._held: dict[int, Lease] = {}
        self._end_listeners: list[Callable[[Lease, bool], None]] = []
        self._closed = False
        # Whose core decides: our own term (`_term`), or the leader of `_epoch` through Redis.
        self._term: _Term | None = None
        self._epoch = NO_EPOCH
        self._leader: str | None = None
        self._token: str | None = None  # our leader lease, while we hold it
        self._resigning: str | None = None  # the lease to hand back once closed
        self._mode: StateMode = "shared" if link else "local"
        self._alive: list[str] = [self.replica]
        self._published: _Published | None = None
        self._decider_listeners: list[Callable[[], None]] = []
        self._outbox: list[str] = []
        self._outbox_ready = asyncio.Event()
        self._outgoing: dict[str, list[str]] = {}
        self._outgoing_ready = asyncio.Event()
        self._barriers: dict[int, asyncio.Future[None]] = {}
        self._loops: list[asyncio.Task[Any]] = []
        self._leading: list[asyncio.Task[Any]] = []
        self._counters = dict.fromkeys(("fallbacks", "recoveries", "store_errors"), 0)
        self._hold: asyncio.TimerHandle | None = None
        # Led, followed or ran a local term before (see `_lead`).
        self._took_part = False
        self._budgets: BudgetBook | None = None
        self._budgets_taken_over: str | None = None  # the lease whose term restored them
        self._bad_budgets: str | None = None  # the unreadable value last logged
        if link is None:
            self._open_term(LOCAL_EPOCH)

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

    @property
    def mode(self) -> StateMode:
        return self._mode

    @property
    def coordinated(self) -> bool:
        """True when replicas coordinate through Redis (`redis://`), False for `memory://`."""
        return self._link is not None

    @property
    def leading(self) -> bool:
        """True while this replica's core decides for every replica on its Redis."""
        return self._token is not None and self._term is not None

    async def acquire(self, ticket: Ticket) -> Lease:
        """Wait for this ticket's turn among every replica's tickets; see `FairScheduler`."""
        self._check_open()
        self._check_tier(ticket.tier)
        loop = asyncio.get_running_loop()
        parked = _Parked(ticket, next(self._tids), loop.create_future(), loop.time())
        self._park(parked)
        self._submit(parked, raise_full=True)
        future = parked.future
        try:
            return await future
        except BaseException:
            if self._unpark(parked.tid) is not None:
                self._cancel(parked.tid)
            elif future.done() and not future.cancelled() and future.exception() is None:
                # Granted, then cancelled before it could be used: hand it back.
                future.result().abandon()
            raise

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
        now = asyncio.get_running_loop().time()
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

    def add_end_listener(self, listener: Callable[[Lease, bool], None]) -> None:
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

    def gate_status(self) -> list[GroupStatus]:
        """The deciding gate's status: ours while we decide, else the leader's published one."""
        if self._term is None and self._published is not None:
            return list(self._published.gate)
        return self._gate.status() if self._gate is not None else []

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
            if not parked.future.done():
                parked.future.set_exception(
                    SchedulerClosed("the scheduler is shutting down", retry_after_s=1)
                )
        self._parked.clear()
        self._parked_index.clear()
        if self._term is not None and self._token is not None:
            self._resigning = self._token
            self._close_term()
        self._core.close()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the heartbeat, the sender and the reply listener (Redis only). Idempotent."""
        if self._closed or self._link is None or self._loops:
            return
        loop = asyncio.get_running_loop()
        self._loops = [
            loop.create_task(self._tick(), name="fair-sched-state-tick"),
            loop.create_task(self._send_loop(), name="fair-sched-state-send"),
            loop.create_task(self._reply_loop(), name="fair-sched-state-replies"),
        ]

    async def aclose(self) -> None:
        """Close, send what is still queued for the leader (briefly), step down, disconnect."""
        self.close()
        token = self._resigning
        if self._link is None:
            return
        await asyncio.sleep(0)
        with contextlib.suppress(StateStoreError, asyncio.TimeoutError):
            await asyncio.wait_for(self._flush_outbox(), 2.0)
        tasks = [*self._loops, *self._leading]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if token is not None:
            with contextlib.suppress(StateStoreError):
                await self._save_budgets(self._link, token)
            with contextlib.suppress(StateStoreError):
                await self._link.resign(token)
        await self._link.aclose()

    async def barrier(self) -> None:
        """Return once the acting leader has handled everything this replica sent before and
        its replies have arrived (tests and benchmarks wait for quiescence with it)."""
        if self._term is not None or self._epoch == NO_EPOCH:
            for _ in range(3):
                await asyncio.sleep(0)
            return
        nonce = next(self._tids)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers[nonce] = future
        self._send(["p", self._epoch, self._session, self.replica, nonce])
        try:
            await future
        finally:
            self._barriers.pop(nonce, None)

    # ------------------------------------------------------------------ our requests

    def _submit(self, parked: _Parked, *, raise_full: bool) -> None:
        term = self._term
        if term is not None:
            try:
                term.submit((self.replica, self._session, parked.tid), parked.ticket)
            except QueueFull as exc:
                self._unpark(parked.tid)
                if raise_full:
                    raise
                if not parked.future.done():
                    parked.future.set_exception(exc)
            return
        self._send(
            [
                "s",
                self._epoch,
                self._session,
                self.replica,
                parked.tid,
                *_ticket_fields(parked.ticket),
                parked.ticket.price,
            ]
        )

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
            self._send(["c", self._epoch, self._session, self.replica, tid])

    def lease_started(self, lease: Lease) -> None:
        if self._term is not None:
            self._term.started((self.replica, self._session, lease.lease_id))
        else:
            self._send(["b", self._epoch, self._session, self.replica, lease.lease_id])

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
        tokens, cost, dropped = _usage(tokens_used, cost_used)
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
            tokens_sent = -1 if tokens is None else tokens
            self._send(
                ["e", self._epoch, self._session, self.replica, tid, tokens_sent, abandoned, cost]
            )

    def _on_reply(self, reply: _Reply) -> None:
        """A grant, rejection, barrier answer or new leader's hello (ours or from Redis)."""
        kind, epoch = reply[0], reply[1]
        if kind == "h":
            if epoch > self._epoch and self._term is None:
                self._follow(epoch, reply[3])
            return
        if epoch != self._epoch or reply[2] != self._session:
            return  # an earlier leader's or an earlier session's: already re-sent
        if kind == "p":
            barrier = self._barriers.get(reply[3])
            if barrier is not None and not barrier.done():
                barrier.set_result(None)
            return
        tid = reply[3]
        parked = self._unpark(tid)
        if kind != "g":
            if parked is not None and not parked.future.done():
                parked.future.set_exception(_error_from(reply))
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
            released_at=asyncio.get_running_loop().time(),
            charged=reply[4],
            deployment=reply[5],
            engine_rank=reply[6] if len(reply) > 6 else 0,  # sent only where it is not 0
        )
        self._held[tid] = lease
        parked.future.set_result(lease)

    def _resend(self) -> None:
        """Tell a new acting leader everything we have: running leases first (so their
        capacity is counted before anything else is granted), then parked tickets in order."""
        term = self._term
        for tid, lease in list(self._held.items()):
            key = (self.replica, self._session, tid)
            if term is not None:
                term.adopt(key, lease.ticket, started=lease.started, deployment=lease.deployment)
            else:
                self._send(
                    [
                        "a",
                        self._epoch,
                        self._session,
                        self.replica,
                        tid,
                        *_ticket_fields(lease.ticket),
                        lease.started,
                        lease.deployment,
                        lease.ticket.price,
                    ]
                )
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

    def add_decider_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` each time this replica starts deciding."""
        self._decider_listeners.append(listener)

    def _open_term(self, epoch: int, *, hold: bool = False) -> None:
        """Decide from now on. `hold`: grant nothing new until a scrape can show what an
        earlier leader (or the other replicas) released just before; running leases are
        adopted at once, queued tickets wait for the hold to end."""
        self._term = _Term(self._core, epoch, self._reply)
        if hold:
            self._term.holding = True
            self._hold = asyncio.get_running_loop().call_later(self._hold_s(), self._term.end_hold)
        self._epoch = epoch
        self._leader = self.replica
        self._outbox.clear()  # addressed to another leader: re-sent below
        self._resend()
        for listener in self._decider_listeners:
            listener()

    def _close_term(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        term, self._term = self._term, None
        if term is not None:
            term.drain()
        self._token = None
        self._leader = None
        self._epoch = NO_EPOCH
        self._outgoing.clear()
        for task in self._leading:
            task.cancel()
        self._leading = []

    def _hold_s(self) -> float:
        graces = (
            [group.arrival_grace_s for group in self._gate.groups().values()] if self._gate else []
        )
        return self._heartbeat_s + max(graces, default=0.0)

    def _reply(self, replica: str, reply: _Reply) -> None:
        if replica == self.replica:
            self._on_reply(reply)
            return
        self._outgoing.setdefault(replica, []).append(json.dumps(reply))
        self._outgoing_ready.set()

    def _follow(self, epoch: int, leader: str) -> None:
        """A new leader (not us): re-send everything to it."""
        self._took_part = True
        self._epoch = epoch
        self._leader = leader
        self._outbox.clear()
        self._resend()

    def _lead(self, token: str, epoch: int) -> None:
        # The first leader of a fresh cluster (epoch 1, and we never took part in a term) has
        # nothing to wait for; any other waits for the others' running leases (and a scrape)
        # before granting. Epoch 1 is not enough: a Redis restarted without persistence counts
        # from 1 again while the other replicas still spend their local shares.
        self._close_term()
        self._token = token
        self._open_term(epoch, hold=epoch > 1 or self._took_part)
        self._took_part = True
        logger.info("fair_sched replica %s leads (epoch %d)", self.replica, epoch)
        loop = asyncio.get_running_loop()
        self._leading = [
            loop.create_task(self._inbox_loop(token, epoch), name="fair-sched-leader-inbox"),
            loop.create_task(self._deliver_loop(token), name="fair-sched-leader-deliver"),
        ]
        for replica in self._alive:
            if replica != self.replica:
                self._reply(replica, ("h", epoch, 0, self.replica))

    def _step_down(self, why: str) -> None:
        if self._token is None:
            return
        logger.warning("fair_sched replica %s no longer leads: %s", self.replica, why)
        self._close_term()

    # ------------------------------------------------------------------ Redis: all replicas

    def _send(self, message: list[Any]) -> None:
        if self._epoch == NO_EPOCH or (self._closed and message[0] not in "ce"):
            return
        self._outbox.append(json.dumps(message))
        self._outbox_ready.set()

    async def _flush_outbox(self) -> None:
        assert self._link is not None
        while self._outbox:
            batch, self._outbox = self._outbox, []
            await self._link.send(batch)

    async def _send_loop(self) -> None:
        # Not only cancellation: redis-py may turn a cancel into its own timeout error.
        while not self._closed:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            if self._mode != "shared":
                self._outbox.clear()
                continue
            try:
                await self._flush_outbox()
            except StateStoreError as exc:
                self._store_failed(exc)

    async def _reply_loop(self) -> None:
        assert self._link is not None
        # Not only cancellation: redis-py may turn a cancel into its own timeout error.
        while not self._closed:
            if self._mode != "shared":
                await asyncio.sleep(self._heartbeat_s)
                continue
            try:
                raw = await self._link.next_replies()
            except StateStoreError as exc:
                self._store_failed(exc)
                continue
            for message in raw:
                try:
                    reply = _parse_reply(message)
                except ValueError as exc:
                    logger.warning(
                        "fair_sched replica %s skipped a malformed reply in Redis key %s (%.80s)",
                        self.replica,
                        self._link.replies_key(self.replica),
                        exc,
                    )
                    continue
                self._on_reply(reply)

    async def _tick(self) -> None:
        # Not only cancellation: redis-py may turn a cancel into its own timeout error.
        while not self._closed:
            try:
                await self._beat()
            except Exception:
                # A bug must not stop the heartbeat (the lease would lapse for good).
                logger.exception("fair_sched replica %s: heartbeat failed", self.replica)
            await asyncio.sleep(self._heartbeat_s)

    async def _beat(self) -> None:
        link = self._link
        assert link is not None
        try:
            if self._mode == "local":
                await link.reset_connections()
            beat = await link.beat()
            if self._mode == "local":
                self._rejoin()
            await self._after_beat(link, beat)
            await self._sync_budgets(link)
        except StateStoreError as exc:
            self._store_failed(exc)

    async def _after_beat(self, link: RedisLink, beat: Beat) -> None:
        self._alive = beat.alive or [self.replica]
        self._published = None
        if beat.statistics:
            try:
                self._published = _read_published(beat.statistics)
            except ValueError as exc:
                # Not the leader's document: reported as our own until its next renewal.
                corrupt_value(
                    link.statistics_key,
                    f"not a statistics document ({exc}): {beat.statistics[:40]!r}",
                )
        if self._token is not None:
            if beat.leader != self._token:
                self._step_down(f"the lease is now {beat.leader!r}")
            elif not await link.renew(self._token, self._document()):
                self._step_down("the lease was taken while renewing it")
            elif self._term is not None:
                for replica in self._term.replicas() - set(self._alive) - {self.replica}:
                    logger.warning(
                        "fair_sched replica %s went silent: its requests dropped", replica
                    )
                    self._term.drop_replica(replica)
            if self._token is not None:
                return
        token = beat.leader or await link.elect()
        parsed = parse_token(token)
        if parsed is None:  # elect.lua and parse_token disagree: wait for the next heartbeat
            corrupt_value(link.leader_key, f"not a leader token: {token[:40]!r}")
            return
        epoch, leader = parsed
        if leader == self.replica:
            if self._token != token:
                self._lead(token, epoch)
                await link.renew(token, self._document())
        elif epoch != self._epoch:
            self._follow(epoch, leader)

    def _rejoin(self) -> None:
        self._counters["recoveries"] += 1
        logger.warning(
            "fair_sched state store is back: replica %s schedules with the others again",
            self.replica,
        )
        self._close_term()  # the local one: our leases and tickets go to the shared leader
        self._session += 1  # replies addressed to the session before the outage are stale
        self._mode = "shared"
        if self._gate is not None:
            self._gate.share_with(1)

    def _store_failed(self, exc: StateStoreError) -> None:
        self._counters["store_errors"] += 1
        if self._mode == "local" or self._closed:
            return
        self._mode = "local"
        self._counters["fallbacks"] += 1
        sharers = max(1, len(self._alive))
        logger.warning(
            "fair_sched state store unavailable (%s): replica %s falls back to in-memory "
            "scheduling with 1/%d of each engine threshold until it is back",
            exc,
            self.replica,
            sharers,
        )
        self._close_term()
        if self._gate is not None:
            self._gate.share_with(sharers)
        self._took_part = True
        self._open_term(LOCAL_EPOCH, hold=True)

    # ------------------------------------------------------------------ Redis: the leader

    async def _inbox_loop(self, token: str, epoch: int) -> None:
        assert self._link is not None
        while self._token == token and not self._closed:
            try:
                raw = await self._link.next_inbox()
            except StateStoreError as exc:
                self._store_failed(exc)
                return
            term = self._term
            if term is None or term.epoch != epoch:
                return
            for message in raw:
                try:
                    inbound = _read_message(message, self._core.tiers)
                except ValueError as exc:
                    # Not from a replica of this version: skip it, keep leading.
                    logger.warning(
                        "fair_sched leader skipped a malformed message in Redis key %s (%.80s)",
                        self._link.inbox_key,
                        exc,
                    )
                    continue
                try:
                    self._handle(term, inbound)
                except Exception:
                    # A bug must not end the inbox loop: every follower would wait for good
                    # on a leader that keeps renewing its lease.
                    logger.exception(
                        "fair_sched leader failed on a %r message from replica %s",
                        inbound.kind,
                        shown(inbound.replica),
                    )

    def _handle(self, term: _Term, message: _Inbound) -> None:
        """One follower's message, read and checked by `_read_message`."""
        if message.kind == "$":
            principal, usd, tokens = message.body
            if self._budgets is not None:
                self._budgets.spend(principal, usd=usd, tokens=tokens)
            return
        kind, epoch, session, replica, tid, body = message
        if epoch != term.epoch or not term.accepts(replica, session):
            return  # addressed to an earlier leader: its sender re-sends what still matters
        key = (replica, session, tid)
        if kind == "s":
            try:
                term.submit(key, body[0])
            except QueueFull as exc:
                self._reply(replica, _rejection(term.epoch, key, exc))
        elif kind == "c":
            term.cancel(key)
        elif kind == "b":
            term.started(key)
        elif kind == "e":
            tokens, cost, dropped = _usage(body[0], body[1])
            if dropped:
                # The lease still ends (its capacity comes back), charged its estimate.
                logger.warning(
                    "fair_sched leader ignored %s in a lease end from replica %s: out of range",
                    " and ".join(dropped),
                    shown(replica),
                )
            term.end(key, tokens, abandoned=body[2], cost_used=cost)
        elif kind == "a":
            ticket, started, deployment = body
            term.adopt(key, ticket, started=started, deployment=deployment)
        elif kind == "p":
            # After the grants this batch's messages caused (their callbacks come first).
            asyncio.get_running_loop().call_soon(
                self._reply, replica, ("p", term.epoch, session, tid)
            )

    async def _deliver_loop(self, token: str) -> None:
        assert self._link is not None
        while self._token == token and not self._closed:
            await self._outgoing_ready.wait()
            self._outgoing_ready.clear()
            if not self._outgoing:
                continue
            batch, self._outgoing = self._outgoing, {}
            try:
                fenced = await self._link.deliver(token, batch)
            except StateStoreError as exc:
                self._store_failed(exc)
                return
            if not fenced:
                self._step_down("another replica holds the lease")
                return

    def _document(self) -> str:
        stats = self.statistics()
        return json.dumps(
            {
                "leader": self.replica,
                "epoch": self._epoch,
                "replicas": len(self._alive),
                "scheduler": {
                    **stats._asdict(),
                    "queued_by_model_tier": [
                        [model, tier, count]
                        for (model, tier), count in stats.queued_by_model_tier.items()
                    ],
                    "in_flight_by_model": list(stats.in_flight_by_model.items()),
                },
                "gate": [row.to_wire() for row in (self._gate.status() if self._gate else [])],
            }
        )

    # ------------------------------------------------------------------ budgets

    def share_budgets(self, book: BudgetBook) -> None:
        """Keep `book` the same on every replica: the acting leader's book is the truth, it
        takes the followers' spends (`record_spend`), stores its snapshot in Redis on every
        heartbeat (a new leader, also after a restart, restores it) and the followers load it.
        A follower's own spends count locally at once and come back with the leader's next
        snapshot (so its view lags the leader's by at most a heartbeat)."""
        self._budgets = book

    def record_spend(self, principal: str, *, usd: float, tokens: int) -> None:
        """What one of this replica's requests spent: into our book, and to the leader."""
        if self._budgets is None:
            return
        self._budgets.spend(principal, usd=usd, tokens=tokens)
        if self._term is None and self._budgets.rule(principal) is not None:
            # A fact, not a request: the leader counts it whatever epoch it was sent in.
            self._send(["$", self._epoch, self._session, self.replica, 0, principal, usd, tokens])

    async def _sync_budgets(self, link: RedisLink) -> None:
        """After a heartbeat: a leader stores its book (restoring the stored one first when its
        term is new); a follower takes the leader's."""
        if self._budgets is None or not self._budgets.longest_window_s():
            return  # no principal has a budget: nothing to share
        if self._mode != "shared":
            return
        token = self._token
        if token is None:
            self._take_budgets(link, await link.load_budgets())
            return
        if self._budgets_taken_over != token:
            self._take_budgets(link, await link.load_budgets())
            self._budgets_taken_over = token
        await self._save_budgets(link, token)

    async def _save_budgets(self, link: RedisLink, token: str) -> None:
        book = self._budgets
        if book is None or not book.longest_window_s():
            return
        await link.save_budgets(token, json.dumps(book.snapshot()), book.longest_window_s())

    def _take_budgets(self, link: RedisLink, raw: str | None) -> None:
        """Replace our book with a stored snapshot; an unreadable one gives a fresh book (the
        leader's next store overwrites it) and one log line per distinct bad value."""
        book = self._budgets
        if book is None or raw is None:
            return
        try:
            book.restore(json.loads(raw), replace=True)
        # RecursionError: absurdly deep JSON; OverflowError: an integer too large for a float.
        except (ValueError, OverflowError, RecursionError) as exc:
            if raw != self._bad_budgets:
                logger.error(
                    "fair_sched budget state in Redis key %s is unreadable (%.200s): replica %s "
                    "starts from a fresh budget book",
                    link.budgets_key,
                    exc,
                    self.replica,
                )
            self._bad_budgets = raw
            book.restore({}, replace=True)
        else:
            self._bad_budgets = None

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise SchedulerClosed("the scheduler is shutting down", retry_after_s=1)

    def _check_tier(self, tier: str) -> None:
        if tier not in {t.name for t in self.tiers}:
            names = [t.name for t in self.tiers]
            raise ValueError(f"unknown tier {tier!r}; tiers are {names}")
