"""Plans of requests for the lifecycle property tests, and a client that plays them.

A plan says who sends a request (`KEYS`), streamed or not, its `max_tokens` (distinct within an
example, so that each request's estimate, and so its lease, is found again), when its client
leaves, whether the engine (the emulator, `lifecycle_emulator`) fails it with a 500 or breaks its
stream, and whether the observers of its admission and end raise. `play_all` sends an example's
plans at once and returns what each client saw (`Outcome`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from hypothesis import strategies as st

from fair_sched_plugin.lab.emulator.engine import FaultSwitches
from fair_sched_plugin.lab.emulator.server import RunningEmulator

from ..support import eventually, open_client
from .conftest import MODEL, emulator

CHAT = "/v1/chat/completions"
# When the client leaves: before its whole body is sent, once the request is parked, once it
# is granted (before its answer), after the answer's first bytes, in the middle of a stream, never.
Leave = Literal["before_body", "parked", "granted", "first_byte", "mid_stream", "never"]
LEAVES: tuple[Leave, ...] = (
    "before_body",
    "parked",
    "granted",
    "first_byte",
    "mid_stream",
    "never",
)
Engine = Literal["ok", "error", "drop"]
KEYS = {"sk-a": "alice", "sk-b": "bob", "sk-c": "carol"}
# The emulator fails every request whose prompt carries FAIL_MARK, and breaks every stream whose
# prompt carries DROP_MARK after its first tokens. Marks of one length keep every prompt's
# estimate the same, so `max_tokens` alone tells two requests' estimates apart.
OK_MARK, FAIL_MARK, DROP_MARK = "[okay]", "[fail]", "[drop]"
ENGINE_SLOTS = 2
# The engine generates at most this many tokens: a longer request reports fewer tokens than its
# estimate, so being charged its `usage` and being charged its estimate differ.
ENGINE_MAX_NEW_TOKENS = 24
# The request's `metadata` flag that asks observers to raise (read by `lifecycle_observer.py`).
OBSERVERS_RAISE = "fair_sched_test_observers_raise"
# Every client operation and every wait is bounded (a hang is a failure, never a stall).
EXAMPLE_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Plan:
    """One request of an example and what happens to it."""

    key: str
    stream: bool
    max_tokens: int
    leave: Leave
    engine: Engine
    observers_raise: bool

    def body(self) -> dict[str, Any]:
        mark = {"ok": OK_MARK, "error": FAIL_MARK, "drop": DROP_MARK}[self.engine]
        prompt = [{"role": "user", "content": f"Tell me about fair scheduling {mark}."}]
        body: dict[str, Any] = {"model": MODEL, "messages": prompt, "max_tokens": self.max_tokens}
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if self.observers_raise:
            # For observers in another process (LiteLLM's callbacks); the engine ignores it.
            body["metadata"] = {OBSERVERS_RAISE: True}
        return body


# Where a server says a plan's request stands: "parked" or "granted" (it may only know of one
# like it, from outside its process).
Reached = Callable[[Plan, Leave], bool | Awaitable[bool]]


def plans(max_size: int) -> st.SearchStrategy[list[Plan]]:
    """Up to `max_size` requests at once, each with its own `max_tokens`."""
    return st.lists(
        st.builds(
            Plan,
            key=st.sampled_from(sorted(KEYS)),
            stream=st.booleans(),
            max_tokens=st.integers(1, 40),
            leave=st.sampled_from([*LEAVES, "never"]),  # most clients read their answer
            engine=st.sampled_from(["ok", "ok", "error", "drop"]),
            observers_raise=st.booleans(),
        ),
        min_size=1,
        max_size=max_size,
        unique_by=lambda plan: plan.max_tokens,
    )


@dataclass
class Outcome:
    """What the client of one plan saw."""

    plan: Plan
    status: int | None = None
    event_stream: bool = False
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False  # read to its end without an error
    error: str | None = None

    def engine_events(self) -> int:
        """Events of the engine's stream the client read whole (not our keep-alive comments or
        error events)."""
        return bytes(self.body).count(b'data: {"id"') if self.event_stream else 0

    def engine_bytes(self) -> bool:
        """Whether a byte of the engine's answer reached the client."""
        if self.event_stream:
            return self.engine_events() > 0
        if self.status == 200:
            return bool(self.body)
        return self.status == 500 and b"injected failure" in self.body

    def engine_failed(self) -> bool:
        """The client read the engine's own 500."""
        return self.status == 500 and b"injected failure" in self.body

    def kind(self) -> str:
        """How it went, for Hypothesis' statistics (`--hypothesis-show-statistics`)."""
        if self.status is None:
            return f"left {self.plan.leave}: no answer"
        shape = "stream" if self.event_stream else "json"
        keepalive = ", keep-alive" if self.body.startswith(b": queued") else ""
        if b'data: {"error"' in self.body:
            keepalive += ", error event"
        end = "read whole" if self.complete else (self.error or f"left {self.plan.leave}")
        usage = ", usage" if self.usage() else ""
        return f"{self.status} {shape}{keepalive}: {end.split('(')[0]}{usage}"

    def usage(self) -> dict[str, Any] | None:
        """The engine's `usage` as the client read it, if it did."""
        text = bytes(self.body)
        if self.event_stream:
            for line in text.split(b"\n"):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    with contextlib.suppress(ValueError):
                        usage = json.loads(line[6:]).get("usage")
                        if isinstance(usage, dict):
                            return usage
            return None
        if self.status == 200 and self.complete:
            usage = json.loads(text).get("usage")
            return usage if isinstance(usage, dict) else None
        return None


