"""What replicas write into Redis for each other, and how each value is read back.

- **A follower's message** to the acting leader's inbox: JSON `[kind, epoch, session, replica,
  id, ...]`; "s" a ticket, "c" its cancel, "b" a lease's first byte, "e" a lease's end with its
  usage, "a" a running lease for a new leader to adopt, "p" a barrier, "$" a spend.
- **A reply** on a replica's own list: JSON `[kind, epoch, session, ...]`; "g" a grant, "f"/"t"/
  "d"/"x" a rejection (queue full, timed out, deadline out of reach, closed), "p" a barrier's
  answer, "h" a new leader's hello.
- **The leader's statistics document** (`stats`) and **its lease** (`leader`).

Every field is checked to its documented range where it is read (`OutOfRange` names the first
that is not), so neither the core nor a follower ever holds a value no replica sends. Fields
added since the first version go last and have readers for the messages without them, so
replicas of the version before keep working through a rolling upgrade.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeGuard

from ..core.backpressure import GroupStatus
from ..core.fairness_window import POLICY_UNITS, FairnessReading
from ..core.reads import SchedulerStatistics
from ..core.ticket import (
    MAX_REQUEST_COST,
    MAX_REQUEST_TOKENS,
    MAX_WEIGHT,
    MIN_WEIGHT,
    Lease,
    Ticket,
    TierLimits,
    request_cost_in_range,
    request_tokens_in_range,
)
from ..errors import DeadlineUnreachable, QueueFull, QueueTimeout, Rejected, SchedulerClosed

logger = logging.getLogger("fair_sched")

Key = tuple[str, int, int]  # (replica, session, ticket id): a request in a leadership term
Reply = tuple[Any, ...]

# ---------------------------------------------------------------------- bounds

# What elect.lua accepts as a lease: "<epoch>:<replica>", at most 512 characters.
_TOKEN = re.compile(r"([0-9]{1,15}):(.+)", re.DOTALL)
_MAX_TOKEN_CHARS = 512

# Counters the replicas send each other (sessions, ticket ids, barrier nonces, counts, ranks):
# whole numbers every JSON reader agrees on. Epochs are what elect.lua hands out (15 digits).
MAX_SERIAL = (1 << 53) - 1
MAX_EPOCH = 10**15 - 1
# Replica names, deployments, principals: far longer than any this package writes.
MAX_NAME_CHARS = 512

_TICKET_FIELDS = 6
# A replica of the version before placement sends tickets without `prefix`, adopted leases
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


class OutOfRange(ValueError):
    """A field of a message between replicas that is not what a replica of this version sends:
    the message is dropped (or, for a lease's end, its usage is) and `field` is logged."""

    def __init__(self, field: str, value: object) -> None:
        super().__init__(f"{field}: {shown(value)}")
        self.field = field


def shown(value: object) -> str:
    """A value for a log line, cut short (a hostile one may be huge)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}… ({len(text)} characters)"


def corrupt_value(key: str, what: str, done: str = "replaced it") -> None:
    """Log a Redis value that is not what a replica writes (every key holds only the replicas'
    own transient state, so it is replaced, never taken for a store outage)."""
    logger.warning(
        "fair_sched: Redis key %s held a corrupt value (%s); %s (it holds only the replicas' "
        "transient state)",
        key,
        what,
        done,
    )


def whole(value: object, low: int, high: int) -> bool:
    """An int (not a bool) within [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def short_text(value: object) -> bool:
    """A non-empty string of at most MAX_NAME_CHARS characters."""
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS


def _serial(value: object) -> bool:
    return whole(value, 0, MAX_SERIAL)


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


def _retry_after(value: object) -> bool:
    return value is None or (_number(value) and 0 <= value <= _MAX_RETRY_AFTER_S)  # type: ignore[operator]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:  # absurdly deep JSON
        raise ValueError("nested too deeply") from None


def parse_token(token: str) -> tuple[int, str] | None:
    """(epoch, replica) of a leader token; None if it is not one."""
    match = _TOKEN.fullmatch(token) if len(token) <= _MAX_TOKEN_CHARS else None
    return (int(match[1]), match[2]) if match else None


# ---------------------------------------------------------------------- a follower's messages


def follower_message(
    kind: str, epoch: int, session: int, replica: str, tid: int, *body: Any
) -> list[Any]:
    """A follower's message (`json.dumps` of it goes into the inbox; `read_message` reads it)."""
    return [kind, epoch, session, replica, tid, *body]


def ticket_body(ticket: Ticket) -> list[Any]:
    """What an "s" message carries after its header."""
    # `price` travels last, so a leader older than the field reads the message as before.
    return [*_ticket_fields(ticket), ticket.price]


def adopted_body(ticket: Ticket, *, started: bool, deployment: str | None) -> list[Any]:
    """What an "a" message carries after its header: a running lease."""
    return [*_ticket_fields(ticket), started, deployment, ticket.price]


def end_body(tokens_used: int | None, *, abandoned: bool, cost_used: float | None) -> list[Any]:
    """What an "e" message carries after its header: the usage (each value in its range)."""
    return [-1 if tokens_used is None else tokens_used, abandoned, cost_used]


def _ticket_fields(ticket: Ticket) -> list[Any]:
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


def usage_in_range(tokens: object, cost: object) -> tuple[int | None, float | None, list[str]]:
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


class Inbound(NamedTuple):
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


def read_message(text: str, tiers: tuple[TierLimits, ...]) -> Inbound:
    """A follower's message from the inbox: JSON `[kind, epoch, session, replica, tid, ...]`.
    Raises `OutOfRange` (naming the field), ValueError or TypeError if it is not one that a
    replica of this version (or an older one) sends: the leader drops it.

    Fields added since the first version go last, so a leader older than them reads the
    message as before, and a message without them still reads here: a ticket's `price` (0.0
    without), a lease end's `cost_used` (unknown without).
    """
    message = _loads(text)
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
        return Inbound(*header, (_known_tier(_ticket_from(rest[:_TICKET_FIELDS], price), tiers),))
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
        return Inbound(*header, (ticket, started, deployment))
    if kind == "e":
        # [tokens_used (-1: unknown), abandoned, cost_used (null: unknown)]; older: without
        # the cost.
        if len(rest) not in (2, 3):
            raise OutOfRange("lease end", f"{len(rest)} fields")
        tokens, abandoned, cost = (*rest, None)[:3]
        if not isinstance(abandoned, bool):
            raise OutOfRange("abandoned", abandoned)
        return Inbound(*header, (None if tokens == -1 else tokens, cost, abandoned))
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
        return Inbound(*header, (principal, float(usd), tokens))
    return Inbound(*header)


def _known_tier(ticket: Ticket, tiers: tuple[TierLimits, ...]) -> Ticket:
    if ticket.tier not in {tier.name for tier in tiers}:
        raise OutOfRange("ticket tier", ticket.tier)
    return ticket


# ---------------------------------------------------------------------- the leader's replies


def grant(epoch: int, key: Key, lease: Lease) -> Reply:
    """A grant of `key`'s ticket, as the core released it."""
    reply: Reply = ("g", epoch, key[1], key[2], lease.charged, lease.deployment)
    # The rank only where the engine's queue is in user order (`fair_engine_queue`): a
    # follower older than the field drops a grant that has it, so it is never sent otherwise.
    return (*reply, lease.engine_rank) if lease.engine_rank else reply


def rejection(epoch: int, key: Key, error: Rejected) -> Reply:
    kind = (
        "f"
        if isinstance(error, QueueFull)
        else "t"
        if isinstance(error, QueueTimeout)
        else "d"
        if isinstance(error, DeadlineUnreachable)
        else "x"
    )
    scope = error.scope if isinstance(error, QueueFull) else ""
    return (kind, epoch, key[1], key[2], str(error), error.retry_after_s, scope)


def error_from(reply: Reply) -> Rejected:
    """The error a rejection reply stands for."""
    kind, _, _, _, message, retry_after_s, scope = reply
    if kind == "f":
        return QueueFull(message, retry_after_s=retry_after_s, scope=scope)
    if kind == "t":
        return QueueTimeout(message, retry_after_s=retry_after_s)
    if kind == "d":
        return DeadlineUnreachable(message, retry_after_s=retry_after_s)
    return SchedulerClosed(message, retry_after_s=retry_after_s)


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
        for kind in "ftdx"
    },
}


