"""A real redis-server on 127.0.0.1 (a free port, a temp dir, no persistence).

Without the binary the Redis tests skip, except in CI (`CI=true`), where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pathlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from fair_sched_plugin.state.redis_replica import RedisReplica

from ..support import eventually, free_port

LOOPBACK = "127.0.0.1"
_prefixes = itertools.count()


def require_redis_server() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("redis-server is missing in CI (scripts/test installs it as root)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return binary


class RedisServer:
    """One redis-server process; `stop()` and `start()` again on the same port (a restart)."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.binary = require_redis_server()
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                LOOPBACK,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        give_up_at = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, self.port), 0.2):
                return
            if self.process.poll() is not None or time.monotonic() > give_up_at:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_redis_server(tmp_path: pathlib.Path) -> Iterator[RedisServer]:
    """A server for this test alone (tests that stop and restart it)."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def unique_prefix() -> str:
    return f"t{os.getpid()}.{next(_prefixes)}:"


async def bounded(awaitable: object, timeout_s: float = 10.0) -> object:
    return await asyncio.wait_for(awaitable, timeout_s)  # type: ignore[arg-type]


async def heartbeats(raw: Any, replicas: int, rounds: int) -> None:
    """Until `replicas` replicas on this redis-server have beaten `rounds` more times each: every
    beat reads the leader lease's PTTL once and nothing else sends PTTL (Redis counts the calls),
    so a test waits for heartbeats instead of sleeping for them."""

    async def pttl_calls() -> int:
        stats = await raw.info("commandstats")
        return int(stats.get("cmdstat_pttl", {}).get("calls", 0))

    target = await pttl_calls() + rounds * replicas

    async def enough() -> bool:
        return await pttl_calls() >= target

    await eventually(enough, 10, what=f"{rounds} heartbeats of {replicas} replicas")


async def vanish(replica: object) -> None:
    """Cut a replica on Redis off without any handover: its tasks stop, its connections close
    (nothing is resigned, nothing is sent)."""
    assert isinstance(replica, RedisReplica)
    for task in (*replica._loops, *replica._leading):
        task.cancel()
    replica._closed = True
    link = replica._link
    assert link is not None
    replica._link = None
    replica._loops = []
    replica._leading = []
    await link.aclose()


async def restart_until_rejoined(
    server: RedisServer, services: Sequence[Any], led: Callable[[], bool]
) -> None:
    """Start a stopped redis-server again; return once every replica (a SchedulingService) is
    back in shared mode and `led()` says the leadership settled."""
    server.start()

    def rejoined() -> bool:
        return all(s.scheduler.mode == "shared" for s in services) and led()

    await eventually(rejoined, 15, what="every replica rejoined its leaders")
