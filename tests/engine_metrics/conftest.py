"""A fake engine `/metrics` served by a real uvicorn on 127.0.0.1, and the captured texts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ..support import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MIDBURST = "vllm-0.32-cpu-metrics-midburst.txt"
KVFULL = "vllm-0.32-cpu-metrics-kvfull.txt"

# Long enough for a slow response to outlive any scrape timeout in the tests, short enough that
# a forgotten one cannot hang the suite.
SLOW_RESPONSE_S = 10.0


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def vllm_text(
    *,
    waiting: float = 2,
    running: float = 5,
    kv_usage: float = 0.5,
    tpot_sum: float = 1.0,
    tpot_count: float = 100,
    model_name: str = "tiny",
) -> str:
    """A small page in vLLM 0.32's shape: one engine, the four signals we read."""
    labels = f'engine="0",model_name="{model_name}"'
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {running}\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv_usage}\n"
        "# TYPE vllm:inter_token_latency_seconds histogram\n"
        f'vllm:inter_token_latency_seconds_bucket{{{labels},le="+Inf"}} {tpot_count}\n'
        f"vllm:inter_token_latency_seconds_count{{{labels}}} {tpot_count}\n"
        f"vllm:inter_token_latency_seconds_sum{{{labels}}} {tpot_sum}\n"
    )


class FakeEngine:
    """What the endpoint answers; tests flip `mode` between scrapes."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.mode = "ok"  # ok | garbage | error | slow
        self.requests = 0
        self.release_slow = asyncio.Event()
        # Every answer this late (a loaded engine rendering its page slowly).
        self.delay_s = 0.0

    async def metrics(self, request: Request) -> Response:
        self.requests += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.mode == "garbage":
            return PlainTextResponse("<html><body>502 Bad Gateway</body></html>")
        if self.mode == "error":
            return PlainTextResponse("internal error", status_code=500)
        if self.mode == "slow":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.release_slow.wait(), timeout=SLOW_RESPONSE_S)
        return PlainTextResponse(self.text, media_type="text/plain; version=0.0.4")


class LoopbackServer:
    """uvicorn on a fixed 127.0.0.1 port that can be stopped and started again."""

    def __init__(self, engine: FakeEngine) -> None:
        self.app = Starlette(routes=[Route("/metrics", engine.metrics)])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        for _ in range(200):
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if not self._server.started:
            await self.stop()
            raise RuntimeError("loopback server did not start")

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await asyncio.wait_for(self._task, timeout=5)
        self._server = self._task = None


@pytest.fixture
def midburst_text() -> str:
    return fixture_text(MIDBURST)


@pytest.fixture
def kvfull_text() -> str:
    return fixture_text(KVFULL)


@pytest.fixture
async def engine() -> FakeEngine:
    # Created inside the test's loop: FakeEngine holds an asyncio.Event.
    return FakeEngine(vllm_text())


@pytest.fixture
async def loopback(engine: FakeEngine) -> AsyncIterator[LoopbackServer]:
    server = LoopbackServer(engine)
    await server.start()
    try:
        yield server
    finally:
        engine.release_slow.set()
        await server.stop()
