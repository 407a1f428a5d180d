"""The status document: per model its queues, who waits and who runs, gate and deployments.

Callers are named by principal name (strangers by a key fingerprint), never by key; metrics
URLs appear without credentials or query, deployments by their public names. Fields are only
ever added, never renamed (the UI page, docs/operations.md and operators' scripts read them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..config import FairSchedSettings
from ..core import DeadlineOutcomes, GroupStatus, UserBacklog
from ._recorder import REJECTION_REASONS, RequestRecorder
from ._view import DeploymentReading, Reading, ServiceView, ViewReader

# Transitions and rejections kept in the status document.
STATUS_TRANSITIONS = 20
STATUS_REJECTIONS = 20


_NO_DEADLINES = DeadlineOutcomes(0, 0, 0)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


class StatusDocument:
    """Builds the JSON-ready status document of one service from its view and recorder."""

    def __init__(self, view: ServiceView, reader: ViewReader, recorder: RequestRecorder) -> None:
        self._view = view
        self._reader = reader
        self._recorder = recorder

    def build(self) -> dict[str, Any]:
        state = self._reader.read()
        view = self._view
        settings = view.settings
        stats = state.statistics
        principal_names = {principal.name for principal in settings.principals}
        max_users = settings.observability.status_max_users
        gate_by_model = {group.model: group for group in state.gate or ()}
        deployments_by_model: dict[str, list[DeploymentReading]] = {}
        for deployment in state.deployments:
            deployments_by_model.setdefault(deployment.model, []).append(deployment)
        backlog_by_model: dict[str, list[UserBacklog]] = {}
        for entry in state.backlog:
            backlog_by_model.setdefault(entry.model, []).append(entry)
        running_by_model: dict[str, list[tuple[str, str, int]]] = {}
        for (model, tier, user), count in state.in_flight_by_user.items():
            if count > 0:
                running_by_model.setdefault(model, []).append((tier, user, count))
        # Released through this replica per (model, tier): the wait histogram counts each one.
        released: dict[tuple[str, str], int] = {}
        for labels, counts, _total in self._recorder.copy_waits():
            released[(labels[0], labels[1])] = released.get((labels[0], labels[1]), 0) + sum(counts)
        models = sorted(
            view.configured_models()
            | set(view.gated_models())
            | {model for model, _ in stats.queued_by_model_tier}
            | set(stats.in_flight_by_model)
            | set(backlog_by_model)
        )
        tiers = view.tier_limits()
        tier_names = [tier.name for tier in tiers]
        released_by_tier = dict.fromkeys(tier_names, 0)
        for (_model, tier_name), count in released.items():
            released_by_tier[tier_name] = released_by_tier.get(tier_name, 0) + count
        released_all = sum(released_by_tier.values())
        rejected_totals = dict.fromkeys(REJECTION_REASONS, 0)
        for labels, count in self._recorder.copy_rejected().items():
            rejected_totals[labels[2]] = rejected_totals.get(labels[2], 0) + count

        redact = view.redact
        # The age of the reading each deployment's gate decides on (its last good scrape), by
        # metrics URL: the gate's rows come in the order of its group's metrics URLs.
        gated = view.gated_models()
        reading_ages = {
            url: row.last_scrape_age_s
            for model, group in gate_by_model.items()
            if len(gated.get(model, ())) == len(group.per_deployment)
            for url, row in zip(gated[model], group.per_deployment, strict=True)
        }
        fairness_by_model: dict[str, dict[str, Any]] = {}
        for reading in state.fairness:
            fairness_by_model.setdefault(reading.model, {})[reading.tier] = {
                "users": reading.users,
                "jain_index": {unit: _round(index) for unit, index in reading.jain_index},
                "service_gap_tokens": _round(reading.service_gap_tokens, 1),
                "starved_wait_s": _round(reading.starved_wait_s, 1),
                "window_s": _round(reading.span_s, 1),
            }
        document_models: dict[str, Any] = {}
        for model in models:
            entries = sorted(
                backlog_by_model.get(model, ()),
                key=lambda entry: (-entry.depth, entry.oldest_enqueued_at, entry.user),
            )
            shown = entries[:max_users]
            running = sorted(running_by_model.get(model, ()), key=lambda r: (-r[2], r[1], r[0]))
            running_shown = running[:max_users]
            document_models[model] = {
                "queued": {
                    tier: stats.queued_by_model_tier.get((model, tier), 0) for tier in tier_names
                },
                "in_flight": stats.in_flight_by_model.get(model, 0),
                "released": {tier: released.get((model, tier), 0) for tier in tier_names},
                "backlogged_users": len(entries),
                # Per tier with backlogged users: the fairness gauges over the sliding window.
                "fairness": fairness_by_model.get(model, {}),
                "backlog": [
                    {
                        "user": entry.user,
                        "configured": entry.user in principal_names,
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
                "in_flight_by_user": [
                    {
                        "user": user,
                        "configured": user in principal_names,
                        "tier": tier,
                        "in_flight": count,
                    }
                    for tier, user, count in running_shown
                ],
                "in_flight_by_user_truncated": len(running) - len(running_shown),
                "gate": _gate_document(
                    gate_by_model.get(model),
                    settings.unknown_model_max_inflight,
                    state.waiting_thresholds.get(model, {}),
                    _fallback_cap(settings, model),
                    view.deployment_name,
                ),
                "deployments": [
                    _deployment_document(
                        deployment, state, redact, view.deployment_name, reading_ages
                    )
                    for deployment in deployments_by_model.get(model, ())
                ],
            }
        return {
            "tiers": [
                {
                    "name": tier.name,
                    "waiting_below": "auto" if tier.auto_bounds() else tier.waiting_below,
                    "ttft_target_ms": tier.ttft_target_ms,
                    "tpot_below_ms": tier.tpot_below_ms,
                    "kv_usage_below": tier.kv_usage_below,
                    "vllm_priority": tier.vllm_priority,
                    "share": tier.share,
                    "promote_after_s": tier.promote_after_s,
                    "reserve_slots": tier.reserve_slots,
                    "max_wait_s": tier.max_wait_s,
                    "released": released_by_tier.get(tier.name, 0),
                    # Of its requests with a limit shorter than the queue's (the tier's or the
                    # client's): started in time, waited it out, refused at once.
                    "deadlines": dict(state.deadlines.get(tier.name, _NO_DEADLINES)._asdict()),
                    "delivered_share": (
                        round(released_by_tier.get(tier.name, 0) / released_all, 4)
                        if released_all
                        else None
                    ),
                }
                for tier in settings.tiers
            ],
            "fairness": settings.fairness,
            "fairness_window_s": settings.observability.fairness_window_s,
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
            "state": state.state._asdict(),
            "transitions": [
                {
                    "model": t.model,
                    "deployment": view.deployment_name(t.deployment),
                    "from": t.old,
                    "to": t.new,
                    "reason": redact(t.reason),
                }
                for t in list(view.recent_transitions())[-STATUS_TRANSITIONS:]
            ],
            "recent_rejections": self._recent_rejections(),
            "budgets": [
                {
                    "user": standing.principal,
                    "unit": standing.unit,
                    "limit": standing.limit,
                    "spent": standing.spent,
                    "remaining": standing.remaining,
                    "resets_in_s": _round(standing.resets_in_s, 1),
                    "over": standing.over,
                    "action": standing.action,
                    "demote_to": standing.demote_to,
                }
                for standing in state.budgets
            ],
        }

    def _recent_rejections(self) -> list[dict[str, Any]]:
        """The latest rejections, newest first, with their age in seconds."""
        now = self._recorder.clock()
        recent = self._recorder.copy_recent_rejections()[-STATUS_REJECTIONS:]
        return [
            {
                "model": entry.model,
                "tier": entry.tier,
                "user": entry.user,
                "reason": entry.reason,
                "age_s": _round(max(0.0, now - entry.at)),
            }
            for entry in reversed(recent)
        ]


def _fallback_cap(settings: FairSchedSettings, model: str) -> int:
    """The in-flight cap per deployment while `model`'s engine metrics cannot be read."""
    backend = settings.backend(model)
    fallback = (backend and backend.on_metrics_unavailable) or settings.on_metrics_unavailable
    return fallback.max_inflight