def parse_reply(text: str) -> Reply:
    """A reply from the leader's list; `OutOfRange` naming the field (or ValueError) if it is
    not one (the follower skips it)."""
    reply = _loads(text)
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


def read_reply(text: str) -> Reply | None:
    """A reply from the leader's list, or None if it is not one (skipped)."""
    try:
        return parse_reply(text)
    except ValueError:
        return None


# ---------------------------------------------------------------------- the leader's document


class Published(NamedTuple):
    """The leader's statistics document, read by a follower."""

    scheduler: SchedulerStatistics
    gate: tuple[GroupStatus, ...]
    # The leader's fairness gauges (none from a leader of the version before them).
    fairness: tuple[FairnessReading, ...] = ()


# A fairness gauge's service gap: at most every request of a full queue at its largest and the
# smallest weight; waits and spans: at most a long year.
_MAX_SERVICE_GAP = 1e30
_MAX_GAUGE_S = 1e8
_FAIRNESS_UNITS = frozenset(POLICY_UNITS.values())


def statistics_document(
    leader: str,
    epoch: int,
    replicas: int,
    stats: SchedulerStatistics,
    gate: Sequence[GroupStatus],
    fairness: Sequence[FairnessReading] = (),
) -> str:
    """What the leader stores in `stats` on each renewal (`read_published` reads it)."""
    return json.dumps(
        {
            "leader": leader,
            "epoch": epoch,
            "replicas": replicas,
            "scheduler": {
                **stats._asdict(),
                "queued_by_model_tier": [
                    [model, tier, count]
                    for (model, tier), count in stats.queued_by_model_tier.items()
                ],
                "in_flight_by_model": list(stats.in_flight_by_model.items()),
            },
            "gate": [row.to_wire() for row in gate],
            "fairness": [
                [*reading[:3], [list(pair) for pair in reading.jain_index], *reading[4:]]
                for reading in fairness
            ],
        }
    )


