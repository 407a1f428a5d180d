"""Admission gates: whether the engine behind a model can take one more request now.

The scheduler decides *who* goes next; a gate decides *whether* anyone may go. A gate calls the
listener registered with `set_listener` whenever capacity may have opened (a lease ended, a new
scrape arrived), so the scheduler never polls.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

from .ticket import Lease, Ticket, TierLimits

# Called with a model name, or None for "every model".
CapacityListener = Callable[[str | None], None]


class AdmissionGate(Protocol):
    def set_listener(self, listener: CapacityListener) -> None:
        """Register the callback to run when capacity may have opened."""

    def may_release(self, model: str, tier: TierLimits) -> bool:
        """May one more request of this tier go to this model's engine now?"""

    def orders_engine_queue(self, model: str) -> bool:
        """Whether this model's engine orders its own queue by user (`fair_engine_queue`):
        its leases then carry their `engine_rank` (0 elsewhere)."""

    def may_release_newcomer(self, model: str, tier: TierLimits) -> bool:
        """Where `may_release` says no: may a request of a user with none of its requests
        waiting in the engine go now? Only where the engine's own queue serves users in turn
        (`fair_engine_queue`), so that it goes first there: then a queue deeper by up to the
        engine's running slots delays it no more than the tier's own would."""

    def may_release_into_reserve(self, model: str, tier: TierLimits) -> bool:
        """Where `may_release` says no: may a request of a user who holds no slot go now, into
        the running slots the tier keeps free (`TierLimits.reserve_slots`)?"""

    def place(self, ticket: Ticket, tier: TierLimits) -> str | None:
        """The deployment of the ticket's model that takes it, called right after `may_release`
        allowed it and before `on_released`; the lease is bound to it. None: nothing to choose
        (one engine, or a gate that does not place)."""

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        """True when the deployment that holds the ticket's prompt prefix has no room for this
        tier but another has: released now, its prefix would be computed again elsewhere (the
        scheduler's look-ahead may release another ticket first)."""

    def waits_for_home(self, ticket: Ticket, tier: TierLimits) -> bool:
        """True when, released now, the ticket would spill into a deployment where it would
        only queue (no free running slot there): the scheduler then keeps it (and the tier)
        waiting until its own deployment has room, the spill would start at once, or another
        ticket can go. Implies `prefers_elsewhere`."""

    def on_released(self, lease: Lease) -> None:
        """A lease was granted (the request is on its way to the engine)."""

    def on_started(self, lease: Lease) -> None:
        """The engine demonstrably took the request (first byte back)."""

    def on_ended(self, lease: Lease) -> None:
        """The lease ended, whatever the outcome (the scheduler then re-runs its decisions)."""


class _ListenerMixin:
    def __init__(self) -> None:
        self._listener: CapacityListener | None = None

    def set_listener(self, listener: CapacityListener) -> None:
        self._listener = listener

    def _notify(self, model: str | None) -> None:
        if self._listener is not None:
            self._listener(model)


class InflightLimitGate(_ListenerMixin):
    """At most `limit` leases in flight per model (a fixed concurrency cap, no metrics)."""

    def __init__(self, limit: int, per_model: dict[str, int] | None = None) -> None:
        super().__init__()
        if limit <= 0:
            raise ValueError(f"limit must be > 0 (got {limit})")
        self._default_limit = limit
        self._per_model = dict(per_model or {})
        self._in_flight: defaultdict[str, int] = defaultdict(int)

    def in_flight(self, model: str) -> int:
        return self._in_flight[model]

    def may_release(self, model: str, tier: TierLimits) -> bool:
        return self._in_flight[model] < self._per_model.get(model, self._default_limit)

    def orders_engine_queue(self, model: str) -> bool:
        return False

    def may_release_newcomer(self, model: str, tier: TierLimits) -> bool:
        return False

    def may_release_into_reserve(self, model: str, tier: TierLimits) -> bool:
        return False

    def place(self, ticket: Ticket, tier: TierLimits) -> str | None:
        return None

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        return False

    def waits_for_home(self, ticket: Ticket, tier: TierLimits) -> bool:
        return False

    def on_released(self, lease: Lease) -> None:
        self._in_flight[lease.ticket.model] += 1

    def on_started(self, lease: Lease) -> None:
        pass

    def on_ended(self, lease: Lease) -> None:
        # No notification: the scheduler re-runs its decisions after every lease end itself.
        self._in_flight[lease.ticket.model] -= 1
