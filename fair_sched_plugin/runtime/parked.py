"""Where a waiting request stands, estimated from the scheduler's counts and the drain rate.

The requests parked in this process, per caller and model in arrival order; each one's estimated
release position and ETA (what a keep-alive comment says), the where-do-I-stand document of
``/fair-sched/queue``, and the `Retry-After` a refused request is told.
"""

from __future__ import annotations

from typing import Any

from ..config import FairSchedSettings, QueueSettings
from ..core import Clock, DrainMeter, Ticket, retry_after_s
from ..core.standing import ArrivalRanks
from ..errors import BudgetExceeded, QueueFull, Rejected
from ..request.identity import Principal
from ..state import ReplicaScheduler


def first_comment_in_s(queue: QueueSettings, waited_s: float) -> float | None:
    """When a parked stream that has waited `waited_s` owes its client its first keep-alive
    comment (0: now); None where `queue.keepalive_after_s` turns keep-alive off."""
    if queue.keepalive_after_s <= 0:
        return None
    return max(0.0, queue.keepalive_after_s - waited_s)


class ParkedRequest:
    """One request waiting in this process: what it waits for and where it stands."""

    __slots__ = ("_ranks", "_standings", "principal", "queue", "since", "ticket")

    def __init__(
        self, standings: Standings, principal: Principal, ticket: Ticket, since: float
    ) -> None:
        self._standings = standings
        self.principal = principal
        self.ticket = ticket
        self.since = since
        self.queue: QueueSettings = standings.settings.queue
        # Its caller's requests parked here in its tier, while it is one of them (`_ParkedOf`).
        self._ranks: ArrivalRanks[ParkedRequest] | None = None

    def wait_s(self) -> float:
        return max(0.0, self._standings.clock.now() - self.since)

    def position(self) -> int:
        """Estimated release position for its model (1: next); see `core.estimate_position`.
        O(tiers + log n): read from counts the scheduler keeps, no scan of the backlog."""
        return self._standings.position_of(self)

    def eta_s(self) -> float | None:
        """Estimated seconds until release at the measured drain rate; None while it is not
        known (see `DrainMeter.eta_s`)."""
        return self.standing()[1]

    def standing(self) -> tuple[int, float | None, float]:
        """`position()`, `eta_s()` and `wait_s()` at once (what a keep-alive comment says)."""
        standings = self._standings
        position = standings.position_of(self)
        now = standings.clock.now()
        eta = standings.drain.eta_s(self.ticket.model, position, now)
        wait_s = now - self.since
        return position, eta, wait_s if wait_s > 0.0 else 0.0


class _ParkedOf:
    """One caller's requests parked here for one model: in arrival order, and ranked in
    arrival order per tier (a request's own index in `core.estimate_position`)."""

    __slots__ = ("by_tier", "requests")

    def __init__(self) -> None:
        self.requests: dict[ParkedRequest, None] = {}
        self.by_tier: dict[str, ArrivalRanks[ParkedRequest]] = {}

    def add(self, parked: ParkedRequest) -> None:
        self.requests[parked] = None
        ranks = self.by_tier.get(parked.ticket.tier)
        if ranks is None:
            ranks = self.by_tier[parked.ticket.tier] = ArrivalRanks()
        ranks.add(parked)
        parked._ranks = ranks

    def discard(self, parked: ParkedRequest) -> None:
        self.requests.pop(parked, None)
        parked._ranks = None
        ranks = self.by_tier.get(parked.ticket.tier)
        if ranks is not None and not ranks.discard(parked):
            del self.by_tier[parked.ticket.tier]


