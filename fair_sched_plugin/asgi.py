"""Pure ASGI middleware: fair scheduling in front of any Starlette or FastAPI app.

    app.add_middleware(FairSchedulerMiddleware, config="fair_sched.yaml")

For each POST to an LLM path (the OpenAI completion, chat and responses paths by default) the
middleware reads the JSON body once, resolves the caller, waits for the request's turn, rewrites
`priority`, and replays the body to the app. A POST to such a path is always scheduled or refused:
a body that is not a JSON object with a string `model` gets a 400 from us (an app that fills in a
default model would otherwise run it unscheduled). Streams pass through unbuffered; the lease
ends when the response body ends, when the client disconnects (while parked the app is never
called; once running the app is cancelled, so its engine request is closed), after
`max_lease_s`, or when the app raises (the exception is re-raised). Everything else passes
straight through.

Where the model has several deployments (`backends.<model>.api_bases`), the scheduler binds each
request to one of them and the app must send it there: the deployment's key (its api_base
without a trailing "/", credentials and query as configured) is
`request.state.fair_sched_deployment` (`scope["state"]`), the one place that holds it. The
request header `x-fair-sched-deployment` carries the deployment's public name (the api_base
without credentials, query or fragment, `#n` appended where two would look alike:
`DeploymentNames.deployment_name`), since apps echo and forward headers; a client's own header
of that name is removed from every HTTP request, scheduled or not, so the app may trust it.
None and no header for a model without deployments the gate knows (one scheduled on the shared
in-flight cap). The response carries the same public name in `x-fair-sched-deployment`.

Invalid settings fail the server's lifespan start-up with the `ConfigError` message (uvicorn
logs it and exits), since Starlette builds its middleware only on the first scope.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import _responses, observability
from ._body import parse_request_body, rewrite_priority
from ._request import DEPLOYMENT_HEADER, RequestWatch
from ._shutdown import install_sigterm_drain
from ._usage import JsonUsageFinder, Usage, read_usage
from .config import FairSchedSettings
from .core import Lease
from .errors import ClientDisconnected, ConfigError, Rejected
from .identity import Credentials
from .service import SchedulingService, UnknownModels

UserResolver = Callable[[Scope, Mapping[str, Any]], str | None]

# Where a caller asks, with its own API key, where its parked requests stand.
QUEUE_PATH = "/fair-sched/queue"

DEFAULT_PATHS = (
    r"^(/v1)?/chat/completions$",
    r"^(/v1)?/completions$",
    r"^(/v1)?/responses$",
)
MAX_BODY_BYTES = 8 * 1024 * 1024
# The longest event-stream line kept while it waits for its line end (a `usage` event is a few
# hundred bytes).
SSE_LINE_LIMIT_BYTES = 64 * 1024

# Key in the ASGI scope's "state" (Starlette's `request.state.fair_sched_deployment`): the
# deployment the request is bound to, None where the gate knows no deployment of its model.
DEPLOYMENT_STATE = "fair_sched_deployment"

__all__ = ["DEFAULT_PATHS", "DEPLOYMENT_STATE", "QUEUE_PATH", "FairSchedulerMiddleware"]

logger = logging.getLogger("fair_sched")


class FairSchedulerMiddleware:
    """Fair, backpressure-aware admission for an ASGI app.

    `config` is a YAML path, a mapping or `FairSchedSettings` (or pass a ready `service`).
    `resolve_user(scope, body)` may name the caller instead of the bearer key; it is trusted.
    `serve_admin=True` answers ``GET /fair-sched/metrics``, ``/fair-sched/status`` and the
    ``/fair-sched/ui`` page itself, behind `admin_key` (or ``observability.admin_key``); `admin`
    answers them with another app instead (the LiteLLM integration's, behind the proxy's master
    key).
    `reject_unknown_keys=True` answers 401 to a caller that is not a configured principal, before
    it can queue: for apps that do not authenticate themselves (the standalone proxy), so that
    made-up keys cannot each open a queue and fill the total cap.
    `unknown_models="reject"` answers 404 to a model the service was not configured with, before
    it queues (the standalone proxy serves only its backends); the default schedules every such
    name in one shared queue with one in-flight cap.
    ``GET /fair-sched/queue`` answers a caller, identified as its requests are (its API key),
    with its own parked requests per model, their estimated positions and ETAs
    (`serve_queue=False` leaves that path to the app).
    `pass_unmodelled=True` passes a body that is not a JSON object naming a model to the app
    unscheduled instead of answering 400: only for paths where such a body cannot reach a
    scheduled engine (LiteLLM's pass-through routes to hosted providers).
    """

    def __init__(
        self,
        app: ASGIApp,
        config: str | Mapping[str, Any] | FairSchedSettings | None = None,
        *,
        service: SchedulingService | None = None,
        paths: Iterable[str] = DEFAULT_PATHS,
        resolve_user: UserResolver | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        serve_admin: bool = False,
        admin_key: str | None = None,
        reject_unknown_keys: bool = False,
        unknown_models: UnknownModels = "share",
        pass_unmodelled: bool = False,
        serve_queue: bool = True,
        admin: ASGIApp | None = None,
    ) -> None:
        self.app = app
        self._serve_queue = serve_queue
        self._unknown_models: UnknownModels = unknown_models
        self._pass_unmodelled = pass_unmodelled
        self._paths = [re.compile(pattern) for pattern in paths]
        self._resolve_user = resolve_user
        self._max_body_bytes = max_body_bytes
        self._reject_unknown_keys = reject_unknown_keys
        self._admin: ASGIApp | None = admin
        # Starlette builds its middleware on the first scope (the lifespan): raised from here,
        # the server would take it for "lifespan unsupported", start, and answer 500 to every
        # request. Kept instead, it fails the start-up with its message (see `_refuse`).
        self._config_error: ConfigError | None = None
        try:
            self.service = service or SchedulingService(config)
        except ConfigError as exc:
            self._config_error = exc
            return
        if serve_admin and admin is None:
            # Opt-in: /fair-sched/metrics, /status and /ui answered here, before the app.
            self._admin = observability.admin_app(self.service, admin_key=admin_key)
            if not (admin_key or self.service.settings.observability.resolved_admin_key()):
                logger.warning(
                    "fair_sched: %s is served without an admin key and %s is refused; set "
                    "observability.admin_key (or admin_key=) to require a key for both and "
                    "enable the status and %s",
                    observability.METRICS_PATH,
                    observability.STATUS_PATH,
                    observability.UI_PATH,
                )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._config_error is not None:
            await self._refuse(self._config_error, scope, receive, send)
            return
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if (
            self._admin is not None
            and scope["type"] == "http"
            and scope.get("path") in observability.ADMIN_PATHS
        ):
            await self._admin(scope, receive, send)
            return
        if (
            self._serve_queue
            and scope["type"] == "http"
            and scope.get("path") == QUEUE_PATH
            and scope.get("method") in ("GET", "HEAD")
        ):
            await self._standing(scope, send)
            return
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or not any(pattern.search(scope.get("path", "")) for pattern in self._paths)
        ):
            await self.app(_without_client_deployment(scope), receive, send)
            return
        settings = self.service.settings
        watch = RequestWatch(
            receive,
            send,
            max_lease_s=settings.max_lease_s,
            send_timeout_s=settings.send_timeout_s,
        )
        await _ScheduledRequest(self, scope, watch).run()

    async def _refuse(self, error: ConfigError, scope: Scope, receive: Receive, send: Send) -> None:
        """Invalid settings: the server's start-up fails with their message (uvicorn logs it and
        exits); a server without lifespan gets the error raised on every request instead."""
        if scope["type"] != "lifespan":
            raise ConfigError(str(error))  # a fresh one: no traceback piling up per request
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.failed", "message": str(error)})

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        uninstall_drain = None

        async def receive_and_track() -> Message:
            nonlocal uninstall_drain
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.service.start()
                # The server (uvicorn) installed its signal handlers before its startup: ours
                # goes in front, so a SIGTERM drains the queue before the server stops.
                uninstall_drain = install_sigterm_drain(self.service)
            return message

        async def send_and_track(message: Message) -> None:
            # A failed startup gets no shutdown: stop the watchers on every way out.
            if message["type"] in (
                "lifespan.shutdown.complete",
                "lifespan.shutdown.failed",
                "lifespan.startup.failed",
            ):
                if uninstall_drain is not None:
                    uninstall_drain()
                await self.service.aclose()
            await send(message)

        await self.app(scope, receive_and_track, send_and_track)

    async def _standing(self, scope: Scope, send: Send) -> None:
        credentials = self.credentials(scope, {})
        principal = None
        if credentials.api_key or credentials.user_id or credentials.claimed_user:
            principal = self.service.identify(credentials)
        if principal is None or (self._reject_unknown_keys and not principal.known):
            await _responses.error(
                401,
                "send your API key to see your own queued requests",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            ).send_asgi(send)
            return
        content = json.dumps(self.service.standings.standing_of(principal)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(content)).encode()),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": content, "more_body": False})

    def credentials(self, scope: Scope, body: Mapping[str, Any]) -> Credentials:
        headers = Headers(scope=scope)
        api_key = _bearer_key(headers)
        claimed = None
        if self._resolve_user is not None:
            claimed = self._resolve_user(scope, body)
            if claimed:
                # A resolver is configured code, not client input: it is trusted as is.
                return Credentials(api_key=None, user_id=claimed)
        identity = self.service.settings.identity
        if identity.source == "header":
            claimed = headers.get(identity.header)
        elif identity.source == "body_user" and isinstance(body.get("user"), str):
            claimed = body["user"]
        return Credentials(api_key=api_key, claimed_user=claimed)


class _ScheduledRequest:
    """Per-request state: body, lease, response progress (the connection is `watch`'s)."""

    def __init__(
        self, middleware: FairSchedulerMiddleware, scope: Scope, watch: RequestWatch
    ) -> None:
        self.middleware = middleware
        self.service = middleware.service
        self.scope = scope
        self.watch = watch
        self.response_is_stream = False
        self.stream_chunks = 0
        self.sse_tail = bytearray()  # an event stream's last line until its line end arrives
        self.body_usage = JsonUsageFinder()  # a JSON answer's `usage`, wherever it is
        self.usage: Usage | None = None

    async def run(self) -> None:
        await self.watch.run(self._schedule_and_call, self.scope)

    async def _schedule_and_call(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_bytes = await self._read_body(receive, send)
        if body_bytes is None:
            return  # the client left before sending its body, or it was too large
        if self.middleware._pass_unmodelled and not _names_a_model(body_bytes):
            await self.middleware.app(
                _without_client_deployment(scope), self._replay(body_bytes, receive), send
            )
            return
        try:
            body = parse_request_body(body_bytes)
            principal = self.service.identify(self.middleware.credentials(scope, body))
            if self.middleware._reject_unknown_keys and not principal.known:
                await _responses.error(
                    401,
                    "unknown or missing API key",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                ).send_asgi(send)
                return
            self.watch.streaming = body.get("stream") is True
            admission = await self.service.admit(
                principal,
                body.get("model"),
                body,
                disconnected=self.watch.watch(),
                unknown_models=self.middleware._unknown_models,
                waiting=self.watch,
                max_wait_s=self.watch.max_wait_s(self.service.settings.queue.max_wait_s),
            )
        except Rejected as exc:
            await _responses.error_response(exc).send_asgi(send)
            return
        except ClientDisconnected:
            return
        lease = admission.lease
        self.watch.hold(lease)
        self.watch.interrupted_tokens = self.service.charges.interrupted_tokens
        self.watch.admitted(admission, name_principal=self.service.names_principals)
        rewrite_priority(body, admission.engine_priority, via_extra_body=False)
        new_body = json.dumps(body).encode()
        app_scope = dict(scope)
        app_scope["headers"] = _for_app(scope["headers"], len(new_body), admission.deployment_name)
        # Where the app sends it: the deployment the scheduler bound it to (request.state), by
        # its key (the api_base); the header carries only its public name, since an app may
        # echo or forward headers.
        app_scope["state"] = {**scope.get("state", {}), DEPLOYMENT_STATE: lease.deployment}
        try:
            await self.middleware.app(
                app_scope, self._replay(new_body, receive), self._send_and_track(lease, send)
            )
        finally:
            # However the app ended (an exception, cancelled because the client left): the
            # watch ends the lease with what the response said it used.
            self._report(lease)

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.middleware._max_body_bytes:
                await _responses.error(
                    413, "request body too large", code="body_too_large"
                ).send_asgi(send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _replay(self, body: bytes, receive: Receive) -> Receive:
        sent = False
        watch = self.watch

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                # The app has the request now, on its way to the engine.
                watch.forwarded = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    def _send_and_track(self, lease: Lease, send: Send) -> Send:
        async def send_and_track(message: Message) -> None:
            if message["type"] == "http.response.start":
                content_type = Headers(raw=message.get("headers", [])).get("content-type", "")
                self.response_is_stream = content_type.startswith("text/event-stream")
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    self._observe(chunk)
                if not message.get("more_body", False):
                    # The watch ends the lease once the last chunk is out (after recording
                    # its first byte): say what it used first.
                    self._report(lease)
            await send(message)

        return send_and_track

    def _observe(self, chunk: bytes) -> None:
        if self.response_is_stream:
            # A relayed stream's chunks are network reads (`fair-sched proxy` relays them as
            # they come), so an event can straddle two: only whole lines are read, and a cut
            # line is kept until its end arrives (appended in place; bounded: a line that long
            # is no `usage` we read, and is dropped).
            whole = chunk.rfind(b"\n") + 1
            if whole:
                # Nearly always the chunk ends a line and nothing was kept: read it as it is.
                lines = bytes(self.sse_tail) + chunk[:whole] if self.sse_tail else chunk[:whole]
                self._observe_sse_lines(lines)
                self.sse_tail.clear()
            if len(self.sse_tail) + len(chunk) - whole <= SSE_LINE_LIMIT_BYTES:
                self.sse_tail += chunk[whole:]
            else:
                self.sse_tail.clear()
        else:
            self.body_usage.feed(chunk)

    def _observe_sse_lines(self, lines: bytes) -> None:
        self.stream_chunks += lines.count(b"data: ")
        if b'"usage"' in lines:
            self.usage = _usage_from_sse(lines) or self.usage

    def _report(self, lease: Lease) -> None:
        """Tell the watch what the response says the request used: its `usage`; without one,
        a stream is charged a token per chunk it carried (nothing relayed: the estimate)."""
        if self.sse_tail:  # a last line without its line end
            self._observe_sse_lines(bytes(self.sse_tail))
            self.sse_tail.clear()
        usage = self.usage or (None if self.response_is_stream else self.body_usage.usage)
        if usage is not None:
            self.watch.report(lease, *self.service.charges.charge_of(lease.ticket.model, usage))
        elif self.stream_chunks:
            self.watch.report(lease, self.stream_chunks, None)


def _names_a_model(body_bytes: bytes) -> bool:
    try:
        return isinstance(parse_request_body(body_bytes).get("model"), str)
    except Rejected:
        return False


def _bearer_key(headers: Headers) -> str | None:
    authorization = headers.get("authorization", "")
    if authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    return headers.get("x-api-key") or headers.get("api-key") or None


def _for_app(
    headers: Iterable[tuple[bytes, bytes]], length: int, deployment: str | None
) -> list[tuple[bytes, bytes]]:
    """The request headers the app sees: the rewritten body's length, and the public name of
    the deployment the request is bound to; a client's own `x-fair-sched-deployment` never
    reaches the app."""
    kept = [
        (name, value)
        for name, value in headers
        if name.lower() not in (b"content-length", b"transfer-encoding", DEPLOYMENT_HEADER)
    ]
    kept.append((b"content-length", str(length).encode()))
    if deployment is not None:
        kept.append((DEPLOYMENT_HEADER, deployment.encode("latin-1", "replace")))
    return kept


def _without_client_deployment(scope: Scope) -> Scope:
    """`scope` for a request the middleware does not schedule, without a client's own
    `x-fair-sched-deployment`: the app may trust that header on every route (one that forwards
    an unscheduled call, an embeddings route say, by it would otherwise go where the client
    said, past the deployment's gate)."""
    if scope["type"] != "http" or not any(
        name.lower() == DEPLOYMENT_HEADER for name, _ in scope.get("headers", ())
    ):
        return scope
    headers = [(n, v) for n, v in scope["headers"] if n.lower() != DEPLOYMENT_HEADER]
    return {**scope, "headers": headers}


def _usage_from_sse(chunk: bytes) -> Usage | None:
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
                usage = read_usage(json.loads(line[6:]).get("usage"))
                if usage is not None:
                    return usage
    return None
