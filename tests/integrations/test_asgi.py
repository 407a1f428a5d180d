"""FairSchedulerMiddleware in Starlette and FastAPI apps, served by uvicorn in front of the
emulator, plus the ASGI contract for scopes it must leave alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, MutableMapping
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from fair_sched_plugin.asgi import FairSchedulerMiddleware
from fair_sched_plugin.core import Lease
from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.runtime.service import SchedulingService

from .conftest import (
    assert_idle,
    cancel_all,
    chat_body,
    emulator,
    fair_config,
    find_middleware,
    forwarding_handler,
    gate_sees_metrics,
    http_state,
    json_error,
    open_client,
    park_behind_full_engine,
    serve,
    wait_until,
)


def starlette_app(emu: RunningEmulator) -> Starlette:
    async def other(request: Request) -> Response:
        return PlainTextResponse(f"other {request.method}")

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", forwarding_handler(emu.base_url), methods=["POST"]),
            Route("/v1/chat/completions", other, methods=["GET"]),
            Route("/other", other, methods=["POST"]),
        ],
        lifespan=http_state,
    )
    app.state.bodies = []
    return app


def fastapi_app(emu: RunningEmulator) -> FastAPI:
    app = FastAPI(lifespan=http_state)
    app.state.bodies = []
    app.add_api_route("/v1/chat/completions", forwarding_handler(emu.base_url), methods=["POST"])

    @app.get("/v1/chat/completions")
    async def get_chat() -> PlainTextResponse:
        return PlainTextResponse("other GET")

    @app.post("/other")
    async def other() -> PlainTextResponse:
        return PlainTextResponse("other POST")

    return app


def build(kind: str, how: str, emu: RunningEmulator, config: Mapping[str, Any]) -> tuple[Any, Any]:
    """(ASGI app to serve, the inner app) with the middleware added or wrapped around it."""
    inner = starlette_app(emu) if kind == "starlette" else fastapi_app(emu)
    if how == "add_middleware":
        inner.add_middleware(FairSchedulerMiddleware, config=config)
        return inner, inner
    return FairSchedulerMiddleware(inner, config=config), inner


def service_in(served: Any) -> SchedulingService:
    middleware = served if isinstance(served, FairSchedulerMiddleware) else find_middleware(served)
    return middleware.service


@pytest.mark.parametrize("how", ["add_middleware", "wrap"])
@pytest.mark.parametrize("kind", ["starlette", "fastapi"])
async def test_llm_posts_are_scheduled_everything_else_passes(kind: str, how: str) -> None:
    async with emulator() as emu:
        served, _ = build(kind, how, emu, fair_config(emu))
        async with serve(served) as url, open_client(url, key="sk-a") as client:
            service = service_in(served)
            assert service.started  # the middleware's lifespan started it

            streamed = await client.post("/v1/chat/completions", json=chat_body(stream=True))
            assert streamed.status_code == 200
            assert streamed.text.rstrip().endswith("data: [DONE]")
            whole = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
            assert whole.json()["usage"]["completion_tokens"] == 4
            assert service.scheduler.statistics().released_total == 2

            # Not LLM work: GET on an LLM path, POST elsewhere, a body that is not JSON.
            assert (await client.get("/v1/chat/completions")).text == "other GET"
            assert (await client.post("/other", json=chat_body())).text == "other POST"
            garbage = await client.post("/v1/chat/completions", content=b"not json")
            assert garbage.status_code == 400  # the emulator's answer, relayed by the app
            assert service.scheduler.statistics().released_total == 2
            assert emu.engine.statistics().requests_received == 2
            await assert_idle(service)
        assert not service.started or service.scheduler.statistics().queued == 0


# ----------------------------------------------------------------------------- ASGI contract


class Recorder:
    """An inner ASGI app that records exactly what it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls.append((scope, receive, send))


