"""Pure ASGI middleware: fair scheduling in front of any Starlette or FastAPI app.

    app.add_middleware(FairSchedulerMiddleware, config="fair_sched.yaml")

For each POST to an LLM path (the OpenAI completion, chat and responses paths by default) the
middleware resolves the caller (from the headers before the body where it can), reads and parses
the JSON body once (bounded: `_body.parse_request_body`), waits for the request's turn holding
the body's bytes, adds our `priority`, and replays the bytes to the app. A POST to such a path is
always scheduled or refused: a body that is not a JSON object with a string `model` gets a 400
from us (an app that fills in a default model would otherwise run it unscheduled). Streams pass
through unbuffered; the lease ends when the response body ends, when the client disconnects
(while parked the app is never called; once running the app is cancelled, so its engine request
is closed), after `max_lease_s`, or when the app raises (the exception is re-raised). Everything
else passes straight through. A server may read a scheduled request's body itself and hand it over
before the request has a task (`take`, as `fair-sched proxy`'s protocol does): the request waits
for its turn in the server, and its app runs once the wait is over.

Which requests are scheduled is one table, built once: each path pattern with its mode
(`paths=` are scheduled; `routes=` adds patterns with modes of their own, such as LiteLLM's
pass-through routes; `others=` is the mode of every other request). A request costs one dict
lookup (the paths answered here: `/fair-sched/*`), for a POST one search of one compiled regex,
and one walk over its headers, whatever its mode. The LiteLLM integration puts one instance in
front of the proxy app with `others="watch"`: every request runs under a `RequestWatch`, which
LiteLLM's pre-call hook finds and hands its lease to (`fair_sched_plugin.litellm._proxy`).

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

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import observability
from .config import FairSchedSettings
from .core import Lease
from .errors import BodyTooLarge, ClientDisconnected, ConfigError, Rejected
from .request import responses as _responses
from .request.body import MAX_BODY_BYTES, parse_request_body, rewrite_priority
from .request.identity import Credentials, Principal
from .request.usage import JsonUsageFinder, Usage, read_usage
from .request.watch import DEPLOYMENT_HEADER, MAX_WAIT_HEADER, RequestWatch, client_max_wait_s
from .runtime.service import Entry, SchedulingService, UnknownModels
from .runtime.shutdown import install_sigterm_drain

UserResolver = Callable[[Scope, Mapping[str, Any]], str | None]

# What the middleware does with an HTTP request whose path matches a pattern (for patterns: a
# POST's; any other method gets the `others` mode):
# - "schedule": read the body, wait for the request's turn, then call the app; a body that is
#   not a JSON object naming a model is refused (400);
# - "schedule_if_model": the same where the body names a model; any other body goes on to the
#   app unscheduled, under the request's watch (for paths where it cannot reach a scheduled
#   engine: LiteLLM's pass-through routes to hosted providers);
# - "watch": call the app under the request's `RequestWatch` (an app that schedules deeper inside
#   finds it with `current_request()`: LiteLLM's pre-call hook);
# - "pass": call the app as it is.
RouteMode = Literal["schedule", "schedule_if_model", "watch", "pass"]
# The paths the middleware answers itself (exact; not patterns).
_ADMIN = "admin"
_QUEUE = "queue"

# Where a caller asks, with its own API key, where its parked requests stand.
QUEUE_PATH = "/fair-sched/queue"

DEFAULT_PATHS = (
    r"^(/v1)?/chat/completions$",
    r"^(/v1)?/completions$",
    r"^(/v1)?/responses$",
)
# The longest event-stream line kept while it waits for its line end (a `usage` event is a few
# hundred bytes).
SSE_LINE_LIMIT_BYTES = 64 * 1024

# Key in the ASGI scope's "state" (Starlette's `request.state.fair_sched_deployment`): the
# deployment the request is bound to, None where the gate knows no deployment of its model.
DEPLOYMENT_STATE = "fair_sched_deployment"
# Key in the ASGI scope's "state": the scheduled request's `model`, read from its body once.
MODEL_STATE = "fair_sched_model"
# Keys in the ASGI scope, set by `take()` at a request's head for the middleware's own call: the
# request taken in at the server (`_Taken`), or the route mode found there (one search).
_TAKEN = "fair_sched.taken"
_ROUTE = "fair_sched.route"

__all__ = [
    "DEFAULT_PATHS",
    "DEPLOYMENT_STATE",
    "MODEL_STATE",
    "QUEUE_PATH",
    "FairSchedulerMiddleware",
    "RouteMode",
]

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
    it can queue (and, unless `resolve_user` or `identity.source: body_user` reads the body,
    before its body is read): for apps that do not authenticate themselves (the standalone
    proxy), so that made-up keys cannot each open a queue and fill the total cap.
    `unknown_models="reject"` answers 404 to a model the service was not configured with, before
    it queues (the standalone proxy serves only its backends); the default schedules every such
    name in one shared queue with one in-flight cap.
    ``GET /fair-sched/queue`` answers a caller, identified as its requests are (its API key),
    with its own parked requests per model, their estimated positions and ETAs
    (`serve_queue=False` leaves that path to the app).
    `paths` are patterns (searched, as `re.search` does) of the paths whose POSTs are scheduled;
    `routes` adds `(pattern, mode)` pairs after them (`RouteMode`), and `others` ("pass" or
    "watch") is the mode of every other HTTP request. The patterns are combined into one regex,
    so each must stand on its own (no numbered back-references).
    """

    def __init__(
        self,
        app: ASGIApp,
        config: str | Mapping[str, Any] | FairSchedSettings | None = None,
        *,
        service: SchedulingService | None = None,
        paths: Iterable[str] = DEFAULT_PATHS,
        routes: Iterable[tuple[str, RouteMode]] = (),
        others: Literal["pass", "watch"] = "pass",
        resolve_user: UserResolver | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        serve_admin: bool = False,
        admin_key: str | None = None,
        reject_unknown_keys: bool = False,
        unknown_models: UnknownModels = "share",
        serve_queue: bool = True,
        admin: ASGIApp | None = None,
    ) -> None:
        self.app = app
        self._unknown_models: UnknownModels = unknown_models
        has_admin = admin is not None or serve_admin
        exact = dict.fromkeys(observability.ADMIN_PATHS, _ADMIN) if has_admin else {}
        if serve_queue:
            exact[QUEUE_PATH] = _QUEUE
        patterns: list[tuple[str, RouteMode]] = [(pattern, "schedule") for pattern in paths]
        self._routes = _Routes(exact, [*patterns, *routes], others)
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
        # Whether a caller's identity may come from its body (a resolver sees the body): if not,
        # it is known from the headers before the body is read.
        self.identity_reads_body = (
            resolve_user is not None or self.service.settings.identity.source == "body_user"
        )
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
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self._lifespan(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        taken: _Taken | None = scope.pop(_TAKEN, None)
        mode = scope.pop(_ROUTE, None)
        if taken is not None:
            # Taken in at the server (`take`): its headers were read there, its body is in.
            max_wait_header = content_length = None
        else:
            mode = mode or self._routes.mode(scope.get("method", ""), scope.get("path", ""))
            if mode == _ADMIN and self._admin is not None:
                await self._admin(scope, receive, send)
                return
            if mode == _QUEUE:
                await self._standing(scope, send)
                return
            scope, max_wait_header, content_length = _read_headers(scope)
            if mode == "pass":
                await self.app(scope, receive, send)
                return
        settings = self.service.settings
        watch = RequestWatch(
            receive,
            send,
            max_lease_s=settings.max_lease_s,
            send_timeout_s=settings.send_timeout_s,
            max_wait_header=max_wait_header,
        )
        if mode == "watch":
            await watch.run(self.app, scope)
        else:
            request = _ScheduledRequest(
                self,
                scope,
                watch,
                mode == "schedule_if_model",
                content_length,
                max_wait_header,
                taken,
            )
            await watch.run(request.schedule_and_call, scope)

    # ------------------------------------------------------------------ taking requests in

    def take(self, scope: Scope) -> Callable[[bytes], _Taken] | None:
        """`ServerParking` (`request/proxy_protocol.py`): a server asks at a request's head
        whether it should read the body and hand it here before the app starts, so that a
        parked request holds no task. Taken: a scheduled POST with its `Content-Length`
        within the limit, from a known caller where strangers are refused. Everything else
        runs as any request does (and is refused there, before its body is read)."""
        if self._config_error is not None or scope["method"] != "POST":
            return None
        mode = scope[_ROUTE] = self._routes.mode("POST", scope["path"])  # its one search
        if mode != "schedule":
            return None
        checked, max_wait_header, content_length = _read_headers(scope)
        declared = _declared_length(content_length)
        if (
            checked is not scope  # the client sent its own deployment header
            or declared is None
            or declared > self._max_body_bytes
        ):
            return None
        principal = None
        if self._reject_unknown_keys and not self.identity_reads_body:
            principal = self.service.identify(self.credentials(scope, {}))
            if not principal.known:
                return None

        def take_body(body: bytes) -> _Taken:
            taken = self.take_in(scope, body, principal=principal, max_wait_header=max_wait_header)
            assert taken is not None  # only "schedule_if_model" leaves a body to the app
            scope[_TAKEN] = taken
            return taken

        return take_body

    def take_in(
        self,
        scope: Scope,
        body_bytes: bytes,
        *,
        principal: Principal | None,
        max_wait_header: bytes | None,
        only_with_model: bool = False,
    ) -> _Taken | None:
        """The scheduled request with its whole body: parsed once, its caller known, its ticket
        released at once or queued (`SchedulingService.enter`), or the answer that refuses it.
        None where `only_with_model` and the body names no model: the app gets it as it is."""
        service = self.service
        try:
            body = parse_request_body(body_bytes, max_bytes=self._max_body_bytes)
        except Rejected as exc:
            return None if only_with_model else _Taken.refused(_responses.error_response(exc))
        model = body.get("model")
        if only_with_model and not isinstance(model, str):
            return None
        try:
            if principal is None:
                principal = service.identify(self.credentials(scope, body))
                if self._reject_unknown_keys and not principal.known:
                    return _Taken.refused(_unknown_key())
            max_wait_s = client_max_wait_s(max_wait_header, service.settings.queue.max_wait_s)
            # While it waits, the request holds its bytes, not the parsed body: the body is
            # read into its ticket (`enter`) and let go, and the bytes forwarded are the
            # client's, without any priority it sent.
            forwarded = _without_client_priority(body, body_bytes)
            del body_bytes
            streaming = body.get("stream") is True
            entry = service.enter(
                principal,
                model,
                body,
                unknown_models=self._unknown_models,
                max_wait_s=max_wait_s,
                body_bytes=len(forwarded),
            )
        except Rejected as exc:
            return _Taken.refused(_responses.error_response(exc))
        assert isinstance(model, str)  # `enter` refuses any other
        return _Taken(model, forwarded, streaming, entry, entry.start_in_s(streaming))

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


class _Taken:
    """A scheduled request taken in with its whole body (`FairSchedulerMiddleware.take_in`): its
    model, the bytes it forwards, whether it streams and its `Entry` in the service; or the
    answer that refuses it. Held while it waits, by its app's frames or, taken in at the server,
    by the server's protocol (as its `ServerParked`)."""

    __slots__ = ("answer", "entry", "forwarded", "model", "start_in_s", "streaming")

    def __init__(
        self,
        model: str,
        forwarded: bytes,
        streaming: bool,
        entry: Entry | None,
        start_in_s: float | None = None,
        answer: _responses.ErrorResponse | None = None,
    ) -> None:
        self.model = model
        self.forwarded = forwarded
        self.streaming = streaming
        self.entry = entry
        self.start_in_s = start_in_s
        self.answer = answer

    @classmethod
    def refused(cls, answer: _responses.ErrorResponse) -> _Taken:
        return cls("", b"", False, None, answer=answer)

    @property
    def waiting(self) -> asyncio.Future[Lease] | None:
        entry = self.entry
        if entry is None or entry.waiter is None or entry.decided:
            return None
        return entry.waiter.future

    def client_left(self) -> None:
        if self.entry is not None:
            self.entry.client_left()


class _ScheduledRequest:
    """Per-request state: body, lease, response progress (the connection is `watch`'s)."""

    __slots__ = (
        "body_usage",
        "content_length",
        "max_wait_header",
        "middleware",
        "only_with_model",
        "response_is_stream",
        "scope",
        "service",
        "sse_tail",
        "stream_chunks",
        "taken",
        "usage",
        "watch",
    )

    def __init__(
        self,
        middleware: FairSchedulerMiddleware,
        scope: Scope,
        watch: RequestWatch,
        only_with_model: bool,
        content_length: bytes | None = None,
        max_wait_header: bytes | None = None,
        taken: _Taken | None = None,
    ) -> None:
        self.middleware = middleware
        # The client's declared `Content-Length` and `x-fair-sched-max-wait-s`, read in the
        # dispatcher's one header walk.
        self.content_length = content_length
        self.max_wait_header = max_wait_header
        # "schedule_if_model": a body naming no model goes on to the app unscheduled.
        self.only_with_model = only_with_model
        # Taken in at the server, before the app started.
        self.taken = taken
        self.service = middleware.service
        self.scope = scope
        self.watch = watch
        self.response_is_stream = False
        self.stream_chunks = 0
        # Made with the response (a parked request holds neither):
        # an event stream's last line until its line end arrives,
        self.sse_tail: bytearray | None = None
        # and a JSON answer's `usage`, wherever it is.
        self.body_usage: JsonUsageFinder | None = None
        self.usage: Usage | None = None

    async def schedule_and_call(self, scope: Scope, receive: Receive, send: Send) -> None:
        middleware = self.middleware
        taken, self.taken = self.taken, None
        if taken is not None:
            self.watch.body_complete = True  # read by the server, before the app started
        else:
            # Where the caller is known from its headers and strangers are refused, a stranger
            # is refused before its body is read: an unknown key never costs the bytes it
            # sends. (Where strangers are served, who calls is read once the body says the
            # request is scheduled.)
            principal = None
            if middleware._reject_unknown_keys and not middleware.identity_reads_body:
                principal = self.service.identify(middleware.credentials(scope, {}))
                if not principal.known:
                    await _unread_body_answer(_unknown_key()).send_asgi(send)
                    return
            body_bytes = await self._read_body(receive, send)
            if body_bytes is None:
                return  # the client left before sending its body, or it was refused
            taken = middleware.take_in(
                scope,
                body_bytes,
                principal=principal,
                max_wait_header=self.max_wait_header,
                only_with_model=self.only_with_model,
            )
            if taken is None:
                await middleware.app(scope, self._replay(body_bytes, receive), send)
                return
            del body_bytes
        if taken.answer is not None:
            await taken.answer.send_asgi(send)
            return
        assert taken.entry is not None
        self.watch.streaming = taken.streaming
        try:
            admission = await self.service.admitted(
                taken.entry, disconnected=self.watch.watch(), waiting=self.watch
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
        new_body = _with_priority(taken.forwarded, admission.engine_priority)
        model = taken.model
        del taken
        app_scope = dict(scope)
        app_scope["headers"] = _for_app(scope["headers"], len(new_body), admission.deployment_name)
        # Where the app sends it: the deployment the scheduler bound it to (request.state), by
        # its key (the api_base); the header carries only its public name, since an app may
        # echo or forward headers. The model is handed on too: the app need not parse again.
        app_scope["state"] = {
            **scope.get("state", {}),
            DEPLOYMENT_STATE: lease.deployment,
            MODEL_STATE: model,
        }
        try:
            await middleware.app(
                app_scope, self._replay(new_body, receive), self._send_and_track(lease, send)
            )
        finally:
            # However the app ended (an exception, cancelled because the client left): the
            # watch ends the lease with what the response said it used.
            self._report(lease)

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        limit = self.middleware._max_body_bytes
        declared = _declared_length(self.content_length)
        if declared is not None and declared > limit:
            # Refused from its header, before a byte of it is read.
            await _unread_body_answer(_too_large(limit)).send_asgi(send)
            return None
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                # A chunked body without end is cut here too.
                await _unread_body_answer(_too_large(limit)).send_asgi(send)
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
                watch.forwarded()
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
            tail = self.sse_tail
            if tail is None:
                tail = self.sse_tail = bytearray()
            whole = chunk.rfind(b"\n") + 1
            if whole:
                # Nearly always the chunk ends a line and nothing was kept: read it as it is.
                lines = bytes(tail) + chunk[:whole] if tail else chunk[:whole]
                self._observe_sse_lines(lines)
                tail.clear()
            if len(tail) + len(chunk) - whole <= SSE_LINE_LIMIT_BYTES:
                tail += chunk[whole:]
            else:
                tail.clear()
        else:
            if self.body_usage is None:
                self.body_usage = JsonUsageFinder()
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
        usage = self.usage
        if usage is None and not self.response_is_stream and self.body_usage is not None:
            usage = self.body_usage.usage
        if usage is not None:
            self.watch.report(lease, *self.service.charges.charge_of(lease.ticket.model, usage))
        elif self.stream_chunks:
            self.watch.report(lease, self.stream_chunks, None)


def _declared_length(content_length: bytes | None) -> int | None:
    """The body's length its `Content-Length` declares, more than any limit past 19 digits;
    None where it declares none in ASCII digits."""
    declared = (content_length or b"").decode("latin-1")
    if not (declared.isascii() and declared.isdigit()):
        return None
    return int(declared) if len(declared) <= 19 else 10**19


def _unknown_key() -> _responses.ErrorResponse:
    return _responses.error(
        401,
        "unknown or missing API key",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _too_large(limit: int) -> _responses.ErrorResponse:
    return _responses.error_response(BodyTooLarge(f"the request body is larger than {limit} bytes"))


def _unread_body_answer(error: _responses.ErrorResponse) -> _responses.ErrorResponse:
    """An answer sent before the body is read to its end: the connection closes after it (the
    server would otherwise read, and discard, whatever the client still sends)."""
    return error._replace(headers={**error.headers, "Connection": "close"})


def _without_client_priority(body: Mapping[str, Any], raw: bytes) -> bytes:
    """The bytes to forward before our priority is added: the client's own where it sent no
    priority (nearly always), else the body serialized once without it."""
    extra_body = body.get("extra_body")
    if "priority" not in body and (
        extra_body is None
        or (isinstance(extra_body, Mapping) and extra_body and "priority" not in extra_body)
    ):
        return raw
    rewritten = dict(body)
    rewrite_priority(rewritten, None, via_extra_body=False)
    return json.dumps(rewritten).encode()


def _with_priority(raw: bytes, priority: int | None) -> bytes:
    """`raw` (a JSON object with a `model`, so not empty, and no `priority`) with the engine
    priority added as its last member: spliced in front of the closing brace, no parse."""
    if priority is None:
        return raw
    end = raw.rstrip().rindex(b"}")
    return b'%s,"priority":%d}' % (raw[:end], priority)


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


_MAX_WAIT_HEADER = MAX_WAIT_HEADER.encode()


def _read_headers(scope: Scope) -> tuple[Scope, bytes | None, bytes | None]:
    """One walk over an HTTP request's headers: `scope` without a client's own
    `x-fair-sched-deployment`, the client's `x-fair-sched-max-wait-s` (the last one), and its
    `Content-Length` (a body declared too large is refused before a byte of it is read).

    The app may trust that header on every route, scheduled or not (one that forwards an
    unscheduled call, an embeddings route say, by it would otherwise go where the client said,
    past the deployment's gate)."""
    max_wait = content_length = None
    from_client = False
    for name, value in scope["headers"]:
        lowered = name.lower()
        if lowered == _MAX_WAIT_HEADER:
            max_wait = value
        elif lowered == b"content-length":
            content_length = value
        elif lowered == DEPLOYMENT_HEADER:
            from_client = True
    if from_client:
        headers = [(n, v) for n, v in scope["headers"] if n.lower() != DEPLOYMENT_HEADER]
        scope = {**scope, "headers": headers}
    return scope, max_wait, content_length


class _Routes:
    """Each HTTP request's mode, from one table built once: the exact paths the middleware
    answers (a dict), then, for a POST, every pattern in one compiled regex (the first that
    matches gives the mode)."""

    def __init__(
        self,
        exact: Mapping[str, str],
        patterns: Iterable[tuple[str, RouteMode]],
        others: RouteMode,
    ) -> None:
        self._exact = dict(exact)
        self._others: str = others
        self._modes: dict[str, str] = {}
        alternatives = []
        for index, (pattern, mode) in enumerate(patterns):
            re.compile(pattern)  # on its own first: a bad pattern's error is its own
            name = f"fair_sched_route{index}"
            self._modes[name] = mode
            alternatives.append(f"(?P<{name}>{_scoped_flags(pattern)})")
        self._regex = re.compile("|".join(alternatives)) if alternatives else None

    def mode(self, method: str, path: str) -> str:
        exact = self._exact.get(path)
        if exact is not None and (exact == _ADMIN or method in ("GET", "HEAD")):
            return exact
        if method == "POST" and self._regex is not None:
            found = self._regex.search(path)
            if found is not None and found.lastgroup is not None:
                return self._modes[found.lastgroup]
        return self._others


_GLOBAL_FLAGS = re.compile(r"^\(\?([aiLmsux]+)\)")


def _scoped_flags(pattern: str) -> str:
    """`(?i)rest` as `(?i:rest)`: global flags are allowed only at the start of the combined
    regex, scoped ones anywhere."""
    found = _GLOBAL_FLAGS.match(pattern)
    if found is None:
        return pattern
    return f"(?{found.group(1)}:{pattern[found.end() :]})"


def _usage_from_sse(chunk: bytes) -> Usage | None:
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
                usage = read_usage(json.loads(line[6:]).get("usage"))
                if usage is not None:
                    return usage
    return None
