"""Redis as the replicas' meeting point: the leader lease, the leader's inbox, one reply list per
replica, the alive set and the leader's statistics document. No scheduling rule lives here.

Imported only when `state:` names Redis (the `redis` extra). Keys, all under the prefix:

- `leader`: the fenced lease, `"<epoch>:<replica>"` with a TTL; `epoch`: the counter behind it.
- `inbox`: a list every follower appends its messages to; the leader pops it (BLPOP).
- `r:<replica>`: a list of the leader's replies to that replica (BLPOP), expiring.
- `replicas`: a sorted set of replicas by liveness deadline (Redis's own clock), expiring.
- `stats`: the leader's statistics document, expiring.
- `budgets`: the leader's budget book (`BudgetBook.snapshot()` as JSON), expiring after the
  longest budget window, so spend survives every replica restarting.

Six short Lua scripts (`lua/*.lua`, keys passed explicitly) make the lease and its fencing
atomic; everything else is plain commands. Redis 6 or later (7 saves a round trip per wake-up
with BLMPOP), standalone or a primary.

Every key holds only the replicas' own transient state, so a corrupt value (another type, bytes
that are not UTF-8, a leader token that is not one, an epoch INCR refuses) is logged with its
key's name and replaced (or, for a message, skipped), never turned into a store outage: an
outage would switch the replica to local mode, and the next heartbeat back again, for good.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any, NamedTuple

import redis.asyncio as redis_asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from ..config import safe_url
from ..errors import StateStoreError
from .wire import corrupt_value, parse_token

_SCRIPTS = ("elect", "renew", "deliver", "resign", "heartbeat", "budgets")

# Most messages taken from a list in one round trip.
_BATCH = 1000


def load_script(name: str) -> str:
    folder = resources.files(__package__).joinpath("lua")
    return folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")


def _wrong_type(exc: BaseException) -> bool:
    return isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE")


class Beat(NamedTuple):
    """One heartbeat's view: who is alive, who leads (a valid token with a TTL, or None), the
    leader's document."""

    alive: list[str]
    leader: str | None
    statistics: str | None


