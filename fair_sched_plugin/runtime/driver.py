"""The async driver over the sans-I/O core: the one place where waiting and time meet asyncio.

`SchedulerCore` (`core/scheduler.py`) decides; this driver owns what a decision needs on an event
loop: one future per waiting caller (made by `new_wait`, resolved by `grant` with the lease or by
`refuse` with the error that ends its wait; a replica's waits for its leader use the same), the
wait itself with its disconnect and time limit (`granted`), and one timer, armed for the core's
`next_due()`, that runs its `tick`. The core holds none of these: a parked ticket's `ref` is
opaque to it, and it asks the driver (`_gone`) whether its waiter went away. Every scheduler
of the process is one: the memory:// service's, and the deciding term's under redis://.

The driver is the core with those added (a subclass), so every read and event of the
core is the driver's too, with no call in between on the hot path.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from ..core.clock import Clock
from ..core.fairness import FairnessPolicy
from ..core.fairness_window import DEFAULT_FAIRNESS_WINDOW_S
from ..core.gate import AdmissionGate
from ..core.queues import Parked
from ..core.scheduler import QueueOrder, SchedulerCore
from ..core.ticket import Lease, Ticket, TierLimits
from ..errors import ClientDisconnected, QueueTimeout, Rejected

__all__ = [
    "Admissions",
    "DisconnectSignal",
    "FairScheduler",
    "LoopClock",
    "Reservation",
    "TimerClock",
    "TimerHandle",
    "Waiter",
    "abandon_if_granted",
    "grant",
    "granted",
    "new_wait",
    "refuse",
]

logger = logging.getLogger("fair_sched")


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class TimerClock(Clock, Protocol):
    """A monotonic clock that can also run a callback at a given time."""

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle: ...


_STDLIB_LOOP_TIME = asyncio.BaseEventLoop.time


class LoopClock:
    """The running event loop's clock (`loop.time()`), bound lazily so nothing touches a loop at
    construction time."""

    def now(self) -> float:
        loop = asyncio.get_running_loop()
        if type(loop).time is _STDLIB_LOOP_TIME:
            return time.monotonic()  # what the standard loop's time() returns, without the call
        return loop.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        return asyncio.get_running_loop().call_at(when, callback)


class Waiter(Protocol):
    """A parked ticket's wait: `future` resolves to its lease (or fails with the `Rejected`
    error that ends the wait); `cancel()` leaves the queue (True if it was still queued);
    `withdraw()` also hands back a lease granted and never used."""

    @property
    def future(self) -> asyncio.Future[Lease]: ...

    @property
    def enqueued_at(self) -> float: ...

    def cancel(self) -> bool: ...

    def withdraw(self) -> None: ...


class Admissions(Protocol):
    """Where a request asks for its turn: `try_acquire` (a lease now, or None), else
    `enqueue` (one future to wait on). The core's driver with memory://, a replica that relays
    to the acting leader with redis://."""

    def try_acquire(self, ticket: Ticket) -> Lease | None: ...

    def enqueue(self, ticket: Ticket) -> Waiter: ...


