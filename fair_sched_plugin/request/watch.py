"""One HTTP request as fair-sched watches it: is its client still there, which leases it holds.

`FairSchedulerMiddleware` runs every request it schedules, or watches for an app that schedules
deeper inside (LiteLLM's pre-call hook), through `RequestWatch.run()`; the standalone proxy is
behind that middleware. It gives every adapter the same rules:

- A client that leaves is noticed (`disconnected`) once the body has been read: one side task
  then owns the server's `receive()` and every later reader gets its result, so no body message
  is ever taken from the app. A server that calls back when the connection is lost (the scope's
  `CONNECTION_LOST_EXTENSION`, as `fair-sched proxy`'s protocol does) is told instead, and the
  app keeps the server's `receive()` to itself: no task per request.
- A lease the request holds (`hold()`) lives in a `RequestLife` (`request/lifecycle.py`): the watch
and
  the adapters send it events (`forwarded()`, `report()` the engine's usage, `engine_answered()`,
  `engine_never_answered()`, `engine_timed_out()`, the response's start and end, the client
  leaving, `close()`), and its transition table alone marks the first byte and ends the lease,
  once, with the charge its end implies. It ends with the request at the latest.
- Nobody listens any more (the client left), the lease is older than `max_lease_s`, or the client
  stopped reading for `send_timeout_s`: the app is cancelled (its upstream request closes, so the
  engine frees the sequence), the lease ends, and the connection is closed.
- A streaming request (`streaming`) that stays parked for `queue.keepalive_after_s` gets its
  `200` and SSE headers at once, then an SSE comment (`: queued position=N wait_s=X`, ignored by
  SSE parsers) every `queue.keepalive_interval_s`, so idle timeouts between the client and us
  do not cut it. Once released, the app's own response start is absorbed and its body continues
  the same response; an error status, an exception or a refusal from then on arrives as an
  OpenAI-style `data: {"error": ...}` event and a clean end, never as a cut stream.

Code that runs in the request's context (LiteLLM's hooks) finds its watch with `current_request()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core import Lease
from ..errors import ClientDisconnected, InvalidRequest, LeaseExpired, Rejected
from ..runtime.driver import DisconnectSignal
from ..runtime.keepalive import ticks_for
from ..runtime.parked import first_comment_in_s
from .lifecycle import End, Event, RequestLife
from .responses import error, error_response

if TYPE_CHECKING:
    from ..runtime.parked import ParkedRequest
    from ..runtime.service import Admission

logger = logging.getLogger("fair_sched")

# The client's own limit on its wait (lowers `queue.max_wait_s`, never raises it).
MAX_WAIT_HEADER = "x-fair-sched-max-wait-s"
# Response headers on every scheduled request.
QUEUED_HEADER = b"x-fair-sched-queued-s"
TIER_HEADER = b"x-fair-sched-tier"
PRINCIPAL_HEADER = b"x-fair-sched-principal"
# The deployment the request was bound to (several deployments behind its model name); the ASGI
# middleware also hands it to the app under this name as a request header.
DEPLOYMENT_HEADER = b"x-fair-sched-deployment"

# A server's send() returns at once while its socket takes data, so an app relaying buffered
# chunks may never let the loop turn, and a client that reset the connection is noticed only on
# the next turn; asyncio logs every write after its fifth to a lost connection ("socket.send()
# raised exception."). A turn every this many body chunks lets the server see it first.
YIELD_EVERY_CHUNKS = 4

# The scope's extension by which a server offers to call back when the request's connection is
# lost before its response completed (at once where it is lost already): `when_lost(callback,
# True)`, and `when_lost(callback, False)` to forget it (only if it is still the one registered:
# on a kept-alive connection the next request may have registered its own before this one's end
# forgets it).
CONNECTION_LOST_EXTENSION = "fair_sched.connection_lost"

# An error body longer than this is cut before it becomes an SSE error event.
MAX_ERROR_BODY_BYTES = 64 * 1024
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # nginx would otherwise buffer the comments and defeat their purpose.
    (b"x-accel-buffering", b"no"),
]

_current: contextvars.ContextVar[RequestWatch | None] = contextvars.ContextVar(
    "fair_sched_request", default=None
)


def current_request() -> RequestWatch | None:
    """The running request's watch, if the request runs under `RequestWatch.run()`."""
    return _current.get()


