"""`ServiceReadModel`: the `ServiceView` of a running service, read from the parts it owns.

The service hands over its settings, scheduler, gate, metrics watchers, budget book and
deployment names, and tells the read model of admissions, lease ends and gate transitions;
observability reads only this, never the service. Nothing here changes what it reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from ..core import (
    BudgetBook,
    DeadlineOutcomes,
    FairnessReading,
    GateTransition,
    GroupStatus,
    Lease,
    MetricsGate,
    SchedulerStatistics,
    TierLimits,
    UserBacklog,
)
from ._view import BudgetStanding, DeploymentReading

if TYPE_CHECKING:
    from ..config import FairSchedSettings
    from ..engine_metrics.watcher import MetricsWatcher
    from ..runtime.deployment_names import DeploymentNames
    from ..state import StateStatistics

# Gate transitions kept (the status document shows the latest of them).
RECENT_TRANSITIONS = 100


class SchedulerReadings(Protocol):
    """What the read model reads of the scheduler (in this process, or the leader's)."""

    @property
    def tiers(self) -> tuple[TierLimits, ...]: ...

    @property
    def coordinated(self) -> bool: ...

    def statistics(self) -> SchedulerStatistics: ...

    def deadline_outcomes(self) -> Mapping[str, DeadlineOutcomes]: ...

    def backlog(self) -> list[UserBacklog]: ...

    def gate_status(self) -> list[GroupStatus]: ...

    def state_statistics(self) -> StateStatistics: ...

    def fairness(self) -> list[FairnessReading]: ...


class ServiceReadModel:
    """A `ServiceView` of one service; an `AdmissionObserver`, a lease end listener and a gate
    transition listener of it, for the requests in flight and the recent transitions."""

    def __init__(
        self,
        settings: FairSchedSettings,
        *,
        scheduler: SchedulerReadings,
        gate: MetricsGate,
        watchers: Mapping[str, Sequence[MetricsWatcher]],
        budgets: BudgetBook,
        names: DeploymentNames,
        configured_models: frozenset[str],
        running: Mapping[Lease, object],
    ) -> None:
        self.settings = settings
        self._scheduler = scheduler
        self._gate = gate
        self._watchers = watchers
        self._budgets = budgets
        self._names = names
        self._configured_models = configured_models
        # Leases granted through the service and not yet ended (the service's one entry per
        # running request), for the per-principal view.
        self._running = running
        self._transitions: deque[GateTransition] = deque(maxlen=RECENT_TRANSITIONS)

    # ------------------------------------------------------------------ told

    def gate_transition(self, transition: GateTransition) -> None:
        self._transitions.append(transition)

    # ------------------------------------------------------------------ read (ServiceView)

    def scheduler_statistics(self) -> SchedulerStatistics:
        return self._scheduler.statistics()

    def deadline_outcomes(self) -> Mapping[str, DeadlineOutcomes]:
        return self._scheduler.deadline_outcomes()

    def backlog(self) -> list[UserBacklog]:
        return self._scheduler.backlog()

    def in_flight_by_user(self) -> Mapping[tuple[str, str, str], int]:
        counts: dict[tuple[str, str, str], int] = {}
        # A copy first: a scrape that timed out waiting for the loop reads from another thread.
        for lease in list(self._running):
            ticket = lease.ticket
            key = (ticket.model, ticket.tier, ticket.user)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def gate_status(self) -> list[GroupStatus]:
        # The deciding gate's: ours while this replica decides, else the leader's document.
        return self._scheduler.gate_status()

    def state_statistics(self) -> StateStatistics:
        return self._scheduler.state_statistics()

    def fairness(self) -> list[FairnessReading]:
        return self._scheduler.fairness()

    def shares_state(self) -> bool:
        return self._scheduler.coordinated

    def waiting_thresholds(self) -> Mapping[str, Mapping[str, float]]:
        # `waiting_below: auto` tiers: what this gate's tuner allows now (read without the
        # clock, so from any thread; a follower replica reports the starting value).
        # Summed over the model's deployments (each holds its own to its tier's threshold).
        result: dict[str, dict[str, float]] = {}
        for model in self._gate.groups():
            by_deployment = self._gate.tuning(model).values()
            result[model] = {
                tier.name: sum(
                    tuning[tier.name].allowed if tier.name in tuning else tier.waiting_below
                    for tuning in by_deployment
                )
                for tier in self._scheduler.tiers
            }
        return result

    def tier_limits(self) -> tuple[TierLimits, ...]:
        return self._scheduler.tiers

    def configured_models(self) -> frozenset[str]:
        return self._configured_models

    def gated_models(self) -> Mapping[str, Sequence[str]]:
        return {model: spec.metrics_urls for model, spec in self._gate.groups().items()}

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

    def recent_transitions(self) -> Sequence[GateTransition]:
        return list(self._transitions)

    def deployment_name(self, key: str) -> str:
        return self._names.deployment_name(key)

    def redact(self, text: str) -> str:
        return self._names.redact(text)

    def budget_standings(self) -> list[BudgetStanding]:
        standings = []
        for principal in sorted(self._budgets.principals()):
            verdict = self._budgets.verdict(principal)
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