@pytest.mark.parametrize(
    "scope",
    [
        {"type": "websocket", "path": "/v1/chat/completions", "headers": []},
        {"type": "http", "method": "GET", "path": "/v1/chat/completions", "headers": []},
        {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": []},
    ],
    ids=["websocket", "get", "other-post"],
)
async def test_other_scopes_pass_through_untouched(scope: dict[str, Any]) -> None:
    recorder = Recorder()
    middleware = FairSchedulerMiddleware(recorder, config={})

    async def receive() -> dict[str, Any]:
        raise AssertionError("the middleware must not read this request")

    async def send(message: Any) -> None:
        raise AssertionError("the middleware must not answer this request")

    await middleware(scope, receive, send)
    assert len(recorder.calls) == 1
    seen_scope, seen_receive, seen_send = recorder.calls[0]
    assert seen_scope is scope and seen_receive is receive and seen_send is send
    assert not middleware.service.started


async def test_lifespan_messages_reach_the_app_and_drive_the_service() -> None:
    seen: list[str] = []
    service = SchedulingService({})

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        message = await receive()
        seen.append(message["type"])
        assert service.started
        await send({"type": "lifespan.startup.complete"})
        message = await receive()
        seen.append(message["type"])
        await send({"type": "lifespan.shutdown.complete"})

    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for message_type in ("lifespan.startup", "lifespan.shutdown"):
        inbox.put_nowait({"type": message_type})
    sent: list[dict[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    middleware = FairSchedulerMiddleware(app, service=service)
    await middleware({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, send)
    assert seen == ["lifespan.startup", "lifespan.shutdown"]
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    with pytest.raises(RuntimeError):
        service.start()  # closed at shutdown


# ----------------------------------------------------------------------------- rejection


async def test_per_user_cap_answers_429_with_retry_after() -> None:
    async with emulator(max_num_seqs=1) as emu:
        config = fair_config(emu, waiting_below=1, queue={"max_per_user": 2})
        served, _ = build("starlette", "add_middleware", emu, config)
        async with serve(served) as url, open_client(url, key="sk-a") as client:
            service = service_in(served)
            await gate_sees_metrics(service)
            hogs = await park_behind_full_engine(emu, service, client)
            parked = [
                asyncio.ensure_future(client.post("/v1/chat/completions", json=chat_body()))
                for _ in range(2)
            ]
            await wait_until(lambda: service.scheduler.statistics().queued == 2)

            response = await client.post("/v1/chat/completions", json=chat_body())
            assert response.status_code == 429
            assert int(response.headers["retry-after"]) >= 1
            error = json_error(response)
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"

            # Another user still gets in line.
            async with open_client(url, key="sk-b") as other:
                queued = asyncio.ensure_future(other.post("/v1/chat/completions", json=chat_body()))
                await wait_until(lambda: service.scheduler.statistics().queued == 3)
                await cancel_all([*hogs, *parked, queued])
            await assert_idle(service)
            assert [r.user for r in emu.engine.received] == ["hog-1", "hog-2"]


# ----------------------------------------------------------------------------- priority


def recording_app(emu: RunningEmulator) -> Starlette:
    """The forwarding app, also keeping every body it was given (what reaches the engine)."""
    forward = forwarding_handler(emu.base_url)

    async def endpoint(request: Request) -> Response:
        request.app.state.bodies.append(json.loads(await request.body()))
        return await forward(request)  # type: ignore[no-any-return]

    app = Starlette(
        routes=[Route("/v1/chat/completions", endpoint, methods=["POST"])], lifespan=http_state
    )
    app.state.bodies = []
    return app


CLIENT_PRIORITIES: list[dict[str, Any]] = [
    {"priority": -100},
    {"extra_body": {"priority": -100}},
    {"priority": -100, "extra_body": {"priority": -50, "top_k": 5}},
    {},
]


async def _send_with_client_priorities(url: str) -> list[httpx.Response]:
    responses = []
    for key in ("sk-a", "sk-batch"):
        async with open_client(url, key=key) as client:
            for extra in CLIENT_PRIORITIES:
                body = chat_body(max_tokens=2, user=key, **extra)
                responses.append(await client.post("/v1/chat/completions", json=body))
    return responses


async def test_tier_priority_replaces_client_priority() -> None:
    async with emulator(policy="priority") as emu:
        inner = recording_app(emu)
        served = FairSchedulerMiddleware(
            inner, config=fair_config(emu, backend={"priority_scheduling": True})
        )
        async with serve(served) as url:
            responses = await _send_with_client_priorities(url)
            assert [r.status_code for r in responses] == [200] * len(responses)
            by_user = {
                user: {r.priority for r in emu.engine.received if r.user == user}
                for user in ("sk-a", "sk-batch")
            }
            assert by_user == {"sk-a": {0}, "sk-batch": {10}}  # the tiers' vllm_priority
            for body in inner.state.bodies:
                assert body["priority"] in (0, 10)
                assert "priority" not in body.get("extra_body", {})
            await assert_idle(served.service)


async def test_no_priority_reaches_an_engine_without_priority_scheduling() -> None:
    async with emulator(policy="fcfs") as emu:
        inner = recording_app(emu)
        served = FairSchedulerMiddleware(inner, config=fair_config(emu))
        async with serve(served) as url:
            responses = await _send_with_client_priorities(url)
            # An fcfs engine answers 400 to any non-zero priority: none got through.
            assert [r.status_code for r in responses] == [200] * len(responses)
            assert len(emu.engine.received) == len(responses)
            for body in inner.state.bodies:
                assert "priority" not in body
                assert "priority" not in body.get("extra_body", {})
            await assert_idle(served.service)


async def test_failed_startup_still_closes_the_service() -> None:
    """An app whose startup fails never gets a shutdown: the watchers must stop anyway."""
    service = SchedulingService({})

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "boom"})

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    await FairSchedulerMiddleware(app, service=service)({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    with pytest.raises(RuntimeError):
        service.start()


# ----------------------------------------------------------------------------- split events

SPLIT_USAGE = {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}
SPLIT_STREAM = (
    b"".join(
        b"data: " + json.dumps(event).encode() + b"\n\n"
        for event in (
            *({"choices": [{"delta": {"content": f"t{n}"}}]} for n in range(3)),
            {"choices": [], "usage": SPLIT_USAGE},
        )
    )
    + b"data: [DONE]\n\n"
)


def split_stream_app(pieces: list[bytes]) -> Starlette:
    """A chat route whose event stream reaches the middleware in these body messages: as a
    relay's network reads may cut it (`fair-sched proxy` relays raw reads)."""

    async def chat(request: Request) -> Response:
        await request.body()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for piece in pieces:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        return app  # type: ignore[return-value]

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def test_a_streams_usage_is_read_wherever_its_chunks_are_cut() -> None:
    """The `tokens` policy charges the stream's `usage` (prompt + completion), also when the
    usage event or its `data: ` arrives in two pieces, or the stream one byte at a time; before,
    such a cut lost the usage and the stream was charged one token per chunk."""
    usage_at = SPLIT_STREAM.index(b'data: {"choices": [], "usage"')
    cuts = [*range(usage_at - 2, usage_at + 12), len(SPLIT_STREAM) - 30, usage_at + 60]
    ways = [[SPLIT_STREAM[:cut], SPLIT_STREAM[cut:]] for cut in cuts]
    ways.append([SPLIT_STREAM[at : at + 1] for at in range(len(SPLIT_STREAM))])
    # A line longer than the middleware keeps (100 kB, in 1 kB reads) is dropped, not the
    # lines after it.
    long_line = "data: " + json.dumps({"choices": [{"delta": {"content": "x" * 100_000}}]})
    longer = long_line.encode() + b"\n\n" + SPLIT_STREAM
    ways.append([longer[at : at + 1000] for at in range(0, len(longer), 1000)])
    async with emulator() as emu:
        for pieces in ways:
            served = FairSchedulerMiddleware(
                split_stream_app(pieces), config=fair_config(emu, fairness="tokens")
            )
            charged: list[int | None] = []

            def record(lease: Lease, abandoned: bool, charged: list[int | None] = charged) -> None:
                charged.append(lease.tokens_used)

            async with serve(served) as url, open_client(url, key="sk-a") as client:
                served.service.scheduler.add_end_listener(record)
                response = await client.post("/v1/chat/completions", json=chat_body(stream=True))
                assert response.status_code == 200
                assert response.content == b"".join(pieces)
            assert charged == [33], [len(piece) for piece in pieces]
