"""Where the scheduler's state lives: this process (`memory://`) or Redis shared by replicas.

`open_state()` picks by `fair_sched.state`. `memory://` keeps today's in-process `FairScheduler`;
`redis://` / `rediss://` runs a `SharedScheduler` over a `RedisStore` (the `redis` extra), with
that same `FairScheduler` as its fallback while Redis is unreachable. `MemoryStore` implements
the store interface in-process (tests; proof that the algorithm does not depend on Redis).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..core.backpressure import MetricsGate
from ..core.scheduler import FairScheduler
from ..core.snapshot import BackendSnapshot
from ..core.ticket import TierLimits
from .memory import MemoryStore
from .shared_scheduler import PolicyBook, SharedScheduler, StateStatistics
from .store import (
    CancelOutcome,
    Enqueued,
    Grant,
    ModelPolicy,
    SharedSnapshot,
    StateStore,
    StoreStatistics,
)

__all__ = [
    "CancelOutcome",
    "Enqueued",
    "Grant",
    "LocalState",
    "MemoryStore",
    "ModelPolicy",
    "PolicyBook",
    "SchedulerState",
    "SharedScheduler",
    "SharedSnapshot",
    "StateStatistics",
    "StateStore",
    "StoreStatistics",
    "open_state",
    "open_store",
]


class SchedulerState(Protocol):
    """What the service holds: the scheduler, and the hooks a shared one needs."""

    @property
    def scheduler(self) -> FairScheduler | SharedScheduler: ...

    def start(self) -> None: ...

    def on_snapshot(self, model: str, snapshot: BackendSnapshot) -> None: ...

    async def aclose(self) -> None: ...


class LocalState:
    """`memory://`: the in-process scheduler; nothing to start, publish or disconnect."""

    def __init__(self, scheduler: FairScheduler) -> None:
        self._scheduler = scheduler

    @property
    def scheduler(self) -> FairScheduler:
        return self._scheduler

    def start(self) -> None:
        return None

    def on_snapshot(self, model: str, snapshot: BackendSnapshot) -> None:
        return None

    async def aclose(self) -> None:
        return None


def open_store(url: str, *, prefix: str = "fair_sched:") -> StateStore:
    """A store for a `redis://` or `rediss://` URL (imports redis only here)."""
    if url.startswith(("redis://", "rediss://")):
        from .redis_store import RedisStore

        return RedisStore(url, prefix=prefix)
    raise ValueError(f"no shared state store for {url!r}; use redis:// or rediss://")


def open_state(
    url: str,
    tiers: tuple[TierLimits, ...],
    gate: MetricsGate,
    make_local: Callable[[], FairScheduler],
    *,
    fairness: str,
    stale_after_s: float,
    unknown_max_inflight: int,
    max_per_user: int,
    max_total: int,
    max_wait_s: float,
    prefix: str = "fair_sched:",
    heartbeat_s: float = 1.0,
    lease_ttl_s: float = 10.0,
    store: StateStore | None = None,
) -> SchedulerState:
    """The scheduler for `fair_sched.state`; `make_local()` builds the in-process one."""
    local = make_local()
    if url.startswith("memory://") and store is None:
        return LocalState(local)
    policies = PolicyBook(
        tiers,
        gate.groups(),
        fairness=fairness,
        stale_after_s=stale_after_s,
        unknown_max_inflight=unknown_max_inflight,
        max_per_user=max_per_user,
        max_total=max_total,
        lease_ttl_s=lease_ttl_s,
    )
    return SharedScheduler(
        store or open_store(url, prefix=prefix),
        policies,
        local,
        max_wait_s=max_wait_s,
        heartbeat_s=heartbeat_s,
        lease_ttl_s=lease_ttl_s,
    )
