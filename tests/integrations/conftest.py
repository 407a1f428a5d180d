"""Helpers for the integration tests: real servers on 127.0.0.1, bounded waits, no fixed sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fair_sched_plugin.asgi import FairSchedulerMiddleware
from fair_sched_plugin.lab.emulator.engine import EmulatorConfig
from fair_sched_plugin.lab.emulator.server import RunningEmulator, run_emulator
from fair_sched_plugin.proxy import CLIENT_KEEP_ALIVE_S
from fair_sched_plugin.runtime.service import SchedulingService

from ..support import LOOPBACK, cancel_all, eventually, open_client

# The names the integration tests have always imported from here.
wait_until = eventually
__all__ = ["LOOPBACK", "cancel_all", "open_client", "wait_until"]

MODEL = "tiny"
STARTUP_TIMEOUT_S = 10.0
# Orderings are what these tests check, so a step only needs to be long enough for the gate's
# scrapes (every 50 ms) to see the engine's queue.
FAST_STEPS = {"base_step_ms": 4.0, "step_ms_per_running_seq": 0.0, "prefill_ms_per_token": 0.0}


def emulator_config(**overrides: Any) -> EmulatorConfig:
    return EmulatorConfig(**{"models": (MODEL,), **FAST_STEPS, **overrides})


def fair_config(emu: RunningEmulator, waiting_below: int = 2, **overrides: Any) -> dict[str, Any]:
    """A `fair_sched` section for one emulator; `backend` entries override `backends.tiny`'s."""
    backend = {"api_base": f"{emu.base_url}/v1", **overrides.pop("backend", {})}
    config: dict[str, Any] = {
        "tiers": [
            {"name": "interactive", "waiting_below": waiting_below, "vllm_priority": 0},
            {"name": "batch", "waiting_below": 1, "vllm_priority": 10},
        ],
        "default_tier": "interactive",
        "principals": [
            {"name": "alice", "keys": ["sk-a"]},
            {"name": "bob", "keys": ["sk-b"]},
            {"name": "carol", "keys": ["sk-c"]},
            {"name": "bot", "keys": ["sk-batch"], "tier": "batch"},
        ],
        "backends": {MODEL: backend},
        "metrics_poll_ms": 50,
    }
    config.update(overrides)
    return config


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app (lifespan on) in this event loop on a free port; yield its base URL."""
    config = uvicorn.Config(
        app,
        host=LOOPBACK,
        port=0,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=2,
        timeout_keep_alive=CLIENT_KEEP_ALIVE_S,  # as `fair-sched proxy` serves
    )
    server = uvicorn.Server(config)
    serving = asyncio.get_running_loop().create_task(server.serve(), name="test-uvicorn")
    try:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + STARTUP_TIMEOUT_S
        while not server.started:
            if serving.done():
                serving.result()
                raise RuntimeError("uvicorn stopped before it started serving")
            if loop.time() > give_up_at:
                raise TimeoutError("the server did not start in time")
            await asyncio.sleep(0.005)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(serving, 10)
        except asyncio.TimeoutError:
            server.force_exit = True
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)


def chat_body(max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
        "max_tokens": max_tokens,
        **extra,
    }


def completion_body(max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Fair scheduling is", "max_tokens": max_tokens, **extra}


async def assert_idle(service: SchedulingService) -> None:
    """Nothing queued, nothing in flight (a lease ends just after the client saw the end)."""

    def idle() -> bool:
        stats = service.scheduler.statistics()
        return stats.queued == 0 and stats.in_flight == 0

    await wait_until(idle, timeout_s=5.0)


async def gate_sees_metrics(service: SchedulingService) -> None:
    """Wait until the gate runs on fresh engine metrics (not the start-up in-flight cap)."""
    await wait_until(lambda: all(s.mode == "metrics" for s in service.gate.status()))


def find_middleware(app: Any) -> FairSchedulerMiddleware:
    """The middleware instance inside an app (built by Starlette at the first call)."""
    node = app.middleware_stack if isinstance(app, Starlette) else app
    for _ in range(32):
        if isinstance(node, FairSchedulerMiddleware):
            return node
        node = getattr(node, "app", None)
        if node is None:
            break
    raise LookupError("no FairSchedulerMiddleware in this app")


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def received_priorities(emu: RunningEmulator) -> list[int]:
    return [request.priority for request in emu.engine.received]


def json_error(response: httpx.Response) -> Mapping[str, Any]:
    payload = json.loads(response.content)
    error = payload["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and "code" in error
    return error  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def emulator(**overrides: Any) -> AsyncIterator[RunningEmulator]:
    async with run_emulator(emulator_config(**overrides)) as running:
        yield running


async def relay_upstream(client: httpx.AsyncClient, url: str, body: bytes) -> StreamingResponse:
    """POST `body` to `url` and stream the answer back unbuffered, closing the upstream after."""
    upstream = await client.send(
        client.build_request(
            "POST", url, content=body, headers={"content-type": "application/json"}
        ),
        stream=True,
    )

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()

    return StreamingResponse(
        relay(),
        status_code=upstream.status_code,
        media_type=upstream.headers.get("content-type"),
    )


def forwarding_handler(
    emu_base_url: str,
) -> Callable[[Any], Any]:
    """A tiny endpoint (what an app author writes): forward the body to the emulator as is."""

    async def endpoint(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.http
        return await relay_upstream(
            client, f"{emu_base_url}/v1/chat/completions", await request.body()
        )

    return endpoint


@contextlib.asynccontextmanager
async def http_state(app: Any) -> AsyncIterator[None]:
    async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
        app.state.http = client
        yield


async def park_behind_full_engine(
    emu: RunningEmulator, service: SchedulingService, client: httpx.AsyncClient
) -> list[asyncio.Task[None]]:
    """Two long streams fill a one-slot engine (one runs, one waits) and the gate has seen it:
    with `waiting_below: 1` the next request parks. Cancel the returned tasks to end them."""

    async def long_stream(tag: str) -> None:
        body = chat_body(max_tokens=5000, stream=True, user=tag)
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_raw():
                pass

    tasks = []
    for tag in ("hog-1", "hog-2"):
        tasks.append(asyncio.ensure_future(long_stream(tag)))
        await wait_until(functools.partial(_engine_received_from, emu, tag))
    await wait_until(lambda: all((s.waiting or 0) >= 1 for s in service.gate.status()))
    return tasks


def _engine_received_from(emu: RunningEmulator, user: str) -> bool:
    return any(request.user == user for request in emu.engine.received)


async def get_on_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str
) -> bytes:
    """One `GET path` on an already open HTTP/1.1 connection, its body read; its status line
    (keep-alive tests reuse the connection after an idle wait)."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head.split(b"\r\n", 1)[0]
