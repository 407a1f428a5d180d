"""Read deadlines for `fair-sched proxy`'s HTTP/1.1 connections (uvicorn's h11 protocol).

uvicorn bounds what one connection buffers (h11's `h11_max_incomplete_event_size` for headers;
a request body stops being read past 64 KiB until the app takes it) and closes a connection
idle between requests (`timeout_keep_alive`), but nothing times out a request's headers sent a
byte at a time, nor a body that never ends: each such connection would stay open for good. Here
a request's headers must arrive within `read_headers_timeout_s` of its first byte (or of the
connection opening) and its body within `read_body_timeout_s` of its headers, as nginx's
`client_header_timeout` and `client_body_timeout`; then the connection is closed and counted.
The time a body waits for the app (reading paused by flow control) is not the client's and
never counts against it.

The same protocol gives each request (and each connection's flow control) an `asyncio.Event`
whose waiters are a list instead of a deque: uvicorn makes one per request and one per
connection, and an empty deque holds a ~600-byte block, which thousands of parked requests would
each keep for nothing (a waiting event has one waiter at most). And it calls back when a
request's connection is lost before its response completed (the scope's
`CONNECTION_LOST_EXTENSION`), so that a parked request needs no task reading `receive()` to
notice its client leaving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .watch import CONNECTION_LOST_EXTENSION

ReadPhase = Literal["headers", "body"]

__all__ = ["ReadPhase", "read_deadline_protocol"]

logger = logging.getLogger("fair_sched")


class _ListEvent(asyncio.Event):
    """An `asyncio.Event`, all its methods unchanged, that keeps its waiters in a list."""

    def __init__(self, *, is_set: bool = False) -> None:
        super().__init__()
        self._waiters: list[asyncio.Future[bool]] = []  # type: ignore[assignment]
        if is_set:
            self.set()


def read_deadline_protocol(
    *,
    headers_timeout_s: float,
    body_timeout_s: float,
    on_timeout: Callable[[ReadPhase], None],
) -> type[H11Protocol]:
    """An `H11Protocol` (uvicorn's `http=` argument) that closes a connection whose request's
    headers or body arrive too slowly, telling `on_timeout` which."""

    class ReadDeadlineProtocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # All set here, in this order: attributes an instance gains later make Python
            # rebuild its `__dict__` larger (~800 bytes more per connection).
            self._read_timer: asyncio.TimerHandle | None = None
            self._read_phase: ReadPhase | None = None
            # What the request now running asked to be told when the connection is lost, and
            # the scope extension by which it asks (made with the connection's first request).
            self._lost_callback: Callable[[], None] | None = None
            self._extensions: dict[str, object] | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            # uvicorn's flow control's own event (private there: left as it is where it differs).
            writable = getattr(self.flow, "_is_writable_event", None)
            if type(writable) is asyncio.Event:
                self.flow._is_writable_event = _ListEvent(is_set=writable.is_set())
            self._start_reading("headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_reading()
            super().connection_lost(exc)
            callback, self._lost_callback = self._lost_callback, None
            if callback is not None:
                try:
                    callback()
                except Exception:
                    logger.exception("fair_sched: a request's connection-lost callback failed")

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._lighten_cycle()
            self._follow_request()

        def on_response_complete(self) -> None:
            self._lost_callback = None  # the request's response is out: nothing to tell it
            super().on_response_complete()
            self._lighten_cycle()
            self._follow_request()

        def _lighten_cycle(self) -> None:
            """A request cycle just made (its task has not run, nothing waits on its event)
            gets a `_ListEvent` in the same state, and the connection-lost extension."""
            cycle = self.cycle
            if cycle is not None and type(cycle.message_event) is asyncio.Event:
                cycle.message_event = _ListEvent(is_set=cycle.message_event.is_set())
                if self._extensions is None:
                    self._extensions = {CONNECTION_LOST_EXTENSION: self._call_when_lost}
                scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
                extensions = scope.setdefault("extensions", self._extensions)
                if extensions is not self._extensions:
                    extensions[CONNECTION_LOST_EXTENSION] = self._call_when_lost

        def _call_when_lost(self, callback: Callable[[], None], call: bool) -> None:
            """The scope's `CONNECTION_LOST_EXTENSION`: `callback()` once if the connection is
            lost before the response completes; `call=False`: not, if it is still the one
            registered (a pipelined or kept-alive next request's own stays)."""
            if call:
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

    return ReadDeadlineProtocol
