"""`fair-sched proxy`'s HTTP/1.1 connections: uvicorn's h11 protocol, with read deadlines, and
requests parked at the server before any task is made for them.

Read deadlines. uvicorn bounds what one connection buffers (h11's
`h11_max_incomplete_event_size` for headers; a request body stops being read past 64 KiB until
the app takes it) and closes a connection idle between requests (`timeout_keep_alive`), but
nothing times out a request's headers sent a byte at a time, nor a body that never ends: each
such connection would stay open for good. Here a request's headers must arrive within
`read_headers_timeout_s` of its first byte (or of the connection opening) and its body within
`read_body_timeout_s` of its headers, as nginx's `client_header_timeout` and
`client_body_timeout`; then the connection is closed and counted. The time a body waits for the
app (reading paused by flow control) is not the client's and never counts against it.

Parking at the server. uvicorn starts a request's app task, with its scope, request cycle and
coroutine frames, the moment its head arrives; a request that then waits minutes for its turn
holds all of them. Given a `ServerParking` (the proxy's middleware), the protocol asks it at
each request's head whether it takes the request; if it does, the protocol reads the body
itself (a declared `Content-Length`, within the middleware's limit) and hands it over, and the
middleware takes the request in (identity, the one parse, its ticket, released or queued). A
queued request then holds only its connection, scope, body bytes and place in the queue: its
request cycle and task are made when its wait is over (or, for a stream whose client must hear
a keep-alive comment, when the first is due), and the middleware goes on from there. Its client
leaving meanwhile takes it out of the queue from `connection_lost`. Any request the middleware
does not take runs as uvicorn runs it.

The request cycles made here wait on an `asyncio.Event` whose waiters are a list instead of a
deque (as does each connection's flow control): an empty deque holds a ~600-byte block, which
thousands of parked requests would each keep for nothing (a waiting event has one waiter at
most). And the protocol calls back when a request's connection is lost before its response
completed (the scope's `CONNECTION_LOST_EXTENSION`), so that a running request needs no task
reading `receive()` to notice its client leaving.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from typing import Any, Literal, Protocol, cast
from urllib.parse import unquote

import h11
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, service_unavailable
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from .watch import CONNECTION_LOST_EXTENSION

ReadPhase = Literal["headers", "body"]

__all__ = ["ReadPhase", "ServerParked", "ServerParking", "proxy_protocol"]

logger = logging.getLogger("fair_sched")


class ServerParked(Protocol):
    """A request taken in at the server (`ServerParking.take`'s function's result)."""

    @property
    def waiting(self) -> asyncio.Future[Any] | None:
        """Pending while the request waits for its turn: its app starts once this is done.
        None: start it now."""

    @property
    def start_in_s(self) -> float | None:
        """Start the app after this long even if it still waits (its client must hear from it
        by then); None: only once its wait is over."""

    def client_left(self) -> None:
        """The connection was lost before the app started: the request leaves its queue."""


class ServerParking(Protocol):
    """Who takes requests in at the server (the proxy's `FairSchedulerMiddleware`)."""

    def take(self, scope: dict[str, Any]) -> Callable[[bytes], ServerParked] | None:
        """A request's head is in (`scope` is the one its app will get): None to run it as
        uvicorn does, or the function to call with its whole body (at most its declared
        `Content-Length`) before its app starts."""


class _Taking:
    """A request taken at the server, on its connection, until its app starts: while its body
    is read, the function it goes to and the body so far; then, while it waits, what it is, the
    wait its app starts after and the timer that starts it sooner."""

    __slots__ = ("body", "closing", "parked", "start_timer", "take_body", "waiting")

    def __init__(self, take_body: Callable[[bytes], ServerParked]) -> None:
        self.take_body: Callable[[bytes], ServerParked] | None = take_body
        self.body: list[bytes] = []
        self.parked: ServerParked | None = None
        self.waiting: asyncio.Future[Any] | None = None
        self.start_timer: asyncio.TimerHandle | None = None
        # The server shut down meanwhile: the response closes the connection.
        self.closing = False

    def stop_waiting(self, wait_over: Callable[[asyncio.Future[Any]], None]) -> None:
        if self.waiting is not None:
            self.waiting.remove_done_callback(wait_over)
        if self.start_timer is not None:
            self.start_timer.cancel()


def _raising(exc: Exception) -> Callable[..., Any]:
    """An ASGI app that raises `exc`."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise exc

    return app


class _ListEvent(asyncio.Event):
    """An `asyncio.Event`, all its methods unchanged, that keeps its waiters in a list."""

    def __init__(self, *, is_set: bool = False) -> None:
        super().__init__()
        self._waiters: list[asyncio.Future[bool]] = []  # type: ignore[assignment]
        if is_set:
            self.set()


def proxy_protocol(
    *,
    headers_timeout_s: float,
    body_timeout_s: float,
    on_timeout: Callable[[ReadPhase], None],
    parking: ServerParking | None = None,
) -> type[H11Protocol]:
    """An `H11Protocol` (uvicorn's `http=` argument) that closes a connection whose request's
    headers or body arrive too slowly, telling `on_timeout` which, and lets `parking` take
    requests in before their app starts."""

    class ProxyProtocol(H11Protocol):
        # Slots, not uvicorn's instance `__dict__`, which Python rebuilds larger once attributes
        # are added past its first size (with these five, ~1.6 KB more per connection).
        __slots__ = ("_extensions", "_lost_callback", "_read_phase", "_read_timer", "_taking")

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._read_timer: asyncio.TimerHandle | None = None
            self._read_phase: ReadPhase | None = None
            # What the request now running asked to be told when the connection is lost, and
            # the scope extension by which it asks (made with the connection's first request).
            self._lost_callback: Callable[[], None] | None = None
            self._extensions: dict[str, object] | None = None
            # The request taken at the server, until its app starts.
            self._taking: _Taking | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            # uvicorn's flow control's own event (private there: left as it is where it differs).
            writable = getattr(self.flow, "_is_writable_event", None)
            if type(writable) is asyncio.Event:
                self.flow._is_writable_event = _ListEvent(is_set=writable.is_set())
            self._start_reading("headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_reading()
            taking, self._taking = self._taking, None
            if taking is not None:
                taking.stop_waiting(self._wait_over)
            if taking is not None and taking.parked is not None:
                try:
                    taking.parked.client_left()
                except Exception:
                    logger.exception("fair_sched: a parked request's client_left failed")
            super().connection_lost(exc)
            callback, self._lost_callback = self._lost_callback, None
            if callback is not None:
                try:
                    callback()
                except Exception:
                    logger.exception("fair_sched: a request's connection-lost callback failed")

        def shutdown(self) -> None:
            if self._taking is not None:
                # Answered first (a parked request is refused by the drain), then closed.
                self._taking.closing = True
                return
            super().shutdown()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow_request()

        def on_response_complete(self) -> None:
            self._lost_callback = None  # the request's response is out: nothing to tell it
            super().on_response_complete()
            self._follow_request()

        def handle_events(self) -> None:
            """uvicorn's event loop over h11 (`H11Protocol.handle_events`), with the request's
            start (`_request_head`) and a taken request's body (kept in its `_Taking`, then
            `_body_end`) made ours."""
            while True:
                try:
                    event = self.conn.next_event()
                except h11.RemoteProtocolError:
                    message = "Invalid HTTP request received."
                    self.logger.warning(message)
                    self.send_400_response(message)
                    return
                if event is h11.NEED_DATA:
                    break
                if event is h11.PAUSED:
                    # A pipelined request waits until this one's response is out. Behind a
                    # request parked here, reading goes on up to a bound, so that its client
                    # leaving is seen while it waits.
                    taking = self._taking
                    if (
                        taking is None
                        or taking.parked is None
                        or len(self.conn.trailing_data[0]) > HIGH_WATER_LIMIT
                    ):
                        self.flow.pause_reading()
                    break
                if isinstance(event, h11.Request):
                    if not self._request_head(event):
                        return  # upgraded to a WebSocket
                elif isinstance(event, h11.Data):
                    if self.conn.our_state is h11.DONE:
                        continue  # answered before its body was read: the rest is dropped
                    if self._taking is not None:
                        self._taking.body.append(event.data)
                        continue
                    assert self.cycle is not None
                    self.cycle.body += event.data
                    if len(self.cycle.body) > HIGH_WATER_LIMIT:
                        self.flow.pause_reading()
                    self.cycle.message_event.set()
                elif isinstance(event, h11.EndOfMessage):
                    if self.conn.our_state is h11.DONE:
                        self.transport.resume_reading()
                        self.conn.start_next_cycle()
                        continue
                    if self._taking is not None:
                        self._body_end(self._taking)
                    else:
                        assert self.cycle is not None
                        self.cycle.more_body = False
                        self.cycle.message_event.set()
                    if self.conn.their_state == h11.MUST_CLOSE:
                        break

        def _request_head(self, event: h11.Request) -> bool:
            """The request's scope, then its app task, or its body read here for the
            middleware to take it in. False: upgraded to a WebSocket (uvicorn's own)."""
            self._unset_keepalive_if_required()
            self.headers = [(key.lower(), value) for key, value in event.headers]
            raw_path, _, query_string = event.target.partition(b"?")
            path = unquote(raw_path.decode("ascii"))
            self.scope = {
                "type": "http",
                "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
                "http_version": event.http_version.decode("ascii"),
                "server": self.server,
                "client": self.client,
                "scheme": self.scheme,  # type: ignore[typeddict-item]
                "method": event.method.decode("ascii"),
                "root_path": self.root_path,
                "path": self.root_path + path,
                "raw_path": self.root_path.encode("ascii") + raw_path,
                "query_string": query_string,
                "headers": self.headers,
                "state": self.app_state.copy(),
                "extensions": self._connection_extensions(),
            }
            if self._should_upgrade():
                self.handle_websocket_upgrade(event)
                return False
            if (
                parking is not None
                and self.limit_concurrency is None
                and not self.conn.they_are_waiting_for_100_continue
            ):
                take_body = parking.take(cast("dict[str, Any]", self.scope))
                if take_body is not None:
                    self._taking = _Taking(take_body)
                    return True
            self._start_app(body_read=False)
            return True

        def _connection_extensions(self) -> dict[str, object]:
            if self._extensions is None:
                self._extensions = {CONNECTION_LOST_EXTENSION: self._call_when_lost}
            return self._extensions

        def _body_end(self, taking: _Taking) -> None:
            """A taken request's body is in: the middleware takes the request in; its app
            starts now or when its wait is over."""
            take_body, taking.take_body = taking.take_body, None
            assert take_body is not None
            body = b"".join(taking.body)
            taking.body = []  # one copy at a time
            try:
                parked = take_body(body)
            except Exception as exc:
                # A bug, not the client's: answered as uvicorn answers an app that raised (500,
                # logged, the connection closed).
                self._taking = None
                self._start_app(body_read=True, app=_raising(exc))
                return
            del body
            waiting = parked.waiting
            if waiting is None or waiting.done():
                self._taking = None
                self._start_app(body_read=True, closing=taking.closing)
                self._read_on()
                return
            taking.parked = parked
            taking.waiting = waiting
            waiting.add_done_callback(self._wait_over)
            if parked.start_in_s is not None:
                taking.start_timer = self.loop.call_later(parked.start_in_s, self._start_parked)
            self._read_on()

        def _read_on(self) -> None:
            """Bytes after a taken request's body (a pipelined request, a stray line end)
            pause reading, in this loop and after this, until its response is out; once, as an
            app's `receive()` would, reading resumes, so that its client leaving is seen."""
            self.loop.call_soon(self.flow.resume_reading)

        def _wait_over(self, waiting: asyncio.Future[Any]) -> None:
            if self._taking is not None and waiting is self._taking.waiting:
                self._start_parked()

        def _start_parked(self) -> None:
            taking, self._taking = self._taking, None
            if taking is None:
                return
            taking.stop_waiting(self._wait_over)
            self._start_app(body_read=True, closing=taking.closing)

        def _start_app(self, *, body_read: bool, closing: bool = False, app: Any = None) -> None:
            """The request's cycle and app task, as uvicorn makes them; `body_read`: the
            middleware has its body already, and the app's `receive()` has nothing more;
            `closing`: the server shut down meanwhile, the connection closes after it; `app`:
            run instead of the server's."""
            cycle = RequestResponseCycle(
                scope=self.scope,
                conn=self.conn,
                transport=self.transport,
                flow=self.flow,
                logger=self.logger,
                access_logger=self.access_logger,
                access_log=self.access_log,
                default_headers=self.server_state.default_headers,
                message_event=_ListEvent(),
                on_response=self.on_response_complete,
            )
            if body_read:
                cycle.more_body = False
            if closing:
                cycle.keep_alive = False
            self.cycle = cycle
            app = app or self.app
            if self.limit_concurrency is not None and (
                len(self.connections) >= self.limit_concurrency
                or len(self.tasks) >= self.limit_concurrency
            ):
                app = service_unavailable
                self.logger.warning("Exceeded concurrency limit.")
            if getattr(self.config, "reset_contextvars", False):
                # uvicorn's opt-in (Python 3.11+): the app's task in a fresh context.
                task = self.loop.create_task(  # type: ignore[call-arg]
                    cycle.run_asgi(app), context=contextvars.Context()
                )
            else:
                task = self.loop.create_task(cycle.run_asgi(app))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)

        def _call_when_lost(self, callback: Callable[[], None], call: bool) -> None:
            """The scope's `CONNECTION_LOST_EXTENSION`: `callback()` once if the connection is
            lost before the response completes (at once if it is already); `call=False`: not,
            if it is still the one registered (a pipelined or kept-alive next request's own
            stays)."""
            if call and self.cycle is not None and self.cycle.disconnected:
                # Lost before the request asked (its app started as the client left).
                callback()
            elif call:
                self._lost_callback = callback
            elif self._lost_callback == callback:  # bound methods: equal, not identical
                self._lost_callback = None

        def _follow_request(self) -> None:
            """Which deadline runs now, from the state of the request being read."""
            state = self.conn.their_state
            if self.transport.is_closing():
                self._stop_reading()
            elif state is h11.SEND_BODY:
                if self._read_phase != "body":
                    self._start_reading("body")
            elif state is h11.IDLE and self.conn.trailing_data[0]:
                # Part of the next request's headers is here.
                if self._read_phase != "headers":
                    self._start_reading("headers")
            else:
                # Between requests (uvicorn's keep-alive timeout holds) or the request is in.
                self._stop_reading()

        def _start_reading(self, phase: ReadPhase) -> None:
            self._stop_reading()
            self._read_phase = phase
            timeout = headers_timeout_s if phase == "headers" else body_timeout_s
            self._read_timer = self.loop.call_later(timeout, self._read_deadline_passed)

        def _stop_reading(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer = None
            self._read_phase = None

        def _read_deadline_passed(self) -> None:
            phase = self._read_phase
            self._read_timer = None
            self._read_phase = None
            if phase is None or self.transport.is_closing():
                return
            if phase == "body" and self.flow.read_paused:
                # The app has not taken what was read: the wait is ours, not the client's.
                self._start_reading("body")
                return
            on_timeout(phase)
            self.transport.close()

    return ProxyProtocol
