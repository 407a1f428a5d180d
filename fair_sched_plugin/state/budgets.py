"""One budget book for every replica: the acting leader's is the truth. It takes the followers'
spends, stores its snapshot in Redis on every heartbeat (a new leader, also after a restart,
restores it) and the followers load it. A follower's own spends count locally at once and come
back with the leader's next snapshot (so its view lags the leader's by at most a heartbeat).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ..core.budget import BudgetBook

if TYPE_CHECKING:  # redis is an optional extra
    from .redis_link import RedisLink

logger = logging.getLogger("fair_sched")


class SharedBudgets:
    """A replica's `BudgetBook` kept the same as the acting leader's through Redis."""

    def __init__(self, book: BudgetBook, replica: str) -> None:
        self.book = book
        self._replica = replica
        self._taken_over: str | None = None  # the lease whose term restored the stored book
        self._bad: str | None = None  # the unreadable value last logged

    def spend(self, principal: str, *, usd: float, tokens: int) -> bool:
        """Count a spend in our book; True if `principal` has a budget (the leader must hear
        of it)."""
        self.book.spend(principal, usd=usd, tokens=tokens)
        return self.book.rule(principal) is not None

    @property
    def shared(self) -> bool:
        """False while no principal has a budget: nothing to keep the same."""
        return bool(self.book.longest_window_s())

    async def sync(self, link: RedisLink, token: str | None) -> None:
        """After a heartbeat: the leader (holding `token`) stores its book, restoring the
        stored one first when its term is new; a follower (None) takes the leader's."""
        if not self.shared:
            return
        if token is None:
            self._take(link, await link.load_budgets())
            return
        if self._taken_over != token:
            self._take(link, await link.load_budgets())
            self._taken_over = token
        await self.save(link, token)

    async def save(self, link: RedisLink, token: str) -> None:
        if not self.shared:
            return
        book = self.book
        await link.save_budgets(token, json.dumps(book.snapshot()), book.longest_window_s())

    def _take(self, link: RedisLink, raw: str | None) -> None:
        """Replace our book with a stored snapshot; an unreadable one gives a fresh book (the
        leader's next store overwrites it) and one log line per distinct bad value."""
        if raw is None:
            return
        try:
            self.book.restore(json.loads(raw), replace=True)
        # RecursionError: absurdly deep JSON; OverflowError: an integer too large for a float.
        except (ValueError, OverflowError, RecursionError) as exc:
            if raw != self._bad:
                logger.error(
                    "fair_sched budget state in Redis key %s is unreadable (%.200s): replica %s "
                    "starts from a fresh budget book",
                    link.budgets_key,
                    exc,
                    self._replica,
                )
            self._bad = raw
            self.book.restore({}, replace=True)
        else:
            self._bad = None
