"""The pure core: fair queues, fairness policies, admission gates. No I/O, injectable clock."""

from __future__ import annotations

from .backpressure import BackendGroup, GateTransition, GroupStatus, MetricsGate
from .clock import Clock, LoopClock
from .gate import AdmissionGate, InflightLimitGate
from .scheduler import (
    FairnessPolicy,
    FairScheduler,
    Reservation,
    SchedulerStatistics,
    UserBacklog,
)
from .snapshot import BackendSnapshot
from .ticket import Lease, LeaseOwner, Ticket, TierLimits

__all__ = [
    "AdmissionGate",
    "BackendGroup",
    "BackendSnapshot",
    "Clock",
    "FairScheduler",
    "FairnessPolicy",
    "GateTransition",
    "GroupStatus",
    "InflightLimitGate",
    "Lease",
    "LeaseOwner",
    "LoopClock",
    "MetricsGate",
    "Reservation",
    "SchedulerStatistics",
    "Ticket",
    "TierLimits",
    "UserBacklog",
]
