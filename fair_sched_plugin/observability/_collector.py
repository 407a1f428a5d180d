"""The Prometheus collector: metric families of one service, and nothing else.

Almost everything is read at scrape time from the `ServiceView` (one `Reading`); the request
path only feeds the `RequestRecorder` (wait histogram, rejections, transitions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ..core import FairnessReading, TierLimits
from ._recorder import OTHER, REJECTION_REASONS, RequestRecorder
from ._view import ViewReader

GATE_MODES = ("starting", "metrics", "fallback")


def _format_bound(bound: float) -> str:
    return repr(float(bound))


def _fairness_families() -> dict[str, GaugeMetricFamily]:
    return {
        "jain": GaugeMetricFamily(
            "fair_sched_fairness_jain_index",
            "Jain's index (1 even, 1/n one user served) over the service per weight of the users "
            "backlogged throughout the fairness window; unit: tokens, and the fairness "
            "policy's own unit (requests or cost) where it is another.",
            labels=("model", "tier", "unit"),
        ),
        "gap": GaugeMetricFamily(
            "fair_sched_service_gap_tokens",
            "The largest difference in tokens per weight served in the fairness window between "
            "two users backlogged throughout it.",
            labels=("model", "tier"),
        ),
        "starved": GaugeMetricFamily(
            "fair_sched_starved_wait_seconds",
            "How long the most starved backlogged user has waited for its next release.",
            labels=("model", "tier"),
        ),
        "users": GaugeMetricFamily(
            "fair_sched_fairness_users",
            "Users backlogged throughout the fairness window (whom the index and gap are over).",
            labels=("model", "tier"),
        ),
    }


def _add_fairness(
    families: dict[str, GaugeMetricFamily],
    readings: Sequence[FairnessReading],
    model_label: Callable[[str], str],
) -> None:
    seen: set[tuple[str, str]] = set()
    for reading in sorted(readings, key=lambda reading: (reading.model, reading.tier)):
        where = (model_label(reading.model), reading.tier)
        if where in seen:  # models past `max_model_labels` share `other`: the first one shows
            continue
        seen.add(where)
        families["starved"].add_metric(list(where), reading.starved_wait_s)
        families["users"].add_metric(list(where), reading.users)
        for unit, index in reading.jain_index:
            families["jain"].add_metric([*where, unit], index)
        if reading.service_gap_tokens is not None:
            families["gap"].add_metric(list(where), reading.service_gap_tokens)


class FairSchedCollector:
    """A prometheus_client custom collector; `describe()` names the families so registries can
    detect a clash without collecting."""

    def __init__(
        self,
        reader: ViewReader,
        recorder: RequestRecorder,
        tiers: tuple[TierLimits, ...],
        gated_models: frozenset[str],
    ) -> None:
        self._reader = reader
        self._recorder = recorder
        self._tiers = tiers
        self._gated_models = gated_models

    def collect(self) -> Iterator[Metric]:
        return iter(self.families())

    def describe(self) -> Iterator[Metric]:
        return iter(self.families(describe_only=True))

    def families(self, *, describe_only: bool = False) -> list[Metric]:
        recorder = self._recorder
        names = recorder.labels
        user = ("user",) if names.user_labels else ()
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
            "1 for the gate's current mode per deployment (starting, metrics, fallback).",
            labels=("model", "deployment", "mode"),
        )
        gate_deployments = GaugeMetricFamily(
            "fair_sched_gate_deployments", "Deployments behind the model group.", labels=("model",)
        )
        # Each deployment has its own gate: its readings, never a sum standing for the group.
        per_deployment = {
            name: GaugeMetricFamily(f"fair_sched_{name}", help_text, labels=("model", "deployment"))
            for name, help_text in (
                ("gate_pending_requests", "Released requests not yet seen by the engine."),
                ("gate_in_flight_requests", "Requests in flight as the gate counts them."),
                ("gate_free_slots", "Running slots the gate counts free (learned capacity)."),
                ("engine_waiting_requests", "Engine waiting queue at the last good scrape."),
                ("engine_running_requests", "Engine running requests at the last good scrape."),
                ("engine_tpot_seconds", "Recent time per output token."),
                ("engine_kv_cache_usage_ratio", "KV cache usage 0..1."),
                ("engine_scrape_age_seconds", "Age of the deployment's last good scrape."),
            )
        }
        allowed_queue = GaugeMetricFamily(
            "fair_sched_gate_allowed_queue",
            "The engine queue a `waiting_below: auto` tier's tuner allows now, per deployment.",
            labels=("model", "deployment", "tier"),
        )
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
        prefix_hit_ratio = GaugeMetricFamily(
            "fair_sched_engine_prefix_cache_hit_ratio",
            "Share of prompt tokens a deployment's engine found in its prefix cache between its "
            "last two good scrapes (only engines that report prefix-cache counters).",
            labels=("model", "url"),
        )
        transitions = CounterMetricFamily(
            "fair_sched_gate_transitions",
            "Gate mode changes per model group.",
            labels=("model", "from", "to"),
        )
        read_timeouts = CounterMetricFamily(
            "fair_sched_read_timeouts",
            "Client connections closed because a request's headers or body came too slowly "
            "(`fair-sched proxy`'s read deadlines).",
            labels=("phase",),
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
        tier_released = CounterMetricFamily(
            "fair_sched_tier_released",
            "Requests released through this replica's service, by the tier they were released "
            "from (after budget demotion and promotion): the tiers' delivered shares.",
            labels=("model", "tier"),
        )
        tier_share = GaugeMetricFamily(
            "fair_sched_tier_share",
            "A tier's configured share (tiers[].share) of releases while several share tiers "
            "have work.",
            labels=("tier",),
        )
        budget = {
            name: GaugeMetricFamily(f"fair_sched_budget_{name}", help_text, labels=("unit", *user))
            for name, help_text in (
                ("limit", "Budget per window of the principals with a budget (summed)."),
                ("spent", "Spent in the principals' current budget windows (summed)."),
                ("remaining", "Left in the principals' current budget windows (summed)."),
                ("over_principals", "Principals over their budget now (demoted or rejected)."),
            )
        }
        budget_resets = GaugeMetricFamily(
            "fair_sched_budget_resets_in_seconds",
            "Until the principal's budget window ends (only with user_labels: principals).",
            labels=("unit", *user),
        )
        fairness = _fairness_families()
        all_families: list[Metric] = [
            queued,
            backlogged,
            in_flight,
            *lifecycle.values(),
            rejected,
            wait,
            gate_mode,
            gate_deployments,
            *per_deployment.values(),
            allowed_queue,
            waiting_threshold,
            tpot_threshold,
            scrapes,
            scrape_failures,
            prefix_hit_ratio,
            transitions,
            read_timeouts,
            unavailable,
            state_fallbacks,
            state_local,
            tier_released,
            tier_share,
            *budget.values(),
            budget_resets,
            *fairness.values(),
        ]
        if describe_only:
            return all_families

        state = self._reader.read()
        stats = state.statistics
        tiers = self._tiers

        # Queues: every configured model and tier has a series (zero included).
        queued_values: dict[tuple[str, ...], float] = {}
        backlogged_values: dict[tuple[str, str], float] = {}
        for model in sorted(names.configured_models):
            for tier in tiers:
                backlogged_values[(model, tier.name)] = 0
                zero = (model, tier.name, OTHER) if names.user_labels else (model, tier.name)
                queued_values[zero] = 0
        if names.user_labels:
            for entry in state.backlog:
                key = (names.model(entry.model), entry.tier, names.user(entry.user))
                queued_values[key] = queued_values.get(key, 0) + entry.depth
        else:
            for (model, tier_name), count in stats.queued_by_model_tier.items():
                model_tier = (names.model(model), tier_name)
                queued_values[model_tier] = queued_values.get(model_tier, 0) + count
        for entry in state.backlog:
            pair = (names.model(entry.model), entry.tier)
            backlogged_values[pair] = backlogged_values.get(pair, 0) + 1
        for labels, value in sorted(queued_values.items()):
            queued.add_metric(list(labels), value)
        for pair, value in sorted(backlogged_values.items()):
            backlogged.add_metric(list(pair), value)

        in_flight_values = dict.fromkeys(sorted(names.configured_models), 0.0)
        for model, count in stats.in_flight_by_model.items():
            label = names.model(model)
            in_flight_values[label] = in_flight_values.get(label, 0) + count
        for model, value in sorted(in_flight_values.items()):
            in_flight.add_metric([model], value)

        lifecycle["released"].add_metric([], stats.released_total)
        lifecycle["completed"].add_metric([], stats.completed_total)
        lifecycle["cancelled"].add_metric([], stats.cancelled_total)
        lifecycle["abandoned"].add_metric([], stats.abandoned_total)

        rejected_values = recorder.copy_rejected()
        wait_values = recorder.copy_waits()
        transition_values = recorder.copy_transitions()
        if not names.user_labels:
            # Counters exist from zero, so rate() sees the first rejection.
            for model in names.configured_models:
                for tier in tiers:
                    for reason in REJECTION_REASONS:
                        rejected_values.setdefault((model, tier.name, reason), 0)
        for labels, count in sorted(rejected_values.items()):
            rejected.add_metric(list(labels), count)
        bounds = recorder.wait_bounds
        for labels, counts, total in sorted(wait_values, key=lambda item: item[0]):
            cumulative = 0
            buckets = []
            for bound, count in zip((*map(_format_bound, bounds), "+Inf"), counts, strict=True):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            wait.add_metric(list(labels), buckets, total)

        for group in state.gate or ():
            gate_deployments.add_metric([group.model], group.deployments)
            for row in group.per_deployment:
                where = [group.model, self._reader.view.deployment_name(row.deployment)]
                for mode in GATE_MODES:
                    gate_mode.add_metric([*where, mode], 1.0 if row.mode == mode else 0.0)
                for name, reading in (
                    ("gate_pending_requests", row.pending),
                    ("gate_in_flight_requests", row.in_flight),
                    ("gate_free_slots", row.free_slots),
                    ("engine_waiting_requests", row.waiting),
                    ("engine_running_requests", row.running),
                    ("engine_tpot_seconds", row.tpot_s),
                    ("engine_kv_cache_usage_ratio", row.kv_usage),
                    ("engine_scrape_age_seconds", row.last_scrape_age_s),
                ):
                    if reading is not None:
                        per_deployment[name].add_metric(where, reading)
                for tier_name, queue in row.allowed_queue:
                    allowed_queue.add_metric([*where, tier_name], queue)
        for model, by_tier in sorted(state.waiting_thresholds.items()):
            for tier_name, threshold in by_tier.items():
                waiting_threshold.add_metric([model, tier_name], threshold)
        for tier in tiers:
            if tier.tpot_below_s is not None:
                tpot_threshold.add_metric([tier.name], tier.tpot_below_s)

        for deployment in state.deployments:
            url = self._reader.view.deployment_name(deployment.url)
            scrapes.add_metric([deployment.model, url], deployment.scrapes_total)
            scrape_failures.add_metric([deployment.model, url], deployment.failures_total)
            if deployment.prefix_cache_hit_rate is not None:
                prefix_hit_ratio.add_metric(
                    [deployment.model, url], deployment.prefix_cache_hit_rate
                )
        for (model, old, new), count in sorted(transition_values.items()):
            transitions.add_metric([model, old, new], count)
        read_timeout_values = {"headers": 0, "body": 0, **recorder.copy_read_timeouts()}
        for phase, count in sorted(read_timeout_values.items()):
            read_timeouts.add_metric([phase], count)
        unavailable_values = dict.fromkeys(sorted(self._gated_models), 0)
        for (model, _old, new), count in transition_values.items():
            if new == "fallback":
                unavailable_values[model] = unavailable_values.get(model, 0) + count
        for model, count in sorted(unavailable_values.items()):
            unavailable.add_metric([model], count)
        if state.shared:
            shared = state.state
            state_fallbacks.add_metric([shared.replica], shared.fallbacks_total)
            local = 1.0 if shared.mode == "local" else 0.0
            state_local.add_metric([shared.replica, shared.leader or ""], local)

        released_by_tier: dict[tuple[str, str], int] = {}
        for model in names.configured_models:
            for tier in tiers:
                released_by_tier[(model, tier.name)] = 0
        for labels, counts, _total in wait_values:
            released_at = (labels[0], labels[1])
            released_by_tier[released_at] = released_by_tier.get(released_at, 0) + sum(counts)
        for released_at, released_count in sorted(released_by_tier.items()):
            tier_released.add_metric(list(released_at), released_count)
        for tier in tiers:
            if tier.share is not None:
                tier_share.add_metric([tier.name], tier.share)
        budget_values: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in budget}
        for standing in state.budgets:
            budget_labels: tuple[str, ...] = (standing.unit,)
            if user:
                budget_labels = (standing.unit, names.user(standing.principal))
            for name, amount in (
                ("limit", standing.limit),
                ("spent", standing.spent),
                ("remaining", standing.remaining),
                ("over_principals", 1.0 if standing.over else 0.0),
            ):
                values = budget_values[name]
                values[budget_labels] = values.get(budget_labels, 0.0) + amount
            if user:
                budget_resets.add_metric(list(budget_labels), standing.resets_in_s)
        for name, by_labels in budget_values.items():
            for budget_labels, amount in sorted(by_labels.items()):
                budget[name].add_metric(list(budget_labels), amount)
        _add_fairness(fairness, state.fairness, names.model)
        return all_families
