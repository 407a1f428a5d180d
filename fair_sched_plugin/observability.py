"""Operator visibility: Prometheus metrics, the status document, their endpoints.

Every `SchedulingService` has one `ServiceMetrics` (``service.observability``) with its own
`CollectorRegistry`: several services can live in one process and nothing is registered in
prometheus_client's global registry unless asked (`register_in_default_registry`, done for a
LiteLLM proxy so the families also appear in LiteLLM's own ``/metrics``).

Almost everything is read at scrape time from `FairScheduler.statistics()`, `backlog()` and
`MetricsGate.status()`: the request path pays only for the wait-time histogram (one bucket
increment when a request is admitted) and a counter bump per rejection.

Users become labels only with ``observability.user_labels: principals``, and then only the
configured principals' names (a bounded set); every other caller is ``other``. Keys, key hashes
and key fingerprints never become labels. The status document names backlogged users by
principal name (strangers by a key fingerprint), never by key.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from .core import GateTransition, GroupStatus, SchedulerStatistics, Ticket, UserBacklog
from .errors import QueueFull, Rejected

if TYPE_CHECKING:
    from .identity import Principal
    from .metrics.watcher import MetricsWatcher
    from .service import Admission, SchedulingService

__all__ = [
    "METRICS_PATH",
    "STATUS_PATH",
    "ServiceMetrics",
    "admin_app",
    "endpoints",
    "install_litellm_routes",
    "register_in_default_registry",
    "rejection_reason",
]

logger = logging.getLogger("fair_sched")

METRICS_PATH = "/fair-sched/metrics"
STATUS_PATH = "/fair-sched/status"
ADMIN_PATHS = frozenset({METRICS_PATH, STATUS_PATH})

OTHER = "other"
GATE_MODES = ("starting", "metrics", "fallback")
REJECTION_REASONS = ("queue_full_user", "queue_full_total", "timeout", "closed")
# Transitions kept in the status document.
STATUS_TRANSITIONS = 20
# How long a scrape from another thread waits for the event loop to read the state.
CROSS_THREAD_TIMEOUT_S = 5.0


def rejection_reason(exc: Rejected) -> str:
    """A short label for a rejection: queue_full_user, queue_full_total, timeout or closed."""
    if isinstance(exc, QueueFull):
        return f"queue_full_{exc.scope}"
    return exc.reason


class _WatcherState(NamedTuple):
    model: str
    url: str
    scrapes_total: int
    failures_total: int
    last_ok: bool | None
    last_age_s: float | None
    last_error: str | None
    last_waiting: float | None
    last_running: float | None
    last_kv_usage: float | None
    last_tpot_s: float | None


class _State(NamedTuple):
    """Everything a scrape or the status page reads, taken in one go on the event loop."""

    statistics: SchedulerStatistics
    backlog: list[UserBacklog]
    gate: list[GroupStatus] | None  # None outside an event loop (the gate's clock needs one)
    watchers: list[_WatcherState]
    now: float | None


class _WaitHistogram:
    """A labelled histogram kept as plain counts, emitted by the collector (no global state)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        # labels -> per-bucket counts (non-cumulative, +Inf last) and the sum
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self.counts.get(labels)
        if counts is None:
            counts = self.counts[labels] = [0] * (len(self.bounds) + 1)
            self.sums[labels] = 0.0
        counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sums[labels] += value

    def copy(self) -> list[tuple[tuple[str, ...], list[int], float]]:
        return [(labels, list(counts), self.sums[labels]) for labels, counts in self.counts.items()]


