"""What the integration puts in front of LiteLLM's proxy app (`install_request_watch`, #35): one
fair-sched layer whose routing is one path -> mode table, so a request costs at most one regex
search and one walk over its headers however it is handled, and each path still gets its mode.

No proxy is started: a stub app stands where LiteLLM's middleware stack is, and does with the
request's watch what the pre-call hook does (the real proxy is in test_litellm.py and
tests/hardening/test_litellm_routes.py)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType, SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from fair_sched_plugin.observability import STATUS_PATH
from fair_sched_plugin.request.watch import DEPLOYMENT_HEADER, RequestWatch, current_request
from fair_sched_plugin.runtime.service import SchedulingService

from .litellm_harness import NEEDS_LITELLM

pytestmark = [pytest.mark.litellm_range, NEEDS_LITELLM]


class CountingHeaders(list[tuple[bytes, bytes]]):
    """A scope's header list that counts the walks over it."""

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(headers)
        self.walks = 0

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        self.walks += 1
        return super().__iter__()


@dataclass
class Seen:
    """What the stub app saw of one request."""

    called: bool = False
    watched: bool = False
    lease_held: bool = False
    client_deployment_header: bool = False
    regex_searches: int = 0
    header_walks: int = 0
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


def _stub_litellm_app(seen: list[Seen]) -> Any:
    """Where LiteLLM's own stack is: reads the body, and (as the pre-call hook does) asks the
    request's watch for the client's wait limit."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        request = current_request()
        now = seen[-1]
        now.called = True
        now.watched = isinstance(request, RequestWatch)
        now.lease_held = request is not None and request.lease is not None
        # Not a walk of ours: the list's own iterator, uncounted.
        own = list.__iter__(scope["headers"])
        now.client_deployment_header = any(
            name.lower() == DEPLOYMENT_HEADER and value == b"client" for name, value in own
        )
        if request is not None and request.lease is None:
            request.max_wait_s(600.0)  # the hook reads it before it admits
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    return app


async def _refused(request: Request) -> Response:
    return Response(status_code=401)


def _wrapped_proxy(service: SchedulingService, seen: list[Seen]) -> tuple[Any, Any]:
    """The proxy app's middleware stack after `install_request_watch`, and the stub under it.

    Built outside a running loop, so no SIGTERM handler is installed in the test process."""
    from fair_sched_plugin.litellm._proxy import install_request_watch

    stub = _stub_litellm_app(seen)
    proxy_server = SimpleNamespace(app=SimpleNamespace(middleware_stack=stub), master_key=None)
    # Where the integration's admin routes go (`_routes.litellm_admin_routes`, which would also
    # join prometheus_client's global registry): one that refuses everyone, as they do without
    # a master key.
    admin = Router(routes=[Route(STATUS_PATH, _refused)])
    assert install_request_watch(proxy_server, service, admin=admin)
    return proxy_server.app.middleware_stack, stub


async def _request(
    app: Any, seen: list[Seen], method: str, path: str, body: bytes, *, own_deployment: bool = False
) -> Seen:
    now = Seen()
    seen.append(now)
    headers = CountingHeaders(
        [
            (b"host", b"127.0.0.1"),
            (b"authorization", b"Bearer sk-alice"),
            (b"content-type", b"application/json"),
            (b"x-fair-sched-max-wait-s", b"30"),
        ]
    )
    if own_deployment:
        headers.append((DEPLOYMENT_HEADER, b"client"))  # a client's own: never reaches the app
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "state": {}}
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            now.status = message["status"]
            now.headers = list(message.get("headers", []))

    def count_regex(frame: FrameType, event: str, arg: Any) -> None:
        # Ours only (the admin routes' Starlette router matches its own).
        if (
            event == "c_call"
            and isinstance(getattr(arg, "__self__", None), re.Pattern)
            and frame.f_globals.get("__name__", "").startswith("fair_sched_plugin")
        ):
            now.regex_searches += 1

    sys.setprofile(count_regex)
    try:
        await app(scope, receive, send)
    finally:
        sys.setprofile(None)
    now.header_walks = headers.walks
    return now


def _fair_sched_layers(stack: Any, stub: Any) -> list[str]:
    """The fair-sched objects between the proxy app and LiteLLM's own stack."""
    layers = []
    node = stack
    while node is not stub:
        if type(node).__module__.startswith("fair_sched_plugin"):
            layers.append(type(node).__name__)
        node = node.app
    return layers


def test_the_proxy_app_gets_one_fair_sched_layer() -> None:
    service = SchedulingService({})
    stack, stub = _wrapped_proxy(service, [])
    assert len(_fair_sched_layers(stack, stub)) == 1, _fair_sched_layers(stack, stub)


MODELLED = json.dumps({"model": "m", "messages": []}).encode()
ROUTES = pytest.mark.parametrize(
    ("method", "path", "body", "mode"),
    [
        # Scheduled by LiteLLM's pre-call hook: the request only runs under its watch.
        ("POST", "/v1/chat/completions", MODELLED, "watched"),
        ("POST", "/chat/completions", MODELLED, "watched"),
        ("GET", "/health/liveliness", b"", "watched"),
        # A pass-through route to a self-hosted engine: scheduled in front of LiteLLM.
        ("POST", "/vllm/v1/completions", MODELLED, "scheduled"),
        ("GET", "/vllm/v1/models", b"", "watched"),
        # One to a hosted provider: scheduled where the body names a model, else watched.
        ("POST", "/openai/v1/chat/completions", MODELLED, "scheduled"),
        ("POST", "/openai/v1/files", b"purpose=batch", "watched"),
        # Answered in front of LiteLLM (no master key configured: nobody gets in).
        ("GET", "/fair-sched/status", b"", "admin"),
    ],
)


def _one_request(method: str, path: str, body: bytes, *, own_deployment: bool = False) -> Seen:
    service = SchedulingService({"unknown_model_max_inflight": 4})
    seen: list[Seen] = []
    stack, _ = _wrapped_proxy(service, seen)

    async def run() -> Seen:
        try:
            return await _request(stack, seen, method, path, body, own_deployment=own_deployment)
        finally:
            await service.aclose()

    return asyncio.run(run())


@ROUTES
def test_one_path_lookup_and_one_header_walk_per_request(
    method: str, path: str, body: bytes, mode: str
) -> None:
    """Each path gets its mode from one table: a POST from one regex search (the admin paths
    are a dict lookup before it); a request the middleware does not schedule itself is walked
    over once (for the client's `x-fair-sched-deployment`, and the wait limit the hook reads)."""
    now = _one_request(method, path, body)
    assert now.regex_searches == (1 if method == "POST" else 0)
    if mode == "admin":
        assert not now.called and now.status == 401
        return
    assert now.called and now.watched and now.status == 200
    assert now.lease_held == (mode == "scheduled")
    if mode == "watched":
        assert now.header_walks == 1
    else:
        assert dict(now.headers).get(b"x-fair-sched-tier") == b"interactive"


@ROUTES
def test_a_clients_own_deployment_header_never_reaches_litellm(
    method: str, path: str, body: bytes, mode: str
) -> None:
    now = _one_request(method, path, body, own_deployment=True)
    assert not now.client_deployment_header
    assert now.called == (mode != "admin")
