"""A replica on Redis (`redis://`, `rediss://`): the leader lease decides whose core decides.

Each heartbeat a replica marks itself alive and reads who holds the lease. The holder leads: it
opens a term over its own core, reads every follower's messages from the inbox into it and
delivers the term's replies (fenced by the lease). The others follow: their requests travel to
the leader as messages (`ReplicaScheduler` relays them) and its replies come back on their own
list. A new epoch makes every replica re-send what it has. When Redis fails, the replica runs a
local term over its own core with 1/n of the engine's thresholds until Redis answers again, then
rejoins with a new session. Its gate keeps that share until every replica it shared with has
rejoined too (or a hold and a lease TTL passed): one still local spends its share meanwhile.

Only the heartbeat decides these transitions; the other loops only move messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any, Protocol

from ..core.backpressure import MetricsGate
from ..errors import StateStoreError
from ..runtime.driver import FairScheduler
from .replica import LOCAL_EPOCH, NO_EPOCH, ReplicaScheduler
from .term import Term
from .wire import (
    Inbound,
    Reply,
    corrupt_value,
    parse_reply,
    parse_token,
    read_message,
    read_published,
    shown,
    statistics_document,
)

if TYPE_CHECKING:  # redis is an optional extra: imported only by `open_state` for redis://
    from .redis_link import Beat, RedisLink

logger = logging.getLogger("fair_sched")


class Spread(Protocol):
    """How a replica's model groups (`groups.py`) spread their leases over the live replicas."""

    def saw_alive(self, group: RedisReplica) -> None:
        """`group`'s heartbeat reached Redis and read the replicas alive."""
        ...

    def may_contend(self, group: RedisReplica) -> bool:
        """False while this replica already leads its share of the groups: it lets a free
        lease wait a little for a replica that leads fewer."""
        ...

    def hand_over(self, group: RedisReplica) -> bool:
        """True when this replica leads more groups than another live one by two or more: it
        resigns `group`'s lease so that one takes it."""
        ...

    def shares_changed(self) -> None:
        """A group went local or rejoined: the replica's one gate spends the smallest share
        any of its groups needs (`RedisReplica.local_sharers`)."""
        ...