class Standings:
    """The requests parked in this process and the estimates of where each one stands."""

    def __init__(
        self,
        settings: FairSchedSettings,
        scheduler: ReplicaScheduler,
        drain: DrainMeter,
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.drain = drain
        self.clock = clock
        self._scheduler = scheduler
        # Requests parked in this process, per user and model, in arrival order.
        self._parked: dict[str, dict[str, _ParkedOf]] = {}

    def park(self, principal: Principal, ticket: Ticket, since: float) -> ParkedRequest:
        """The request, parked since `since`, is parked here until `unpark` (however its wait
        ends)."""
        parked = ParkedRequest(self, principal, ticket, since)
        models = self._parked.get(ticket.user)
        if models is None:
            models = self._parked[ticket.user] = {}
        mine = models.get(ticket.model)
        if mine is None:
            mine = models[ticket.model] = _ParkedOf()
        mine.add(parked)
        return parked

    def unpark(self, parked: ParkedRequest) -> None:
        ticket = parked.ticket
        models = self._parked.get(ticket.user)
        mine = models.get(ticket.model) if models is not None else None
        if models is None or mine is None:
            return
        mine.discard(parked)
        if not mine.requests:
            del models[ticket.model]
            if not models:
                del self._parked[ticket.user]

    def position_of(self, parked: ParkedRequest) -> int:
        """Estimated release position of a request parked here (`core.estimate_position`, its
        own index counted among its caller's requests parked here in its tier): O(log n)."""
        ranks = parked._ranks
        if ranks is None:
            return 1  # no longer parked
        ticket = parked.ticket
        own_index = ranks.rank(parked)
        return self._scheduler.position_estimate(ticket.model, ticket.tier, ticket.user, own_index)

    def positions_of(self, user: str, model: str) -> dict[ParkedRequest, int]:
        """Estimated release positions of `user`'s requests parked here for `model`."""
        mine = self._parked.get(user, {}).get(model)
        if mine is None:
            return {}
        return {parked: self.position_of(parked) for parked in mine.requests}

    def parked_of(self, user: str) -> dict[str, list[ParkedRequest]]:
        """`user`'s requests parked in this process, per model, in arrival order."""
        return {model: list(mine.requests) for model, mine in self._parked.get(user, {}).items()}

    def standing_of(self, principal: Principal) -> dict[str, Any]:
        """The where-do-I-stand document: `principal`'s own parked requests per model, with
        estimated positions and ETAs; nothing about anyone else's requests."""
        now = self.clock.now()
        models: dict[str, Any] = {}
        for model, mine in self.parked_of(principal.name).items():
            rate = self.drain.rate(model, now)
            parked_rows = []
            for parked in mine:
                position, eta, _ = parked.standing()
                parked_rows.append(
                    {
                        "position": position,
                        "tier": parked.ticket.tier,
                        "wait_s": round(now - parked.since, 3),
                        "eta_s": round(eta, 1) if eta is not None else None,
                    }
                )
            models[model] = {
                "drain_rate_per_s": round(rate, 3) if rate is not None else None,
                "parked": parked_rows,
            }
        document: dict[str, Any] = {"models": models}
        # Named only where responses may name the caller (`observability.user_labels`).
        if self.settings.observability.user_labels == "principals" and principal.known:
            document["principal"] = principal.name
        return document

    def suggest_retry_after(
        self, model: str, *, user: str = "", tier: str | None = None, own_index: int = 1
    ) -> float | None:
        """Seconds until a request of `user` queued `own_index`-th in its own queue would be
        released, at the measured drain rate of `model`; None before a rate was measured."""
        now = self.clock.now()
        rate = self.drain.rate(model, now)
        if rate is None:
            return None
        order = [limits.name for limits in self._scheduler.tiers]
        tier = tier if tier in order else self.settings.default_tier_name
        ahead = self._scheduler.position_estimate(model, tier, user, own_index)
        return retry_after_s(ahead, rate, ceiling_s=self.settings.queue.max_wait_s)

    def estimate_retry_after(self, exc: Rejected, ticket: Ticket) -> None:
        """`Retry-After` from the measured drain rate (the core's hint stays until one is)."""
        if isinstance(exc, BudgetExceeded) or not exc.retryable:
            return  # a budget window ends when it ends
        rate = self.drain.rate(ticket.model, self.clock.now())
        if rate is None:
            return
        if isinstance(exc, QueueFull) and exc.scope == "total":
            # Any release frees a place.
            exc.retry_after_s = retry_after_s(1, rate, ceiling_s=self.settings.queue.max_wait_s)
            return
        if isinstance(exc, QueueFull):
            own_index = 1  # the caller's own cap: its oldest request's release frees a place
        else:
            # Sent again now, it would queue behind the caller's own parked requests.
            own_index = 1 + self._scheduler.queued_of(ticket.model, ticket.tier, ticket.user)
        estimate = self.suggest_retry_after(
            ticket.model, user=ticket.user, tier=ticket.tier, own_index=own_index
        )
        if estimate is not None:
            exc.retry_after_s = estimate
