"""`ParkedBytes`: the request bodies a process holds while their requests wait, capped per user
and in total, as the queues cap the requests themselves.

The request caps bound how many wait; a body may be up to the size limit, so one caller at the
per-user request cap could otherwise hold that many bodies. Counted in this process: the bodies
are held here, whichever replica decides.
"""

from __future__ import annotations

from ..errors import QueueFull


class ParkedBytes:
    """Body bytes held by waiting requests, per user and in total; `reserve` refuses
    (`QueueFull`, 429) what would pass either cap, `release` gives a reservation back."""

    def __init__(self, *, max_per_user: int, max_total: int) -> None:
        self._max_per_user = max_per_user
        self._max_total = max_total
        self._by_user: dict[str, int] = {}
        self._total = 0

    @property
    def total(self) -> int:
        return self._total

    def held_by(self, user: str) -> int:
        return self._by_user.get(user, 0)

    def reserve(self, user: str, size: int, *, retry_after_s: float = 1.0) -> None:
        held = self._by_user.get(user, 0)
        if held + size > self._max_per_user:
            raise QueueFull(
                f"too many bytes of queued request bodies for this caller "
                f"(limit {self._max_per_user})",
                retry_after_s=retry_after_s,
                scope="user",
            )
        if self._total + size > self._max_total:
            raise QueueFull(
                f"too many bytes of queued request bodies (limit {self._max_total})",
                retry_after_s=retry_after_s,
                scope="total",
            )
        self._by_user[user] = held + size
        self._total += size

    def release(self, user: str, size: int) -> None:
        held = self._by_user.get(user, 0) - size
        if held > 0:
            self._by_user[user] = held
        else:
            self._by_user.pop(user, None)  # nothing is remembered for a user who holds nothing
        self._total -= size
