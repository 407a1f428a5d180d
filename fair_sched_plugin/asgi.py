"""Pure ASGI middleware: fair scheduling in front of any Starlette or FastAPI app.

    app.add_middleware(FairSchedulerMiddleware, config="fair_sched.yaml")

For each POST to an LLM path (the OpenAI completion, chat and responses paths by default) the
middleware reads the JSON body once, resolves the caller, waits for the request's turn, rewrites
`priority`, and replays the body to the app. Streams pass through unbuffered; the lease ends when
the response body ends, when the client disconnects (while parked the app is never called), or
when the app raises (the exception is re-raised). Everything else passes straight through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

from . import observability
from .config import FairSchedSettings
from .errors import Rejected
from .identity import Credentials
from .service import ClientDisconnected, SchedulingService

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
UserResolver = Callable[[Scope, Mapping[str, Any]], str | None]

DEFAULT_PATHS = (
    r"^(/v1)?/chat/completions$",
    r"^(/v1)?/completions$",
    r"^(/v1)?/responses$",
)
MAX_BODY_BYTES = 8 * 1024 * 1024
# A copy of a non-streamed response body is kept up to this size to read its `usage`.
USAGE_SNIFF_BYTES = 256 * 1024

__all__ = ["DEFAULT_PATHS", "FairSchedulerMiddleware", "error_body"]

logger = logging.getLogger("fair_sched")


def error_body(message: str, *, kind: str, code: str) -> bytes:
    """An error in OpenAI's shape."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "code": code, "param": None}}
    ).encode()


