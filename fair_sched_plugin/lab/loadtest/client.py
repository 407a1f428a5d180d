"""The load generator's client side: streaming requests timed from the caller's point of view."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from ...runtime.engine_http import sse_lines

MODEL = "tiny"
PROMPT = "Write a short story about a lighthouse keeper."
# A stream silent this long is a failure, not a slow request; keeps every run bounded.
REQUEST_TIMEOUT = httpx.Timeout(connect=10.0, read=60.0, write=10.0, pool=120.0)


@dataclass(frozen=True)
class Caller:
    """Who sends a request: a user name, the group it is reported in, and its API key."""

    user: str
    group: str
    api_key: str | None = None


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds since the scenario started."""

    user: str
    group: str
    started: float
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def e2e(self) -> float | None:
        return None if self.ended is None or self.error else self.ended - self.started

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ttft": self.ttft, "e2e": self.e2e}


def make_client(connections: int = 256) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT, trust_env=False)


def completion_body(
    max_tokens: int, messages: Sequence[dict[str, str]] | None = None
) -> dict[str, Any]:
    # `ignore_eos` makes a real engine generate exactly `max_tokens` (the emulator always does).
    return {
        "model": MODEL,
        "messages": list(messages) if messages else [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


def _has_content(line: str) -> bool:
    """True for an SSE data line whose chunk carries generated text."""
    if not line.startswith("data:"):
        return False
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return False
    try:
        chunk = json.loads(payload)
    except ValueError:
        return False
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


async def stream_one(
    client: httpx.AsyncClient,
    base_url: str,
    caller: Caller,
    max_tokens: int,
    clock_zero: float,
    messages: Sequence[dict[str, str]] | None = None,
) -> RequestRecord:
    """Send one streaming chat completion (`messages`, or the default prompt) and time its first
    content token and its end."""
    record = RequestRecord(caller.user, caller.group, time.perf_counter() - clock_zero)
    headers = {"authorization": f"Bearer {caller.api_key}"} if caller.api_key else {}
    url = f"{base_url.rstrip('/')}/chat/completions"
    try:
        async with client.stream(
            "POST", url, json=completion_body(max_tokens, messages), headers=headers
        ) as response:
            if response.status_code != 200:
                body = (await response.aread())[:200].decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body}"
            else:
                async for line in sse_lines(response.aiter_text()):
                    if _has_content(line):
                        if record.first_token is None:
                            record.first_token = time.perf_counter() - clock_zero
                        record.tokens += 1
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.ended = time.perf_counter() - clock_zero
    return record


async def send_wave(
    client: httpx.AsyncClient,
    base_url: str,
    callers: Sequence[Caller],
    max_tokens: int,
    clock_zero: float,
    delay_s: float = 0.0,
) -> list[RequestRecord]:
    """Send one request per caller, all at once, after `delay_s`."""
    if delay_s:
        await asyncio.sleep(delay_s)
    return list(
        await asyncio.gather(
            *(stream_one(client, base_url, caller, max_tokens, clock_zero) for caller in callers)
        )
    )
