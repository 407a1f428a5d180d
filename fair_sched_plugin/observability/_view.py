"""The one read-only view of a service that observability reads, and reading it safely.

`ServiceView` is a seam (a Protocol): `ServiceReadModel` implements it from a service's scheduler,
gate and watchers; a service whose statistics come from shared state changes what these methods
return, never the collector, the status document or the endpoints.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ..core import (
    DeadlineOutcomes,
    FairnessReading,
    GateTransition,
    GroupStatus,
    Lease,
    SchedulerStatistics,
    TierLimits,
    UserBacklog,
)

if TYPE_CHECKING:
    from ..config import FairSchedSettings
    from ..core import BackendSnapshot
    from ..state import StateStatistics

logger = logging.getLogger("fair_sched")

# How long a scrape from another thread waits for the event loop to read the state.
CROSS_THREAD_TIMEOUT_S = 5.0


class DeploymentReading(NamedTuple):
    """One engine deployment as its metrics watcher last saw it (`url` as configured)."""

    model: str
    url: str
    scrapes_total: int
    failures_total: int
    last_snapshot: BackendSnapshot | None
    prefix_cache_hit_rate: float | None = None  # between the last two good scrapes


class BudgetStanding(NamedTuple):
    """Where one principal with a budget stands now (`principals[].budget`)."""

    principal: str
    unit: str  # usd | tokens
    limit: float
    spent: float  # in the current window (0 when none is open)
    remaining: float
    resets_in_s: float  # until the current window ends (a full window when none is open)
    over: bool
    action: str  # demote | reject
    demote_to: str | None


class Admitted(Protocol):
    """A granted admission, as observability is told of it (`service.Admission`)."""

    @property
    def lease(self) -> Lease: ...


class ServiceView(Protocol):
    """What observability may read of a service; nothing here changes it."""

    @property
    def settings(self) -> FairSchedSettings: ...

    def scheduler_statistics(self) -> SchedulerStatistics: ...

    def deadline_outcomes(self) -> Mapping[str, DeadlineOutcomes]:
        """Per tier, the requests with a limit of their own: met, missed, refused at once."""
        ...

    def backlog(self) -> list[UserBacklog]:
        """Every backlogged (model, tier, user) with its depth and oldest arrival."""
        ...

    def in_flight_by_user(self) -> Mapping[tuple[str, str, str], int]:
        """Requests released and not yet ended, by (model, tier, principal name)."""
        ...

    def gate_status(self) -> list[GroupStatus]:
        """Per model group; only on the service's event loop (the gate's clock needs it)."""
        ...

    def waiting_thresholds(self) -> Mapping[str, Mapping[str, float]]:
        """Per gated model and tier, the engine queue that tier may fill (summed over the
        model's deployments). Where thresholds tune themselves, the values in force now."""
        ...

    def tier_limits(self) -> tuple[TierLimits, ...]:
        """The tiers as the scheduler applies them, most urgent first."""
        ...

    def configured_models(self) -> frozenset[str]:
        """Models named in `backends` (with or without engine metrics)."""
        ...

    def gated_models(self) -> Mapping[str, Sequence[str]]:
        """Models gated on engine metrics, with their metrics URLs as written (these may carry
        credentials: never shown as is)."""
        ...

    def deployments(self) -> list[DeploymentReading]: ...

    def recent_transitions(self) -> Sequence[GateTransition]: ...

    def deployment_name(self, key: str) -> str:
        """A deployment's (or metrics URL's) public name (never the URL as configured, which
        may carry credentials)."""
        ...

    def redact(self, text: str) -> str:
        """`text` with every configured URL in its public form."""
        ...

    def state_statistics(self) -> StateStatistics:
        """Which replica these numbers describe, and whether replicas share a leader."""
        ...

    def shares_state(self) -> bool:
        """True when replicas coordinate through Redis (`redis://`)."""
        ...

    def budget_standings(self) -> list[BudgetStanding]:
        """Every principal with a budget (with Redis: the leader's book, at most a heartbeat
        old on a follower)."""
        ...

    def fairness(self) -> list[FairnessReading]:
        """The fairness gauges per (model, tier) with backlogged users, over the sliding window
        (with Redis: the leader's, at most a heartbeat old on a follower); on the service's
        event loop only (the scheduler's clock needs it)."""
        ...


class Reading(NamedTuple):
    """Everything one scrape or one status document reads, taken in one go on the event loop."""

    statistics: SchedulerStatistics
    backlog: list[UserBacklog]
    in_flight_by_user: Mapping[tuple[str, str, str], int]
    waiting_thresholds: Mapping[str, Mapping[str, float]]
    gate: list[GroupStatus] | None  # None outside an event loop (the gate's clock needs one)
    deployments: list[DeploymentReading]
    state: StateStatistics
    shared: bool
    now: float | None  # the loop's clock, for ages; None outside a loop
    budgets: list[BudgetStanding] = []
    fairness: list[FairnessReading] = []
    deadlines: Mapping[str, DeadlineOutcomes] = {}


class ViewReader:
    """Reads a `ServiceView` on the service's event loop, from wherever it is asked.

    LiteLLM renders its /metrics in a worker thread: the read hops to the loop (remembered from
    the first admission or read there) and waits for it, up to `CROSS_THREAD_TIMEOUT_S`; with no
    running loop it reads what needs none (queues, counters), leaving the gate out.
    """

    def __init__(self, view: ServiceView) -> None:
        self._view = view
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def view(self) -> ServiceView:
        return self._view

    def remember_loop(self) -> None:
        with contextlib.suppress(RuntimeError):  # not on a loop: the one remembered stays
            self._loop = asyncio.get_running_loop()

    def _read(self, *, on_loop: bool) -> Reading:
        view = self._view
        return Reading(
            statistics=view.scheduler_statistics(),
            backlog=view.backlog(),
            in_flight_by_user=view.in_flight_by_user(),
            waiting_thresholds=view.waiting_thresholds(),
            gate=view.gate_status() if on_loop else None,
            deployments=view.deployments(),
            state=view.state_statistics(),
            shared=view.shares_state(),
            now=asyncio.get_running_loop().time() if on_loop else None,
            budgets=view.budget_standings(),
            fairness=view.fairness() if on_loop else [],
            deadlines=view.deadline_outcomes(),
        )

    def read(self) -> Reading:
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
        result: concurrent.futures.Future[Reading] = concurrent.futures.Future()

        def read_on_loop() -> None:
            if not result.set_running_or_notify_cancel():
                return
            try:
                result.set_result(self._read(on_loop=True))
            except Exception as exc:
                result.set_exception(exc)

        loop.call_soon_threadsafe(read_on_loop)
        try:
            return result.result(timeout=CROSS_THREAD_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            result.cancel()
            logger.warning("fair_sched metrics: the event loop did not answer; partial scrape")
            return self._read(on_loop=False)
