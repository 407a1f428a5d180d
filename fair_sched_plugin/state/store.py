"""The shared-state interface: a few async primitives the shared scheduler is built on.

Every primitive is atomic in the store (one Lua script in Redis, one uninterrupted method in
memory), and every one that can open capacity also runs the release decision before returning,
so two replicas can never spend the same credit. Times are wall-clock seconds (`time.time()`),
the only clock several machines share; replicas' clocks must be synchronised (NTP), as skew adds
to the gate's staleness and arrival-grace windows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Protocol

from ..core.ticket import Ticket, TierLimits


class Grant(NamedTuple):
    """A queued ticket was released: its lease id and the fairness charge it carries."""

    ticket_id: str
    lease_id: int
    charged: float
    model: str


class Enqueued(NamedTuple):
    """`ticket_id` is None when a cap was reached (`full` says which: "user" or "total")."""

    ticket_id: str | None
    grants: list[Grant]
    full: str | None = None


class CancelOutcome(NamedTuple):
    """`state` is "cancelled", "gone" (unknown or expired) or "granted" (then `lease_id`)."""

    state: str
    lease_id: int | None = None
    model: str | None = None


class SharedSnapshot(NamedTuple):
    """One deployment's scrape, as published to the other replicas (wall-clock `started_at`)."""

    url: str
    started_at: float
    waiting: float
    running: float
    tpot_s: float | None = None
    kv_usage: float | None = None


class StoreStatistics(NamedTuple):
    queued: int
    replicas: int
    queued_by_model_tier: Mapping[tuple[str, str], int]
    in_flight_by_model: Mapping[str, int]
    pending_by_model: Mapping[str, int]


@dataclass(frozen=True)
class ModelPolicy:
    """Everything a release decision for one model needs: tiers, fairness, gate and caps."""

    tiers: tuple[TierLimits, ...]
    fairness: str = "round_robin"
    metrics_urls: tuple[str, ...] = ()
    arrival_grace_s: float = 0.3
    stale_after_s: float = 1.0
    fallback_max_inflight: int = 4  # per deployment, while metrics are missing or stale
    unknown_max_inflight: int = 64  # models without metrics URLs
    max_per_user: int = 1000
    max_total: int = 100_000
    lease_ttl_s: float = 10.0

    @cached_property
    def as_json(self) -> str:
        """The policy as the Lua scripts read it (computed once)."""
        tiers = []
        for tier in self.tiers:
            entry: dict[str, object] = {"name": tier.name, "waiting_below": tier.waiting_below}
            if tier.tpot_below_s is not None:
                entry["tpot_below_s"] = tier.tpot_below_s
            if tier.kv_usage_below is not None:
                entry["kv_usage_below"] = tier.kv_usage_below
            tiers.append(entry)
        return json.dumps(
            {
                "tiers": tiers,
                "fairness": self.fairness,
                "urls": list(self.metrics_urls),
                "arrival_grace_s": self.arrival_grace_s,
                "stale_after_s": self.stale_after_s,
                "fallback_cap": self.fallback_max_inflight,
                "unknown_cap": self.unknown_max_inflight,
                "max_per_user": self.max_per_user,
                "max_total": self.max_total,
                "lease_ttl_s": self.lease_ttl_s,
            },
            separators=(",", ":"),
        )


class StateStore(Protocol):
    """Where queues, virtual times, leases and gate inputs live when replicas share them.

    `replica` names the calling process. Grants for the caller's own tickets are returned;
    grants for other replicas' tickets are delivered to them through `next_grants`.
    Failures raise `StateStoreError` (with the backend's exception as `__cause__`).
    """

    async def enqueue(
        self, replica: str, ticket: Ticket, policy: ModelPolicy, now: float
    ) -> Enqueued: ...

    async def release(
        self, replica: str, model: str, policy: ModelPolicy, now: float
    ) -> list[Grant]: ...

    async def started(
        self, replica: str, model: str, lease_id: int, policy: ModelPolicy, now: float
    ) -> list[Grant]: ...

    async def end(
        self,
        replica: str,
        model: str,
        lease_id: int,
        policy: ModelPolicy,
        now: float,
        *,
        tokens_used: int | None,
        abandoned: bool,
    ) -> list[Grant]: ...

    async def cancel(self, replica: str, ticket_id: str, now: float) -> CancelOutcome: ...

    async def publish_snapshot(
        self, replica: str, model: str, snapshot: SharedSnapshot, policy: ModelPolicy, now: float
    ) -> list[Grant]: ...

    async def heartbeat(self, replica: str, now: float, ttl_s: float) -> list[str]:
        """Mark `replica` alive; purge replicas silent for `ttl_s`. Returns the models touched."""
        ...

    async def next_grants(self, replica: str, timeout_s: float) -> list[Grant]:
        """Grants addressed to `replica` by other replicas; [] after `timeout_s` without any."""
        ...

    async def statistics(self, tiers: Sequence[str]) -> StoreStatistics: ...

    async def ping(self) -> None: ...

    async def aclose(self) -> None: ...


def parse_grant(raw: str) -> Grant:
    ticket_id, lease_id, charged, model = raw.split(" ", 3)
    return Grant(ticket_id, int(lease_id), float(charged), model)