class DisconnectSignal(asyncio.Event):
    """An `asyncio.Event` that also calls back when set: a parked request watches its client
    with a callback on its one future, not with a task of its own (`SchedulingService.admit`)."""

    # The callbacks not called yet: created with the first (most requests never park).
    _callbacks: list[Callable[[], None]] | None = None
    # `is_set()`, read without a call (the request path reads it several times).
    fired = False
    # `Event`'s waiters, made by the first `wait()`: a request's signal is watched by callbacks,
    # and an empty deque made for each request would be most of the signal's memory.
    # (An empty tuple until then: `set()` iterates it, and only `wait()` appends.)
    _waiters: collections.deque[asyncio.Future[Any]] = ()  # type: ignore[assignment]

    def __init__(self) -> None:
        # Not `Event.__init__`, which makes the deque.
        self._value = False

    async def wait(self) -> Literal[True]:
        if not isinstance(self._waiters, collections.deque):
            self._waiters = collections.deque()
        return await super().wait()

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once when the signal is set (at once where it already is)."""
        if self.fired:
            _call_back(callback)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def remove_callback(self, callback: Callable[[], None]) -> None:
        if self._callbacks is not None and callback in self._callbacks:
            self._callbacks.remove(callback)

    def set(self) -> None:
        if self.fired:
            return
        self.fired = True
        super().set()
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            _call_back(callback)

    def clear(self) -> None:
        self.fired = False
        super().clear()


def _call_back(callback: Callable[[], None]) -> None:
    # The signal is set from a request watch's receive loop: one callback that raised would skip
    # the others (their requests would stay parked for a client that is gone) and end that loop.
    try:
        callback()
    except Exception:
        logger.exception("fair_sched: a disconnect callback raised; the other callbacks still run")


class Reservation:
    """A ticket's place in the queue: `future` resolves to its lease (or fails with
    `QueueTimeout` / `SchedulerClosed`); `cancel()` takes it out of the queue.

    For callers that wait by callback rather than in a task (the shared-state leader waits for
    many replicas' tickets at once); `FairScheduler.acquire()` is built on it.
    """

    __slots__ = ("_parked", "_scheduler", "enqueued_at", "future")

    def __init__(
        self, scheduler: FairScheduler, parked: Parked, future: asyncio.Future[Lease]
    ) -> None:
        self._scheduler = scheduler
        self._parked = parked
        self.future = future
        self.enqueued_at = parked.enqueued_at

    @property
    def ticket(self) -> Ticket:
        return self._parked.ticket

    def cancel(self) -> bool:
        """Leave the queue; True if the ticket was still queued (it will never be granted).

        False once it was granted, timed out or failed: a granted lease is the caller's to
        `abandon()` (or use); `withdraw()` does both.
        """
        return self._scheduler.cancel(self._parked)

    def withdraw(self) -> None:
        """The caller will not use its turn: leave the queue, or hand back the lease it was
        granted and never used (the engine never saw it, so the next request gets the turn)."""
        if not self.cancel():
            abandon_if_granted(self.future)


# How long after a client's own limit a wait ends that the core has not ended.
LIMIT_BACKSTOP_S = 0.05


async def granted(
    waiter: Waiter,
    disconnected: asyncio.Event | None = None,
    *,
    max_wait_s: float | None = None,
    clock: TimerClock | None = None,
    since: float | None = None,
) -> Lease:
    """The lease `waiter` waits for; a caller that stops waiting hands its turn back
    (`withdraw`). A ticket decided the moment it was queued resumes one loop turn later, after
    the waiters decided before it (their wake-ups are already scheduled), as a replica that
    hears of its grant through the leader does.

    The client leaving (`disconnected`: `ClientDisconnected`) and its own limit (`max_wait_s`
    on `clock`, counted from `since` or else from now: `QueueTimeout`) end the wait from a
    callback that takes the ticket out of the queue and fails its one future: no task and no
    timer per parked request beyond the limit's.
    A grant and a disconnect at the same moment: the disconnect wins (the engine must never see
    a request nobody waits for) and the lease goes back unused.
    """
    future = waiter.future
    # What ends the wait besides its future, undone when it ends (not kept in a list of
    # callables: thousands of parked requests hold these).
    signal: DisconnectSignal | None = None
    watching: asyncio.Task[Literal[True]] | None = None
    limit: TimerHandle | None = None
    gone = False  # the client left (told by the callback)
    plain_event = None  # a plain `asyncio.Event`: its task may tell us a turn late
    if disconnected is not None:

        def client_left() -> None:
            nonlocal gone
            gone = True
            if not future.done():
                waiter.cancel()
                refuse(future, ClientDisconnected("client disconnected while its request waited"))

        if isinstance(disconnected, DisconnectSignal):
            signal = disconnected
            signal.add_callback(client_left)
        else:
            plain_event = disconnected
            watching = asyncio.ensure_future(disconnected.wait())
            watching.add_done_callback(lambda task: None if task.cancelled() else client_left())
    if max_wait_s is not None:
        clock = clock or LoopClock()

        def expired() -> None:
            # A lease granted at the same moment wins: the request is served.
            if not future.done():
                waiter.cancel()
                refuse(
                    future,
                    QueueTimeout(
                        f"the request waited its limit of {max_wait_s:g} s "
                        "(x-fair-sched-max-wait-s) without being released",
                        retry_after_s=1.0,
                    ),
                )

        # The local core ends the wait at the limit itself (and counts it); this backstop, a
        # moment later, is for a follower replica, whose leader does not hear of the limit.
        began = clock.now() if since is None else since
        limit = clock.call_at(began + max_wait_s + LIMIT_BACKSTOP_S, expired)
    try:
        if future.done():
            await asyncio.sleep(0)  # after the waiters decided before it
        lease = await future
        if gone or (plain_event is not None and plain_event.is_set()):
            raise ClientDisconnected("client disconnected while its request waited")
        return lease
    except BaseException as exc:
        waiter.withdraw()  # no lease outlives a wait that ends without it
        if isinstance(exc, Rejected) and (
            gone or (plain_event is not None and plain_event.is_set())
        ):
            raise ClientDisconnected("client disconnected while its request waited") from None
        raise
    finally:
        if signal is not None:
            signal.remove_callback(client_left)
        if watching is not None:
            watching.cancel()
        if limit is not None:
            limit.cancel()


def new_wait() -> asyncio.Future[Lease]:
    """A parked ticket's one future (every wait for a turn has one, made here, resolved by
    `grant` or `refuse`)."""
    return asyncio.get_running_loop().create_future()


def grant(future: asyncio.Future[Lease], lease: Lease) -> None:
    """`lease` for the wait on `future` (pending: the caller checked that someone waits)."""
    future.set_result(lease)


def refuse(future: asyncio.Future[Lease], error: BaseException) -> None:
    """End the wait on `future` with `error`, unless it is over already (granted, refused, or
    its task went away)."""
    if not future.done():
        future.set_exception(error)


def abandon_if_granted(future: asyncio.Future[Lease]) -> None:
    """A lease granted to a caller that no longer waits for it goes back unused (the engine never
    saw it: the turn passes on and the user is not charged). The one place that does this: the
    driver's callers, a follower replica's own waits and the service's wait all end here."""
    if future.done() and not future.cancelled() and future.exception() is None:
        future.result().abandon()


