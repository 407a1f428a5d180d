"""The one code path both integrations share: identity, admission, body rewrite and release.

The LiteLLM callback and the ASGI middleware are thin adapters over `SchedulingService`:
they turn their request into `Credentials` and a JSON body, call `admit()`, forward the request,
and end the lease exactly once with `finish()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx

from ._http import hide_url_secrets_in_httpx_logs
from ._usage import Usage
from .config import (
    BUDGET_WINDOWS_S,
    BackendSettings,
    FairSchedSettings,
    PriceSettings,
    QueueSettings,
    deployment_names,
    load_settings,
    safe_url,
)
from .core import (
    MAX_REQUEST_COST,
    MAX_REQUEST_TOKENS,
    BackendGroup,
    BackendSnapshot,
    BudgetBook,
    BudgetRule,
    Deployment,
    DrainMeter,
    GateTransition,
    GroupStatus,
    Lease,
    MetricsGate,
    SchedulerStatistics,
    Ticket,
    TierLimits,
    UserBacklog,
    request_cost_in_range,
    retry_after_s,
)
from .core.standing import ArrivalRanks
from .driver import FairScheduler, LoopClock, TimerClock, TimerHandle, abandon_if_granted
from .errors import (
    BudgetExceeded,
    ClientDisconnected,
    InvalidRequest,
    QueueFull,
    QueueTimeout,
    Rejected,
    SchedulerClosed,
    UnknownModel,
)
from .identity import Credentials, Principal, PrincipalDirectory
from .metrics.profiles import profile_for
from .metrics.watcher import MetricsWatcher
from .observability import BudgetStanding, DeploymentReading, ServiceMetrics, rejection_reason
from .prefix import prompt_prefix
from .state import ReplicaScheduler, StateStatistics, open_state

logger = logging.getLogger("fair_sched")

__all__ = [
    "UNKNOWN_MODELS",
    "Admission",
    "AdmissionObserver",
    "ClientDisconnected",
    "ParkedRequest",
    "SchedulingService",
    "parse_request_body",
]

# What a request costs when it does not say how many tokens it may generate.
DEFAULT_MAX_TOKENS = 256
# Every model name this server was not configured with is scheduled under this one name: one
# queue, one in-flight cap (`unknown_model_max_inflight`) and one set of counters, however many
# names clients make up. Parentheses and spaces keep it apart from any real model name.
UNKNOWN_MODELS = "(unknown models)"
# `fair_engine_queue`: engine priorities per tier (a tier's band for its users' ranks).
ENGINE_RANKS = 1000
# The fields that bound a request's output tokens (the largest present counts, see
# `requested_max_tokens`).
OUTPUT_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# OpenAI's own limit on `n` (choices generated per request).
MAX_CHOICES = 128
# Longer names are refused before anything is queued (LiteLLM's own names are far shorter).
MAX_MODEL_NAME_CHARS = 256
# Deeper request bodies are refused with a 400 before any work (real ones nest < 20 levels).
MAX_BODY_DEPTH = 64

UnknownModels = Literal["share", "reject"]


def parse_request_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; `InvalidRequest` (400) for anything else.

    Nesting is bounded before any work is done on the body: a deeply nested one would otherwise
    overflow the JSON decoder's recursion (a 500 with a traceback) or cost time per level.
    """
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        raise InvalidRequest("the request body is not valid JSON (or nests too deeply)") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_body_depth(body)
    return body


def check_body_depth(body: Mapping[str, Any], limit: int = MAX_BODY_DEPTH) -> None:
    """Raise `InvalidRequest` when `body`'s dicts and lists nest deeper than `limit`."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    # An adapter's own request dict (LiteLLM's) may refer to itself: visit each container once.
    seen = {id(body)}
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise InvalidRequest(f"the request body nests deeper than {limit} levels")
        children = node.values() if isinstance(node, Mapping) else node
        for child in children:
            if isinstance(child, (Mapping, list)) and id(child) not in seen:
                seen.add(id(child))
                stack.append((child, depth + 1))


class AdmissionObserver(Protocol):
    """Told about each granted admission and each rejection, on the request's own task."""

    def admitted(self, admission: Admission) -> None: ...

    def rejected(self, principal: Principal, ticket: Ticket, error: Rejected) -> None: ...


class WaitObserver(Protocol):
    """Told when a request parks (it was not released at once) and when it stops waiting,
    however that ends (released, refused, client gone, cancelled). The request's watch uses it
    for the keep-alive of streaming requests."""

    def parked(self, parked: ParkedRequest) -> None: ...

    def unparked(self) -> None: ...

    def shutdown(self) -> None:
        """The server drains and the grace period is over: end the request now."""


