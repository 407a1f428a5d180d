"""A leadership term: the acting leader's core with every replica's tickets and leases in it,
keyed by (replica, session, ticket id). Only the replica that decides holds one: a replica on
its own for good, the Redis leader for its lease, a replica cut off from Redis until it is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..core.reads import SchedulerStatistics
from ..core.ticket import Lease, Ticket
from ..errors import DeadlineUnreachable, QueueFull, Rejected
from ..runtime.driver import FairScheduler, Reservation
from .wire import Inbound, Key, Reply, grant, rejection, shown, usage_in_range

logger = logging.getLogger("fair_sched")


class Term:
    """One leadership term over the core: every replica's tickets and leases in it.

    `reply(replica, message)` carries grants and rejections back. A term ends with `drain()`:
    its tickets leave the core without a reply (their replicas re-send them to the next acting
    leader) and its leases end unused.
    """

    def __init__(
        self, core: FairScheduler, epoch: int, reply: Callable[[str, Reply], None]
    ) -> None:
        self.core = core
        self.epoch = epoch
        self._reply = reply
        self.reservations: dict[Key, Reservation] = {}
        self.leases: dict[Key, Lease] = {}
        self._cancelled: set[Key] = set()
        self._sessions: dict[str, int] = {}
        self.over = False
        # While holding, tickets wait here (in arrival order) instead of in the core.
        self.holding = False
        self._held_back: dict[Key, Ticket] = {}
        self._callbacks_pending = 0

    # ------------------------------------------------------------------ from replicas

    def handle(self, message: Inbound) -> None:
        """A follower's message from the inbox, read and checked by `read_message` (a spend,
        "$", is the budget book's, not the term's)."""
        kind, epoch, session, replica, tid, body = message
        if epoch != self.epoch or not self.accepts(replica, session):
            return  # addressed to an earlier leader: its sender re-sends what still matters
        key = (replica, session, tid)
        if kind == "s":
            self.queue(key, body[0])
        elif kind == "c":
            self.cancel(key)
        elif kind == "b":
            self.started(key)
        elif kind == "e":
            tokens, cost, dropped = usage_in_range(body[0], body[1])
            if dropped:
                # The lease still ends (its capacity comes back), charged its estimate.
                logger.warning(
                    "fair_sched leader ignored %s in a lease end from replica %s: out of range",
                    " and ".join(dropped),
                    shown(replica),
                )
            self.end(key, tokens, abandoned=body[2], cost_used=cost)
        elif kind == "a":
            ticket, started, deployment = body
            self.adopt(key, ticket, started=started, deployment=deployment)
        elif kind == "p":
            # After the grants this batch's messages caused (their callbacks come first).
            asyncio.get_running_loop().call_soon(
                self._reply, replica, ("p", self.epoch, session, tid)
            )

    def heard_from(self) -> set[str]:
        """The replicas that sent this term a message (each follows it: it left any local
        term of its own before sending)."""
        return set(self._sessions)

    def accepts(self, replica: str, session: int) -> bool:
        """False for a replica's older session; a newer one replaces everything of the old."""
        known = self._sessions.get(replica)
        if known is None or session > known:
            if known is not None:
                self.drop_replica(replica)
            self._sessions[replica] = session
            return True
        return session == known

    def submit(self, key: Key, ticket: Ticket) -> None:
        """Queue a ticket (raises `QueueFull` or `DeadlineUnreachable`); a ticket already known
        is not queued again."""
        if key in self.reservations or key in self.leases:
            return
        if self.holding:
            self._held_back[key] = ticket
            return
        reservation = self.core.enqueue(ticket)
        self.reservations[key] = reservation
        if reservation.future.done() and not self._callbacks_pending:
            # Granted (or refused) at once and nothing granted earlier is still on its way:
            # answer now, in order, without a loop hop.
            self._resolved(key, reservation.future)
            return
        self._callbacks_pending += 1
        reservation.future.add_done_callback(lambda future: self._on_done(key, future))

    def queue(self, key: Key, ticket: Ticket) -> None:
        """`submit`, with a full queue (or a deadline out of reach) answered to the ticket's
        replica."""
        try:
            self.submit(key, ticket)
        except (QueueFull, DeadlineUnreachable) as exc:
            self._reply(key[0], rejection(self.epoch, key, exc))

    def statistics(self) -> SchedulerStatistics:
        """The core's, with the tickets held back during a hold counted as queued."""
        stats = self.core.statistics()
        if not self._held_back:
            return stats
        by_tier = dict(stats.queued_by_model_tier)
        for ticket in self._held_back.values():
            by_tier[(ticket.model, ticket.tier)] = by_tier.get((ticket.model, ticket.tier), 0) + 1
        return stats._replace(
            queued=stats.queued + len(self._held_back), queued_by_model_tier=by_tier
        )

    def end_hold(self) -> None:
        self.holding = False
        held_back, self._held_back = self._held_back, {}
        for key, ticket in held_back.items():
            if self.over:
                return
            self.queue(key, ticket)

    def try_acquire(self, key: Key, ticket: Ticket) -> Lease | None:
        if self.holding:
            return None
        lease = self.core.try_acquire(ticket)
        if lease is not None:
            self.leases[key] = lease
        return lease

    def cancel(self, key: Key) -> None:
        if self._held_back.pop(key, None) is not None:
            return
        reservation = self.reservations.get(key)
        if reservation is None:
            return  # granted already: the replica hands the grant back unused
        if reservation.cancel():
            del self.reservations[key]
        else:
            self._cancelled.add(key)  # granted, its callback not run yet: abandon it there

    def started(self, key: Key) -> None:
        lease = self.leases.get(key)
        if lease is not None:
            lease.mark_started()

    def end(
        self,
        key: Key,
        tokens_used: int | None,
        *,
        abandoned: bool,
        cost_used: float | None = None,
    ) -> None:
        """A lease's end with its usage (each value checked to its range by the caller)."""
        lease = self.leases.pop(key, None)
        if lease is None:
            return
        if abandoned:
            lease.abandon()
        else:
            lease.release(tokens_used, cost_used=cost_used)

    def adopt(
        self, key: Key, ticket: Ticket, *, started: bool, deployment: str | None = None
    ) -> None:
        """A lease granted by an earlier term (or locally) that is still running."""
        if key in self.leases:
            return
        self._held_back.pop(key, None)
        reservation = self.reservations.pop(key, None)
        if reservation is not None:
            reservation.cancel()
        self.leases[key] = self.core.adopt(ticket, started=started, deployment=deployment)

    # ------------------------------------------------------------------ endings

    def replicas(self) -> set[str]:
        return {key[0] for key in (*self.reservations, *self.leases, *self._held_back)}

    def drop_replica(self, replica: str) -> None:
        """A replica that went silent (or restarted its session): its tickets leave the queue,
        its leases end unused, so its capacity comes back."""
        for key in [key for key in self._held_back if key[0] == replica]:
            del self._held_back[key]
        reservations = [key for key in self.reservations if key[0] == replica]
        self._drop(reservations, [key for key in self.leases if key[0] == replica])

    def drain(self) -> None:
        self.over = True
        self._held_back.clear()
        self._drop(list(self.reservations), list(self.leases))

    def _drop(self, reservations: list[Key], leases: list[Key]) -> None:
        # Queued tickets first, so ending the leases cannot grant them.
        for key in reservations:
            self.reservations.pop(key).cancel()
        for key in leases:
            self.leases.pop(key).abandon()

    def _on_done(self, key: Key, future: asyncio.Future[Lease]) -> None:
        self._callbacks_pending -= 1
        self._resolved(key, future)

    def _resolved(self, key: Key, future: asyncio.Future[Lease]) -> None:
        reservation = self.reservations.pop(key, None)
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            if reservation is not None and isinstance(error, Rejected) and not self.over:
                self._reply(key[0], rejection(self.epoch, key, error))
            return
        lease = future.result()
        if reservation is None or self.over or key in self._cancelled:
            self._cancelled.discard(key)
            lease.abandon()
            return
        self.leases[key] = lease
        self._reply(key[0], grant(self.epoch, key, lease))