def ensure_current_request() -> RequestWatch:
    """The running request's watch; without one, a detached one bound to this context.

    Detached: it holds leases (so every hook of the request finds them) but watches nothing.
    Awaited code shares its caller's context, so hooks called later in the same request see it.
    """
    watch = _current.get()
    if watch is None:
        watch = RequestWatch(None, None)
        _current.set(watch)
    return watch


def client_max_wait_s(header: bytes | None, configured_s: float) -> float | None:
    """The client's `x-fair-sched-max-wait-s` (`header`) where it is below `configured_s`, else
    None. A value that is not a positive number of seconds is refused (400 naming the header).
    """
    if header is None:
        return None
    # Digits with at most one point and 9 on each side, as the docs show it: `float()` alone
    # would also take `1_0`, `1e3`, `infinity` and a thousand digits.
    value = header.strip()
    whole, _, fraction = value.partition(b".")
    seconds = 0.0
    if (
        (whole or fraction)
        and len(whole) <= 9
        and len(fraction) <= 9
        and (not whole or whole.isdigit())
        and (not fraction or fraction.isdigit())
    ):
        seconds = float(value)
    if not seconds > 0:
        # The value is not echoed (like config errors): it may be anything pasted there.
        raise InvalidRequest(
            f"the header {MAX_WAIT_HEADER} must be a positive number of seconds in digits, "
            "e.g. 10 or 1.5",
            param=MAX_WAIT_HEADER,
        )
    return seconds if seconds < configured_s else None


async def _no_receive() -> Message:
    raise RuntimeError("a detached RequestWatch has no connection")


