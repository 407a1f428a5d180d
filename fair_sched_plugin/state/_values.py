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