def _gate_document(
    group: GroupStatus | None,
    unknown_cap: int,
    waiting_threshold: Mapping[str, float],
    fallback_cap: int,
    deployment_name: Callable[[str], str],
) -> dict[str, Any]:
    if group is None:
        # No engine metrics for this model: the gate is a fixed in-flight cap.
        return {"mode": "inflight_cap", "max_inflight": unknown_cap}
    return {
        "mode": group.mode,
        # The cap per deployment in force while it has no reading (modes starting, fallback):
        # then it decides, not `waiting_threshold`.
        "fallback_max_inflight": fallback_cap,
        "deployments": group.deployments,
        "waiting": group.waiting,
        "running": group.running,
        "tpot_s": group.tpot_s,
        "kv_usage": group.kv_usage,
        "pending": group.pending,
        "in_flight": group.in_flight,
        "last_scrape_age_s": _round(group.last_scrape_age_s),
        "blocked_reason": group.blocked_reason,
        # The engine queue each tier may fill (summed over the group's deployments), as
        # fair_sched_tier_waiting_threshold reports it.
        "waiting_threshold": dict(waiting_threshold),
        # Each deployment's own gate: the figures above are these rows' sums (worst for TPOT,
        # KV usage, scrape age and mode).
        "per_deployment": [
            {
                "deployment": deployment_name(row.deployment),
                "mode": row.mode,
                "waiting": row.waiting,
                "running": row.running,
                "tpot_s": row.tpot_s,
                "kv_usage": row.kv_usage,
                "pending": row.pending,
                "free_slots": row.free_slots,
                "in_flight": row.in_flight,
                "last_scrape_age_s": _round(row.last_scrape_age_s),
                "blocked_reason": row.blocked_reason,
                "allowed_queue": dict(row.allowed_queue),
            }
            for row in group.per_deployment
        ],
    }


def _deployment_document(
    deployment: DeploymentReading,
    state: Reading,
    redact: Callable[[str], str],
    deployment_name: Callable[[str], str],
    reading_ages: Mapping[str, float | None],
) -> dict[str, Any]:
    snapshot = deployment.last_snapshot
    last: dict[str, Any] | None = None
    if snapshot is not None:
        ok = snapshot.ok
        last = {
            "ok": ok,
            "age_s": _round(state.now - snapshot.started_at) if state.now is not None else None,
            "waiting": snapshot.waiting if ok else None,
            "running": snapshot.running if ok else None,
            "kv_usage": snapshot.kv_usage if ok else None,
            "tpot_s": snapshot.tpot_s if ok else None,
            "error": redact(snapshot.error) if snapshot.error else None,
        }
        if ok and deployment.prefix_cache_hit_rate is not None:
            last["prefix_cache_hit_rate"] = round(deployment.prefix_cache_hit_rate, 4)
    return {
        "url": deployment_name(deployment.url),
        "scrapes_total": deployment.scrapes_total,
        "failures_total": deployment.failures_total,
        # Seconds since the last good scrape, the one the gate reads (None: none yet);
        # `last_snapshot.age_s` is the last attempt's, failed or not.
        "reading_age_s": _round(reading_ages.get(deployment.url)),
        "last_snapshot": last,
    }