class _Collector:
    """The prometheus_client collector; `describe()` names the families so registries can
    detect a clash without collecting."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics.families())

    def describe(self) -> Iterator[Metric]:
        return iter(self._metrics.families(describe_only=True))


class ServiceMetrics:
    """The metrics and status of one `SchedulingService` (use ``service.observability``).

    `registry` holds only this service's collector. `render()` is the text exposition,
    `status()` the JSON-ready status document.
    """

    def __init__(self, service: SchedulingService) -> None:
        self._service = service
        settings = service.settings.observability
        self._user_labels = settings.user_labels == "principals"
        self._principal_names = frozenset(p.name for p in service.settings.principals)
        self._max_model_labels = settings.max_model_labels
        self._status_max_users = settings.status_max_users
        self._configured_models = frozenset(service.backends) | frozenset(service.gate.groups())
        self._extra_models: set[str] = set()
        self._lock = threading.Lock()
        self._wait = _WaitHistogram(settings.wait_buckets_s)
        self._rejected: dict[tuple[str, ...], int] = {}
        self._transitions: dict[tuple[str, str, str], int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.collector = _Collector(self)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        service.add_admission_observer(self)
        service.add_transition_listener(self._on_transition)

    # ------------------------------------------------------------------ labels

    @property
    def user_labels(self) -> bool:
        return self._user_labels

    def model_label(self, model: str) -> str:
        """The model's label value: configured models always, others up to a bound, then
        `other` (a client can send any model name)."""
        if model in self._configured_models or model in self._extra_models:
            return model
        with self._lock:
            if len(self._extra_models) < self._max_model_labels:
                self._extra_models.add(model)
                return model
        return OTHER

    def user_label(self, principal_name: str) -> str:
        return principal_name if principal_name in self._principal_names else OTHER

    def _labels(self, ticket: Ticket, *extra: str) -> tuple[str, ...]:
        labels = (self.model_label(ticket.model), ticket.tier, *extra)
        return (*labels, self.user_label(ticket.user)) if self._user_labels else labels

    # ------------------------------------------------------------------ observer (request path)

    def admitted(self, admission: Admission) -> None:
        lease = admission.lease
        self._remember_loop()
        labels = self._labels(lease.ticket)
        with self._lock:
            self._wait.observe(labels, max(0.0, lease.waited_s))

    def rejected(self, principal: Principal, ticket: Ticket, error: Rejected) -> None:
        labels = self._labels(ticket, rejection_reason(error))
        with self._lock:
            self._rejected[labels] = self._rejected.get(labels, 0) + 1

    def _on_transition(self, transition: GateTransition) -> None:
        key = (transition.model, transition.old, transition.new)
        with self._lock:
            self._transitions[key] = self._transitions.get(key, 0) + 1

    def _remember_loop(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()

    # ------------------------------------------------------------------ reading the state

    def _read(self, *, on_loop: bool) -> _State:
        scheduler = self._service.scheduler
        statistics = scheduler.statistics()
        backlog = scheduler.backlog()
        # The deciding gate's: ours while this replica decides, else the leader's document.
        gate = scheduler.gate_status() if on_loop else None
        now = asyncio.get_running_loop().time() if on_loop else None
        watchers = [
            _watcher_state(model, watcher, now)
            for model, group in self._service.watchers().items()
            for watcher in group
        ]
        return _State(statistics, backlog, gate, watchers, now)

    def _state(self) -> _State:
        """Read on the service's event loop: hop there when called from another thread (LiteLLM
        renders its /metrics in a worker thread), read what needs no loop when there is none."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None:
            self._loop = self._loop or running
            return self._read(on_loop=True)
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return self._read(on_loop=False)
        result: concurrent.futures.Future[_State] = concurrent.futures.Future()

        def read() -> None:
            if not result.set_running_or_notify_cancel():
                return
            try:
                result.set_result(self._read(on_loop=True))
            except Exception as exc:
                result.set_exception(exc)

        loop.call_soon_threadsafe(read)
        try:
            return result.result(timeout=CROSS_THREAD_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            result.cancel()
            logger.warning("fair_sched metrics: the event loop did not answer; partial scrape")
            return self._read(on_loop=False)

    # ------------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """The Prometheus text exposition of this service's metrics."""
        return generate_latest(self.registry)

    def families(self, *, describe_only: bool = False) -> list[Metric]:
        user = ("user",) if self._user_labels else ()
        queued = GaugeMetricFamily(
            "fair_sched_queued_requests",
            "Requests parked in the scheduler's queues.",
            labels=("model", "tier", *user),
        )
        backlogged = GaugeMetricFamily(
            "fair_sched_backlogged_users",
            "Users with at least one queued request.",
            labels=("model", "tier"),
        )
        in_flight = GaugeMetricFamily(
            "fair_sched_in_flight_requests",
            "Requests released to the engine and not finished.",
            labels=("model",),
        )
        lifecycle = {
            name: CounterMetricFamily(f"fair_sched_{name}", help_text)
            for name, help_text in (
                ("released", "Leases granted (requests sent to the engine), all models."),
                ("completed", "Leases ended after the request was served, all models."),
                ("cancelled", "Requests that left the queue because the caller went away."),
                ("abandoned", "Leases granted, then given back unused (the caller left)."),
            )
        }
        rejected = CounterMetricFamily(
            "fair_sched_rejected",
            "Requests refused: queue_full_user, queue_full_total, timeout, closed.",
            labels=("model", "tier", "reason", *user),
        )
        wait = HistogramMetricFamily(
            "fair_sched_wait_seconds",
            "Time from arrival to release (0 for requests released at once).",
            labels=("model", "tier", *user),
        )
        gate_mode = GaugeMetricFamily(
            "fair_sched_gate_mode",
            "1 for the gate's current mode per model group (starting, metrics, fallback).",
            labels=("model", "mode"),
        )
        per_group = {
            name: GaugeMetricFamily(f"fair_sched_{name}", help_text, labels=("model",))
            for name, help_text in (
                ("gate_deployments", "Deployments behind the model group."),
                ("gate_pending_requests", "Released requests not yet seen by the engine."),
                ("gate_in_flight_requests", "Requests in flight as the gate counts them."),
                ("engine_waiting_requests", "Engine waiting queue at the last scrape (summed)."),
                ("engine_running_requests", "Engine running requests at the last scrape (summed)."),
                ("engine_tpot_seconds", "Recent time per output token (worst deployment)."),
                ("engine_kv_cache_usage_ratio", "KV cache usage 0..1 (worst deployment)."),
                ("engine_scrape_age_seconds", "Age of the stalest deployment's last good scrape."),
            )
        }
        waiting_threshold = GaugeMetricFamily(
            "fair_sched_tier_waiting_threshold",
            "A tier releases only while engine waiting + pending is below this (per group).",
            labels=("model", "tier"),
        )
        tpot_threshold = GaugeMetricFamily(
            "fair_sched_tier_tpot_threshold_seconds",
            "A tier releases only while the engine's TPOT is below this.",
            labels=("tier",),
        )
        scrapes = CounterMetricFamily(
            "fair_sched_metrics_scrapes",
            "Scrapes of an engine's /metrics.",
            labels=("model", "url"),
        )
        scrape_failures = CounterMetricFamily(
            "fair_sched_metrics_scrape_failures",
            "Scrapes of an engine's /metrics that failed or could not be parsed.",
            labels=("model", "url"),
        )
        transitions = CounterMetricFamily(
            "fair_sched_gate_transitions",
            "Gate mode changes per model group.",
            labels=("model", "from", "to"),
        )
        unavailable = CounterMetricFamily(
            "fair_sched_metrics_unavailable",
            "Times a model group's engine metrics became unavailable (switch to fallback).",
            labels=("model",),
        )
        state_fallbacks = CounterMetricFamily(
            "fair_sched_state_fallbacks",
            "Times shared state (Redis) became unreachable and this replica scheduled alone.",
            labels=("replica",),
        )
        state_local = GaugeMetricFamily(
            "fair_sched_state_local",
            "1 while this replica schedules alone (Redis unreachable), 0 while shared.",
            labels=("replica", "leader"),
        )
        all_families: list[Metric] = [
            queued,
            backlogged,
            in_flight,
            *lifecycle.values(),
            rejected,
            wait,
            gate_mode,
            *per_group.values(),
            waiting_threshold,
            tpot_threshold,
            scrapes,
            scrape_failures,
            transitions,
            unavailable,
            state_fallbacks,
            state_local,
        ]
        if describe_only:
            return all_families

        state = self._state()
        stats = state.statistics
        tiers = self._service.scheduler.tiers

        # Queues: every configured model and tier has a series (zero included).
        queued_values: dict[tuple[str, ...], float] = {}
        backlogged_values: dict[tuple[str, str], float] = {}
        for model in sorted(self._configured_models):
            for tier in tiers:
                backlogged_values[(model, tier.name)] = 0
                zero = (model, tier.name, OTHER) if self._user_labels else (model, tier.name)
                queued_values[zero] = 0
        if self._user_labels:
            for entry in state.backlog:
                key = (self.model_label(entry.model), entry.tier, self.user_label(entry.user))
                queued_values[key] = queued_values.get(key, 0) + entry.depth
        else:
            for (model, tier_name), count in stats.queued_by_model_tier.items():
                model_tier = (self.model_label(model), tier_name)
                queued_values[model_tier] = queued_values.get(model_tier, 0) + count
        for entry in state.backlog:
            pair = (self.model_label(entry.model), entry.tier)
            backlogged_values[pair] = backlogged_values.get(pair, 0) + 1
        for labels, value in sorted(queued_values.items()):
            queued.add_metric(list(labels), value)
        for pair, value in sorted(backlogged_values.items()):
            backlogged.add_metric(list(pair), value)

        in_flight_values = dict.fromkeys(sorted(self._configured_models), 0.0)
        for model, count in stats.in_flight_by_model.items():
            label = self.model_label(model)
            in_flight_values[label] = in_flight_values.get(label, 0) + count
        for model, value in sorted(in_flight_values.items()):
            in_flight.add_metric([model], value)

        lifecycle["released"].add_metric([], stats.released_total)
        lifecycle["completed"].add_metric([], stats.completed_total)
        lifecycle["cancelled"].add_metric([], stats.cancelled_total)
        lifecycle["abandoned"].add_metric([], stats.abandoned_total)

        with self._lock:
            rejected_values = dict(self._rejected)
            wait_values = self._wait.copy()
            transition_values = dict(self._transitions)
        if not self._user_labels:
            # Counters exist from zero, so rate() sees the first rejection.
            for model in self._configured_models:
                for tier in tiers:
                    for reason in REJECTION_REASONS:
                        rejected_values.setdefault((model, tier.name, reason), 0)
        for labels, count in sorted(rejected_values.items()):
            rejected.add_metric(list(labels), count)
        bounds = self._wait.bounds
        for labels, counts, total in sorted(wait_values, key=lambda item: item[0]):
            cumulative = 0
            buckets = []
            for bound, count in zip((*map(_format_bound, bounds), "+Inf"), counts, strict=True):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            wait.add_metric(list(labels), buckets, total)

        for group in state.gate or ():
            for mode in GATE_MODES:
                gate_mode.add_metric([group.model, mode], 1.0 if group.mode == mode else 0.0)
            per_group["gate_deployments"].add_metric([group.model], group.deployments)
            per_group["gate_pending_requests"].add_metric([group.model], group.pending)
            per_group["gate_in_flight_requests"].add_metric([group.model], group.in_flight)
            for name, reading in (
                ("engine_waiting_requests", group.waiting),
                ("engine_running_requests", group.running),
                ("engine_tpot_seconds", group.tpot_s),
                ("engine_kv_cache_usage_ratio", group.kv_usage),
                ("engine_scrape_age_seconds", group.last_scrape_age_s),
            ):
                if reading is not None:
                    per_group[name].add_metric([group.model], reading)
            for tier in tiers:
                waiting_threshold.add_metric(
                    [group.model, tier.name], tier.waiting_below * group.deployments
                )
        for tier in tiers:
            if tier.tpot_below_s is not None:
                tpot_threshold.add_metric([tier.name], tier.tpot_below_s)

        for watcher in state.watchers:
            scrapes.add_metric([watcher.model, watcher.url], watcher.scrapes_total)
            scrape_failures.add_metric([watcher.model, watcher.url], watcher.failures_total)
        for (model, old, new), count in sorted(transition_values.items()):
            transitions.add_metric([model, old, new], count)
        unavailable_values = dict.fromkeys(sorted(self._service.gate.groups()), 0)
        for (model, _old, new), count in transition_values.items():
            if new == "fallback":
                unavailable_values[model] = unavailable_values.get(model, 0) + count
        for model, count in sorted(unavailable_values.items()):
            unavailable.add_metric([model], count)
        if self._service.scheduler.coordinated:
            shared = self._service.scheduler.state_statistics()
            state_fallbacks.add_metric([shared.replica], shared.fallbacks_total)
            local = 1.0 if shared.mode == "local" else 0.0
            state_local.add_metric([shared.replica, shared.leader or ""], local)
        return all_families

    # ------------------------------------------------------------------ status document

    def _redactor(self) -> Callable[[str], str]:
        """Replace configured metrics URLs (which may carry credentials) by their safe form."""
        replacements = [
            (url, safe_url(url))
            for spec in self._service.gate.groups().values()
            for url in spec.metrics_urls
            if url != safe_url(url)
        ]

        def redact(text: str) -> str:
            for raw, safe in replacements:
                text = text.replace(raw, safe)
            return text

        return redact

    def status(self) -> dict[str, Any]:
        """The status document: per model its queues, backlogged users, gate and deployments."""
        state = self._state()
        service = self._service
        stats = state.statistics
        directory = service.directory
        gate_by_model = {group.model: group for group in state.gate or ()}
        watchers_by_model: dict[str, list[_WatcherState]] = {}
        for watcher in state.watchers:
            watchers_by_model.setdefault(watcher.model, []).append(watcher)
        backlog_by_model: dict[str, list[UserBacklog]] = {}
        for entry in state.backlog:
            backlog_by_model.setdefault(entry.model, []).append(entry)
        models = sorted(
            set(service.backends)
            | set(service.gate.groups())
            | {model for model, _ in stats.queued_by_model_tier}
            | set(stats.in_flight_by_model)
            | set(backlog_by_model)
        )
        tier_names = [tier.name for tier in service.scheduler.tiers]
        with self._lock:
            rejected_totals = dict.fromkeys(REJECTION_REASONS, 0)
            for labels, count in self._rejected.items():
                rejected_totals[labels[2]] = rejected_totals.get(labels[2], 0) + count

        redact = self._redactor()
        document_models: dict[str, Any] = {}
        for model in models:
            entries = sorted(
                backlog_by_model.get(model, ()),
                key=lambda entry: (-entry.depth, entry.oldest_enqueued_at, entry.user),
            )
            shown = entries[: self._status_max_users]
            group = gate_by_model.get(model)
            document_models[model] = {
                "queued": {
                    tier: stats.queued_by_model_tier.get((model, tier), 0) for tier in tier_names
                },
                "in_flight": stats.in_flight_by_model.get(model, 0),
                "backlogged_users": len(entries),
                "backlog": [
                    {
                        "user": entry.user,
                        "configured": directory.principal_named(entry.user) is not None,
                        "tier": entry.tier,
                        "depth": entry.depth,
                        "oldest_wait_s": (
                            _round(state.now - entry.oldest_enqueued_at)
                            if state.now is not None
                            else None
                        ),
                    }
                    for entry in shown
                ],
                "backlog_truncated": len(entries) - len(shown),
                "gate": _gate_document(group, service.settings.unknown_model_max_inflight),
                "deployments": [
                    _watcher_document(watcher, redact)
                    for watcher in watchers_by_model.get(model, ())
                ],
            }
        return {
            "tiers": [
                {
                    "name": tier.name,
                    "waiting_below": tier.waiting_below,
                    "tpot_below_ms": tier.tpot_below_ms,
                    "kv_usage_below": tier.kv_usage_below,
                    "vllm_priority": tier.vllm_priority,
                }
                for tier in service.settings.tiers
            ],
            "fairness": service.settings.fairness,
            "totals": {
                "queued": stats.queued,
                "in_flight": stats.in_flight,
                "released": stats.released_total,
                "completed": stats.completed_total,
                "cancelled": stats.cancelled_total,
                "abandoned": stats.abandoned_total,
                "rejected": rejected_totals,
            },
            "models": document_models,
            # Which replica these numbers describe: the leader's core decides while shared.
            "state": service.scheduler.state_statistics()._asdict(),
            "transitions": [
                {"model": t.model, "from": t.old, "to": t.new, "reason": redact(t.reason)}
                for t in service.transitions[-STATUS_TRANSITIONS:]
            ],
        }


# ----------------------------------------------------------------------------- helpers


def _format_bound(bound: float) -> str:
    return repr(float(bound))


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def safe_url(url: str) -> str:
    """A URL without credentials, query or fragment (fit for a label or a status page)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _watcher_state(model: str, watcher: MetricsWatcher, now: float | None) -> _WatcherState:
    snapshot = watcher.last_snapshot
    if snapshot is None:
        return _WatcherState(
            model,
            safe_url(watcher.url),
            watcher.scrapes_total,
            watcher.failures_total,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )
    return _WatcherState(
        model,
        safe_url(watcher.url),
        watcher.scrapes_total,
        watcher.failures_total,
        snapshot.ok,
        now - snapshot.started_at if now is not None else None,
        snapshot.error,
        snapshot.waiting if snapshot.ok else None,
        snapshot.running if snapshot.ok else None,
        snapshot.kv_usage if snapshot.ok else None,
        snapshot.tpot_s if snapshot.ok else None,
    )


def _gate_document(group: GroupStatus | None, unknown_cap: int) -> dict[str, Any]:
    if group is None:
        # No engine metrics for this model: the gate is a fixed in-flight cap.
        return {"mode": "inflight_cap", "max_inflight": unknown_cap}
    return {
        "mode": group.mode,
        "deployments": group.deployments,
        "waiting": group.waiting,
        "running": group.running,
        "tpot_s": group.tpot_s,
        "kv_usage": group.kv_usage,
        "pending": group.pending,
        "in_flight": group.in_flight,
        "last_scrape_age_s": _round(group.last_scrape_age_s),
        "blocked_reason": group.blocked_reason,
    }


def _watcher_document(watcher: _WatcherState, redact: Callable[[str], str]) -> dict[str, Any]:
    last: dict[str, Any] | None = None
    if watcher.last_ok is not None:
        last = {
            "ok": watcher.last_ok,
            "age_s": _round(watcher.last_age_s),
            "waiting": watcher.last_waiting,
            "running": watcher.last_running,
            "kv_usage": watcher.last_kv_usage,
            "tpot_s": watcher.last_tpot_s,
            "error": redact(watcher.last_error) if watcher.last_error else None,
        }
    return {
        "url": watcher.url,
        "scrapes_total": watcher.scrapes_total,
        "failures_total": watcher.failures_total,
        "last_snapshot": last,
    }


# ----------------------------------------------------------------------------- endpoints


def _presented_key(request: Request, *, extra_headers: Iterable[str] = ()) -> str | None:
    authorization = request.headers.get("authorization", "")
    if authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    for header in extra_headers:
        value = request.headers.get(header)
        if value:
            return value.strip()
    return None


def keys_match(presented: str | None, expected: str | None) -> bool:
    """Constant-time comparison; digests first, so the time says nothing about the length."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(
        hashlib.sha256(presented.encode()).digest(), hashlib.sha256(expected.encode()).digest()
    )