class ParkedRequest:
    """One request waiting in this process: what it waits for and where it stands."""

    __slots__ = ("_ranks", "_service", "principal", "queue", "since", "ticket")

    def __init__(
        self, service: SchedulingService, principal: Principal, ticket: Ticket, since: float
    ) -> None:
        self._service = service
        self.principal = principal
        self.ticket = ticket
        self.since = since
        self.queue: QueueSettings = service.settings.queue
        # Its caller's requests parked here in its tier, while it is one of them (`_ParkedOf`).
        self._ranks: ArrivalRanks[ParkedRequest] | None = None

    def wait_s(self) -> float:
        return max(0.0, self._service.clock.now() - self.since)

    def position(self) -> int:
        """Estimated release position for its model (1: next); see `core.estimate_position`.
        O(tiers + log n): read from counts the scheduler keeps, no scan of the backlog."""
        return self._service.position_of(self)

    def eta_s(self) -> float | None:
        """Estimated seconds until release at the measured drain rate; None while it is not
        known (see `DrainMeter.eta_s`)."""
        return self.standing()[1]

    def standing(self) -> tuple[int, float | None, float]:
        """`position()`, `eta_s()` and `wait_s()` at once (what a keep-alive comment says)."""
        service = self._service
        position = service.position_of(self)
        now = service.clock.now()
        eta = service.drain.eta_s(self.ticket.model, position, now)
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
        if ranks is not None:
            ranks.discard(parked)
            if not ranks:
                del self.by_tier[parked.ticket.tier]


@dataclass(frozen=True)
class Admission:
    """A granted request: its lease, who it is, and the engine priority to send (if any)."""

    lease: Lease
    principal: Principal
    engine_priority: int | None
    # The bound deployment's public name (`SchedulingService.deployment_name`), for headers.
    deployment_name: str | None = None


