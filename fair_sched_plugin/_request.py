"""One HTTP request as fair-sched watches it: is its client still there, which leases it holds.

The middleware, the standalone proxy (through the middleware) and the wrapper around LiteLLM's
proxy app all run a request through `RequestWatch.run()`. It gives every adapter the same rules:

- A client that leaves is noticed (`disconnected`) once the body has been read: one side task
  then owns the server's `receive()` and every later reader gets its result, so no body message
  is ever taken from the app.
- A lease the request holds (`hold()`) ends with the request at the latest: completed once the
  response went out (or its first byte did), abandoned if nothing ever did.
- Nobody listens any more (the client left), the lease is older than `max_lease_s`, or the client
  stopped reading for `send_timeout_s`: the app is cancelled (its upstream request closes, so the
  engine frees the sequence), the lease ends, and the connection is closed.

Code that runs in the request's context (LiteLLM's hooks) finds its watch with `current_request()`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._responses import error_response
from .core import Lease
from .errors import ClientDisconnected, LeaseExpired

logger = logging.getLogger("fair_sched")

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


async def _no_receive() -> Message:
    raise RuntimeError("a detached RequestWatch has no connection")


class RequestWatch:
    """Per-request state shared by the scheduling adapters (see the module docstring)."""

    def __init__(
        self,
        receive: Receive | None,
        send: Send | None,
        *,
        max_lease_s: float | None = None,
        send_timeout_s: float | None = None,
    ) -> None:
        self._receive = receive or _no_receive
        self._send = send
        self._max_lease_s = max_lease_s
        self._send_timeout_s = send_timeout_s
        self.disconnected = asyncio.Event()
        self.body_complete = False
        self.response_started = False
        self.response_complete = False
        self.leases: list[Lease] = []
        self._watcher: asyncio.Task[Message] | None = None
        self._app_task: asyncio.Task[None] | None = None
        self._lease_timer: asyncio.TimerHandle | None = None
        # Why we cancelled the app (None: we did not).
        self.stopped: LeaseExpired | ClientDisconnected | None = None

    # ------------------------------------------------------------------ running the app

    async def run(self, app: ASGIApp, scope: Scope) -> None:
        """Run `app` for this request under the rules above; re-raise what the app raises."""
        token = _current.set(self)
        try:
            # In a task of its own (which copies the context, so the app sees this watch) that
            # `stop()` can cancel without cancelling the server's task.
            self._app_task = asyncio.get_running_loop().create_task(self._call(app, scope))
        finally:
            _current.reset(token)
        app_task = self._app_task
        try:
            await asyncio.wait({app_task})
        except BaseException:
            app_task.cancel()  # the server cancels us: the app goes too
            self.close()
            raise
        try:
            if app_task.cancelled():
                if self.stopped is None:
                    raise asyncio.CancelledError  # the app cancelled itself: not ours to hide
                await self._answer_stopped()
            else:
                app_task.result()  # re-raise what the app raised
        finally:
            self.close()

    async def _call(self, app: ASGIApp, scope: Scope) -> None:
        await app(scope, self.receive, self.send)

    async def _answer_stopped(self) -> None:
        assert self.stopped is not None
        if self.response_started or self.disconnected.is_set() or self._send is None:
            # Mid-response, or nobody to tell: returning without completing it makes the server
            # close the connection, which is the truth.
            return
        # Said without the send timeout: the response has not started, so the client is
        # reading (it is waiting for the headers).
        await error_response(self.stopped).send_asgi(self._send)

    def stop(self, reason: LeaseExpired | ClientDisconnected) -> None:
        """Cancel the running app (once); `run()` then ends the leases and the response."""
        if self.stopped is not None or self.response_complete:
            return
        self.stopped = reason
        if self._app_task is not None:
            self._app_task.cancel()

    # ------------------------------------------------------------------ leases

    def hold(self, lease: Lease) -> None:
        """This request holds `lease` until it ends (at the latest when the request ends)."""
        self.leases.append(lease)
        if self._max_lease_s is not None and self._lease_timer is None:
            self._lease_timer = asyncio.get_running_loop().call_later(
                self._max_lease_s, self._lease_expired
            )
        if self.disconnected.is_set():
            self.stop(ClientDisconnected("the client left before its request was sent"))

    @property
    def lease(self) -> Lease | None:
        """The lease this request holds and has not ended, if any."""
        for lease in self.leases:
            if lease.active:
                return lease
        return None

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
            self.stop(LeaseExpired(f"the request held its engine slot longer than {limit}"))

    def end_leases(self) -> None:
        """Completed where a response went out, abandoned where nothing did (idempotent)."""
        for lease in self.leases:
            if lease.started or self.response_started:
                lease.release()
            else:
                lease.abandon()

    # ------------------------------------------------------------------ receive side

    def watch(self) -> asyncio.Event | None:
        """Start watching for the client leaving; None while the body is not fully read."""
        if self.disconnected.is_set():
            return self.disconnected
        if not self.body_complete or self._send is None:
            return None
        if self._watcher is None:
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
            self.stop(ClientDisconnected("the client left while its request ran"))

    async def receive(self) -> Message:
        if self._watcher is not None:
            # The watcher owns the server's receive(); share its one result, never read twice.
            return await asyncio.shield(self._watcher)
        if self.disconnected.is_set():
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
        kind = message["type"]
        if kind == "http.response.start":
            self.response_started = True
        elif kind == "http.response.body":
            if message.get("body"):
                for lease in self.leases:
                    lease.mark_started()
            if not message.get("more_body", False):
                self.response_complete = True
        if self._send_timeout_s is None or not self.leases:
            # Only a request holding a lease is timed: others hold nothing of the engine's.
            await self._send(message)
        else:
            # A timer rather than wait_for: no task per chunk. `stop()` cancels the app's task,
            # which is the one blocked in this send.
            stalled = asyncio.get_running_loop().call_later(self._send_timeout_s, self._stalled)
            try:
                await self._send(message)
            finally:
                stalled.cancel()
        if self.response_complete:
            for lease in self.leases:
                lease.release()

    def _stalled(self) -> None:
        logger.warning(
            "fair_sched: a client took no response data for %g s (send_timeout_s); ending its "
            "request",
            self._send_timeout_s,
        )
        self.stop(LeaseExpired("the client stopped reading the response"))

    def close(self) -> None:
        """End the leases and stop watching (what `run()` does on its way out)."""
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
        self.end_leases()


class WatchRequests:
    """Pure ASGI wrapper running every HTTP request under a `RequestWatch`.

    For apps that schedule deeper inside (LiteLLM's pre-call hook): code in the request's task
    finds the watch with `current_request()`, asks it to watch for the client leaving, and hands
    it the lease, which then ends with the request at the latest.
    """

    def __init__(
        self, app: ASGIApp, *, max_lease_s: float | None = None, send_timeout_s: float | None = None
    ) -> None:
        self.app = app
        self._max_lease_s = max_lease_s
        self._send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or current_request() is not None:
            # Not HTTP, or already watched (the middleware in front scheduled it).
            await self.app(scope, receive, send)
            return
        watch = RequestWatch(
            receive, send, max_lease_s=self._max_lease_s, send_timeout_s=self._send_timeout_s
        )
        await watch.run(self.app, scope)