def _seconds(value: object) -> bool:
    return _number(value) and 0 <= value <= _MAX_GAUGE_S  # type: ignore[operator]


def _fairness_reading(row: object) -> FairnessReading:
    """One fairness reading of the leader's document, each field checked to its range."""
    if not isinstance(row, list) or len(row) != len(FairnessReading._fields):
        raise ValueError("a fairness reading is not a list of its fields")
    model, tier, users, index, gap, starved, span = row
    if not short_text(model) or not short_text(tier):
        raise OutOfRange("a fairness reading's model or tier", model)
    if not whole(users, 0, MAX_SERIAL):
        raise OutOfRange("a fairness reading's users", users)
    if not isinstance(index, list) or len(index) > len(_FAIRNESS_UNITS):
        raise OutOfRange("a fairness reading's index", index)
    pairs = []
    for pair in index:
        if not isinstance(pair, list) or len(pair) != 2 or pair[0] not in _FAIRNESS_UNITS:
            raise OutOfRange("a fairness reading's unit", pair)
        if not (_number(pair[1]) and 0 <= pair[1] <= 1):
            raise OutOfRange("a fairness reading's Jain index", pair[1])
        pairs.append((pair[0], float(pair[1])))
    if gap is not None and not (_number(gap) and 0 <= gap <= _MAX_SERVICE_GAP):
        raise OutOfRange("a fairness reading's service gap", gap)
    if not _seconds(starved) or not _seconds(span):
        raise OutOfRange("a fairness reading's wait or span", (starved, span))
    return FairnessReading(
        model,
        tier,
        users,
        tuple(pairs),
        None if gap is None else float(gap),
        float(starved),
        float(span),
    )


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


def read_published(text: str) -> Published:
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
        fairness = tuple(_fairness_reading(row) for row in document.get("fairness", []))
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
    return Published(statistics, gate, fairness)
