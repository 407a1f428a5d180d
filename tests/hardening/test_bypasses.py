"""The middleware and `fair-sched proxy`: no request reaches an engine
unscheduled, no client-chosen name gets fresh capacity, no lease lasts for ever.

Every test runs real servers on 127.0.0.1 (uvicorn in this loop, the emulator) and fails on the
code before the fix it names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fair_sched_plugin.asgi import FairSchedulerMiddleware
from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.runtime.service import SchedulingService

from ..integrations.conftest import (
    MODEL,
    assert_idle,
    cancel_all,
    chat_body,
    emulator,
    fair_config,
    json_error,
    open_client,
    relay_upstream,
    serve,
    wait_until,
)
from ..support import service_of

CHAT = "/v1/chat/completions"


def aliasing_app(emu: RunningEmulator, *, default_model: str | None = MODEL) -> Starlette:
    """What an app behind the middleware may do: fill in a default model, or serve any name
    the client chooses on its one engine (here: everything goes to the emulator's `tiny`)."""

    async def endpoint(request: Request) -> Response:
        body = json.loads(await request.body())
        body["model"] = default_model
        client: httpx.AsyncClient = request.app.state.http
        return await relay_upstream(
            client, f"{emu.base_url}/v1/chat/completions", json.dumps(body).encode()
        )

    return Starlette(routes=[Route(CHAT, endpoint, methods=["POST"])])


@contextlib.asynccontextmanager
async def middleware_app(app: Starlette, config: dict[str, Any]) -> AsyncIterator[str]:
    async with httpx.AsyncClient(trust_env=False, timeout=30.0) as http:
        app.state.http = http
        app.add_middleware(FairSchedulerMiddleware, config=config)
        async with serve(app) as url:
            yield url


def middleware_service(app: Starlette) -> SchedulingService:
    node: Any = app.middleware_stack
    while not isinstance(node, FairSchedulerMiddleware):
        node = node.app
    return node.service


@contextlib.contextmanager
def raw_request(url: str, path: str, body: dict[str, Any], key: str) -> Iterator[socket.socket]:
    """Send one HTTP request on a plain socket and read nothing: a client that stalled."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection((host, int(port)))
    # A small receive buffer so the server's sends block soon.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.sendall(head + payload)
        yield sock
    finally:
        sock.close()


async def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection (fails after `timeout_s`)."""
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    received = bytearray()

    async def read_all() -> bytes:
        while True:
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk:
                return bytes(received)
            received.extend(chunk)

    return await asyncio.wait_for(read_all(), timeout_s)


# ----------------------------------------------------------------------------- request shapes


async def test_a_body_without_model_is_refused_not_forwarded_with_its_priority() -> None:
    """Before: the middleware passed a body without `model` to the app unscheduled, and the app
    (filling in its default model) sent the client's `priority: -50` to the engine."""
    async with emulator() as emu:
        app = aliasing_app(emu)
        async with middleware_app(app, fair_config(emu)) as url, open_client(url, "sk-a") as c:
            body = chat_body(priority=-50)
            del body["model"]
            response = await c.post(CHAT, json=body)
            assert response.status_code == 400, response.text
            assert json_error(response)["param"] == "model"
            not_json = await c.post(CHAT, content=b"{not json")
            assert not_json.status_code == 400
            assert json_error(not_json)["type"] == "invalid_request_error"
        assert not emu.engine.received


async def test_deeply_nested_json_is_a_clear_400_not_a_500() -> None:
    """Before: `json.loads` hit its recursion limit, a 500 with a traceback per request."""
    async with emulator() as emu:
        app = build_proxy_app(fair_config(emu))
        async with serve(app) as url, open_client(url, "sk-a") as client:
            too_deep = b'{"model": "tiny", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
            response = await client.post(CHAT, content=too_deep)
            assert response.status_code == 400
            assert json_error(response)["code"] == "invalid_request"
            deep = chat_body()
            node: Any = deep
            for _ in range(100):  # valid JSON, but deeper than any real request
                node["x"] = {}
                node = node["x"]
            response = await client.post(CHAT, json=deep)
            assert response.status_code == 400
            assert "nests deeper" in json_error(response)["message"]
        assert not emu.engine.received
        assert service_of(app).scheduler.statistics().released_total == 0


async def test_a_comma_separated_model_list_is_refused() -> None:
    """LiteLLM fans `tiny,tiny` out to one engine call per name under one lease; the plugin
    treated the string as an unknown model. The shared request path refuses it everywhere."""
    async with emulator() as emu:
        app = build_proxy_app(fair_config(emu))
        async with serve(app) as url, open_client(url, "sk-batch") as client:
            response = await client.post(CHAT, json=chat_body(model="tiny,tiny"))
            assert response.status_code == 400
            assert json_error(response)["param"] == "model"
        assert not emu.engine.received


async def test_an_unknown_model_is_404_before_it_queues_on_the_proxy() -> None:
    """Before: the proxy's middleware admitted (and remembered) the made-up name, then the route
    answered 404."""
    async with emulator() as emu:
        app = build_proxy_app(fair_config(emu))
        async with serve(app) as url, open_client(url, "sk-a") as client:
            response = await client.post(CHAT, json=chat_body(model="x" * 200))
            assert response.status_code == 404
            assert json_error(response)["code"] == "model_not_found"
            too_long = await client.post(CHAT, json=chat_body(model="x" * 1000))
            assert too_long.status_code == 400
        assert service_of(app).scheduler.statistics().released_total == 0


async def test_client_chosen_model_names_share_one_in_flight_cap() -> None:
    """Before: each made-up name got a fresh `unknown_model_max_inflight` cap, so eight names
    put eight requests into the engine. Now they share one cap of 2."""
    async with emulator(max_num_seqs=16) as emu:
        app = aliasing_app(emu)
        config = fair_config(emu, unknown_model_max_inflight=2)
        async with middleware_app(app, config) as url, open_client(url, "sk-a") as client:
            streams = [
                asyncio.ensure_future(
                    client.post(CHAT, json=chat_body(max_tokens=5000, model=f"made-up-{i}"))
                )
                for i in range(8)
            ]
            try:
                scheduler = middleware_service(app).scheduler
                # Once all eight are in the scheduler, none more can be on its way to the engine.
                await wait_until(lambda: scheduler.statistics().queued == 6)
                await wait_until(lambda: len(emu.engine.received) >= 2)
                assert scheduler.statistics().in_flight == 2
                assert len(emu.engine.received) == 2
            finally:
                await cancel_all(streams)
            await assert_idle(middleware_service(app))


# ----------------------------------------------------------------------------- the backend


async def test_proxy_sends_the_backend_key_and_its_own_request_id(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: no way to reach a vLLM started with --api-key, and the client's x-request-id
    was forwarded, so two clients could make their ids collide in the engine."""
    secret = "sk-backend-only-3f9a"
    monkeypatch.setenv("FAIR_SCHED_TEST_BACKEND_KEY", secret)
    seen: list[dict[str, str]] = []

    async def completions(request: Request) -> Response:
        seen.append(dict(request.headers))
        return JSONResponse({"id": "x", "object": "chat.completion", "choices": []})

    backend = Starlette(routes=[Route(CHAT, completions, methods=["POST"])])
    async with serve(backend) as backend_url:
        config = {
            "principals": [{"name": "a", "keys": ["sk-a"]}, {"name": "b", "keys": ["sk-b"]}],
            "backends": {
                MODEL: {
                    "api_base": f"{backend_url}/v1",
                    "api_key": "os.environ/FAIR_SCHED_TEST_BACKEND_KEY",
                }
            },
        }
        caplog.set_level(logging.DEBUG)
        app = build_proxy_app(config)
        async with serve(app) as url:
            for key in ("sk-a", "sk-b"):
                async with open_client(url, key) as client:
                    response = await client.post(
                        CHAT, json=chat_body(), headers={"x-request-id": "same-id"}
                    )
                    assert response.status_code == 200
    assert [headers["authorization"] for headers in seen] == [f"Bearer {secret}"] * 2
    request_ids = [headers["x-request-id"] for headers in seen]
    assert "same-id" not in request_ids and len(set(request_ids)) == 2
    assert secret not in caplog.text


# ----------------------------------------------------------------------------- leases end


async def test_max_lease_ends_a_stalled_stream_and_closes_its_connection() -> None:
    """Before: a client that stopped reading held its lease (and the engine slot) for as long
    as it kept the socket open."""
    async with emulator() as emu:
        app = build_proxy_app(fair_config(emu, max_lease_s=1.0))
        service = service_of(app)
        async with serve(app) as url:
            body = chat_body(max_tokens=100_000, stream=True)
            with raw_request(url, CHAT, body, "sk-a") as stalled:
                await wait_until(lambda: emu.engine.statistics().running == 1)
                assert service.scheduler.statistics().in_flight == 1
                await wait_until(lambda: service.scheduler.statistics().in_flight == 0, 10)
                await wait_until(lambda: emu.engine.statistics().requests_aborted == 1, 10)
                assert emu.engine.statistics().running == 0
                # The server closed the connection mid-stream: no final chunk came.
                received = await read_until_closed(stalled, 15)
                assert b"data: [DONE]" not in received
            async with open_client(url, "sk-a") as client:  # the proxy still serves
                assert (await client.post(CHAT, json=chat_body())).status_code == 200
            await assert_idle(service)


async def test_max_lease_ends_a_long_non_streamed_request_with_a_504() -> None:
    async with emulator() as emu:
        app = build_proxy_app(fair_config(emu, max_lease_s=0.5))
        async with serve(app) as url, open_client(url, "sk-a") as client:
            response = await client.post(CHAT, json=chat_body(max_tokens=100_000))
            assert response.status_code == 504
            assert json_error(response)["code"] == "lease_expired"
            await wait_until(lambda: emu.engine.statistics().requests_aborted == 1)
            await assert_idle(service_of(app))


async def test_send_timeout_ends_the_lease_of_a_client_that_stops_reading() -> None:
    """An app streaming fast to a client that reads nothing: once the socket buffers are full
    the send blocks; after `send_timeout_s` the request ends and its slot is free again."""

    async def firehose(request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(100_000):  # bounded: 6.4 GB, far more than any buffer
                yield b"data: " + b"x" * 65_536 + b"\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(routes=[Route(CHAT, firehose, methods=["POST"])])
    config = {
        "principals": [{"name": "a", "keys": ["sk-a"]}],
        "send_timeout_s": 0.5,
        "unknown_model_max_inflight": 1,
    }
    async with middleware_app(app, config) as url:
        service = middleware_service(app)
        with raw_request(url, CHAT, chat_body(stream=True), "sk-a"):
            await wait_until(lambda: service.scheduler.statistics().released_total == 1)
            await wait_until(lambda: service.scheduler.statistics().in_flight == 0, 15)
        await assert_idle(service)


async def test_a_client_leaving_a_non_streamed_request_stops_the_engine_and_is_charged() -> None:
    """Before: the middleware left a non-streamed request running in the app when its client
    left (the engine generated everything for nobody). Then its lease, with nothing ever sent
    back, was abandoned: the fairness charge refunded and the budget skipped, though the engine
    had generated tokens for it (194 generated, 0 charged). Now it is completed and charged
    about what the engine generated before the abort reached it."""
    async with emulator() as emu:
        app = aliasing_app(emu)
        async with middleware_app(app, fair_config(emu)) as url, open_client(url, "sk-a") as c:
            service = middleware_service(app)
            charged: list[tuple[int | None, bool]] = []
            service.scheduler.add_end_listener(
                lambda lease, abandoned: charged.append((lease.tokens_used, abandoned))
            )
            leaving = asyncio.ensure_future(c.post(CHAT, json=chat_body(max_tokens=100_000)))
            # Long enough that the engine has generated some and its speed was scraped.
            await wait_until(lambda: emu.engine.statistics().generation_tokens_total >= 40)
            await wait_until(
                lambda: any(
                    r.last_snapshot and r.last_snapshot.tpot_s
                    for r in service.observability.view.deployments()
                )
            )
            await cancel_all([leaving])
            await wait_until(lambda: emu.engine.statistics().requests_aborted == 1)
            await assert_idle(service)
            stats = service.scheduler.statistics()
            generated = emu.engine.statistics().generation_tokens_total
    assert (stats.abandoned_total, stats.completed_total) == (0, 1)
    [(tokens_used, abandoned)] = charged
    assert not abandoned and tokens_used is not None
    # At the engine's recent speed from its release until now: within a factor of two.
    assert generated / 2 <= tokens_used <= 2 * generated, (tokens_used, generated)