class RequestWatch:
    """Per-request state shared by the scheduling adapters (see the module docstring)."""

    # Thousands may be parked at once: each holds only what it has begun to use.
    __slots__ = (
        "__weakref__",  # adapters key per-request state by the watch, weakly (LiteLLM's spills)
        "_app_task",
        "_chunks_since_yield",
        "_connection_lost",
        "_error_body",
        "_error_status",
        "_keepalive_sending",
        "_keepalive_stalled",
        "_keepalive_task",
        "_keepalive_timer",
        "_lease_timer",
        "_lives",
        "_max_lease_s",
        "_max_wait_header",
        "_parked",
        "_receive",
        "_refusal",
        "_refusals_logged",
        "_send",
        "_send_timeout_s",
        "_sending_since",
        "_stall_timer",
        "_watched_by_server",
        "_watcher",
        "body_complete",
        "disconnected",
        "interrupted_tokens",
        "keepalive_started",
        "response_complete",
        "response_headers",
        "response_started",
        "stopped",
        "streaming",
    )

    def __init__(
        self,
        receive: Receive | None,
        send: Send | None,
        *,
        max_lease_s: float | None = None,
        send_timeout_s: float | None = None,
        max_wait_header: bytes | None = None,
    ) -> None:
        self._receive = receive or _no_receive
        self._send = send
        self._max_lease_s = max_lease_s
        self._send_timeout_s = send_timeout_s
        self.disconnected = DisconnectSignal()
        self.body_complete = False
        self.response_started = False
        self.response_complete = False
        # Each lease this request held, with its life (`request/lifecycle.py`), in the order held.
        self._lives: dict[Lease, RequestLife] = {}
        # The leases whose bound deployment an adapter refused to replace, and said so (by
        # `id`: they stay in `leases`), made with the first: LiteLLM retries each refused attempt.
        self._refusals_logged: set[int] | None = None
        self._watcher: asyncio.Task[Message] | None = None
        # The server's `CONNECTION_LOST_EXTENSION` (from `run()`'s scope), and whether it holds
        # our callback.
        self._connection_lost: Callable[[Callable[[], None], bool], None] | None = None
        self._watched_by_server = False
        self._app_task: asyncio.Task[None] | None = None
        self._lease_timer: asyncio.TimerHandle | None = None
        # The send timeout: when the send now running began (None: none is), and its timer.
        self._sending_since: float | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        # Why we cancelled the app (None: we did not).
        self.stopped: LeaseExpired | ClientDisconnected | None = None
        # Keep-alive while parked: the adapter says whether the client asked for a stream.
        self.streaming = False
        self.keepalive_started = False
        self._parked: ParkedRequest | None = None
        # Until the first comment is due, a timer; the task that sends the comments from then.
        self._keepalive_timer: asyncio.TimerHandle | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._keepalive_sending = False
        self._keepalive_stalled = False
        # After the keep-alive began: the app's error response, collected to become an event.
        self._error_status: int | None = None
        self._error_body: bytearray | None = None
        # The client's `x-fair-sched-max-wait-s`, as the middleware read it with the other
        # headers (one walk over them per request).
        self._max_wait_header = max_wait_header
        self._chunks_since_yield = 0
        # A refusal of ours that the app answers in its own words (LiteLLM reshapes an
        # HTTPException's body): `refuse()` makes the watch send our answer instead.
        self._refusal: Rejected | ClientDisconnected | None = None
        # Added to the response start: where the request stood (`admitted()`).
        self.response_headers: list[tuple[bytes, bytes]] = []
        # How many tokens an interrupted request is charged (`SchedulingService.
        # interrupted_tokens`); None: its whole estimate.
        self.interrupted_tokens: Callable[[Lease], int] | None = None

    # ------------------------------------------------------------------ running the app

    async def run(self, app: ASGIApp, scope: Scope) -> None:
        """Run `app` for this request under the rules above; re-raise what the app raises."""
        extensions = scope.get("extensions")
        if extensions:
            self._connection_lost = extensions.get(CONNECTION_LOST_EXTENSION)
        token = _current.set(self)
        try:
            # In a task of its own (which copies the context, so the app sees this watch) that
            # `stop()` can cancel without cancelling the server's task.
            called = app(scope, self.receive, self.send)
            self._app_task = asyncio.get_running_loop().create_task(
                called if asyncio.iscoroutine(called) else _awaited(called)
            )
        finally:
            _current.reset(token)
        app_task = self._app_task
        # Done with the app (its result: the task). Not `asyncio.wait`, whose set, closure and
        # two coroutines every request would hold for its whole life.
        app_done: asyncio.Future[asyncio.Task[None]] = app_task.get_loop().create_future()
        app_task.add_done_callback(app_done.set_result)
        try:
            await app_done
        except BaseException:
            app_task.remove_done_callback(app_done.set_result)
            app_task.cancel()  # the server cancels us: the app goes too
            self.close()
            raise
        try:
            if app_task.cancelled():
                if self.stopped is None:
                    raise asyncio.CancelledError  # the app cancelled itself: not ours to hide
                await self._answer_stopped()
            elif app_task.exception() is not None and self._owes_event():
                # The client holds a 200 from our keep-alive: end it with an error event
                # instead of a cut stream, then let the server see (and log) the exception.
                await self._end_with_event(
                    error(500, "the request failed on the server", code="internal_error").body
                )
                app_task.result()
            else:
                app_task.result()  # re-raise what the app raised
        finally:
            self.close()

    async def _answer_stopped(self) -> None:
        assert self.stopped is not None
        if self._owes_event():
            await self._end_with_event(error_response(self.stopped).body)
            return
        if self.response_started or self.disconnected.fired or self._send is None:
            # Mid-response, or nobody to tell: returning without completing it makes the server
            # close the connection, which is the truth.
            return
        # Said without the send timeout: the response has not started, so the client is
        # reading (it is waiting for the headers).
        await error_response(self.stopped).send_asgi(self._send)

    def stop(self, reason: LeaseExpired | ClientDisconnected, event: Event) -> None:
        """Cancel the running app (once) and tell the leases why (`event`); `run()` then ends
        the response, and the request's end whatever lease is still held."""
        if self.stopped is not None or self.response_complete:
            return
        self.stopped = reason
        self._tell(event)
        if self._app_task is not None:
            self._app_task.cancel()

    # ------------------------------------------------------------------ where it stands

    def max_wait_s(self, configured_s: float) -> float | None:
        """`client_max_wait_s` of this request's header."""
        return client_max_wait_s(self._max_wait_header, configured_s)

    def refuse(self, refusal: Rejected | ClientDisconnected) -> None:
        """The request was refused deeper in the app, which will answer it: the answer the
        client gets is ours (`error_response`), whatever shape the app gives it."""
        self._refusal = refusal

    def first_refusal(self, lease: Lease) -> bool:
        """True the first time an adapter says it refused to replace `lease`'s deployment."""
        if self._refusals_logged is None:
            self._refusals_logged = set()
        elif id(lease) in self._refusals_logged:
            return False
        self._refusals_logged.add(id(lease))
        return True

    def admitted(self, admission: Admission, *, name_principal: bool) -> None:
        """Say in the response headers how long the request queued, in which tier, on which
        deployment where the model has several (and, where the settings allow it, as which
        principal)."""
        lease = admission.lease
        self.response_headers = [
            (QUEUED_HEADER, f"{lease.waited_s:.3f}".encode()),
            (TIER_HEADER, lease.ticket.tier.encode("latin-1", "replace")),
        ]
        if admission.deployment_name is not None:
            # Its public name: the api_base itself may carry credentials or a `?token=`.
            self.response_headers.append(
                (DEPLOYMENT_HEADER, admission.deployment_name.encode("latin-1", "replace"))
            )
        if name_principal and admission.principal.known:
            self.response_headers.append(
                (PRINCIPAL_HEADER, admission.principal.name.encode("latin-1", "replace"))
            )

    # ------------------------------------------------------------------ leases

    def hold(self, lease: Lease) -> None:
        """This request holds `lease` until it ends (at the latest when the request ends)."""
        life = self._lives[lease] = RequestLife(_HeldLease(lease, self))
        if self._max_lease_s is not None and self._lease_timer is None:
            self._lease_timer = asyncio.get_running_loop().call_later(
                self._max_lease_s, self._lease_expired
            )
        if self.disconnected.fired:
            left = ClientDisconnected("the client left before its request was sent")
            self.stop(left, Event.CLIENT_LEFT)
            life.handle(Event.CLIENT_LEFT)  # also where the request was stopped before

    @property
    def leases(self) -> list[Lease]:
        """Every lease this request held, in order (ended ones too)."""
        return list(self._lives)

    @property
    def lease(self) -> Lease | None:
        """The lease this request holds and has not ended, if any."""
        for lease, life in self._lives.items():
            if life.holds and lease.active:
                return lease
        return None

    def _tell(self, event: Event, lease: Lease | None = None) -> None:
        """Send `event` to `lease`'s life, or to every lease's where None."""
        if lease is not None:
            life = self._lives.get(lease)
            if life is not None:
                life.handle(event)
            return
        for life in self._lives.values():  # an end never holds another lease
            life.handle(event)

    def _lease_expired(self) -> None:
        self._lease_timer = None
        if self.lease is not None:
            logger.warning(
                "fair_sched: a request on model %s held its lease for %g s (max_lease_s); "
                "ending it and closing the connection",
                self.leases[0].ticket.model,
                self._max_lease_s,
            )
            limit = f"max_lease_s={self._max_lease_s:g}"
            self.stop(
                LeaseExpired(f"the request held its engine slot longer than {limit}"),
                Event.LEASE_EXPIRED,
            )

    # What adapters saw of a lease's engine request: events for its life (`request/lifecycle.py`),
    # which alone marks the first byte and ends the lease. Without a `lease`: every lease it holds.

    def forwarded(self) -> None:
        """The request went on to the engine (the app read its body, LiteLLM's hook returned):
        from then on a client that leaves is charged what the engine can have generated."""
        self._tell(Event.FORWARDED)

    def report(self, lease: Lease, tokens_used: int | None, cost_used: float | None) -> None:
        """What the engine said `lease`'s request used; charged when the lease ends completed.

        A detached watch (no connection: nothing to see the response go out) takes the report
        as the end of its response."""
        life = self._lives.get(lease)
        if life is None:
            return
        life.usage(tokens_used, cost_used)
        if self._send is None:
            life.handle(Event.RESPONSE_COMPLETE)

    def engine_answered(self, lease: Lease | None = None) -> None:
        """The engine's first chunk came (an adapter sees it before it is sent)."""
        self._tell(Event.FIRST_BYTE, lease)

    def engine_never_answered(self, lease: Lease | None = None) -> None:
        """The engine gave no answer (refused on the way, or failed before its first chunk)."""
        self._tell(Event.ENGINE_FAILED, lease)

    def engine_timed_out(self, lease: Lease | None = None) -> None:
        """The engine had the request until we gave up waiting for its answer."""
        self._tell(Event.ENGINE_TIMED_OUT, lease)

    # ------------------------------------------------------------------ receive side

    def watch(self) -> asyncio.Event | None:
        """Start watching for the client leaving; None while the body is not fully read."""
        if self.disconnected.fired:
            return self.disconnected
        if not self.body_complete or self._send is None:
            return None
        if self._watcher is None and not self._watched_by_server:
            if self._connection_lost is not None:
                self._connection_lost(self._client_left, True)
                self._watched_by_server = True
            else:
                self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self.disconnected

    async def _watch(self) -> Message:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._client_left()
                return message

    def _client_left(self) -> None:
        self.disconnected.set()
        if self.lease is not None and not self.response_complete:
            # Nobody reads the answer any more: stop the engine's work.
            self.stop(
                ClientDisconnected("the client left while its request ran"), Event.CLIENT_LEFT
            )

    async def receive(self) -> Message:
        if self._watcher is not None:
            # The watcher owns the server's receive(); share its one result, never read twice.
            return await asyncio.shield(self._watcher)
        if self.disconnected.fired:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self._client_left()
        elif message["type"] == "http.request" and not message.get("more_body", False):
            self.body_complete = True
        return message

    # ------------------------------------------------------------------ send side

    async def send(self, message: Message) -> None:
        assert self._send is not None
        if self.stopped is not None:
            return  # cancelled: what the app still says goes nowhere
        if self._keepalive_task is not None:
            # A comment may be on its way out: the app's first message goes after it.
            self.unparked()
            await asyncio.wait({self._keepalive_task})
            self._keepalive_task = None
        if self.keepalive_started:
            await self._send_after_keepalive(message)
            return
        if self._refusal is not None:
            if message["type"] == "http.response.start" and not self.response_started:
                self.response_started = self.response_complete = True
                await error_response(self._refusal).send_asgi(self._send)
            return  # the app's own rendering of our refusal goes nowhere
        kind = message["type"]
        if kind == "http.response.start":
            self.response_started = True
            self._tell(Event.RESPONSE_STARTED)
            if self.response_headers:
                headers = [*message.get("headers", ()), *self.response_headers]
                message = {**message, "headers": headers}
        elif kind == "http.response.body":
            if message.get("body"):
                self._tell(Event.FIRST_BYTE)
            if not message.get("more_body", False):
                self.response_complete = True
        await self._deliver(message)
        if self.response_complete:
            self._tell(Event.RESPONSE_COMPLETE)

    async def _deliver(self, message: Message) -> None:
        assert self._send is not None
        if self.disconnected.fired:
            return  # the client is gone: nothing to write to
        if self._send_timeout_s is None or not self._lives:
            # Only a request holding a lease is timed: others hold nothing of the engine's.
            await self._send(message)
        else:
            # One timer per request, not one per chunk (a timer set and cancelled for every
            # token was LiteLLM's proxy loop's work): each send notes when it began; the timer,
            # when due, ends the request if the send then running began `send_timeout_s` ago,
            # else moves on to that send's deadline. `stop()` cancels the app's task, which is
            # the one blocked in this send.
            loop = asyncio.get_running_loop()
            self._sending_since = loop.time()
            if self._stall_timer is None:
                self._stall_timer = loop.call_at(
                    self._sending_since + self._send_timeout_s, self._check_stalled
                )
            try:
                await self._send(message)
            finally:
                self._sending_since = None
        if message.get("more_body", False):
            self._chunks_since_yield += 1
            if self._chunks_since_yield >= YIELD_EVERY_CHUNKS:
                self._chunks_since_yield = 0
                await asyncio.sleep(0)  # see YIELD_EVERY_CHUNKS

    async def _send_after_keepalive(self, message: Message) -> None:
        """The app answers a client that already has our 200 and SSE headers."""
        assert self._send is not None
        kind = message["type"]
        if kind == "http.response.start":
            self.response_started = True
            self._tell(Event.RESPONSE_STARTED)
            status = int(message.get("status", 200))
            if status >= 400:
                self._error_status = status
            return  # the client has its response start already
        if kind != "http.response.body":
            return
        more = message.get("more_body", False)
        body = message.get("body", b"")
        if self._error_status is not None:
            if self._error_body is None:
                self._error_body = bytearray()
            room = MAX_ERROR_BODY_BYTES - len(self._error_body)
            self._error_body += body[: max(0, room)]
            if not more:
                payload = (
                    error_response(self._refusal).body
                    if self._refusal is not None
                    else _error_payload(self._error_status, bytes(self._error_body))
                )
                await self._end_with_event(payload)
            return
        if body:
            self._tell(Event.FIRST_BYTE)
        if not more:
            self.response_complete = True
        await self._deliver(message)
        if not more:
            self._tell(Event.RESPONSE_COMPLETE)

    def _owes_event(self) -> bool:
        """True while the client holds our keep-alive 200 and nothing has ended it."""
        return (
            self.keepalive_started
            and not self.response_complete
            and not self.disconnected.fired
            and self._send is not None
        )

    async def _end_with_event(self, payload: dict[str, Any]) -> None:
        """End the keep-alive response with an OpenAI-style error event (what SDKs raise)."""
        assert self._send is not None
        self.response_complete = True
        event = b"data: " + json.dumps(payload).encode() + b"\n\n"
        with contextlib.suppress(OSError, RuntimeError):
            # The client may be gone by now; there is nobody left to tell.
            await self._send({"type": "http.response.body", "body": event, "more_body": False})

    # ------------------------------------------------------------------ keep-alive while parked

    def parked(self, parked: ParkedRequest) -> None:
        """The request waits in the queue (`service.WaitObserver`): keep a stream alive."""
        due_in_s = first_comment_in_s(parked.queue, parked.wait_s())
        if not self.streaming or self._send is None or due_in_s is None:
            return
        self._parked = parked
        if self._keepalive_task is None and self._keepalive_timer is None:
            # A timer, not a task, while the request may yet leave the queue before its first
            # comment (most do): a task is made only for a stream that is kept alive. Counted
            # from when it parked (the server may have held it before this app ran).
            self._keepalive_timer = asyncio.get_running_loop().call_later(
                due_in_s, self._start_keep_alive, parked.queue.keepalive_interval_s
            )

    def _start_keep_alive(self, interval_s: float) -> None:
        self._keepalive_timer = None
        if self._parked is not None and self._keepalive_task is None:
            self._keepalive_task = asyncio.get_running_loop().create_task(
                self._keep_alive(interval_s)
            )

    def shutdown(self) -> None:
        """The server drained past its grace period: end the request (a keep-alive stream
        gets an error event; a started one is closed, which is the truth)."""
        self.stop(LeaseExpired("the server shut down before the response ended"), Event.SHUTDOWN)

    def unparked(self) -> None:
        """The request stopped waiting: no more comments (one being sent finishes first)."""
        self._parked = None
        if self._keepalive_timer is not None:
            self._keepalive_timer.cancel()
            self._keepalive_timer = None
        task = self._keepalive_task
        if task is not None and not self._keepalive_sending:
            task.cancel()

    async def _keep_alive(self, interval_s: float) -> None:
        send = self._send
        assert send is not None
        # The first comment now (`keepalive_after_s` into the wait); the next ones on the
        # loop's shared keep-alive clock, which also times the sends out (`runtime/keepalive.py`).
        ticks = ticks_for(interval_s)
        while True:
            parked = self._parked
            if parked is None or self.disconnected.fired:
                return
            position, eta, wait_s = parked.standing()
            # Bytes formatting: half the cost of an f-string and an encode, on every comment.
            if eta is None:
                comment = b": queued position=%d wait_s=%.1f\n\n" % (position, wait_s)
            else:
                comment = b": queued position=%d wait_s=%.1f eta_s=%.1f\n\n" % (
                    position,
                    wait_s,
                    eta,
                )
            self._keepalive_sending = True
            # A client that does not take a comment within an interval (1 s at least) has
            # stopped reading: it is treated as gone (the request leaves the queue).
            ticks.sending(self)
            try:
                if not self.keepalive_started:
                    tier = (TIER_HEADER, parked.ticket.tier.encode("latin-1", "replace"))
                    headers = [*SSE_HEADERS, tier]
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    self.keepalive_started = True
                await send({"type": "http.response.body", "body": comment, "more_body": True})
            except (OSError, RuntimeError) as exc:
                logger.debug("fair_sched: keep-alive to a parked client failed: %r", exc)
                self._client_left()
                return
            except asyncio.CancelledError:
                if not self._keepalive_stalled:
                    raise
                logger.debug("fair_sched: a parked client did not take its keep-alive comment")
                self._client_left()
                return
            finally:
                ticks.sent(self)
                self._keepalive_sending = False
            if self._parked is None:
                return
            await ticks.next_tick()

    def send_stalled(self) -> None:
        """The client did not take its keep-alive comment in time (`KeepAliveTicks`)."""
        task = self._keepalive_task
        if task is not None and not task.done():
            self._keepalive_stalled = True
            task.cancel()

    def _check_stalled(self) -> None:
        self._stall_timer = None
        since = self._sending_since
        if since is None or self._send_timeout_s is None:
            return  # no send running: the next one sets the timer again
        loop = asyncio.get_running_loop()
        due = since + self._send_timeout_s
        if loop.time() < due:
            self._stall_timer = loop.call_at(due, self._check_stalled)
            return
        self._stalled()

    def _stalled(self) -> None:
        logger.warning(
            "fair_sched: a client took no response data for %g s (send_timeout_s); ending its "
            "request",
            self._send_timeout_s,
        )
        self.stop(LeaseExpired("the client stopped reading the response"), Event.SEND_STALLED)

    def close(self) -> None:
        """End the leases and stop watching (what `run()` does on its way out)."""
        if self._keepalive_timer is not None:
            self._keepalive_timer.cancel()
            self._keepalive_timer = None
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
        if self._watched_by_server:
            self._watched_by_server = False
            assert self._connection_lost is not None
            self._connection_lost(self._client_left, False)
        self._tell(Event.CLOSED)