def _unauthorized() -> Response:
    body = {
        "error": {
            "message": "fair_sched: this endpoint needs the admin key (Authorization: Bearer ...)",
            "type": "authentication_error",
            "code": "unauthorized",
            "param": None,
        }
    }
    return JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})


_Renderer = Callable[["ServiceMetrics"], Response]


def _metrics_response(metrics: ServiceMetrics) -> Response:
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _status_response(metrics: ServiceMetrics) -> Response:
    return Response(
        json.dumps(metrics.status(), separators=(",", ":"), allow_nan=False).encode(),
        media_type="application/json",
        headers={"cache-control": "no-store"},
    )


def endpoints(service: SchedulingService, *, admin_key: str | None = None) -> list[Route]:
    """Starlette routes for ``GET /fair-sched/metrics`` and ``GET /fair-sched/status``.

    With an admin key (`admin_key`, else ``observability.admin_key`` from the settings) both
    answer 401 unless the request carries ``Authorization: Bearer <admin key>``. Without one the
    metrics stay open (aggregates; user labels only when `user_labels` opts in) and the status
    page, which names backlogged callers, answers 403: it is never public by accident.
    """
    metrics = service.observability
    key = admin_key or service.settings.observability.resolved_admin_key()

    def guarded(
        render: _Renderer, *, open_without_key: bool
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if key is None:
                if not open_without_key:
                    return JSONResponse(
                        {
                            "error": {
                                "message": "the status page needs observability.admin_key",
                                "type": "permission_error",
                                "code": "admin_key_not_configured",
                                "param": None,
                            }
                        },
                        status_code=403,
                    )
            elif not keys_match(_presented_key(request), key):
                return _unauthorized()
            return render(metrics)

        return endpoint

    return [
        Route(METRICS_PATH, guarded(_metrics_response, open_without_key=True), methods=["GET"]),
        Route(STATUS_PATH, guarded(_status_response, open_without_key=False), methods=["GET"]),
    ]


def admin_app(service: SchedulingService, *, admin_key: str | None = None) -> Router:
    """The two endpoints as one ASGI app (a `Router`), for mounting or for the middleware."""
    return Router(routes=endpoints(service, admin_key=admin_key))


# ----------------------------------------------------------------------------- LiteLLM


def register_in_default_registry(metrics: ServiceMetrics) -> bool:
    """Add the service's collector to prometheus_client's global `REGISTRY` (where LiteLLM's
    own /metrics reads); True if added, False if it (or another fair_sched collector) is
    already there."""
    try:
        REGISTRY.register(metrics.collector)
    except ValueError:
        return False
    return True


def install_litellm_routes(proxy_server: Any, callback: Any) -> None:
    """Add /fair-sched/metrics and /fair-sched/status to a running LiteLLM proxy (admin only).

    Both need the proxy's master key (``Authorization: Bearer`` or ``x-litellm-api-key``),
    compared in constant time with ``proxy_server.master_key`` at request time; anything else
    gets 401. The collector also joins prometheus_client's default registry, so the families
    appear in LiteLLM's own /metrics when its Prometheus callback is on.
    """
    app = getattr(proxy_server, "app", None)
    if app is None or not hasattr(app, "add_api_route"):
        logger.warning("fair_sched: cannot add /fair-sched/* routes (no proxy app found)")
        return
    metrics: ServiceMetrics = callback.service.observability
    metrics._remember_loop()
    register_in_default_registry(metrics)

    def guarded(render: _Renderer) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            master_key = getattr(proxy_server, "master_key", None)
            presented = _presented_key(request, extra_headers=("x-litellm-api-key",))
            if not keys_match(presented, str(master_key) if master_key else None):
                return _unauthorized()
            return render(metrics)

        return endpoint

    existing = {getattr(route, "path", None) for route in getattr(app, "routes", ())}
    for path, render in ((METRICS_PATH, _metrics_response), (STATUS_PATH, _status_response)):
        if path in existing:
            continue  # imported twice (a plugin file next to the config): keep the first
        app.add_api_route(
            path,
            guarded(render),
            methods=["GET"],
            include_in_schema=False,
            response_model=None,
        )
