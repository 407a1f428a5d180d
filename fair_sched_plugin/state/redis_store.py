"""The Redis state store: every update one Lua script (`lua/*.lua`), so replicas never race.

Imported only when `state:` names Redis; needs the `redis` extra. Each script is `common.lua`
followed by the operation's own file; redis-py runs it by SHA and reloads it after a Redis
restart. Grants for other replicas are pushed onto per-replica lists, which each replica's
listener waits on with BLPOP on its own connection (no polling). Standalone Redis only: the scripts
derive keys from the prefix, which Redis Cluster does not allow.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis.asyncio as redis_asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from ..core.ticket import Ticket
from ..errors import StateStoreError
from .store import (
    CancelOutcome,
    Enqueued,
    Grant,
    ModelPolicy,
    SharedSnapshot,
    StoreStatistics,
    parse_grant,
)

_SCRIPTS = ("enqueue", "release", "started", "end", "cancel", "snapshot", "heartbeat", "stats")
_EMPTY_POLICY = ModelPolicy(tiers=())


def load_script(name: str) -> str:
    """`common.lua` + `<name>.lua`, read from the package's resource files."""
    folder = resources.files(__package__).joinpath("lua")
    common = folder.joinpath("common.lua").read_text(encoding="utf-8")
    return common + "\n" + folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")


class RedisStore:
    """`StateStore` on Redis (`redis://host:port/db`, `rediss://` for TLS)."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "fair_sched:",
        timeout_s: float = 1.0,
        block_s: float = 1.0,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self._block_s = block_s
        # Fail fast: a replica that cannot reach Redis falls back to local scheduling rather
        # than stalling its requests behind retries.
        common: dict[str, Any] = {
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": True,
        }
        self._redis = redis_asyncio.Redis.from_url(url, socket_timeout=timeout_s, **common)
        # BLPOP holds its connection for up to `block_s`: a separate client, so it never takes a
        # connection the scripts need, and a longer socket timeout than the block.
        self._blocking = redis_asyncio.Redis.from_url(
            url, socket_timeout=block_s + timeout_s, **common
        )
        self._scripts = {name: self._redis.register_script(load_script(name)) for name in _SCRIPTS}

    # ------------------------------------------------------------------ primitives

    async def enqueue(
        self, replica: str, ticket: Ticket, policy: ModelPolicy, now: float
    ) -> Enqueued:
        reply = await self._run(
            "enqueue",
            replica,
            now,
            policy,
            ticket.model,
            ticket.tier,
            ticket.user,
            repr(float(ticket.weight)),
            str(ticket.cost),
        )
        if reply[0] == "full":
            return Enqueued(None, [], full=reply[1])
        return Enqueued(reply[1], [parse_grant(raw) for raw in reply[2:]])

    async def release(
        self, replica: str, model: str, policy: ModelPolicy, now: float
    ) -> list[Grant]:
        return _grants(await self._run("release", replica, now, policy, model))

    async def started(
        self, replica: str, model: str, lease_id: int, policy: ModelPolicy, now: float
    ) -> list[Grant]:
        return _grants(await self._run("started", replica, now, policy, model, str(lease_id)))

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
    ) -> list[Grant]:
        tokens = -1 if tokens_used is None else max(0, tokens_used)
        reply = await self._run(
            "end",
            replica,
            now,
            policy,
            model,
            str(lease_id),
            str(tokens),
            "1" if abandoned else "0",
        )
        return _grants(reply)

    async def cancel(self, replica: str, ticket_id: str, now: float) -> CancelOutcome:
        reply = await self._run("cancel", replica, now, _EMPTY_POLICY, ticket_id)
        if reply[0] == "granted":
            return CancelOutcome("granted", int(reply[1]), reply[2])
        return CancelOutcome(reply[0])

    async def publish_snapshot(
        self, replica: str, model: str, snapshot: SharedSnapshot, policy: ModelPolicy, now: float
    ) -> list[Grant]:
        fields = {k: v for k, v in snapshot._asdict().items() if k != "url" and v is not None}
        reply = await self._run(
            "snapshot", replica, now, policy, model, snapshot.url, json.dumps(fields)
        )
        return _grants(reply)

    async def heartbeat(self, replica: str, now: float, ttl_s: float) -> list[str]:
        reply = await self._run("heartbeat", replica, now, _EMPTY_POLICY, repr(float(ttl_s)))
        return [str(model) for model in reply]

    async def next_grants(self, replica: str, timeout_s: float) -> list[Grant]:
        key = f"{self.prefix}r#{len(replica)}:{replica}:grants"
        try:
            first = await self._blocking.blpop([key], timeout=min(timeout_s, self._block_s))
            if first is None:
                return []
            rest = await self._blocking.lpop(key, 1000) or []
        except RedisError as exc:
            raise StateStoreError(f"redis {self.url}: waiting for grants failed: {exc}") from exc
        return [parse_grant(raw) for raw in [first[1], *rest]]

    async def statistics(self, tiers: Sequence[str]) -> StoreStatistics:
        reply = await self._run("stats", "-", 0.0, _EMPTY_POLICY, json.dumps(list(tiers)))
        queued, replicas = int(reply[0]), int(reply[1])
        by_tier: dict[tuple[str, str], int] = {}
        in_flight: dict[str, int] = {}
        pending: dict[str, int] = {}
        index = 2
        while index < len(reply):
            model = reply[index]
            in_flight[model] = int(reply[index + 2])
            pending[model] = int(reply[index + 3])
            count = int(reply[index + 4])
            index += 5
            for _ in range(count):
                if int(reply[index + 1]):
                    by_tier[(model, reply[index])] = int(reply[index + 1])
                index += 2
        return StoreStatistics(
            queued=queued,
            replicas=replicas,
            queued_by_model_tier=by_tier,
            in_flight_by_model={m: n for m, n in in_flight.items() if n},
            pending_by_model={m: n for m, n in pending.items() if n},
        )

    async def ping(self) -> None:
        """Is Redis reachable? Idle pooled connections are dropped first: after a Redis restart
        they are dead, and the first script after a recovery must not land on one."""
        try:
            await self._redis.connection_pool.disconnect(inuse_connections=False)
            await self._blocking.connection_pool.disconnect(inuse_connections=False)
            await self._redis.ping()
        except RedisError as exc:
            raise StateStoreError(f"redis {self.url}: ping failed: {exc}") from exc

    async def aclose(self) -> None:
        await self._redis.aclose()
        await self._blocking.aclose()

    # ------------------------------------------------------------------ internals

    async def _run(
        self, name: str, replica: str, now: float, policy: ModelPolicy, *args: str
    ) -> list[Any]:
        try:
            reply = await self._scripts[name](
                args=[self.prefix, replica, repr(float(now)), policy.as_json, *args]
            )
        except RedisError as exc:
            raise StateStoreError(f"redis {self.url}: {name} failed: {exc}") from exc
        return list(reply)


def _grants(reply: list[Any]) -> list[Grant]:
    return [parse_grant(raw) for raw in reply]
