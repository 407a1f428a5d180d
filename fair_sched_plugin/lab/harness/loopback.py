"""Loopback servers' plumbing: free ports, clients for floods, bounded polling.

`eventually` is how a caller waits for something that *will* happen (a counter, a log line, a
status field): it polls every few milliseconds and gives up after a bound (an `AssertionError`,
a failed test under pytest), so nothing sleeps for a fixed time or loops forever.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

LOOPBACK = "127.0.0.1"
# Floods open more than httpx's default 100 connections at once.
CLIENT_LIMITS = httpx.Limits(max_connections=500, max_keepalive_connections=500)
POLL_INTERVAL_S = 0.005


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def open_client(
    base_url: str = "",
    key: str | None = None,
    timeout: float | httpx.Timeout = 30.0,
    **options: Any,
) -> httpx.AsyncClient:
    """A client for a server on 127.0.0.1: no proxies from the environment, room for floods,
    `authorization: Bearer key` when given."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(
        base_url=base_url,
        limits=options.pop("limits", CLIENT_LIMITS),
        timeout=timeout,
        headers={**headers, **options.pop("headers", {})},
        trust_env=False,
        **options,
    )


async def eventually(
    condition: Callable[[], bool] | Callable[[], Awaitable[bool]],
    timeout_s: float = 10.0,
    *,
    interval_s: float = POLL_INTERVAL_S,
    what: str = "condition",
) -> None:
    """Poll `condition` (a plain or async callable) until it is true; raise `AssertionError`
    after `timeout_s`. The bound is a safety net, never what a test measures."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > give_up_at:
            raise AssertionError(f"{what} not met within {timeout_s} s")
        await asyncio.sleep(interval_s)