async def leave_before_body(url: str, plan: Plan) -> None:
    """Send the headers and half of the body, then close the connection."""
    payload = json.dumps(plan.body()).encode()
    host, port = url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {plan.key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
        + payload[: len(payload) // 2]
    )
    await writer.drain()
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def play(
    client: httpx.AsyncClient,
    url: str,
    plan: Plan,
    reached: Reached,
) -> Outcome:
    """Send `plan`'s request and leave when it says; what the client saw."""
    outcome = Outcome(plan)
    if plan.leave == "before_body":
        await leave_before_body(url, plan)
        return outcome
    headers_in = asyncio.Event()

    async def request() -> None:
        headers = {"authorization": f"Bearer {plan.key}"}
        async with client.stream("POST", CHAT, json=plan.body(), headers=headers) as response:
            outcome.status = response.status_code
            content_type = response.headers.get("content-type", "")
            outcome.event_stream = content_type.startswith("text/event-stream")
            headers_in.set()
            if plan.leave in ("parked", "granted"):
                return  # the headers may be a keep-alive's while it is still parked
            async for chunk in response.aiter_raw():
                outcome.body += chunk
                if plan.leave == "first_byte" and outcome.engine_bytes():
                    return
                if plan.leave == "mid_stream" and (
                    outcome.engine_events() >= 2 or (outcome.body and not outcome.event_stream)
                ):
                    return
            outcome.complete = True

    task = asyncio.create_task(request())
    if plan.leave in ("parked", "granted"):

        async def there_or_answered() -> bool:
            if task.done() or headers_in.is_set():
                return True
            there = reached(plan, plan.leave)
            return bool(await there) if inspect.isawaitable(there) else bool(there)

        await eventually(there_or_answered, IDLE_TIMEOUT_S, what=f"{plan} there or answered")
        task.cancel()  # the client leaves (a no-op where it has already)
    try:
        await asyncio.wait({task})
    except BaseException:
        task.cancel()
        raise
    error = None if task.cancelled() else task.exception()
    if isinstance(error, httpx.HTTPError):  # a stream the engine broke
        outcome.error = repr(error)
    elif error is not None:
        raise error
    return outcome


async def play_all(url: str, examples: Iterable[Plan], reached: Reached) -> list[Outcome]:
    """Every plan at once; what each client saw, in the plans' order."""
    async with open_client(url, timeout=30.0) as client:
        return await asyncio.wait_for(
            asyncio.gather(*(play(client, url, plan, reached) for plan in examples)),
            EXAMPLE_TIMEOUT_S,
        )


def lifecycle_emulator() -> contextlib.AbstractAsyncContextManager[RunningEmulator]:
    """The engine of every plan: room for `ENGINE_SLOTS` sequences, failing the requests marked
    `FAIL_MARK` and breaking the streams marked `DROP_MARK`."""
    return emulator(
        max_num_seqs=ENGINE_SLOTS,
        max_new_tokens=ENGINE_MAX_NEW_TOKENS,
        faults=FaultSwitches(fail_prompt=FAIL_MARK, drop_prompt=DROP_MARK),
    )
