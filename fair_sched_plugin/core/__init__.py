"""The pure core: fair queues, fairness policies, admission gates. Sans-I/O: no event loop, no
I/O, time from an injected clock; `fair_sched_plugin.runtime.driver` runs it on asyncio."""

from __future__ import annotations

from .backpressure import (
    BackendGroup,
    Deployment,
    DeploymentStatus,
    GateTransition,
    GroupStatus,
    MetricsGate,
)
from .budget import BudgetAction, BudgetBook, BudgetRule, BudgetUnit, BudgetVerdict
from .clock import Clock, MonotonicClock
from .fairness import FairnessPolicy
from .fairness_window import DEFAULT_FAIRNESS_WINDOW_S, FairnessReading, FairnessWindow
from .gate import AdmissionGate, InflightLimitGate
from .reads import DeadlineOutcomes, SchedulerStatistics, UserBacklog
from .scheduler import Decision, QueueOrder, SchedulerCore
from .snapshot import BackendSnapshot
from .ticket import (
    MAX_REQUEST_COST,
    MAX_REQUEST_TOKENS,
    Lease,
    LeaseOwner,
    Ticket,
    TierLimits,
    request_cost_in_range,
    request_tokens_in_range,
)
from .tuning import QueueTuner, TunerStatus
from .waiting import DrainMeter, estimate_position, retry_after_s

__all__ = [
    "DEFAULT_FAIRNESS_WINDOW_S",
    "MAX_REQUEST_COST",
    "MAX_REQUEST_TOKENS",
    "AdmissionGate",
    "BackendGroup",
    "BackendSnapshot",
    "BudgetAction",
    "BudgetBook",
    "BudgetRule",
    "BudgetUnit",
    "BudgetVerdict",
    "Clock",
    "DeadlineOutcomes",
    "Decision",
    "Deployment",
    "DeploymentStatus",
    "DrainMeter",
    "FairnessPolicy",
    "FairnessReading",
    "FairnessWindow",
    "GateTransition",
    "GroupStatus",
    "InflightLimitGate",
    "Lease",
    "LeaseOwner",
    "MetricsGate",
    "MonotonicClock",
    "QueueOrder",
    "QueueTuner",
    "SchedulerCore",
    "SchedulerStatistics",
    "Ticket",
    "TierLimits",
    "TunerStatus",
    "UserBacklog",
    "estimate_position",
    "request_cost_in_range",
    "request_tokens_in_range",
    "retry_after_s",
]