class FairSchedulerMiddleware:
    """Fair, backpressure-aware admission for an ASGI app.

    `config` is a YAML path, a mapping or `FairSchedSettings` (or pass a ready `service`).
    `resolve_user(scope, body)` may name the caller instead of the bearer key; it is trusted.
    `serve_admin=True` answers ``GET /fair-sched/metrics``, ``/fair-sched/status`` and the
    ``/fair-sched/ui`` page itself, behind `admin_key` (or ``observability.admin_key``).
    `reject_unknown_keys=True` answers 401 to a caller that is not a configured principal, before
    it can queue: for apps that do not authenticate themselves (the standalone proxy), so that
    made-up keys cannot each open a queue and fill the total cap.
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
    ) -> None:
        self.app = app
        self.service = service or SchedulingService(config)
        self._paths = [re.compile(pattern) for pattern in paths]
        self._resolve_user = resolve_user
        self._max_body_bytes = max_body_bytes
        self._reject_unknown_keys = reject_unknown_keys
        self._admin: ASGIApp | None = None
        if serve_admin:
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
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or not any(pattern.search(scope.get("path", "")) for pattern in self._paths)
        ):
            await self.app(scope, receive, send)
            return
        await _ScheduledRequest(self, scope, receive, send).run()

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_and_track() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.service.start()
            return message

        async def send_and_track(message: Message) -> None:
            # A failed startup gets no shutdown: stop the watchers on every way out.
            if message["type"] in (
                "lifespan.shutdown.complete",
                "lifespan.shutdown.failed",
                "lifespan.startup.failed",
            ):
                await self.service.aclose()
            await send(message)

        await self.app(scope, receive_and_track, send_and_track)

    def credentials(self, scope: Scope, body: Mapping[str, Any]) -> Credentials:
        headers = _headers(scope)
        api_key = _bearer_key(headers)
        claimed = None
        if self._resolve_user is not None:
            claimed = self._resolve_user(scope, body)
            if claimed:
                # A resolver is configured code, not client input: it is trusted as is.
                return Credentials(api_key=None, user_id=claimed)
        identity = self.service.settings.identity
        if identity.source == "header":
            claimed = headers.get(identity.header.lower())
        elif identity.source == "body_user" and isinstance(body.get("user"), str):
            claimed = body["user"]
        return Credentials(api_key=api_key, claimed_user=claimed)


class _ScheduledRequest:
    """Per-request state: body, lease, response progress."""

    def __init__(
        self, middleware: FairSchedulerMiddleware, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.middleware = middleware
        self.service = middleware.service
        self.scope = scope
        self.receive = receive
        self.send = send
        self.response_started = False
        self.response_is_stream = False
        self.stream_chunks = 0
        self.sniffed = bytearray()
        self.usage_tokens: int | None = None

    async def run(self) -> None:
        body_bytes = await self._read_body()
        if body_bytes is None:
            return  # the client left before sending its body
        try:
            body = json.loads(body_bytes) if body_bytes else None
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            # Not ours to judge: the app answers malformed requests itself (no engine work).
            await self.middleware.app(self.scope, self._replay(body_bytes), self.send)
            return
        principal = self.service.identify(self.middleware.credentials(self.scope, body))
        if self.middleware._reject_unknown_keys and not principal.known:
            await self._respond(
                401,
                error_body(
                    "unknown or missing API key",
                    kind="authentication_error",
                    code="invalid_api_key",
                ),
                extra_headers=[(b"www-authenticate", b"Bearer")],
            )
            return
        disconnected = asyncio.Event()
        watcher = asyncio.ensure_future(self._watch_disconnect(disconnected))
        try:
            admission = await self.service.admit(
                principal, body["model"], body, disconnected=disconnected
            )
        except Rejected as exc:
            await self._reject(exc)
            return
        except ClientDisconnected:
            return
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        lease = admission.lease
        if disconnected.is_set():
            # Granted as the client left: the engine never sees it, so the turn passes on
            # uncharged (release() would count it as served).
            lease.abandon()
            return
        try:
            self.service.rewrite_priority(body, admission.engine_priority, via_extra_body=False)
            new_body = json.dumps(body).encode()
            scope = dict(self.scope)
            scope["headers"] = _with_content_length(self.scope["headers"], len(new_body))
            await self.middleware.app(scope, self._replay(new_body), self._send_and_track(lease))
        finally:
            lease.release(tokens_used=self._tokens_used(lease.ticket.cost))

    async def _read_body(self) -> bytes | None:
        chunks = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.middleware._max_body_bytes:
                await self._respond(
                    413,
                    error_body(
                        "request body too large",
                        kind="invalid_request_error",
                        code="body_too_large",
                    ),
                )
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _watch_disconnect(self, disconnected: asyncio.Event) -> None:
        # The body is fully read, so the only message left to come is http.disconnect.
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                disconnected.set()
                return

    def _replay(self, body: bytes) -> Receive:
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await self.receive()

        return receive

    def _send_and_track(self, lease: Any) -> Send:
        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.response_started = True
                headers = dict(_decode_headers(message.get("headers", [])))
                self.response_is_stream = headers.get("content-type", "").startswith(
                    "text/event-stream"
                )
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    lease.mark_started()
                    self._observe(chunk)
                if not message.get("more_body", False):
                    await self.send(message)
                    lease.release(tokens_used=self._tokens_used(lease.ticket.cost))
                    return
            await self.send(message)

        return send

    def _observe(self, chunk: bytes) -> None:
        if self.response_is_stream:
            self.stream_chunks += chunk.count(b"data: ")
            if b'"usage"' in chunk:
                self.usage_tokens = _usage_from_sse(chunk) or self.usage_tokens
        elif len(self.sniffed) < USAGE_SNIFF_BYTES:
            self.sniffed += chunk[: USAGE_SNIFF_BYTES - len(self.sniffed)]

    def _tokens_used(self, estimate: int) -> int | None:
        if self.usage_tokens is not None:
            return self.usage_tokens
        if self.sniffed:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                usage = json.loads(bytes(self.sniffed)).get("usage") or {}
                total = usage.get("total_tokens")
                if isinstance(total, int):
                    return total
        if self.stream_chunks:
            return self.stream_chunks
        return None

    async def _reject(self, exc: Rejected) -> None:
        kind = "rate_limit_error" if exc.status_code == 429 else "server_error"
        await self._respond(
            exc.status_code,
            error_body(str(exc), kind=kind, code=exc.reason),
            extra_headers=[(b"retry-after", exc.retry_after_header.encode())],
        )

    async def _respond(
        self, status: int, body: bytes, extra_headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *(extra_headers or []),
        ]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


def _decode_headers(raw: Iterable[tuple[bytes, bytes]]) -> Iterable[tuple[str, str]]:
    for name, value in raw:
        yield name.decode("latin-1").lower(), value.decode("latin-1")


def _headers(scope: Scope) -> dict[str, str]:
    return dict(_decode_headers(scope.get("headers", [])))


def _bearer_key(headers: Mapping[str, str]) -> str | None:
    authorization = headers.get("authorization", "")
    if authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    return headers.get("x-api-key") or headers.get("api-key") or None


def _with_content_length(
    headers: Iterable[tuple[bytes, bytes]], length: int
) -> list[tuple[bytes, bytes]]:
    kept = [
        (name, value)
        for name, value in headers
        if name.lower() not in (b"content-length", b"transfer-encoding")
    ]
    kept.append((b"content-length", str(length).encode()))
    return kept


def _usage_from_sse(chunk: bytes) -> int | None:
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                usage = json.loads(line[6:]).get("usage") or {}
                total = usage.get("total_tokens")
                if isinstance(total, int):
                    return total
    return None
