"""The log line of a refused request, at most one per principal, model and reason a minute.

It names the principal (never its key); a client hammering a full queue must not flood the log
(the metrics count every rejection). A shutdown is not news: logged at INFO, every time.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from ..core import Ticket
from ..errors import Rejected, SchedulerClosed
from ..request.identity import Principal
from . import rejection_reason

logger = logging.getLogger("fair_sched")


class RejectionLog:
    """Writes the `fair_sched rejected ...` line of each refusal that its limiter lets through."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._limiter = RejectionLogLimiter(clock=clock)

    def write(self, principal: Principal, ticket: Ticket, exc: Rejected) -> None:
        reason = rejection_reason(exc)
        closing = isinstance(exc, SchedulerClosed)
        key = (principal.name, ticket.model, reason)
        skipped = 0 if closing else self._limiter.allow(key)
        if skipped is not None:
            logger.log(
                logging.INFO if closing else logging.WARNING,
                "fair_sched rejected principal=%s model=%s tier=%s reason=%s retry_after=%s%s",
                principal.name,
                ticket.model,
                ticket.tier,
                reason,
                exc.retry_after_header,
                f" (and {skipped} more not logged)" if skipped else "",
                extra={
                    "fair_sched_event": "rejected",
                    "principal": principal.name,
                    "model": ticket.model,
                    "tier": ticket.tier,
                    "reason": reason,
                    "retry_after_s": exc.retry_after_s,
                    "skipped": skipped,
                },
            )


class RejectionLogLimiter:
    """At most one log line per key per `interval_s`; the next one says how many were skipped.

    Remembers at most `max_keys` keys (the least recently logged are forgotten first), so a
    stream of made-up principals cannot grow it without bound.
    """

    def __init__(
        self,
        interval_s: float = 60.0,
        *,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        # key -> (time of its last line, lines skipped since)
        self._keys: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()

    def allow(self, key: Hashable) -> int | None:
        """None: skip this line. Otherwise log it, with this many skipped since the last one."""
        now = self._clock()
        last = self._keys.get(key)
        if last is not None and now - last[0] < self._interval_s:
            self._keys[key] = (last[0], last[1] + 1)
            return None
        self._keys[key] = (now, 0)
        self._keys.move_to_end(key)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)
        return last[1] if last is not None else 0