class _HeldLease:
    """A watch's lease as its life ends it (`_lifecycle.LeaseEnd`)."""

    __slots__ = ("_lease", "_watch")

    def __init__(self, lease: Lease, watch: RequestWatch) -> None:
        self._lease = lease
        self._watch = watch

    def started(self) -> None:
        self._lease.mark_started()

    def ended(self, end: End, tokens_used: int | None, cost_used: float | None) -> None:
        lease = self._lease
        if end == "completed":
            lease.release(tokens_used, cost_used=cost_used)
        elif end == "interrupted":
            charge = self._watch.interrupted_tokens
            lease.release(charge(lease) if charge is not None else lease.ticket.cost)
        else:
            lease.abandon()


async def _awaited(awaitable: Awaitable[None]) -> None:
    await awaitable


def _error_payload(status: int, body: bytes) -> dict[str, Any]:
    """An app's error response as an OpenAI-style error object (its own when it sent one)."""
    with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError):
        decoded = json.loads(body)
        if isinstance(decoded, dict):
            found = decoded.get("error", decoded.get("detail"))
            if isinstance(found, dict) and isinstance(found.get("error"), dict):
                found = found["error"]  # LiteLLM's HTTPException detail carries ours
            if isinstance(found, dict) and found.get("message"):
                return {"error": found}
            if isinstance(found, str):
                return {**error(status, found, code=str(status)).body}
    text = body.decode("utf-8", "replace").strip() or f"HTTP {status}"
    return error(status, text[:2000], code=str(status)).body
