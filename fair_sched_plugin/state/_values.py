"""Reading the values replicas keep in Redis: what a valid one is, and what to say when one is
not (every key holds only the replicas' own transient state, so a corrupt one is replaced)."""

from __future__ import annotations

import logging
import re

logger = logging.getLogger("fair_sched")

# What elect.lua accepts as a lease: "<epoch>:<replica>", at most 512 characters.
_TOKEN = re.compile(r"([0-9]{1,15}):(.+)", re.DOTALL)
_MAX_TOKEN_CHARS = 512


def parse_token(token: str) -> tuple[int, str] | None:
    """(epoch, replica) of a leader token; None if it is not one."""
    match = _TOKEN.fullmatch(token) if len(token) <= _MAX_TOKEN_CHARS else None
    return (int(match[1]), match[2]) if match else None


def corrupt_value(key: str, what: str, done: str = "replaced it") -> None:
    logger.warning(
        "fair_sched: Redis key %s held a corrupt value (%s); %s (it holds only the replicas' "
        "transient state)",
        key,
        what,
        done,
    )


# Counters the replicas send each other (sessions, ticket ids, barrier nonces, counts, ranks):
# whole numbers every JSON reader agrees on. Epochs are what elect.lua hands out (15 digits).
MAX_SERIAL = (1 << 53) - 1
MAX_EPOCH = 10**15 - 1
# Replica names, deployments, principals: far longer than any this package writes.
MAX_NAME_CHARS = 512


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


def whole(value: object, low: int, high: int) -> bool:
    """An int (not a bool) within [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def short_text(value: object) -> bool:
    """A non-empty string of at most MAX_NAME_CHARS characters."""
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS
