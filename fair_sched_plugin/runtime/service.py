"""The one code path both integrations share: identity, admission and release, and the wiring.

The LiteLLM callback and the ASGI middleware are thin adapters over `SchedulingService`:
they turn their request into `Credentials` and a JSON body, call `admit()` and forward the
request; the request's watch (`request/watch.py`) holds the granted lease, and its life
(`request/lifecycle.py`) ends it once. What the service wires together lives beside it:
the request body's bounds (`request/body.py`), prices and charges (`runtime/charging.py`), where a
parked request stands and `Retry-After` (`runtime/parked.py`), graceful drain (`runtime/drain.py`),
deployments' public names (`runtime/deployment_names.py`), and the read model observability reads
(`observability.ServiceReadModel`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx

from ..config import BUDGET_WINDOWS_S, BackendSettings, FairSchedSettings, load_settings
from ..core import (
    MAX_REQUEST_TOKENS,
    BackendGroup,
    BackendSnapshot,
    BudgetBook,
    BudgetRule,
    Deployment,
    DrainMeter,
    GateTransition,
    Lease,
    MetricsGate,
    Ticket,
    TierLimits,
)
from ..core.parked_bytes import ParkedBytes
from ..engine_metrics.profiles import profile_for
from ..engine_metrics.watcher import MetricsWatcher
from ..errors import (
    BudgetExceeded,
    ClientDisconnected,
    InvalidRequest,
    Rejected,
    UnknownModel,
)
from ..observability import ServiceMetrics, ServiceReadModel
from ..observability._rejection_log import RejectionLog
from ..request.body import request_size
from ..request.identity import Credentials, Principal, PrincipalDirectory
from ..request.prefix import prompt_prefix
from ..state import ReplicaScheduler, open_state
from .charging import Charges
from .deployment_names import DeploymentNames
from .drain import GracefulDrain, Running, RunningRequest
from .driver import (
    LIMIT_BACKSTOP_S,
    FairScheduler,
    LoopClock,
    TimerClock,
    Waiter,
    granted,
)
from .engine_http import hide_url_secrets_in_httpx_logs
from .parked import ParkedRequest, Standings, first_comment_in_s

logger = logging.getLogger("fair_sched")

__all__ = [
    "UNKNOWN_MODELS",
    "Admission",
    "AdmissionObserver",
    "ClientDisconnected",
    "Entry",
    "SchedulingService",
]

# Every model name this server was not configured with is scheduled under this one name: one
# queue, one in-flight cap (`unknown_model_max_inflight`) and one set of counters, however many
# names clients make up. Parentheses and spaces keep it apart from any real model name.
UNKNOWN_MODELS = "(unknown models)"
# `fair_engine_queue`: engine priorities per tier (a tier's band for its users' ranks).
ENGINE_RANKS = 1000
# Longer names are refused before anything is queued (LiteLLM's own names are far shorter).
MAX_MODEL_NAME_CHARS = 256

UnknownModels = Literal["share", "reject"]


class AdmissionObserver(Protocol):
    """Told about each granted admission and each rejection, on the request's own task."""

    def admitted(self, admission: Admission) -> None: ...

    def rejected(self, principal: Principal, ticket: Ticket, error: Rejected) -> None: ...


class WaitObserver(RunningRequest, Protocol):
    """Told when a request parks (it was not released at once) and when it stops waiting,
    however that ends (released, refused, client gone, cancelled). The request's watch uses it
    for the keep-alive of streaming requests; a drain's grace period over, it is `shutdown()`."""

    def parked(self, parked: ParkedRequest) -> None: ...

    def unparked(self) -> None: ...


@dataclass(frozen=True)
class Admission:
    """A granted request: its lease, who it is, and the engine priority to send (if any)."""

    lease: Lease
    principal: Principal
    engine_priority: int | None
    # The bound deployment's public name (`DeploymentNames.deployment_name`), for headers.
    deployment_name: str | None = None


class Entry:
    """A request the service took in (`SchedulingService.enter`): released at once (`lease`), or
    parked (`waiter`, its `standing` and the body bytes it holds) until its turn, its refusal or
    its caller leaving; `SchedulingService.admitted` turns it into an `Admission`."""

    __slots__ = ("_service", "body_bytes", "lease", "principal", "standing", "ticket", "waiter")

    def __init__(
        self,
        service: SchedulingService,
        principal: Principal,
        ticket: Ticket,
        *,
        lease: Lease | None = None,
        waiter: Waiter | None = None,
        standing: ParkedRequest | None = None,
        body_bytes: int = 0,
    ) -> None:
        self._service = service
        self.principal = principal
        self.ticket = ticket
        self.lease = lease
        self.waiter = waiter
        self.standing = standing
        self.body_bytes = body_bytes

    @property
    def decided(self) -> bool:
        """Its wait is over (granted or refused): `admitted()` returns or raises at once."""
        return self.waiter is None or self.waiter.future.done()

    def start_in_s(self, streaming: bool) -> float | None:
        """How long a server that holds the parked request without a task may wait before it
        must start one though the wait goes on: when a stream owes its client its first
        keep-alive comment, or at the backstop of the client's own limit (a follower replica's
        leader does not hear of that limit). None: only once the wait is over."""
        standing = self.standing
        if self.decided or standing is None:
            return None
        waited_s = standing.wait_s()
        due_in_s = first_comment_in_s(standing.queue, waited_s) if streaming else None
        limit_s = self.ticket.max_wait_s
        if limit_s is not None:
            backstop_in_s = max(0.0, limit_s + LIMIT_BACKSTOP_S - waited_s)
            due_in_s = backstop_in_s if due_in_s is None else min(due_in_s, backstop_in_s)
        return due_in_s

    def client_left(self) -> None:
        """Its caller left before anyone waited on it (a request parked by the server): out
        of the queue, and a lease granted meanwhile goes back unused."""
        if self.waiter is not None:
            self.waiter.withdraw()
            self.waiter.future.cancel()  # nobody waits on it: no error to retrieve
        self.left_queue()

    def left_queue(self) -> None:
        """It no longer waits: its standing and its parked bytes go (once)."""
        standing, self.standing = self.standing, None
        if standing is not None:
            self._service.standings.unpark(standing)
            self._service.parked_bytes.release(self.ticket.user, self.body_bytes)


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
        self.settings = settings = load_settings(settings)
        self.directory = PrincipalDirectory(settings)
        self.backends = _resolve_backends(settings, deployments or {})
        # Names scheduled as themselves: configured backends, the deployments behind a LiteLLM
        # proxy, and whatever else the adapter knows it serves (`models`).
        self.known_models = frozenset(self.backends) | frozenset(deployments or ()) | set(models)
        # What responses, the status document, metric labels and logs call each deployment: its
        # key (an api_base) may carry credentials or a `?token=`; only the app gets the key.
        self.names = DeploymentNames(self.backends)
        self._tiers = {tier.name: tier for tier in settings.tiers}
        self.gate = MetricsGate(
            _backend_groups(settings, self.backends),
            stale_after_s=settings.effective_stale_after_ms / 1000,
            unknown_model_max_inflight=settings.unknown_model_max_inflight,
            on_transition=self._log_transition,
            request_scrape=self._request_scrape,
            clock=self.clock,
        )
        # The models whose placement reads a ticket's prefix (affinity across deployments).
        self._prefix_models = frozenset(
            model
            for model, group in self.gate.groups().items()
            if group.prefix_affinity and len(group.deployments) > 1
        )
        queue = settings.queue
        # One scheduler object on every backend: the core decides, in this process
        # (`memory://`) or in the replica leading the others through Redis (`redis://`).
        self.scheduler: ReplicaScheduler = open_state(
            settings.state,
            FairScheduler(
                _tier_limits(settings),
                self.gate,
                fairness=settings.fairness,
                max_per_user=queue.max_per_user,
                max_total=queue.max_total,
                max_wait_s=queue.max_wait_s,
                order=queue.order,
                clock=self.clock,
                fairness_window_s=settings.observability.fairness_window_s,
            ),
            self.gate,
            prefix=settings.state_prefix,
            heartbeat_s=settings.state_heartbeat_s,
            lease_ttl_s=settings.state_lease_ttl_s,
            model_groups=settings.leadership_groups(self.known_models),
        )
        # Where requests ask for their turn: the core itself with memory:// (its lease is the
        # request's, end to end), the replica that relays to the leader with redis://.
        self._admissions = self.scheduler.admissions
        self._http_client = http_client
        self._watchers: dict[str, list[MetricsWatcher]] = {}
        self._started = False
        self._closed = False
        self._transition_listeners: list[Callable[[GateTransition], None]] = []
        self._admission_observers: list[AdmissionObserver] = []
        self._rejection_log = RejectionLog(clock=self.clock.now)
        self.charges = Charges(self.backends, self.known_models, self.scheduler, self.clock)
        # The request bodies parked requests hold here (`admit`'s `body_bytes`).
        self.parked_bytes = ParkedBytes(
            max_per_user=self.settings.queue.max_bytes_per_user,
            max_total=self.settings.queue.max_bytes_total,
        )
        self.budgets = BudgetBook(_budget_rules(settings), clock=self.clock)
        # The principals with a budget: only their admissions read it, only their ends count.
        self._budgeted = frozenset(self.budgets.principals())
        # Shared with the other replicas (and kept over restarts) when state is in Redis.
        self.scheduler.share_budgets(self.budgets)
        if self._budgeted:
            self.scheduler.add_end_listener(self.charges.count_spend)
        # How fast each model's queue drains (releases per second), for estimates.
        self.drain = DrainMeter()
        self.standings = Standings(settings, self.scheduler, self.drain, self.clock)
        # Every request running, one entry each (the drain and the status document read it).
        self.running = Running()
        self.scheduler.add_end_listener(self.running.lease_ended)
        self._graceful_drain = GracefulDrain(self.clock, settings.drain_grace_s, self.running)
        self.scheduler.add_decider_listener(self._scrape_all_now)
        # Created now so the wait histogram sees every admission; reads happen at scrape time.
        view = ServiceReadModel(
            settings,
            scheduler=self.scheduler,
            gate=self.gate,
            watchers=self._watchers,
            budgets=self.budgets,
            names=self.names,
            configured_models=frozenset(self.backends),
            running=self.running.entries,
        )
        self._observability = ServiceMetrics(view)
        self.add_admission_observer(self._observability.recorder)
        self.add_transition_listener(view.gate_transition)
        self.add_transition_listener(self._observability.recorder.gate_transition)

    def read_timed_out(self, phase: str) -> None:
        """Count a client connection closed because its request came too slowly (the
        `fair_sched_read_timeouts` metric)."""
        self._observability.recorder.read_timed_out(phase)

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
        # Scrapes from other threads read the state on this loop.
        self._observability.remember_loop()
        if self.names.hides_secrets:
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
                    active=functools.partial(self.scheduler.decides_for, model),
                )
                watcher.start()
                self._watchers.setdefault(model, []).append(watcher)

    @property
    def draining(self) -> bool:
        return self._graceful_drain.draining

    def begin_drain(self) -> None:
        """Stop admitting and refuse every parked request (503 `shutting_down` with
        `Retry-After`); requests already running may finish within `drain_grace_s`, then they
        are ended. What a SIGTERM starts (`_shutdown.install_sigterm_drain`). Idempotent."""
        if self._graceful_drain.draining or self._closed:
            return
        self._graceful_drain.begin(queued=self.scheduler.statistics().queued)
        self.scheduler.close()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started and self.names.hides_secrets:
            hide_url_secrets_in_httpx_logs(False)
        self._graceful_drain.cancel()
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

    def watchers(self) -> Mapping[str, list[MetricsWatcher]]:
        """The metrics watchers started, per model."""
        return self._watchers

    # ------------------------------------------------------------------ the request path

    def identify(self, credentials: Credentials) -> Principal:
        return self.directory.resolve(credentials)

    def ticket_for(self, principal: Principal, model: str, body: Mapping[str, Any]) -> Ticket:
        """The request as the core sees it. The body's nesting and numbers are bounded here,
        where they are read (`InvalidRequest` for a field out of its range; the estimates are
        capped at the core's `MAX_REQUEST_TOKENS` and `MAX_REQUEST_COST`). The prompt's prefix
        is hashed only where placement reads it (`_prefix_models`)."""
        prompt_tokens, output_tokens = request_size(body)
        price = self.charges.cost_of(model, prompt_tokens, output_tokens)
        return Ticket(
            model,
            principal.name,
            principal.tier,
            principal.weight,
            min(prompt_tokens + output_tokens, MAX_REQUEST_TOKENS),
            price if price is not None else 0.0,
            prompt_prefix(body) if model in self._prefix_models else (),
        )

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
        body_bytes: int = 0,
    ) -> Admission:
        """Wait for this request's turn. Raises `Rejected` (400/404/429/503) or
        `ClientDisconnected`: `enter()`, then `admitted()` (see both)."""
        entry = self.enter(
            principal,
            model,
            body,
            unknown_models=unknown_models,
            max_wait_s=max_wait_s,
            body_bytes=body_bytes,
        )
        del body
        return await self.admitted(entry, disconnected=disconnected, waiting=waiting)

    def enter(
        self,
        principal: Principal,
        model: object,
        body: Mapping[str, Any],
        *,
        unknown_models: UnknownModels = "share",
        max_wait_s: float | None = None,
        body_bytes: int = 0,
    ) -> Entry:
        """The request's ticket, released at once or parked (no await: a server parks it
        before any task is made for it, `request/proxy_protocol.py`). Raises `Rejected`.

        The model and the body's shape are checked first (see `scheduling_model`); the lease is
        for the name returned there. `max_wait_s` (the client's `x-fair-sched-max-wait-s`)
        gives up sooner than `queue.max_wait_s`, never later. `body_bytes`, the size of the
        body the caller holds while the request waits, counts against
        `queue.max_bytes_per_user` and `queue.max_bytes_total` until it stops waiting
        (`QueueFull` past either).
        """
        scheduled_as = self.scheduling_model(model, unknown_models=unknown_models)
        if not self._started:
            self.start()
        ticket = self.ticket_for(principal, scheduled_as, body)
        # A parked request keeps its ticket, not the body (which may be megabytes of objects).
        del body
        if max_wait_s is not None:
            # The core orders the user's queue by it and refuses early what cannot make it.
            ticket = ticket._replace(max_wait_s=max_wait_s)
        try:
            if ticket.user in self._budgeted:
                ticket = self._apply_budget(ticket)
            lease = self._admissions.try_acquire(ticket)
            if lease is not None:
                return Entry(self, principal, ticket, lease=lease)
            self.parked_bytes.reserve(ticket.user, body_bytes)
            try:
                waiter = self._admissions.enqueue(ticket)
            except BaseException:
                self.parked_bytes.release(ticket.user, body_bytes)
                raise
        except Rejected as exc:
            self._refused(principal, ticket, exc)
            raise
        standing = self.standings.park(principal, ticket, waiter.enqueued_at)
        return Entry(
            self, principal, ticket, waiter=waiter, standing=standing, body_bytes=body_bytes
        )

    async def admitted(
        self,
        entry: Entry,
        *,
        disconnected: asyncio.Event | None = None,
        waiting: WaitObserver | None = None,
    ) -> Admission:
        """`entry`'s admission, once its turn comes. Raises `Rejected` or `ClientDisconnected`.

        A request whose client disconnects while parked leaves the queue and never gets a
        lease. `waiting` is told when the request parks and when it stops waiting.
        """
        lease = entry.lease
        waiter = entry.waiter
        if lease is None:
            assert waiter is not None and entry.standing is not None
            try:
                if disconnected is not None and disconnected.is_set():
                    raise ClientDisconnected("client disconnected before its request was scheduled")
                if waiting is not None:
                    waiting.parked(entry.standing)
                # On the service's clock, like every other time it reads, and from when the
                # request entered (a server may have parked it before this wait began).
                lease = await granted(
                    waiter,
                    disconnected,
                    max_wait_s=entry.ticket.max_wait_s,
                    clock=self.clock,
                    since=entry.standing.since,
                )
            except BaseException as exc:
                waiter.withdraw()  # no lease outlives a wait that ends without it
                if isinstance(exc, Rejected):
                    self._refused(entry.principal, entry.ticket, exc)
                raise
            finally:
                entry.left_queue()
                if waiting is not None:
                    waiting.unparked()
        # Its release time is the service clock's (the core's, or the loop's for a replica).
        self.drain.record(entry.ticket.model, lease.released_at)
        ticket = entry.ticket
        admission = Admission(
            lease,
            entry.principal,
            self.engine_priority(ticket.model, ticket.tier, lease.engine_rank),
            self.names.deployment_name(lease.deployment) if lease.deployment is not None else None,
        )
        if lease.active:
            self.running.hold(lease, waiting)
        for observer in self._admission_observers:
            # The lease is granted: an observer's failure must not lose it (no request would
            # hold it) nor fail the request.
            try:
                observer.admitted(admission)
            except Exception:
                logger.exception("fair_sched: an admission observer failed")
        return admission

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

    # ------------------------------------------------------------------ internals

    def _snapshot_listener(self, model: str) -> Callable[[BackendSnapshot], None]:
        def on_snapshot(snapshot: BackendSnapshot) -> None:
            self.gate.update(model, snapshot)

        return on_snapshot

    def _scrape_all_now(self) -> None:
        """This replica starts deciding: its engines' readings are the other replica's, so each
        watcher reads its engine at once (a new leader's hold waits for such a scrape)."""
        for group in self._watchers.values():
            for watcher in group:
                watcher.request_early_scrape()

    def _request_scrape(self, model: str) -> None:
        for watcher in self._watchers.get(model, ()):
            watcher.request_early_scrape()

    def _refused(self, principal: Principal, ticket: Ticket, exc: Rejected) -> None:
        self.standings.estimate_retry_after(exc, ticket)
        self._rejection_log.write(principal, ticket, exc)
        for observer in self._admission_observers:
            try:
                observer.rejected(principal, ticket, exc)
            except Exception:
                logger.exception("fair_sched: an admission observer failed")

    def _log_transition(self, transition: GateTransition) -> None:
        if transition.new == "fallback":
            cap = self.gate.groups()[transition.model].fallback_max_inflight
            logger.warning(
                "fair_sched gate model=%s deployment=%s mode=fallback reason=%r: engine metrics "
                "unavailable, limiting it to %d in flight",
                transition.model,
                self.names.deployment_name(transition.deployment),
                self.names.redact(transition.reason),
                cap,
            )
        elif transition.old == "fallback":
            logger.warning(
                "fair_sched gate model=%s deployment=%s mode=metrics: engine metrics recovered",
                transition.model,
                self.names.deployment_name(transition.deployment),
            )
        else:
            logger.info("fair_sched gate model=%s mode=%s", transition.model, transition.new)
        for listener in self._transition_listeners:
            listener(transition)


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


def _backend_groups(
    settings: FairSchedSettings, backends: Mapping[str, BackendSettings]
) -> list[BackendGroup]:
    """The gate's model groups: each backend with engine metrics to read."""
    return [
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
                backend.on_metrics_unavailable or settings.on_metrics_unavailable
            ).max_inflight,
        )
        for model, backend in backends.items()
        if backend.all_metrics_urls()
    ]


def _tier_limits(settings: FairSchedSettings) -> tuple[TierLimits, ...]:
    return tuple(
        TierLimits(
            tier.name,
            waiting_below=tier.initial_waiting_below(),
            auto_waiting_below=tier.auto_bounds(),
            ttft_target_s=tier.ttft_target_ms / 1000 if tier.ttft_target_ms else None,
            tpot_below_s=tier.tpot_below_ms / 1000 if tier.tpot_below_ms else None,
            kv_usage_below=tier.kv_usage_below,
            share=tier.share,
            promote_after_s=tier.promote_after_s,
            reserve_slots=tier.reserve_slots,
            max_wait_s=tier.max_wait_s,
        )
        for tier in settings.tiers
    )


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