class FairScheduler(SchedulerCore):
    """Fair, tiered admission of requests to engines, behind an `AdmissionGate`: the core's
    decisions, awaited. Nothing here touches an event loop until the first `acquire()`."""

    def __init__(
        self,
        tiers: tuple[TierLimits, ...] | list[TierLimits],
        gate: AdmissionGate,
        *,
        fairness: FairnessPolicy = "round_robin",
        max_per_user: int = 1000,
        max_total: int = 100_000,
        max_wait_s: float = 600.0,
        order: QueueOrder = "fifo",
        clock: TimerClock | None = None,
        fairness_window_s: float = DEFAULT_FAIRNESS_WINDOW_S,
    ) -> None:
        self._timer_clock: TimerClock = clock or LoopClock()
        super().__init__(
            tiers,
            gate,
            fairness=fairness,
            max_per_user=max_per_user,
            max_total=max_total,
            max_wait_s=max_wait_s,
            order=order,
            clock=self._timer_clock,
            fairness_window_s=fairness_window_s,
        )
        self._timer: TimerHandle | None = None
        self._timer_due: float | None = None

    @property
    def clock(self) -> TimerClock:
        """The time base of its leases' `enqueued_at` and `released_at`."""
        return self._timer_clock

    async def acquire(self, ticket: Ticket) -> Lease:
        """Wait for this ticket's turn and return its lease (``async with lease:`` releases it).

        Raises `QueueFull` at once when a cap is reached, `QueueTimeout` after `max_wait_s`,
        `SchedulerClosed` if the scheduler closes while waiting.
        """
        return await granted(self.enqueue(ticket))

    def enqueue(self, ticket: Ticket) -> Reservation:
        """Queue `ticket` and run the release decision; its `Reservation.future` resolves to
        the lease. Raises `QueueFull` at once when a cap is reached."""
        future = new_wait()
        parked = self.submit(ticket, future)
        wakeups = self._wakeups
        if wakeups and (self._timer_due is None or wakeups[0][0] < self._timer_due):
            self._arm()
        return Reservation(self, parked, future)

    def close(self) -> None:
        super().close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_due = None

    def _gone(self, parked: Parked) -> bool:
        # The ticket's future is done before its task's cleanup (`withdraw`) runs: cancelled.
        future: asyncio.Future[Lease] = parked.ref  # type: ignore[assignment]
        return future.done()

    def _decided(self, parked: Parked, outcome: Lease | Rejected) -> None:
        # The core asks `_gone` before deciding, so the future is pending here.
        future: asyncio.Future[Lease] = parked.ref  # type: ignore[assignment]
        if isinstance(outcome, Lease):
            grant(future, outcome)
        else:
            refuse(future, outcome)

    def _arm(self) -> None:
        """One timer, for the core's next due deadline or promotion (an earlier one than armed
        replaces it; a later one waits for the armed one to fire and re-arm)."""
        due = self.next_due()
        if due is None or (self._timer_due is not None and self._timer_due <= due):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = self._timer_clock.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_due = None
        self.tick(self._timer_clock.now())
        self._arm()
