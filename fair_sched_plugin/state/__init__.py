"""Where the deciding scheduler runs: in this process (`memory://`), or in the one replica that
holds the leader lease in Redis (`redis://`, `rediss://`; the `redis` extra).

Either way the decisions are the core's (`FairScheduler` + `MetricsGate`); Redis only carries
tickets, grants and the leader lease between replicas. See `replica.py`, `redis_replica.py`
and docs/redis.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from ..core.backpressure import MetricsGate
from ..runtime.driver import FairScheduler
from .replica import LocalScheduler, ReplicaScheduler, StateMode, StateStatistics

__all__ = ["LocalScheduler", "ReplicaScheduler", "StateMode", "StateStatistics", "open_state"]


def open_state(
    url: str,
    core: FairScheduler,
    gate: MetricsGate | None = None,
    *,
    prefix: str = "fair_sched:",
    heartbeat_s: float = 1.0,
    lease_ttl_s: float = 10.0,
    replica: str | None = None,
    model_groups: Sequence[tuple[str, Sequence[str]]] = (),
) -> ReplicaScheduler:
    """The replica scheduler for `fair_sched.state` over `core` (imports redis only for Redis).

    `model_groups`: (name, models) of each group that elects its own leader (`groups.py`); the
    first is the home group (budgets, and every model no group names). With none or one, one
    leader decides for every model, on the keys directly under `prefix`."""
    if url.startswith("memory://"):
        return LocalScheduler(core, gate, replica=replica)
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"no shared state for {url!r}; use memory://, redis:// or rediss://")
    if lease_ttl_s < 2 * heartbeat_s:
        raise ValueError("lease_ttl_s must be at least twice heartbeat_s")
    from .groups import ModelGroups
    from .redis_link import RedisLink
    from .redis_replica import RedisReplica, Spread

    name = replica or uuid.uuid4().hex[:12]

    def member(group_prefix: str, spread: Spread | None = None) -> RedisReplica:
        link = RedisLink(url, name, prefix=group_prefix, ttl_s=lease_ttl_s, block_s=heartbeat_s)
        return RedisReplica(core, gate, link=link, heartbeat_s=heartbeat_s, spread=spread)

    if len(model_groups) < 2:
        return member(prefix)
    return ModelGroups(
        core,
        gate,
        replica=name,
        groups=[(group, tuple(models)) for group, models in model_groups],
        member=lambda group, spread: member(f"{prefix}g:{group}:", spread),
        tenure_s=lease_ttl_s,
        heartbeat_s=heartbeat_s,
    )
