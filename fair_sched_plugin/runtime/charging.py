"""What a request costs and what it is charged.

Prices (`backends.<model>.price`, else the adapter's, else the dearest configured one), the
charge of a response's usage, the share an interrupted request is charged, and the spend each
ended lease adds to its caller's budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from ..config import BackendSettings, PriceSettings
from ..core import MAX_REQUEST_COST, Clock, Lease, request_cost_in_range
from ..request.usage import Usage
from ..state import ReplicaScheduler


def bounded_cost(money: float) -> float:
    """A money estimate within the core's range (a huge or non-finite one is its ceiling)."""
    return money if request_cost_in_range(money) else MAX_REQUEST_COST


class Charges:
    """Prices and charges of one service; `count_spend` is its scheduler's end listener."""

    def __init__(
        self,
        backends: Mapping[str, BackendSettings],
        known_models: frozenset[str],
        scheduler: ReplicaScheduler,
        clock: Clock,
    ) -> None:
        self._prices = {
            model: backend.price for model, backend in backends.items() if backend.price
        }
        self._known_models = known_models
        self._scheduler = scheduler
        self._clock = clock
        # An adapter's own price data (LiteLLM's cost map) for models without `price`.
        self._price_lookup: Callable[[str], PriceSettings | None] | None = None
        # Models without a price are charged as the dearest priced one (never free).
        self._fallback_price = max(
            self._prices.values(), key=lambda price: price.cost(1000, 1000), default=None
        )

    def price_of(self, model: str) -> PriceSettings | None:
        """`backends.<model>.price`, else the adapter's price for it (`use_price_lookup`), else
        the dearest configured price, else None."""
        configured = self._prices.get(model)
        if configured is not None:
            return configured
        if self._price_lookup is not None and model in self._known_models:
            found = self._price_lookup(model)
            if found is not None:
                return found
        return self._fallback_price

    def use_price_lookup(self, lookup: Callable[[str], PriceSettings | None]) -> None:
        """Ask `lookup` for the price of a served model that has no `backends.<model>.price`
        (the LiteLLM adapter passes LiteLLM's own cost data; `lookup` caches if it needs to)."""
        self._price_lookup = lookup

    def cost_of(
        self, model: str, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0
    ) -> float | None:
        """What these tokens cost at `model`'s price (None: no price known)."""
        price = self.price_of(model)
        if price is None:
            return None
        return bounded_cost(price.cost(prompt_tokens, output_tokens, cached_tokens))

    def charge_of(self, model: str, usage: Usage) -> tuple[int | None, float | None]:
        """What a response's `usage` charges (the one place every adapter turns it into a
        charge): uncached prompt plus output tokens, and the money cost at the model's price
        when prompt and output are both known."""
        prompt, output = usage.prompt_tokens, usage.completion_tokens
        cost = None
        if prompt is not None and output is not None:
            cost = self.cost_of(model, prompt, output, usage.cached_tokens)
        return usage.tokens_used, cost

    def interrupted_tokens(self, lease: Lease) -> int:
        """What a request is charged whose client left after it went on to the engine, before
        any answer: the output the engine can have generated since its release at the
        deployment's recent time per output token (its abort reaches the engine about now),
        within the request's estimate; the whole estimate where no speed is known."""
        ticket = lease.ticket
        tpot_s = self._recent_tpot_s(ticket.model, lease.deployment)
        if tpot_s is None:
            return ticket.cost
        elapsed_s = max(0.0, self._clock.now() - lease.released_at)
        return min(ticket.cost, max(1, math.ceil(elapsed_s / tpot_s)))

    def _recent_tpot_s(self, model: str, deployment: str | None) -> float | None:
        """The latest time per output token the deciding gate knows for the deployment (any of
        the model's where the request was not bound to one); None: not known. The deciding
        gate's: a follower replica reads no engine itself, the leader publishes its readings."""
        for group in self._scheduler.gate_status():
            if group.model != model:
                continue
            for row in group.per_deployment:
                if deployment is not None and row.deployment != deployment:
                    continue
                if row.tpot_s is not None and row.tpot_s > 0:
                    return row.tpot_s
        return None

    def count_spend(self, lease: Lease, abandoned: bool) -> None:
        """Add an ended lease's spend to its caller's budget (an abandoned one spent nothing)."""
        if abandoned:
            return
        ticket = lease.ticket
        tokens = lease.tokens_used if lease.tokens_used is not None else ticket.cost
        usd = lease.cost_used
        if usd is None:
            # Only the token count is known: scale the estimated price by it.
            usd = ticket.price * tokens / max(ticket.cost, 1)
        self._scheduler.record_spend(ticket.user, usd=usd, tokens=tokens)
