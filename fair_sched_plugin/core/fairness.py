"""Fairness policies: what a release charges its user's virtual time, how the lease's end corrects
it, and which round of an engine queue in user order the user's next request joins.

One small interface (`Fairness`), one class per `fairness:` setting; the scheduler asks the
policy and never branches on its name.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from .ticket import Lease, Ticket

FairnessPolicy = Literal["round_robin", "weighted", "tokens", "cost"]


class Fairness:
    """Round robin: every release costs one turn; the end corrects nothing."""

    __slots__ = ()
    # Whether `end_correction` can be other than 0 (the scheduler asks only then).
    corrects: ClassVar[bool] = False

    def release_charge(self, ticket: Ticket) -> float:
        """What releasing `ticket` charges its user (finite: a ticket's fields are bounded)."""
        return 1.0

    def end_correction(self, lease: Lease, tokens_used: int | None) -> float:
        """What to add to the charge once the lease ended with `tokens_used` (and
        `lease.cost_used`) reported; 0 when the estimate stands."""
        return 0.0

    def engine_round(self, unstarted: int, weight: float) -> int:
        """The round of an engine queue in user order that the user's next request joins
        (`Lease.engine_rank`): how many of its requests released before it are not streaming
        yet."""
        return unstarted


class WeightedFairness(Fairness):
    """A turn costs 1/weight: a user of weight 2 has two turns to others' one."""

    __slots__ = ()

    def release_charge(self, ticket: Ticket) -> float:
        return 1.0 / ticket.weight

    def engine_round(self, unstarted: int, weight: float) -> int:
        # Its requests per round are its weight, as in our queue; the epsilon keeps 3 / 0.1
        # (29.999...) in round 30.
        return math.floor(unstarted / weight + 1e-9)


class TokenFairness(Fairness):
    """A release costs its estimated tokens / weight, corrected to the actual count at its end."""

    __slots__ = ()
    corrects = True

    def release_charge(self, ticket: Ticket) -> float:
        return max(ticket.cost, 1) / ticket.weight

    def end_correction(self, lease: Lease, tokens_used: int | None) -> float:
        if tokens_used is None:
            return 0.0
        return max(tokens_used, 1) / lease.ticket.weight - lease.charged


class CostFairness(Fairness):
    """A release costs its estimated money / weight, corrected to the actual cost at its end
    (or the estimate scaled by the actual tokens where only those came back)."""

    __slots__ = ()
    corrects = True

    def release_charge(self, ticket: Ticket) -> float:
        return money_charge(ticket.price, ticket)

    def end_correction(self, lease: Lease, tokens_used: int | None) -> float:
        spent = lease.cost_used
        ticket = lease.ticket
        if spent is None and tokens_used is not None:
            spent = ticket.price * max(tokens_used, 1) / max(ticket.cost, 1)
        if spent is None:
            return 0.0
        return money_charge(spent, ticket) - lease.charged


def money_charge(money: float, ticket: Ticket) -> float:
    # A request priced at nothing (a model without prices) still takes a turn's worth of a
    # microdollar, so zero-priced users are served round robin, not ahead of everybody forever.
    return max(money, 1e-6) / ticket.weight


POLICIES: dict[str, Fairness] = {
    "round_robin": Fairness(),
    "weighted": WeightedFairness(),
    "tokens": TokenFairness(),
    "cost": CostFairness(),
}