class RedisLink:
    """The Redis side of one replica (`redis://host:port/db`, `rediss://` for TLS).

    Every failure raises `StateStoreError` (the RedisError as its cause). Blocking pops run on
    their own connections so they never hold one the other commands need.
    """

    def __init__(
        self,
        url: str,
        replica: str,
        *,
        prefix: str = "fair_sched:",
        ttl_s: float = 10.0,
        timeout_s: float = 1.0,
        block_s: float = 1.0,
    ) -> None:
        self.url = url
        self.replica = replica
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._ttl_ms = str(max(1, int(ttl_s * 1000)))
        self._block_s = block_s
        self._blmpop = True
        self.leader_key = f"{prefix}leader"
        self.epoch_key = f"{prefix}epoch"
        self.inbox_key = f"{prefix}inbox"
        self.replicas_key = f"{prefix}replicas"
        self.statistics_key = f"{prefix}stats"
        self.budgets_key = f"{prefix}budgets"
        # Fail fast: a replica that cannot reach Redis schedules locally rather than stalling
        # its requests behind retries.
        common: dict[str, Any] = {
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": True,
            # Bytes that are not UTF-8 become U+FFFD: a corrupt value, not a failed connection.
            "encoding_errors": "replace",
        }
        self._redis = redis_asyncio.Redis.from_url(url, socket_timeout=timeout_s, **common)
        blocking_timeout = block_s + timeout_s
        self._inbox_reader = redis_asyncio.Redis.from_url(
            url, socket_timeout=blocking_timeout, **common
        )
        self._reply_reader = redis_asyncio.Redis.from_url(
            url, socket_timeout=blocking_timeout, **common
        )
        self._scripts = {name: self._redis.register_script(load_script(name)) for name in _SCRIPTS}

    def replies_key(self, replica: str) -> str:
        return f"{self.prefix}r:{replica}"

    # ------------------------------------------------------------------ lease

    async def beat(self) -> Beat:
        """Mark this replica alive and read the lease and the statistics (one round trip)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                await self._scripts["heartbeat"](
                    keys=[self.replicas_key], args=[self.replica, self._ttl_ms], client=pipe
                )
                pipe.get(self.leader_key)
                pipe.pttl(self.leader_key)
                pipe.get(self.statistics_key)
                # Per command: a key of another type is that key's problem, not an outage.
                heartbeat, leader, leader_ttl_ms, statistics = await pipe.execute(
                    raise_on_error=False
                )
        except RedisError as exc:
            raise self._error("heartbeat", exc) from exc
        for reply in (heartbeat, leader, leader_ttl_ms, statistics):
            # heartbeat.lua replaces a `replicas` key of another type itself.
            if isinstance(reply, RedisError) and (reply is heartbeat or not _wrong_type(reply)):
                raise self._error("heartbeat", reply) from reply
        corrupt, alive = heartbeat
        if corrupt:
            corrupt_value(self.replicas_key, str(corrupt))
        if isinstance(statistics, RedisError):
            statistics = None
            corrupt_value(
                self.statistics_key, "not a string", "ignored it until the leader's next renewal"
            )
        return Beat([str(name) for name in alive], self._lease(leader, leader_ttl_ms), statistics)

    def _lease(self, leader: Any, ttl_ms: Any) -> str | None:
        """The leader token if it is a lease; None if nobody holds one (the next election
        replaces a corrupt value)."""
        if leader is None:
            return None
        elect = "the next election replaces it"
        if isinstance(leader, RedisError):
            corrupt_value(self.leader_key, "not a string", elect)
        elif parse_token(leader) is None:
            corrupt_value(self.leader_key, f"not a leader token: {leader[:40]!r}", elect)
        elif ttl_ms == -1:
            corrupt_value(self.leader_key, "a token without a TTL", elect)
        else:
            return str(leader)
        return None

    async def elect(self) -> str:
        """Take the lease if nobody holds a valid one; the holder's token either way."""
        token, *replaced = await self._run(
            "elect", [self.leader_key, self.epoch_key], [self.replica]
        )
        for name in replaced:
            key = self.leader_key if name == "leader" else self.epoch_key
            corrupt_value(key, "not a lease" if name == "leader" else "not a counter")
        return str(token)

    async def renew(self, token: str, statistics: str) -> bool:
        """Extend our lease and publish the statistics; False if the lease is not ours."""
        reply = await self._run(
            "renew", [self.leader_key, self.statistics_key], [token, statistics]
        )
        return bool(reply)

    async def resign(self, token: str) -> None:
        await self._run("resign", [self.leader_key], [token], with_ttl=False)

    # ------------------------------------------------------------------ budgets

    async def save_budgets(self, token: str, snapshot: str, ttl_s: float) -> bool:
        """Store the budget book's snapshot, fenced by our lease; False if it is not ours."""
        ttl_ms = str(max(1, int(ttl_s * 1000)))
        reply = await self._run(
            "budgets",
            [self.leader_key, self.budgets_key],
            [token, ttl_ms, snapshot],
            with_ttl=False,
        )
        return bool(reply)

    async def load_budgets(self) -> str | None:
        """The stored budget snapshot (None: none stored, or it expired)."""
        try:
            raw = await self._redis.get(self.budgets_key)
        except RedisError as exc:
            raise self._error("reading budgets", exc) from exc
        return None if raw is None else str(raw)

    # ------------------------------------------------------------------ messages

    async def send(self, messages: Sequence[str]) -> None:
        """Append to the leader's inbox (in order); the inbox expires if nobody leads."""
        for attempt in range(2):
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.rpush(self.inbox_key, *messages)
                    pipe.pexpire(self.inbox_key, int(self._ttl_ms))
                    await pipe.execute()
                return
            except RedisError as exc:
                if attempt or not _wrong_type(exc):
                    raise self._error("send", exc) from exc
                await self._replace(self.inbox_key, "not a list")

    async def deliver(self, token: str, replies: Mapping[str, Sequence[str]]) -> bool:
        """Append each replica's replies, fenced by our lease (one script call for all);
        False if the lease is no longer ours."""
        keys = [self.leader_key, *(self.replies_key(replica) for replica in replies)]
        counts = [str(len(messages)) for messages in replies.values()]
        messages = [message for batch in replies.values() for message in batch]
        fenced, *replaced = await self._run("deliver", keys, [token, *counts, *messages])
        for key in replaced:
            corrupt_value(str(key), "not a list")
        return bool(fenced)

    async def next_inbox(self) -> list[str]:
        """The leader's next messages; [] after `block_s` without any."""
        return await self._pop(self._inbox_reader, self.inbox_key)

    async def next_replies(self) -> list[str]:
        """This replica's next replies from the leader; [] after `block_s` without any."""
        return await self._pop(self._reply_reader, self.replies_key(self.replica))

    async def aclose(self) -> None:
        for client in (self._redis, self._inbox_reader, self._reply_reader):
            await client.aclose()

    async def reset_connections(self) -> None:
        """Drop every pooled connection (dead after a Redis restart) before trying again."""
        for client in (self._redis, self._inbox_reader, self._reply_reader):
            await client.connection_pool.disconnect()

    # ------------------------------------------------------------------ internals

    async def _pop(self, client: redis_asyncio.Redis, key: str) -> list[str]:
        try:
            if self._blmpop:
                # Redis 7: block for the first message and take what else is there, at once.
                try:
                    reply = await client.blmpop(
                        self._block_s, 1, key, direction="LEFT", count=_BATCH
                    )
                except ResponseError as exc:
                    if _wrong_type(exc):
                        await self._replace(key, "not a list")
                    else:
                        self._blmpop = False  # Redis 6: BLPOP, then the rest in one transaction
                    return []
                return [str(message) for message in reply[1]] if reply else []
            try:
                first = await client.blpop([key], timeout=self._block_s)
            except ResponseError as exc:
                if not _wrong_type(exc):
                    raise
                await self._replace(key, "not a list")
                return []
            if first is None:
                return []
            async with client.pipeline(transaction=True) as pipe:
                pipe.lrange(key, 0, _BATCH - 1)
                pipe.ltrim(key, _BATCH, -1)
                rest, _ = await pipe.execute()
        except RedisError as exc:
            raise self._error(f"reading {key}", exc) from exc
        return [str(first[1]), *(str(message) for message in rest)]

    async def _replace(self, key: str, what: str) -> None:
        """Delete a transient key that holds another type (its next write recreates it)."""
        corrupt_value(key, what)
        try:
            await self._redis.delete(key)
        except RedisError as exc:
            raise self._error(f"replacing {key}", exc) from exc

    async def _run(
        self, name: str, keys: list[str], args: list[str], *, with_ttl: bool = True
    ) -> Any:
        if with_ttl:
            args = [args[0], self._ttl_ms, *args[1:]]
        try:
            return await self._scripts[name](keys=keys, args=args)
        except RedisError as exc:
            raise self._error(name, exc) from exc

    def _error(self, what: str, exc: RedisError) -> StateStoreError:
        # Without the password a `redis://:secret@host` URL carries (the error may be logged).
        return StateStoreError(f"redis {safe_url(self.url)}: {what} failed: {exc}")
