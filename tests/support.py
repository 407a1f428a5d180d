"""What every test directory needs once: free loopback ports, HTTP clients, bounded polling
(from the harness the benchmarks share), CI detection, a service's app, cancelling tasks.

`eventually` is how a test waits for something that *will* happen (a counter, a log line, a
status field): it polls every few milliseconds and fails after a bound, so a test never sleeps
for a fixed time and never loops forever. To prove that something did *not* happen, wait for
the event that would have come with or after it instead (see tests/README.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import pytest

from fair_sched_plugin.lab.harness.loopback import (
    CLIENT_LIMITS,
    LOOPBACK,
    POLL_INTERVAL_S,
    eventually,
    free_port,
    open_client,
)
from fair_sched_plugin.runtime.service import SchedulingService

__all__ = ["CLIENT_LIMITS", "LOOPBACK", "POLL_INTERVAL_S", "eventually", "free_port", "open_client"]


def find_int(document: Any, key: str) -> int:
    """The first integer under `key` anywhere in a JSON document (depth first); KeyError if none."""
    if isinstance(document, Mapping):
        if isinstance(document.get(key), int):
            return int(document[key])
        for value in document.values():
            try:
                return find_int(value, key)
            except KeyError:
                continue
    raise KeyError(key)


def in_ci() -> bool:
    """Whether this run is CI's (`CI=true`), where a missing tool fails instead of skipping."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def service_of(app: Any) -> SchedulingService:
    """The scheduling service an app built by `build_proxy_app` (or the middleware) keeps."""
    service: SchedulingService = app.state.fair_sched
    return service


async def cancel_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until each has ended, whatever it raised."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def wait_healthy(
    base_url: str, process: subprocess.Popen[bytes], log: Callable[[], str], timeout_s: float = 60
) -> None:
    """Poll `base_url`/health until it answers 200; fail with `log()` if `process` exits first or
    `timeout_s` passes (a server process this test started)."""
    async with httpx.AsyncClient(base_url=base_url, trust_env=False) as client:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/health")).status_code == 200:
                    return
            if process.poll() is not None or loop.time() > give_up_at:
                pytest.fail(f"{base_url} did not start:\n{log()}")
            await asyncio.sleep(0.1)
