"""A standalone fair proxy: an OpenAI-compatible pass-through for teams without LiteLLM.

    fair-sched proxy --config fair_sched.yaml --port 4000

Each model named in `fair_sched.backends` with an `api_base` (or `api_bases`) is served: `POST
/v1/chat/completions`, `/v1/completions` and `/v1/responses` are forwarded to
`{api_base}/chat/completions` (and so on; a query in the api_base stays after the path) with the
body as the scheduler left it, to the deployment the scheduler bound the request to where the
model has several `api_bases` (logs name it by its public name, never the URL); `GET
/v1/models` lists the models, `GET /health` answers, `GET /fair-sched/metrics` and
`/fair-sched/status` show the scheduler (behind `observability.admin_key` when set), and `GET
/fair-sched/ui` is a live page over the status.
Scheduling is done by `FairSchedulerMiddleware` around the routes, not by the routes themselves.
Responses stream through unbuffered with the upstream status and content type; when the client
goes away (or `max_lease_s` passes) the middleware cancels the route, which closes the upstream
request, so the engine frees the sequence. The client's `Authorization` is never forwarded: it
identifies the caller to us, not to the engine; `backends.<model>.api_key` is sent instead where
set. Nor is its `x-request-id`: two clients could make their ids collide in the engine, so each
request gets a fresh one of ours.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .asgi import DEPLOYMENT_STATE, MODEL_STATE, FairSchedulerMiddleware
from .config import FairSchedSettings, load_settings
from .errors import ConfigError, EngineUnavailable
from .observability import METRICS_PATH, STATUS_PATH, endpoints
from .request import responses as _responses
from .request.watch import current_request
from .runtime.engine_http import KEEPALIVE_EXPIRY_S
from .runtime.service import SchedulingService

if TYPE_CHECKING:
    import uvicorn

__all__ = ["DEFAULT_TIMEOUT", "add_proxy_parser", "build_proxy_app", "proxy_server_config"]

logger = logging.getLogger("fair_sched.proxy")

# How long the proxy keeps a client's idle connection open. Longer than the clients' own pools
# keep theirs (httpx and the openai SDK 5 s, aiohttp 15 s): with uvicorn's 5 s, a client reusing
# a connection idle for 5 s could send a request just as the proxy closed it (a read error
# without a response; seen in the HTTP flood test on a loaded machine).
CLIENT_KEEP_ALIVE_S = 75

# A short connect timeout; a read timeout that only ends a stream silent for minutes (a long
# generation is fine as long as tokens keep coming).
DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=60.0, pool=300.0)

# Routes served under both `/v1/...` and `/...`; the part after `/v1` is appended to `api_base`.
_FORWARDED = ("/chat/completions", "/completions", "/responses")

# Failures that mean the request never got an answer on that connection (a refused connect, a
# pooled connection the server had closed, a reset before any response byte): worth one more try
# on a fresh connection, as the OpenAI and LiteLLM clients also do. A completion has no side
# effects, so the rare duplicate (an engine that cut the connection mid-generation) costs only
# compute.
_RETRIED_ONCE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)

# Request headers passed to the engine. Everything else stays here: `authorization` above all,
# and `x-request-id` (ours replaces it).
_FORWARD_REQUEST_HEADERS = ("content-type", "accept")

# Response headers that describe one hop, not the content.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "date",
        "server",
    }
)


def _json_error(error: _responses.ErrorResponse) -> Response:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


class _UpstreamStream(StreamingResponse):
    """The engine's response relayed chunk by chunk; the upstream is closed however it ends.

    Starlette stops iterating when the client disconnects (or a send fails), which leaves the
    generator suspended: `__call__`'s `finally` closes it and the upstream response explicitly.
    """

    def __init__(self, upstream: httpx.Response) -> None:
        self._upstream = upstream
        self._relay = self._relay_chunks(upstream)
        headers = {
            name: value
            for name, value in upstream.headers.items()
            if name.lower() not in _HOP_BY_HOP
        }
        super().__init__(self._relay, status_code=upstream.status_code, headers=headers)

    @staticmethod
    async def _relay_chunks(upstream: httpx.Response) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            # The client sees a cut connection (no final chunk), which is the truth.
            logger.warning("fair_sched proxy: upstream stream broke: %s", exc)
            raise
        finally:
            await upstream.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._relay.aclose()
            await self._upstream.aclose()


class _ProxyRoutes:
    """The pass-through routes and the one HTTP client they share (open between startup and
    shutdown)."""

    def __init__(
        self,
        service: SchedulingService,
        *,
        timeout: httpx.Timeout,
        transport: httpx.AsyncBaseTransport | None,
    ) -> None:
        self._service = service
        settings = service.settings
        # Each served model's api_bases (`api_base` first): a request goes to the one its lease
        # is bound to, where the model has several.
        self.api_bases = {
            model: bases
            for model, backend in settings.backends.items()
            if (bases := backend.all_api_bases())
        }
        # Resolved once: the settings checked that every `os.environ/NAME` is set.
        self._api_keys = {
            model: key
            for model, backend in settings.backends.items()
            if (key := backend.resolved_api_key()) is not None
        }
        self._timeout = timeout
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # The scheduler bounds what is in flight; a pool limit here would only add a second,
        # unfair queue behind it.
        limits = httpx.Limits(
            max_connections=None,
            max_keepalive_connections=100,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        async with httpx.AsyncClient(
            timeout=self._timeout, limits=limits, transport=self._transport, trust_env=False
        ) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    def routes(self) -> list[Route]:
        routes = [
            Route(prefix + path, self.forward, methods=["POST"])
            for path in _FORWARDED
            for prefix in ("/v1", "")
        ]
        routes.append(Route("/v1/models", self.list_models, methods=["GET"]))
        routes.append(Route("/health", self.health, methods=["GET"]))
        return routes

    async def forward(self, request: Request) -> Response:
        # The middleware scheduled this request: its body is a JSON object with a string `model`
        # this proxy serves (anything else was answered there), read once there and handed on.
        model: str = getattr(request.state, MODEL_STATE, "")
        body = await request.body()
        api_bases = self.api_bases.get(model)
        if api_bases is None:
            return _json_error(
                _responses.error(
                    404,
                    f"The model `{model}` does not exist.",
                    code="model_not_found",
                    param="model",
                )
            )
        # Bound by the middleware in front; a key that is not an api_base in front of one
        # api_base (deployments known by their metrics URLs), or none (the gate did not place
        # the request), means the first api_base.
        deployment = getattr(request.state, DEPLOYMENT_STATE, None)
        api_base = deployment if deployment in api_bases else api_bases[0]
        if deployment is not None and deployment not in api_bases and len(api_bases) > 1:
            # A leader whose `api_bases` differ (a config change rolling out) bound it to an
            # engine this replica does not serve: sent to another, it would run where the
            # leader did not count it.
            shown = self._service.names.deployment_name(deployment)
            logger.warning(
                "fair_sched proxy: a request for model %r was bound to %s, which this proxy "
                "does not serve (do the replicas' api_bases differ?)",
                model,
                shown,
            )
            _engine_never_answered()
            return _json_error(
                _responses.error_response(
                    EngineUnavailable(
                        f"the request was bound to a deployment this proxy does not serve "
                        f"({shown})",
                        retry_after_s=1.0,
                    )
                )
            )
        client = self._client
        if client is None:
            return _json_error(_responses.error(503, "the proxy is not running", code="not_ready"))
        path = request.url.path
        suffix = path[len("/v1") :] if path.startswith("/v1/") else path
        headers = {
            name: request.headers[name]
            for name in _FORWARD_REQUEST_HEADERS
            if name in request.headers
        }
        # Raw bytes are relayed as they come, so ask for them uncompressed.
        headers["accept-encoding"] = "identity"
        headers["x-request-id"] = f"fair-sched-{uuid.uuid4().hex}"
        api_key = self._api_keys.get(model)
        if api_key is not None:
            headers["authorization"] = f"Bearer {api_key}"
        url = upstream_url(api_base, suffix)
        # A client that leaves before the engine answers (for a non-streamed completion: before
        # it has generated everything) makes the middleware cancel this await, which closes the
        # upstream connection: the engine aborts the request.
        try:
            upstream = await _send_retrying_once(
                client, url, body, headers, self._service, api_base
            )
        except httpx.TransportError as exc:
            logger.warning(
                "fair_sched proxy: cannot reach %s for model %r: %s",
                self._service.names.deployment_name(api_base),
                model,
                self._service.names.redact(_describe(exc)),
            )
            if isinstance(exc, httpx.ReadTimeout):
                _engine_timed_out()
            else:
                _engine_never_answered()
            # Retry when the queue ahead would have drained at the measured rate, or at least
            # once the gate could have noticed (metrics go stale and it falls back).
            service = self._service
            retry_after = service.standings.suggest_retry_after(model) or (
                service.settings.effective_stale_after_ms / 1000
            )
            return _json_error(
                _responses.error_response(
                    EngineUnavailable(
                        f"the engine for model `{model}` cannot be reached",
                        retry_after_s=retry_after,
                    )
                )
            )
        return _UpstreamStream(upstream)

    async def list_models(self, request: Request) -> Response:
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "fair-sched"}
            for model in self.api_bases
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})


def upstream_url(api_base: str, suffix: str) -> str:
    """`suffix` appended to the api_base's path, its query kept after it
    (`http://h/v1?k=v` + `/chat/completions` -> `http://h/v1/chat/completions?k=v`)."""
    parts = urlsplit(api_base)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + suffix))


def _engine_never_answered() -> None:
    """The engine never answered: its lease's life ends it before our own answer goes out
    (which is not the engine's first byte: the gate would count a slot taken there)."""
    watch = current_request()
    if watch is not None:
        watch.engine_never_answered()


def _engine_timed_out() -> None:
    """We gave up waiting for the engine's answer (a read timeout): its lease's life ends it
    before our own answer goes out (which is not the engine's first byte)."""
    watch = current_request()
    if watch is not None:
        watch.engine_timed_out()


async def _send_retrying_once(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    service: SchedulingService,
    api_base: str,
) -> httpx.Response:
    """Send the request; after a connection-level failure, once more on a fresh connection.
    The log names the deployment by its public name (the URL may carry credentials)."""

    def send() -> Awaitable[httpx.Response]:
        request = client.build_request("POST", url, content=body, headers=headers)
        return client.send(request, stream=True)

    try:
        return await send()
    except _RETRIED_ONCE as exc:
        logger.info(
            "fair_sched proxy: a request to %s failed (%s); sending it once more",
            service.names.deployment_name(api_base),
            service.names.redact(_describe(exc)),
        )
    return await send()


def _describe(exc: BaseException) -> str:
    """The exception's type and message (httpx's transport errors often carry no message)."""
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def build_proxy_app(
    config: str | Mapping[str, Any] | FairSchedSettings | None = None,
    *,
    service: SchedulingService | None = None,
    timeout: httpx.Timeout = DEFAULT_TIMEOUT,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    """The fair proxy as a Starlette app (serve it with any ASGI server).

    `config` is a YAML path, a mapping or `FairSchedSettings` (or pass a ready `service`). The
    scheduling service is `app.state.fair_sched`; the app's lifespan starts and stops it.
    `transport` replaces the network for tests (httpx's transports).
    """
    service = service or SchedulingService(config)
    proxy = _ProxyRoutes(service, timeout=timeout, transport=transport)
    if service.settings.observability.resolved_admin_key() is None:
        logger.warning(
            "fair_sched proxy: %s is served without authentication and %s is refused; set "
            "fair_sched.observability.admin_key to require a key for both and enable the status",
            METRICS_PATH,
            STATUS_PATH,
        )
    app = Starlette(
        routes=[*proxy.routes(), *endpoints(service)],
        middleware=[
            Middleware(
                FairSchedulerMiddleware,
                service=service,
                # The proxy authenticates no one else: with principal keys configured, only
                # they get in (a stranger's made-up key would otherwise open a fresh queue).
                reject_unknown_keys=(
                    service.directory.has_keys and service.settings.identity.source == "auth"
                ),
                # This proxy serves only its backends: any other name is a 404 before it queues.
                unknown_models="reject",
            )
        ],
        lifespan=proxy.lifespan,
    )
    app.state.fair_sched = service
    return app


def proxy_server_config(
    app: Starlette, *, host: str, port: int, log_level: str = "info"
) -> uvicorn.Config:
    """How `fair-sched proxy` serves `app` (from `build_proxy_app`) with uvicorn: its keep-alive,
    the read deadlines of its settings (counted in its metrics), and its scheduled requests
    taken in at the server (`request/proxy_protocol.py`)."""
    import uvicorn

    from .request.proxy_protocol import proxy_protocol

    service: SchedulingService = app.state.fair_sched
    settings = service.settings
    served, middleware = _entered_without_a_frame(app)
    return uvicorn.Config(
        served,
        interface="asgi3",
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=CLIENT_KEEP_ALIVE_S,
        # Nothing here reads the client's address or scheme (callers are known by their keys):
        # uvicorn's X-Forwarded-* layer would only hold a frame per open request. Its access
        # log names the connection's peer.
        proxy_headers=False,
        http=proxy_protocol(
            headers_timeout_s=settings.read_headers_timeout_s,
            body_timeout_s=settings.read_body_timeout_s,
            on_timeout=service.read_timed_out,
            parking=middleware,
        ),
    )


def _entered_without_a_frame(
    app: Starlette,
) -> tuple[Callable[[Scope, Receive, Send], Awaitable[None]], FairSchedulerMiddleware]:
    """`app` as Starlette enters it, without a coroutine frame of its own and without its
    outermost layer, `ServerErrorMiddleware`: a parked request holds a frame for each layer it
    went through until it is answered, thousands at once. That layer answers an exception with
    a 500 where no response started and re-raises it; uvicorn does the same (and closes the
    connection) and logs it. And the scheduling middleware, now its outermost layer."""
    stack = app.build_middleware_stack()
    if isinstance(stack, ServerErrorMiddleware):
        stack = stack.app
    if not isinstance(stack, FairSchedulerMiddleware):
        raise TypeError(f"the proxy app's outermost middleware is {type(stack).__name__}")
    app.middleware_stack = stack

    def enter(scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        scope["app"] = app
        return stack(scope, receive, send)

    return enter, stack


# ----------------------------------------------------------------------------- command line


def run_proxy_from_args(args: argparse.Namespace) -> int:
    import uvicorn

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"fair-sched proxy: {exc}", file=sys.stderr)
        return 2
    if not any(backend.all_api_bases() for backend in settings.backends.values()):
        print(
            "fair-sched proxy: no model to serve: give `api_base` to at least one entry of "
            "fair_sched.backends",
            file=sys.stderr,
        )
        return 2
    uvicorn.Server(
        proxy_server_config(
            build_proxy_app(settings), host=args.host, port=args.port, log_level=args.log_level
        )
    ).run()
    return 0


def add_proxy_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``fair-sched proxy``; the handler is in ``args.handler``."""
    parser = subparsers.add_parser(
        "proxy", help="serve an OpenAI-compatible fair proxy in front of the configured backends"
    )
    parser.add_argument(
        "--config", required=True, help="YAML file with a fair_sched section (or the section)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4000)
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.set_defaults(handler=run_proxy_from_args)