class RedisReplica(ReplicaScheduler):
    """A `ReplicaScheduler` whose acting leader is whichever replica holds the lease in Redis,
    plus the heartbeat and message loops (`start`/`aclose` run them)."""

    def __init__(
        self,
        core: FairScheduler,
        gate: MetricsGate | None,
        *,
        link: RedisLink,
        heartbeat_s: float = 1.0,
        spread: Spread | None = None,
    ) -> None:
        if gate is not None:
            gate.ends_arrive_out_of_step()
        super().__init__(core, gate, replica=link.replica)
        self._link: RedisLink | None = link
        self._heartbeat_s = heartbeat_s
        self._mode = "shared"
        self._token: str | None = None  # our leader lease, while we hold it
        self._ended_token: str | None = None  # the lease of our last term, once it ended
        self._resigning: str | None = None  # the lease to hand back once closed
        self._outbox: list[str] = []
        self._outbox_ready = asyncio.Event()
        self._outgoing: dict[str, list[str]] = {}
        self._outgoing_ready = asyncio.Event()
        self._barriers: dict[int, asyncio.Future[None]] = {}
        self._loops: list[asyncio.Task[Any]] = []
        self._leading: list[asyncio.Task[Any]] = []
        self._hold: asyncio.TimerHandle | None = None
        # Led, followed or ran a local term before (see `_lead`).
        self._took_part = False
        self._spread = spread
        # When this replica first saw the lease free and let it wait (`Spread.may_contend`).
        self._free_since: float | None = None
        self.led_since: float | None = None
        # 1 while shared; in local mode the replicas whose threshold this one shares, and after
        # rejoining until they are back (`_awaiting`, see `_rejoin`).
        self.local_sharers = 1
        self._sharing_with: set[str] = set()
        self._awaiting: set[str] = set()
        self._awaiting_until = 0.0

    @property
    def coordinated(self) -> bool:
        return True

    @property
    def leading(self) -> bool:
        return self._token is not None and self._term is not None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the heartbeat, the sender and the reply listener. Idempotent."""
        if self._closed or self._link is None or self._loops:
            return
        loop = asyncio.get_running_loop()
        self._loops = [
            loop.create_task(self._tick(), name="fair-sched-state-tick"),
            loop.create_task(self._send_loop(), name="fair-sched-state-send"),
            loop.create_task(self._reply_loop(), name="fair-sched-state-replies"),
        ]

    async def aclose(self) -> None:
        """Close, send what is still queued for the leader (briefly), step down, disconnect."""
        self.close()
        token = self._resigning
        if self._link is None:
            return
        await asyncio.sleep(0)
        with contextlib.suppress(StateStoreError, asyncio.TimeoutError):
            await asyncio.wait_for(self._flush_outbox(), 2.0)
        tasks = [*self._loops, *self._leading]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if token is not None:
            if self._budgets is not None:
                with contextlib.suppress(StateStoreError):
                    await self._budgets.save(self._link, token)
            with contextlib.suppress(StateStoreError):
                await self._link.resign(token)
        await self._link.aclose()

    def _resign(self) -> None:
        if self._term is not None and self._token is not None:
            self._resigning = self._token
            self._close_term()

    async def barrier(self) -> None:
        if self._term is not None or self._epoch == NO_EPOCH:
            await super().barrier()
            return
        nonce = next(self._tids)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers[nonce] = future
        self._tell("p", nonce)
        try:
            await future
        finally:
            self._barriers.pop(nonce, None)

    # ------------------------------------------------------------------ terms

    def _on_reply(self, reply: Reply) -> None:
        kind, epoch = reply[0], reply[1]
        if kind == "h":
            if epoch > self._epoch and self._term is None:
                self._follow(epoch, reply[3])
            return
        if kind == "p":
            if epoch == self._epoch and reply[2] == self._session:
                barrier = self._barriers.get(reply[3])
                if barrier is not None and not barrier.done():
                    barrier.set_result(None)
            return
        super()._on_reply(reply)

    def _resend(self) -> None:
        self._outbox.clear()  # addressed to the leader before: re-sent now
        super()._resend()

    def _open_term(self, epoch: int, *, hold: bool) -> None:
        """Decide from now on. `hold`: grant nothing new until a scrape can show what an
        earlier leader (or the other replicas) released just before; running leases are
        adopted at once, queued tickets wait for the hold to end."""
        term = Term(self._core, epoch, self._reply)
        if hold:
            term.holding = True
            self._hold = asyncio.get_running_loop().call_later(self._hold_s(), term.end_hold)
        self._decide(term)

    def _close_term(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        term, self._term = self._term, None
        if term is not None:
            term.drain()
        if self._token is not None:
            self._ended_token = self._token
        self._token = None
        self._leader = None
        self._epoch = NO_EPOCH
        self._outgoing.clear()
        for task in self._leading:
            task.cancel()
        self._leading = []

    def _hold_s(self) -> float:
        graces = (
            [group.arrival_grace_s for group in self._gate.groups().values()] if self._gate else []
        )
        return self._heartbeat_s + max(graces, default=0.0)

    def _reply(self, replica: str, reply: Reply) -> None:
        if replica == self.replica:
            self._on_reply(reply)
            return
        self._outgoing.setdefault(replica, []).append(json.dumps(reply))
        self._outgoing_ready.set()

    def _follow(self, epoch: int, leader: str) -> None:
        """A new leader (not us): re-send everything to it."""
        self._took_part = True
        self._epoch = epoch
        self._leader = leader
        self._resend()

    def _lead(self, token: str, epoch: int) -> None:
        # The first leader of a fresh cluster (epoch 1, and we never took part in a term) has
        # nothing to wait for; any other waits for the others' running leases (and a scrape)
        # before granting. Epoch 1 is not enough: a Redis restarted without persistence counts
        # from 1 again while the other replicas still spend their local shares.
        self._close_term()
        self._token = token
        self._free_since = None
        self.led_since = asyncio.get_running_loop().time()
        self._open_term(epoch, hold=epoch > 1 or self._took_part)
        self._took_part = True
        logger.info("fair_sched replica %s leads (epoch %d)", self.replica, epoch)
        loop = asyncio.get_running_loop()
        self._leading = [
            loop.create_task(self._inbox_loop(token, epoch), name="fair-sched-leader-inbox"),
            loop.create_task(self._deliver_loop(token), name="fair-sched-leader-deliver"),
        ]
        for replica in self._alive:
            if replica != self.replica:
                self._reply(replica, ("h", epoch, 0, self.replica))

    def _step_down(self, why: str) -> None:
        if self._token is None:
            return
        logger.warning("fair_sched replica %s no longer leads: %s", self.replica, why)
        self._close_term()

    def _rejoin(self) -> None:
        self._counters["recoveries"] += 1
        logger.warning(
            "fair_sched state store is back: replica %s schedules with the others again",
            self.replica,
        )
        self._close_term()  # the local one: our leases and tickets go to the shared leader
        self._session += 1  # replies addressed to the session before the outage are stale
        self._mode = "shared"
        # The others may still be local, each spending its share: a leader with the whole
        # threshold beside them put one more into the engine's queue than it allows (issue
        # #36, after the new leader's hold). The share stays until each has rejoined (it sent
        # our term a message: a follower re-sends its leases and tickets first) or a lease TTL
        # passed after a leader's hold (silent for that long, a replica counts as gone; or it
        # had nothing to re-send, so nothing of its own on the way to an engine either).
        self._awaiting = self._sharing_with - {self.replica}
        wait_s = self._hold_s() + self._ttl_s()
        self._awaiting_until = asyncio.get_running_loop().time() + wait_s
        self._back_in_full()

    def _back_in_full(self) -> None:
        """Spend the whole threshold again once nobody we shared it with may still be local."""
        if self._mode != "shared" or self.local_sharers == 1:
            return
        if self._term is not None:
            self._awaiting -= self._term.heard_from()
        if self._awaiting and asyncio.get_running_loop().time() < self._awaiting_until:
            return
        self._awaiting.clear()
        self._share(1)

    def _ttl_s(self) -> float:
        return self._link.ttl_s if self._link is not None else self._heartbeat_s

    def _store_failed(self, exc: StateStoreError) -> None:
        self._counters["store_errors"] += 1
        if self._mode == "local" or self._closed:
            return
        self._mode = "local"
        self._counters["fallbacks"] += 1
        # Those seen alive, and any we still wait for after an earlier outage: the first
        # heartbeats on a Redis restarted empty see only the replicas back so far.
        self._sharing_with = set(self._alive) | self._awaiting | {self.replica}
        sharers = max(len(self._sharing_with), self.local_sharers)
        logger.warning(
            "fair_sched state store unavailable (%s): replica %s falls back to in-memory "
            "scheduling with 1/%d of each engine threshold until it is back",
            exc,
            self.replica,
            sharers,
        )
        self._close_term()
        self._share(sharers)
        self._took_part = True
        self._open_term(LOCAL_EPOCH, hold=True)

    def _share(self, sharers: int) -> None:
        self.local_sharers = sharers
        if self._spread is not None:
            self._spread.shares_changed()
        elif self._gate is not None:
            self._gate.share_with(sharers)

    # ------------------------------------------------------------------ the heartbeat

    async def _tick(self) -> None:
        # Not only cancellation: redis-py may turn a cancel into its own timeout error.
        while not self._closed:
            try:
                await self._beat()
            except Exception:
                # A bug must not stop the heartbeat (the lease would lapse for good).
                logger.exception("fair_sched replica %s: heartbeat failed", self.replica)
            await asyncio.sleep(self._heartbeat_s)

    async def _beat(self) -> None:
        link = self._link
        assert link is not None
        try:
            if self._mode == "local":
                await link.reset_connections()
            beat = await link.beat()
            if self._mode == "local":
                self._rejoin()
            await self._after_beat(link, beat)
            self._back_in_full()
            if self._budgets is not None and self._mode == "shared":
                await self._budgets.sync(link, self._token)
        except StateStoreError as exc:
            self._store_failed(exc)

    async def _after_beat(self, link: RedisLink, beat: Beat) -> None:
        self._alive = beat.alive or [self.replica]
        if self._spread is not None:
            self._spread.saw_alive(self)
        self._published = None
        if beat.statistics:
            try:
                self._published = read_published(beat.statistics)
            except ValueError as exc:
                # Not the leader's document: reported as our own until its next renewal.
                corrupt_value(
                    link.statistics_key,
                    f"not a statistics document ({exc}): {beat.statistics[:40]!r}",
                )
        if self._token is not None:
            if beat.leader != self._token:
                self._step_down(f"the lease is now {beat.leader!r}")
            elif not await link.renew(self._token, self._document()):
                self._step_down("the lease was taken while renewing it")
            elif self._term is not None:
                for replica in self._term.replicas() - set(self._alive) - {self.replica}:
                    logger.warning(
                        "fair_sched replica %s went silent: its requests dropped", replica
                    )
                    self._term.drop_replica(replica)
            if self._token is not None:
                if self._spread is not None and self._spread.hand_over(self):
                    await self._hand_over(link)
                return
        if beat.leader is None and not self._contends():
            return
        self._free_since = None
        token = beat.leader or await link.elect()
        parsed = parse_token(token)
        if parsed is None:  # elect.lua and parse_token disagree: wait for the next heartbeat
            corrupt_value(link.leader_key, f"not a leader token: {token[:40]!r}")
            return
        epoch, leader = parsed
        if leader == self.replica:
            if self._token != token and token == self._ended_token:
                # Our term of this lease ended (we fell back to a local term and are back
                # before its TTL): the others still follow its epoch, so they would re-send
                # nothing to a new term of it, their tickets left in the old one for good and
                # their grants on the way to an engine uncounted. A new epoch makes them.
                if self._budgets is not None:
                    await self._budgets.save(link, token)  # as a handover does
                await link.resign(token)
            elif self._token != token:
                self._lead(token, epoch)
                await link.renew(token, self._document())
        elif epoch != self._epoch:
            self._follow(epoch, leader)

    def _contends(self) -> bool:
        """Whether to take a free lease now: at once, unless this replica already leads its
        share of the groups; then after two more heartbeats (nobody who leads fewer took it)."""
        if self._spread is None or self._spread.may_contend(self):
            return True
        now = asyncio.get_running_loop().time()
        if self._free_since is None:
            self._free_since = now
        return now - self._free_since >= 2 * self._heartbeat_s

    async def _hand_over(self, link: RedisLink) -> None:
        """Resign this group's lease so a replica that leads fewer takes it at its next
        heartbeat: a failover without the TTL (every replica re-sends to the new leader)."""
        token = self._token
        assert token is not None
        logger.info("fair_sched replica %s hands its lease %s over", self.replica, token)
        self._close_term()
        if self._budgets is not None:
            await self._budgets.save(link, token)
        await link.resign(token)

    def _document(self) -> str:
        gate = self._gate.status() if self._gate else []
        return statistics_document(
            self.replica, self._epoch, len(self._alive), self.statistics(), gate, self.fairness()
        )

    # ------------------------------------------------------------------ messages: every replica

    def _send(self, message: list[Any]) -> None:
        if self._epoch == NO_EPOCH or (self._closed and message[0] not in "ce"):
            return
        self._outbox.append(json.dumps(message))
        self._outbox_ready.set()

    async def _flush_outbox(self) -> None:
        assert self._link is not None
        while self._outbox:
            batch, self._outbox = self._outbox, []
            await self._link.send(batch)

    async def _send_loop(self) -> None:
        # Not only cancellation: redis-py may turn a cancel into its own timeout error.
        while not self._closed:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            if self._mode != "shared":
                self._outbox.clear()
                continue
            try:
                await self._flush_outbox()
            except StateStoreError as exc:
                self._store_failed(exc)

    async def _reply_loop(self) -> None:
        assert self._link is not None
        # Not only cancellation: redis-py may turn a cancel into its own timeout error.
        while not self._closed:
            if self._mode != "shared":
                await asyncio.sleep(self._heartbeat_s)
                continue
            try:
                raw = await self._link.next_replies()
            except StateStoreError as exc:
                self._store_failed(exc)
                continue
            for message in raw:
                try:
                    reply = parse_reply(message)
                except ValueError as exc:
                    logger.warning(
                        "fair_sched replica %s skipped a malformed reply in Redis key %s (%.80s)",
                        self.replica,
                        self._link.replies_key(self.replica),
                        exc,
                    )
                    continue
                self._on_reply(reply)

    # ------------------------------------------------------------------ messages: the leader

    async def _inbox_loop(self, token: str, epoch: int) -> None:
        assert self._link is not None
        while self._token == token and not self._closed:
            try:
                raw = await self._link.next_inbox()
            except StateStoreError as exc:
                self._store_failed(exc)
                return
            term = self._term
            if term is None or term.epoch != epoch:
                return
            for message in raw:
                try:
                    inbound = read_message(message, self._core.tiers)
                except ValueError as exc:
                    # Not from a replica of this version: skip it, keep leading.
                    logger.warning(
                        "fair_sched leader skipped a malformed message in Redis key %s (%.80s)",
                        self._link.inbox_key,
                        exc,
                    )
                    continue
                try:
                    self._handle(term, inbound)
                except Exception:
                    # A bug must not end the inbox loop: every follower would wait for good
                    # on a leader that keeps renewing its lease.
                    logger.exception(
                        "fair_sched leader failed on a %r message from replica %s",
                        inbound.kind,
                        shown(inbound.replica),
                    )
            if self._awaiting:
                self._back_in_full()  # the replicas that just joined may be the last ones

    def _handle(self, term: Term, message: Inbound) -> None:
        """One follower's message, read and checked by `read_message`."""
        if message.kind != "$":
            term.handle(message)
        elif self._budgets is not None:
            # A fact, not a request: counted whatever epoch it was sent in.
            principal, usd, tokens = message.body
            self._budgets.spend(principal, usd=usd, tokens=tokens)

    async def _deliver_loop(self, token: str) -> None:
        assert self._link is not None
        while self._token == token and not self._closed:
            await self._outgoing_ready.wait()
            self._outgoing_ready.clear()
            if not self._outgoing:
                continue
            batch, self._outgoing = self._outgoing, {}
            try:
                fenced = await self._link.deliver(token, batch)
            except StateStoreError as exc:
                self._store_failed(exc)
                return
            if not fenced:
                self._step_down("another replica holds the lease")
                return
