"""Noticing a client that leaves while its request is parked in LiteLLM's pre-call hook.

LiteLLM does not cancel the hook when the client disconnects, so the request would still reach the
engine. `DisconnectWatch` wraps the proxy's ASGI app and gives every HTTP request a
`RequestDisconnect` through a context variable; the hook (which runs in the request's own task)
asks it to watch. Watching begins only after the app has read the whole body, so no body message
is ever taken from the app; from then on one side task owns the server's `receive()` and every later
reader gets its result.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class RequestDisconnect:
    """One HTTP request's disconnect signal."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.disconnected = asyncio.Event()
        self.body_complete = False
        self._watcher: asyncio.Task[Message] | None = None

    def watch(self) -> asyncio.Event | None:
        """Start watching for the disconnect; None if the body is not fully read yet."""
        if self.disconnected.is_set():
            return self.disconnected
        if not self.body_complete:
            return None
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self.disconnected

    async def _watch(self) -> Message:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return message

    async def receive(self) -> Message:
        if self._watcher is not None:
            # The watcher owns the server's receive(); share its one result, never read twice.
            return await asyncio.shield(self._watcher)
        if self.disconnected.is_set():
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.disconnected.set()
        elif message["type"] == "http.request" and not message.get("more_body", False):
            self.body_complete = True
        return message

    def close(self) -> None:
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()


_current: contextvars.ContextVar[RequestDisconnect | None] = contextvars.ContextVar(
    "fair_sched_request_disconnect", default=None
)


def current_disconnect_event() -> asyncio.Event | None:
    """The running request's disconnect event, if `DisconnectWatch` wraps the app."""
    state = _current.get()
    return state.watch() if state is not None else None


class DisconnectWatch:
    """Pure ASGI wrapper exposing a per-request disconnect signal to code in the request's task."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = RequestDisconnect(receive)
        token = _current.set(state)
        try:
            await self.app(scope, state.receive, send)
        finally:
            state.close()
            _current.reset(token)