def bounded_cost(money: float) -> float:
    """A money estimate within the core's range (a huge or non-finite one is its ceiling)."""
    return money if request_cost_in_range(money) else MAX_REQUEST_COST


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """A cheap prompt-size estimate (~4 characters a token), good enough for fair ordering."""
    characters = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, Mapping):
                content = message.get("content")
                if isinstance(content, str):
                    characters += len(content)
                elif isinstance(content, list):
                    for part in content:
                        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                            characters += len(part["text"])
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        characters += len(prompt)
    elif isinstance(prompt, list):
        characters += sum(len(item) for item in prompt if isinstance(item, str))
    return max(1, characters // 4)


def requested_max_tokens(body: Mapping[str, Any]) -> int:
    """The most output tokens the request may generate, per choice: the largest of the OpenAI
    fields present (chat's `max_completion_tokens` and `max_tokens`, the responses API's
    `max_output_tokens`), else `DEFAULT_MAX_TOKENS`. The largest, not the route's own: each
    route's engine reads a different one (vLLM's chat prefers `max_completion_tokens`, its
    `/v1/completions` reads only `max_tokens`, `/v1/responses` only `max_output_tokens`), and a
    client that adds a field its engine ignores, set to 1, must not be estimated (and charged,
    if it leaves) at 1 while the engine generates the other. Each present field must be a whole
    number in [1, MAX_REQUEST_TOKENS] (`InvalidRequest` naming it): the engine would refuse
    anything else, and an unbounded one must never reach the scheduler's charge."""
    found = [bounded_count(body, field, 1, MAX_REQUEST_TOKENS) for field in OUTPUT_TOKEN_FIELDS]
    present = [value for value in found if value is not None]
    return max(present) if present else DEFAULT_MAX_TOKENS


def requested_choices(body: Mapping[str, Any]) -> int:
    """How many sequences the engine generates for the request (`n`, `best_of`; 1 if absent),
    each up to `requested_max_tokens`; `InvalidRequest` outside [1, MAX_CHOICES]."""
    n = bounded_count(body, "n", 1, MAX_CHOICES) or 1
    best_of = bounded_count(body, "best_of", 1, MAX_CHOICES) or 1
    return max(n, best_of)


def bounded_count(body: Mapping[str, Any], field: str, low: int, high: int) -> int | None:
    """`body[field]` as a whole number in [low, high]; None where the field is absent or null;
    `InvalidRequest` naming the field for anything else (a string, a list, NaN, 1e400, a
    400-digit integer, a negative count). The value is not echoed: it may be anything."""
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and low <= value <= high:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return value
    raise InvalidRequest(f"`{field}` must be a whole number from {low} to {high}", param=field)


class SchedulingService:
    """Settings, scheduler, metrics gate and watchers, with an explicit lifecycle.

    Construct anywhere (nothing touches an event loop); `start()` from a running loop starts the
    metrics watchers; `aclose()` stops them and fails whatever still waits.
    `deployments` maps a model name to the `api_base` of each deployment behind it (LiteLLM's
    `model_list`), used where `backends` gives no metrics URL. `clock` is the one time base of
    the gate, the scheduler, the metrics watchers and the rejection-log limiter (the running
    loop's by default; `fair_sched_plugin.testing.FakeClock` in tests).
    """

    def __init__(
        self,
        settings: FairSchedSettings | Mapping[str, Any] | str | None = None,
        *,
        deployments: Mapping[str, Iterable[str]] | None = None,
        models: Iterable[str] = (),
        http_client: httpx.AsyncClient | None = None,
        clock: TimerClock | None = None,
    ) -> None:
        self.clock: TimerClock = clock or LoopClock()
        self.settings = load_settings(settings)
        self.directory = PrincipalDirectory(self.settings)
        self.backends = _resolve_backends(self.settings, deployments or {})
        # Names scheduled as themselves: configured backends, the deployments behind a LiteLLM
        # proxy, and whatever else the adapter knows it serves (`models`).
        self.known_models = frozenset(self.backends) | frozenset(deployments or ()) | set(models)
        # What responses, the status document, metric labels and logs call each deployment: its
        # key (an api_base) may carry credentials or a `?token=`; only the app gets the key.
        # Metrics URLs too (named alike, for the `url` labels): a deployment known by its
        # metrics URL has it as its key.
        self._deployment_names = deployment_names(
            [key for backend in self.backends.values() for key, _ in backend.deployments()]
            + [url for backend in self.backends.values() for _, url in backend.deployments()]
        )
        # Every configured URL that shows more than its name, longest first (see `redact`).
        self._redactions = sorted(
            {
                (url, name)
                for backend in self.backends.values()
                for key, metrics_url in backend.deployments()
                for url, name in (
                    (key, self._deployment_names[key]),
                    (metrics_url, self._deployment_names[metrics_url]),
                    *((base, self._deployment_names[key]) for base in _raw_bases(backend, key)),
                )
                if url != name
            },
            key=lambda pair: -len(pair[0]),
        )
        groups = [
            BackendGroup(
                model=model,
                deployments=tuple(
                    Deployment(key, metrics_url) for key, metrics_url in backend.deployments()
                ),
                prefix_affinity=backend.placement.prefix_affinity,
                load_bound=backend.placement.load_bound,
                arrival_grace_s=backend.arrival_grace_ms / 1000,
                max_num_seqs=backend.max_num_seqs,
                metrics_lag_s=backend.metrics_lag_ms / 1000,
                fair_engine_queue=backend.fair_engine_queue,
                fallback_max_inflight=(
                    backend.on_metrics_unavailable or self.settings.on_metrics_unavailable
                ).max_inflight,
            )
            for model, backend in self.backends.items()
            if backend.all_metrics_urls()
        ]
        self._tiers = {tier.name: tier for tier in self.settings.tiers}
        self.gate = MetricsGate(
            groups,
            stale_after_s=self.settings.effective_stale_after_ms / 1000,
            unknown_model_max_inflight=self.settings.unknown_model_max_inflight,
            on_transition=self._log_transition,
            request_scrape=self._request_scrape,
            clock=self.clock,
        )
        queue = self.settings.queue
        tier_limits = tuple(
            TierLimits(
                tier.name,
                waiting_below=tier.initial_waiting_below(),
                auto_waiting_below=tier.auto_bounds(),
                ttft_target_s=tier.ttft_target_ms / 1000 if tier.ttft_target_ms else None,
                tpot_below_s=tier.tpot_below_ms / 1000 if tier.tpot_below_ms else None,
                kv_usage_below=tier.kv_usage_below,
                share=tier.share,
                promote_after_s=tier.promote_after_s,
            )
            for tier in self.settings.tiers
        )
        settings = self.settings
        # One scheduler object on every backend: the core decides, in this process
        # (`memory://`) or in the replica leading the others through Redis (`redis://`).
        self.scheduler: ReplicaScheduler = open_state(
            settings.state,
            FairScheduler(
                tier_limits,
                self.gate,
                fairness=settings.fairness,
                max_per_user=queue.max_per_user,
                max_total=queue.max_total,
                max_wait_s=queue.max_wait_s,
                order=queue.order,
                clock=self.clock,
            ),
            self.gate,
            prefix=settings.state_prefix,
            heartbeat_s=settings.state_heartbeat_s,
            lease_ttl_s=settings.state_lease_ttl_s,
        )
        self._http_client = http_client
        self._watchers: dict[str, list[MetricsWatcher]] = {}
        self._started = False
        self._closed = False
        self.transitions: list[GateTransition] = []
        self._transition_listeners: list[Callable[[GateTransition], None]] = []
        self._admission_observers: list[AdmissionObserver] = []
        self._rejection_log = RejectionLogLimiter(clock=self.clock.now)
        self._prices = {
            model: backend.price for model, backend in self.backends.items() if backend.price
        }
        # An adapter's own price data (LiteLLM's cost map) for models without `price`.
        self._price_lookup: Callable[[str], PriceSettings | None] | None = None
        # Models without a price are charged as the dearest priced one (never free).
        self._fallback_price = max(
            self._prices.values(), key=lambda price: price.cost(1000, 1000), default=None
        )
        self.budgets = BudgetBook(_budget_rules(self.settings), clock=self.clock)
        # Shared with the other replicas (and kept over restarts) when state is in Redis.
        self.scheduler.share_budgets(self.budgets)
        self.scheduler.add_end_listener(self._count_spend)
        # Leases granted through admit() and not yet ended, for the per-principal in-flight view.
        self._running: dict[Lease, tuple[str, str, str]] = {}
        # Requests parked in this process, per user and model, in arrival order.
        self._parked: dict[str, dict[str, _ParkedOf]] = {}
        # How fast each model's queue drains (releases per second), for estimates.
        self.drain = DrainMeter()
        # Granted leases whose request can be ended when a drain's grace period is over.
        self._holders: dict[Lease, WaitObserver] = {}
        self._draining = False
        self._drain_timer: TimerHandle | None = None
        self.scheduler.add_end_listener(self._lease_ended)
        self.scheduler.add_decider_listener(self._scrape_all_now)
        # Created now so the wait histogram sees every admission; reads happen at scrape time.
        self._observability = ServiceMetrics(self)
        self.add_admission_observer(self._observability.recorder)
        self.add_transition_listener(self._observability.recorder.gate_transition)

    # ------------------------------------------------------------------ lifecycle

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        """Start one metrics watcher per deployment URL. Needs a running loop; idempotent."""
        if self._closed:
            raise RuntimeError("SchedulingService is closed")
        if self._started:
            return
        self._started = True
        if self._redactions:
            # httpx logs each request's URL (ours: an engine's, maybe with credentials).
            hide_url_secrets_in_httpx_logs(True)
        self.scheduler.start()
        settings = self.settings
        for model, backend in self.backends.items():
            profile = profile_for(backend)
            for url in backend.all_metrics_urls():
                watcher = MetricsWatcher(
                    url,
                    profile,
                    model_name=backend.engine_model_name,
                    interval_s=settings.metrics_poll_ms / 1000,
                    timeout_s=settings.effective_metrics_timeout_ms / 1000,
                    on_snapshot=self._snapshot_listener(model),
                    client=self._http_client,
                    clock=self.clock.now,
                    name_filter=backend.metrics_filter,
                    # While another replica decides, it reads the engine: one engine's worth of
                    # scrapes, however many replicas share it.
                    active=self._decides,
                )
                watcher.start()
                self._watchers.setdefault(model, []).append(watcher)

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Stop admitting and refuse every parked request (503 `shutting_down` with
        `Retry-After`); requests already running may finish within `drain_grace_s`, then they
        are ended. What a SIGTERM starts (`_shutdown.install_sigterm_drain`). Idempotent."""
        if self._draining or self._closed:
            return
        self._draining = True
        grace_s = self.settings.drain_grace_s
        logger.warning(
            "fair_sched: draining: %d parked requests refused, %d running may finish within "
            "%g s (drain_grace_s)",
            self.scheduler.statistics().queued,
            len(self._holders),
            grace_s,
        )
        self.scheduler.close()
        self._drain_timer = self.clock.call_at(self.clock.now() + grace_s, self._end_running)

    def _end_running(self) -> None:
        self._drain_timer = None
        if self._holders:
            logger.warning(
                "fair_sched: drain grace period over: ending %d running requests",
                len(self._holders),
            )
        for holder in list(self._holders.values()):
            holder.shutdown()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started and self._redactions:
            hide_url_secrets_in_httpx_logs(False)
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        self.scheduler.close()
        watchers = [watcher for group in self._watchers.values() for watcher in group]
        await asyncio.gather(*(watcher.aclose() for watcher in watchers), return_exceptions=True)
        await self.scheduler.aclose()

    async def __aenter__(self) -> SchedulingService:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def names_principals(self) -> bool:
        """Whether responses may name the caller's principal (`observability.user_labels:
        principals`, the same choice as for metric labels)."""
        return self.settings.observability.user_labels == "principals"

    def add_transition_listener(self, listener: Callable[[GateTransition], None]) -> None:
        self._transition_listeners.append(listener)

    @property
    def observability(self) -> ServiceMetrics:
        """This service's Prometheus metrics (its own registry) and status document."""
        return self._observability

    def add_admission_observer(self, observer: AdmissionObserver) -> None:
        """Tell `observer` about every admission and rejection (the metrics use this)."""
        self._admission_observers.append(observer)

    # ------------------------------------------------------------------ the request path

    def identify(self, credentials: Credentials) -> Principal:
        return self.directory.resolve(credentials)

    def ticket_for(self, principal: Principal, model: str, body: Mapping[str, Any]) -> Ticket:
        """The request as the core sees it. Its numbers are bounded here, where they are read
        (`InvalidRequest` for a field out of its range; the estimates are capped at the core's
        `MAX_REQUEST_TOKENS` and `MAX_REQUEST_COST`)."""
        output_tokens = requested_max_tokens(body) * requested_choices(body)
        prompt_tokens = estimate_prompt_tokens(body)
        price = self.price_of(model)
        return Ticket(
            model=model,
            user=principal.name,
            tier=principal.tier,
            weight=principal.weight,
            cost=min(prompt_tokens + output_tokens, MAX_REQUEST_TOKENS),
            price=bounded_cost(price.cost(prompt_tokens, output_tokens)) if price else 0.0,
            prefix=prompt_prefix(body),
        )

    def price_of(self, model: str) -> PriceSettings | None:
        """`backends.<model>.price`, else the adapter's price for it (`use_price_lookup`), else
        the dearest configured price, else None."""
        configured = self._prices.get(model)
        if configured is not None:
            return configured
        if self._price_lookup is not None and model in self.known_models:
            found = self._price_lookup(model)
            if found is not None:
                return found
        return self._fallback_price

    def use_price_lookup(self, lookup: Callable[[str], PriceSettings | None]) -> None:
        """Ask `lookup` for the price of a served model that has no `backends.<model>.price`
        (the LiteLLM adapter passes LiteLLM's own cost data; `lookup` caches if it needs to)."""
        self._price_lookup = lookup

    def cost_of_usage(
        self, model: str, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0
    ) -> float | None:
        """What a request's actual usage cost at `model`'s price (None: no price known)."""
        price = self.price_of(model)
        if price is None:
            return None
        return bounded_cost(price.cost(prompt_tokens, output_tokens, cached_tokens))

    def _apply_budget(self, ticket: Ticket) -> Ticket:
        """Over budget: the ticket in the `demote_to` tier, or `BudgetExceeded` until the
        window ends."""
        verdict = self.budgets.verdict(ticket.user)
        if verdict is None or not verdict.over:
            return ticket
        rule = verdict.rule
        if rule.action == "reject" or rule.demote_to is None:
            raise BudgetExceeded(
                f"the {rule.unit} budget of {ticket.user!r} is spent until the window ends",
                retry_after_s=verdict.resets_in_s,
            )
        return ticket._replace(tier=rule.demote_to)

    def _count_spend(self, lease: Lease, abandoned: bool) -> None:
        if abandoned:
            return
        ticket = lease.ticket
        tokens = lease.tokens_used if lease.tokens_used is not None else ticket.cost
        usd = lease.cost_used
        if usd is None:
            # Only the token count is known: scale the estimated price by it.
            usd = ticket.price * tokens / max(ticket.cost, 1)
        self.scheduler.record_spend(ticket.user, usd=usd, tokens=tokens)

    def scheduling_model(self, model: object, *, unknown_models: UnknownModels = "share") -> str:
        """The name a request is scheduled under; `InvalidRequest` for one we will not schedule.

        Checked before anything is queued or remembered. A configured model is itself. Any other
        name shares `UNKNOWN_MODELS` (one queue and one in-flight cap, so made-up names get no
        fresh capacity and no per-name memory) or, with `unknown_models="reject"` (an adapter
        that knows every model it serves), is refused with 404. A comma-separated list is
        refused: LiteLLM would fan it out to one engine call per name under a single lease.
        """
        if not isinstance(model, str) or not model:
            raise InvalidRequest("the request body needs a string `model`", param="model")
        if model in self.known_models:
            return model
        if len(model) > MAX_MODEL_NAME_CHARS:
            raise InvalidRequest(
                f"the model name is longer than {MAX_MODEL_NAME_CHARS} characters", param="model"
            )
        if "," in model:
            raise InvalidRequest(
                "a comma-separated list of models is not scheduled; send one request per model",
                param="model",
            )
        if unknown_models == "reject":
            raise UnknownModel(f"The model `{model}` does not exist.", param="model")
        return UNKNOWN_MODELS

    async def admit(
        self,
        principal: Principal,
        model: object,
        body: Mapping[str, Any],
        *,
        disconnected: asyncio.Event | None = None,
        unknown_models: UnknownModels = "share",
        waiting: WaitObserver | None = None,
        max_wait_s: float | None = None,
    ) -> Admission:
        """Wait for this request's turn. Raises `Rejected` (400/404/429/503) or
        `ClientDisconnected`.

        The model and the body's shape are checked first (see `scheduling_model`); the lease is
        for the name returned there. A request whose client disconnects while parked leaves the
        queue and never gets a lease. `waiting` is told when the request parks and when it stops
        waiting; `max_wait_s` (the client's `x-fair-sched-max-wait-s`) gives up sooner than
        `queue.max_wait_s`, never later.
        """
        scheduled_as = self.scheduling_model(model, unknown_models=unknown_models)
        check_body_depth(body)
        if not self._started:
            self.start()
        ticket = self.ticket_for(principal, scheduled_as, body)
        try:
            ticket = self._apply_budget(ticket)
            lease = self.scheduler.try_acquire(ticket)
            if lease is None:
                lease = await self._park(principal, ticket, disconnected, waiting, max_wait_s)
        except Rejected as exc:
            self._estimate_retry_after(exc, ticket)
            self._rejected(principal, ticket, exc)
            raise
        self.drain.record(scheduled_as, self.clock.now())
        admission = Admission(
            lease,
            principal,
            self.engine_priority(scheduled_as, ticket.tier, lease.engine_rank),
            self.deployment_name(lease.deployment) if lease.deployment is not None else None,
        )
        if lease.active:
            self._running[lease] = (lease.ticket.model, lease.ticket.tier, lease.ticket.user)
            if waiting is not None:
                self._holders[lease] = waiting
        for observer in self._admission_observers:
            # The lease is granted: an observer's failure must not lose it (no request would
            # hold it) nor fail the request.
            try:
                observer.admitted(admission)
            except Exception:
                logger.exception("fair_sched: an admission observer failed")
        return admission

    async def _park(
        self,
        principal: Principal,
        ticket: Ticket,
        disconnected: asyncio.Event | None,
        waiting: WaitObserver | None,
        max_wait_s: float | None,
    ) -> Lease:
        parked = ParkedRequest(self, principal, ticket, self.clock.now())
        models = self._parked.setdefault(ticket.user, {})
        mine = models.get(ticket.model)
        if mine is None:
            mine = models[ticket.model] = _ParkedOf()
        mine.add(parked)
        try:
            if waiting is not None:
                waiting.parked(parked)
            return await self._wait(ticket, disconnected, max_wait_s)
        finally:
            if waiting is not None:
                waiting.unparked()
            mine.discard(parked)
            if not mine.requests and models.get(ticket.model) is mine:
                del models[ticket.model]
                if not models and self._parked.get(ticket.user) is models:
                    del self._parked[ticket.user]

    async def _wait(
        self, ticket: Ticket, disconnected: asyncio.Event | None, max_wait_s: float | None
    ) -> Lease:
        if disconnected is None and max_wait_s is None:
            return await self.scheduler.acquire(ticket)
        if disconnected is not None and disconnected.is_set():
            raise ClientDisconnected("client disconnected before its request was scheduled")
        acquiring = asyncio.ensure_future(self.scheduler.acquire(ticket))
        waits: set[asyncio.Future[Any]] = {acquiring}
        watching = None
        if disconnected is not None:
            watching = asyncio.ensure_future(disconnected.wait())
            waits.add(watching)
        deadline = None
        if max_wait_s is not None:
            # On the service's clock, like every other time it reads.
            expired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            waits.add(expired)
            deadline = self.clock.call_at(self.clock.now() + max_wait_s, _resolver(expired))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Our own task is being cancelled: make sure no lease outlives it.
            _cancel_acquire(acquiring)
            raise
        finally:
            if watching is not None:
                watching.cancel()
            if deadline is not None:
                deadline.cancel()
        if disconnected is not None and disconnected.is_set():
            # Disconnect wins a tie: the engine must never see a request nobody waits for.
            _cancel_acquire(acquiring)
            raise ClientDisconnected("client disconnected while its request waited")
        if not acquiring.done():
            # The client's own limit (`x-fair-sched-max-wait-s`) passed first. (A lease granted
            # at the same moment wins: the request is served, nothing is thrown away.)
            _cancel_acquire(acquiring)
            raise QueueTimeout(
                f"the request waited its limit of {max_wait_s:g} s (x-fair-sched-max-wait-s) "
                "without being released",
                retry_after_s=1.0,
            )
        return acquiring.result()

    def position_of(self, parked: ParkedRequest) -> int:
        """Estimated release position of a request parked here (`core.estimate_position`, its
        own index counted among its caller's requests parked here in its tier): O(log n)."""
        ranks = parked._ranks
        if ranks is None:
            return 1  # no longer parked
        ticket = parked.ticket
        own_index = ranks.rank(parked)
        return self.scheduler.position_estimate(ticket.model, ticket.tier, ticket.user, own_index)

    def positions_of(self, user: str, model: str) -> dict[ParkedRequest, int]:
        """Estimated release positions of `user`'s requests parked here for `model`."""
        mine = self._parked.get(user, {}).get(model)
        if mine is None:
            return {}
        return {parked: self.position_of(parked) for parked in mine.requests}

    def suggest_retry_after(
        self, model: str, *, user: str = "", tier: str | None = None, own_index: int = 1
    ) -> float | None:
        """Seconds until a request of `user` queued `own_index`-th in its own queue would be
        released, at the measured drain rate of `model`; None before a rate was measured."""
        now = self.clock.now()
        rate = self.drain.rate(model, now)
        if rate is None:
            return None
        order = [limits.name for limits in self.scheduler.tiers]
        tier = tier if tier in order else self.settings.default_tier_name
        ahead = self.scheduler.position_estimate(model, tier, user, own_index)
        return retry_after_s(ahead, rate, ceiling_s=self.settings.queue.max_wait_s)

    def _estimate_retry_after(self, exc: Rejected, ticket: Ticket) -> None:
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
            own_index = 1 + self.scheduler.queued_of(ticket.model, ticket.tier, ticket.user)
        estimate = self.suggest_retry_after(
            ticket.model, user=ticket.user, tier=ticket.tier, own_index=own_index
        )
        if estimate is not None:
            exc.retry_after_s = estimate

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
        if self.names_principals and principal.known:
            document["principal"] = principal.name
        return document

    def engine_priority(self, model: str, tier_name: str, engine_rank: int = 0) -> int | None:
        """The `priority` to send for this tier, or None where the backend does not support it.
        With `fair_engine_queue` it also orders users inside the engine's queue: the tier's
        priority x 1000 plus the request's `engine_rank` (its user's requests released before
        it and not yet streaming, at most 999), so a user's first request there goes before
        the second of everyone else in its tier, and tiers stay apart."""
        backend = self.backends.get(model)
        if backend is None or not backend.priority_scheduling or backend.engine == "tgi":
            return None
        priority = self._tiers[tier_name].vllm_priority
        if backend.fair_engine_queue:
            priority = priority * ENGINE_RANKS + min(engine_rank, ENGINE_RANKS - 1)
        # vLLM serves lower values first; SGLang higher first unless started otherwise.
        if backend.engine == "sglang" and not backend.priority_low_values_first:
            return -priority
        return priority

    @staticmethod
    def rewrite_priority(
        body: MutableMapping[str, Any], priority: int | None, *, via_extra_body: bool
    ) -> None:
        """Remove whatever priority the client sent; set ours where the backend supports it.

        LiteLLM forwards `extra_body.priority` as the engine's top-level `priority` (and consumes a
        top-level `priority` itself), so the LiteLLM adapter passes `via_extra_body=True`.
        """
        body.pop("priority", None)
        extra_body = body.get("extra_body")
        if isinstance(extra_body, MutableMapping):
            extra_body.pop("priority", None)
            if not extra_body:
                body.pop("extra_body", None)
        elif extra_body is not None:
            body.pop("extra_body", None)
        if priority is None:
            return
        if via_extra_body:
            extra = body.setdefault("extra_body", {})
            extra["priority"] = priority
        else:
            body["priority"] = priority

    @staticmethod
    def finish(lease: Lease, tokens_used: int | None = None) -> bool:
        """End the lease (idempotent); True for the call that ended it."""
        return lease.release(tokens_used=tokens_used)

    def charge_of(self, model: str, usage: Usage) -> tuple[int | None, float | None]:
        """What a response's `usage` charges (the one place every adapter turns it into a
        charge): uncached prompt plus output tokens, and the money cost at the model's price
        when prompt and output are both known."""
        prompt, output = usage.prompt_tokens, usage.completion_tokens
        cost = None
        if prompt is not None and output is not None:
            cost = self.cost_of_usage(model, prompt, output, usage.cached_tokens)
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
        elapsed_s = max(0.0, self.clock.now() - lease.released_at)
        return min(ticket.cost, max(1, math.ceil(elapsed_s / tpot_s)))

    def _recent_tpot_s(self, model: str, deployment: str | None) -> float | None:
        """The latest time per output token the deciding gate knows for the deployment (any of
        the model's where the request was not bound to one); None: not known. The deciding
        gate's: a follower replica reads no engine itself, the leader publishes its readings."""
        for group in self.scheduler.gate_status():
            if group.model != model:
                continue
            for row in group.per_deployment:
                if deployment is not None and row.deployment != deployment:
                    continue
                if row.tpot_s is not None and row.tpot_s > 0:
                    return row.tpot_s
        return None

    # ------------------------------------------------------------------ observation (ServiceView)

    def watchers(self) -> Mapping[str, list[MetricsWatcher]]:
        return self._watchers

    def scheduler_statistics(self) -> SchedulerStatistics:
        return self.scheduler.statistics()

    def backlog(self) -> list[UserBacklog]:
        return self.scheduler.backlog()

    def in_flight_by_user(self) -> Mapping[tuple[str, str, str], int]:
        counts: dict[tuple[str, str, str], int] = {}
        # A copy first: a scrape that timed out waiting for the loop reads from another thread.
        for key in list(self._running.values()):
            counts[key] = counts.get(key, 0) + 1
        return counts

    def gate_status(self) -> list[GroupStatus]:
        # The deciding gate's: ours while this replica decides, else the leader's document.
        return self.scheduler.gate_status()

    def state_statistics(self) -> StateStatistics:
        return self.scheduler.state_statistics()

    def shares_state(self) -> bool:
        return self.scheduler.coordinated

    def waiting_thresholds(self) -> Mapping[str, Mapping[str, float]]:
        # `waiting_below: auto` tiers: what this gate's tuner allows now (read without the
        # clock, so from any thread; a follower replica reports the starting value).
        # Summed over the model's deployments (each holds its own to its tier's threshold).
        result: dict[str, dict[str, float]] = {}
        for model in self.gate.groups():
            by_deployment = self.gate.tuning(model).values()
            result[model] = {
                tier.name: sum(
                    tuning[tier.name].allowed if tier.name in tuning else tier.waiting_below
                    for tuning in by_deployment
                )
                for tier in self.scheduler.tiers
            }
        return result

    def tier_limits(self) -> tuple[TierLimits, ...]:
        return self.scheduler.tiers

    def configured_models(self) -> frozenset[str]:
        return frozenset(self.backends)

    def gated_models(self) -> Mapping[str, Sequence[str]]:
        return {model: spec.metrics_urls for model, spec in self.gate.groups().items()}

    def deployments(self) -> list[DeploymentReading]:
        return [
            DeploymentReading(
                model,
                watcher.url,
                watcher.scrapes_total,
                watcher.failures_total,
                watcher.last_snapshot,
                watcher.prefix_cache_hit_rate,
            )
            for model, group in self._watchers.items()
            for watcher in group
        ]

    def deployment_name(self, key: str) -> str:
        """A deployment's public name, never its key (which may carry credentials): the key
        as `safe_url` shows it, numbered where two would look alike (`config.deployment_names`).
        A key the configuration does not know (a leader's differing config) is shown safely."""
        return self._deployment_names.get(key) or safe_url(key)

    def redact(self, text: str) -> str:
        """`text` with every configured api_base and metrics URL replaced by its public form."""
        for url, name in self._redactions:
            if url in text:
                text = text.replace(url, name)
        return text

    def recent_transitions(self) -> Sequence[GateTransition]:
        return self.transitions

    def budget_standings(self) -> list[BudgetStanding]:
        standings = []
        for principal in sorted(self.budgets.principals()):
            verdict = self.budgets.verdict(principal)
            if verdict is None:
                continue
            rule = verdict.rule
            standings.append(
                BudgetStanding(
                    principal,
                    rule.unit,
                    rule.limit,
                    verdict.spent,
                    verdict.remaining,
                    verdict.resets_in_s,
                    verdict.over,
                    rule.action,
                    rule.demote_to,
                )
            )
        return standings

    # ------------------------------------------------------------------ internals

    def _snapshot_listener(self, model: str) -> Callable[[BackendSnapshot], None]:
        def on_snapshot(snapshot: BackendSnapshot) -> None:
            self.gate.update(model, snapshot)

        return on_snapshot

    def _lease_ended(self, lease: Lease, abandoned: bool) -> None:
        self._running.pop(lease, None)
        self._holders.pop(lease, None)

    def _decides(self) -> bool:
        return self.scheduler.decides

    def _scrape_all_now(self) -> None:
        """This replica starts deciding: its engines' readings are the other replica's, so each
        watcher reads its engine at once (a new leader's hold waits for such a scrape)."""
        for group in self._watchers.values():
            for watcher in group:
                watcher.request_early_scrape()

    def _request_scrape(self, model: str) -> None:
        for watcher in self._watchers.get(model, ()):
            watcher.request_early_scrape()

    def _rejected(self, principal: Principal, ticket: Ticket, exc: Rejected) -> None:
        reason = rejection_reason(exc)
        # One line per principal, model and reason per minute, naming the principal (never its
        # key): a client hammering a full queue must not flood the log (the metric counts every
        # rejection). A shutdown is not news.
        closing = isinstance(exc, SchedulerClosed)
        key = (principal.name, ticket.model, reason)
        skipped = 0 if closing else self._rejection_log.allow(key)
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
        for observer in self._admission_observers:
            try:
                observer.rejected(principal, ticket, exc)
            except Exception:
                logger.exception("fair_sched: an admission observer failed")

    def _log_transition(self, transition: GateTransition) -> None:
        self.transitions.append(transition)
        del self.transitions[:-100]
        if transition.new == "fallback":
            cap = self.gate.groups()[transition.model].fallback_max_inflight
            logger.warning(
                "fair_sched gate model=%s deployment=%s mode=fallback reason=%r: engine metrics "
                "unavailable, limiting it to %d in flight",
                transition.model,
                self.deployment_name(transition.deployment),
                self.redact(transition.reason),
                cap,
            )
        elif transition.old == "fallback":
            logger.warning(
                "fair_sched gate model=%s deployment=%s mode=metrics: engine metrics recovered",
                transition.model,
                self.deployment_name(transition.deployment),
            )
        else:
            logger.info("fair_sched gate model=%s mode=%s", transition.model, transition.new)
        for listener in self._transition_listeners:
            listener(transition)


def _resolver(future: asyncio.Future[None]) -> Callable[[], None]:
    def resolve() -> None:
        if not future.done():
            future.set_result(None)

    return resolve


def _cancel_acquire(acquiring: asyncio.Future[Lease]) -> None:
    """Stop waiting for a lease; if one was already granted, give it back unused."""
    if not acquiring.done():
        # The scheduler's own cancellation path removes the waiter, or hands back a lease that
        # was granted but not yet seen by the waiting task.
        acquiring.cancel()
        return
    abandon_if_granted(acquiring)


def _resolve_backends(
    settings: FairSchedSettings, deployments: Mapping[str, Iterable[str]]
) -> dict[str, BackendSettings]:
    """`backends` from the settings, with the deployments of a model configured without any
    api_base taken from the adapter's (LiteLLM's model_list)."""
    resolved = dict(settings.backends)
    for model, api_bases in deployments.items():
        # Keyed by LiteLLM's api_bases (normalized as configured ones are), so that a lease's
        # deployment names the model_list entry it goes to.
        bases = tuple(dict.fromkeys(base.rstrip("/") for base in api_bases if base))
        backend = resolved.get(model)
        if not bases or (backend is not None and backend.all_api_bases()):
            continue
        resolved[model] = (backend or BackendSettings()).with_api_bases(bases, model=model)
    return resolved


def _raw_bases(backend: BackendSettings, key: str) -> tuple[str, ...]:
    """The api_bases as configured (a trailing "/" and all) whose deployment key is `key`."""
    bases = ((backend.api_base,) if backend.api_base else ()) + backend.api_bases
    return tuple(base for base in bases if base.rstrip("/") == key)


def _budget_rules(settings: FairSchedSettings) -> dict[str, BudgetRule]:
    rules = {}
    for principal in settings.principals:
        budget = principal.budget
        if budget is None:
            continue
        unit: Literal["usd", "tokens"] = "usd" if budget.usd is not None else "tokens"
        limit = float(budget.usd if budget.usd is not None else budget.tokens or 0)
        rules[principal.name] = BudgetRule(
            limit, unit, BUDGET_WINDOWS_S[budget.per], budget.action, budget.demote_to
        )
    return rules


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
