"""Replaying a trace against a target we do not own: a plan first, then never more than it.

:func:`make_plan` sums what a trace will send (requests, output tokens, a bound on the time) and
refuses a trace beyond the :class:`Limits`; :func:`replay` sends exactly the trace's requests at
their arrival times (divided by `speed`), at most `concurrency` at once, and stops at the plan's
time bound or after `stop_after_errors` consecutive failures (5xx, other non-2xx but 429,
connection errors, timeouts). It sends nothing else: no warm-up, no /metrics, no health checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from ...runtime.engine_http import sse_lines
from .trace import TraceRequest, prompt_messages

Progress = Callable[[str], None]


class PlanError(ValueError):
    """A trace that does not fit the limits; nothing was sent."""


@dataclass(frozen=True)
class Limits:
    """What one scenario against one target may send, at most."""

    max_requests: int = 5_000
    max_output_tokens: int = 1_000_000
    max_duration_s: float = 1_800.0
    concurrency: int = 256
    stop_after_errors: int = 10
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if min(self.max_requests, self.max_output_tokens, self.concurrency) < 1:
            raise ValueError("max_requests, max_output_tokens and concurrency must be >= 1")
        if self.stop_after_errors < 1:
            raise ValueError("stop_after_errors must be >= 1")
        if not (self.max_duration_s > 0 and self.request_timeout_s > 0):
            raise ValueError("max_duration_s and request_timeout_s must be > 0")


@dataclass(frozen=True)
class Plan:
    """What a replay will send, at most, decided before anything is sent."""

    requests: int
    output_tokens: int
    prompt_tokens: int
    users: int
    arrivals_s: float
    duration_bound_s: float
    concurrency: int
    stop_after_errors: int
    speed: float

    def describe(self) -> str:
        return (
            f"{self.requests} requests from {self.users} users, at most {self.output_tokens:,} "
            f"output tokens (~{self.prompt_tokens:,} prompt tokens), arrivals over "
            f"{self.arrivals_s:.1f} s (speed {self.speed:g}x), at most {self.concurrency} at "
            f"once, stopped after {self.duration_bound_s:.0f} s or "
            f"{self.stop_after_errors} consecutive errors"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(trace: Sequence[TraceRequest], limits: Limits, speed: float = 1.0) -> Plan:
    """The plan for `trace`, or PlanError naming the limit it would exceed."""
    if not speed > 0:
        raise PlanError(f"speed must be > 0, got {speed!r}")
    if not trace:
        raise PlanError("the trace is empty")
    output = sum(request.max_tokens for request in trace)
    arrivals = max(request.at_s for request in trace) / speed
    if len(trace) > limits.max_requests:
        raise PlanError(f"{len(trace)} requests exceed --max-requests {limits.max_requests}")
    if output > limits.max_output_tokens:
        raise PlanError(
            f"{output:,} output tokens exceed --max-total-tokens {limits.max_output_tokens:,}"
        )
    if arrivals >= limits.max_duration_s:
        raise PlanError(
            f"arrivals over {arrivals:.0f} s do not fit --max-duration {limits.max_duration_s:g}"
        )
    prompt = sum(request.prompt_tokens + request.prefix_tokens for request in trace)
    prompt += sum(len(request.prompt) // 4 for request in trace if request.prompt)
    return Plan(
        requests=len(trace),
        output_tokens=output,
        prompt_tokens=prompt,
        users=len({request.user for request in trace}),
        arrivals_s=arrivals,
        duration_bound_s=min(limits.max_duration_s, arrivals + limits.request_timeout_s),
        concurrency=limits.concurrency,
        stop_after_errors=limits.stop_after_errors,
        speed=speed,
    )


@dataclass(frozen=True)
class Identity:
    """How synthetic users reach the target: a key per user (round-robin over `keys`, or over
    `tier_keys[tier]` for a request with a tier), the user's name as the body's `user` field,
    and optionally in a header (for gateways configured with `identity.source: header`)."""

    keys: tuple[str, ...] = ()
    tier_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    user_field: bool = True
    user_header: str | None = None


@dataclass(frozen=True)
class OpenTarget:
    """An OpenAI-compatible endpoint (its base URL ends in /v1) that the bench does not start."""

    name: str
    base_url: str
    identity: Identity = Identity()


@dataclass
class ReplayRecord:
    """One request as the client saw it; times in seconds since the replay started."""

    index: int
    user: str
    tier: str | None
    started: float
    max_tokens: int
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    status: int | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ReplayRun:
    records: list[ReplayRecord]
    stopped: str | None  # why the replay stopped before the end of its trace, if it did
    not_sent: int


def users_in_order(trace: Sequence[TraceRequest]) -> list[str]:
    """The heavy user (most requests; the first on a tie) first, then by first arrival."""
    counts = Counter(request.user for request in trace)
    first_seen: dict[str, int] = {}
    for index, request in enumerate(trace):
        first_seen.setdefault(request.user, index)
    heavy = max(counts, key=lambda user: (counts[user], -first_seen[user]))
    return [heavy, *sorted((u for u in first_seen if u != heavy), key=first_seen.__getitem__)]


def assign_keys(trace: Sequence[TraceRequest], identity: Identity) -> dict[str, str | None]:
    """Each user's key: the heavy user gets the first, then round-robin (per tier if given)."""
    tiers = {request.user: request.tier for request in trace}
    assigned: dict[str, str | None] = {}
    used: Counter[str | None] = Counter()
    for user in users_in_order(trace):
        tier = tiers[user]
        pool = identity.tier_keys.get(tier, identity.keys) if tier else identity.keys
        pool_name = tier if tier in identity.tier_keys else None
        assigned[user] = pool[used[pool_name] % len(pool)] if pool else None
        used[pool_name] += 1
    return assigned


def request_body(
    request: TraceRequest, index: int, model: str, identity: Identity, ignore_eos: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": prompt_messages(request, index),
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        # vLLM and SGLang then generate exactly max_tokens, so every run asks the same work.
        body["ignore_eos"] = True
    if identity.user_field:
        body["user"] = request.user
    return body


def _chunk_tokens(line: str) -> tuple[int, int | None]:
    """(content chunks in an SSE line, its usage's completion_tokens if any)."""
    if not line.startswith("data:"):
        return 0, None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return 0, None
    try:
        chunk = json.loads(payload)
    except ValueError:
        return 0, None
    if not isinstance(chunk, dict):
        return 0, None
    usage = chunk.get("usage")
    completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
    content = 0
    for choice in chunk.get("choices") or ():
        if isinstance(choice, dict):
            delta = choice.get("delta") or {}
            if (isinstance(delta, dict) and delta.get("content")) or choice.get("text"):
                content = 1
    return content, completion if isinstance(completion, int) else None


class _Breaker:
    """Counts consecutive failures; trips at `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.consecutive = 0
        self.tripped = asyncio.Event()
        self.last_error: str | None = None

    def record(self, record: ReplayRecord) -> None:
        if record.error is None:
            self.consecutive = 0
        elif record.status != 429:  # a 429 is a scheduler saying "later", not a broken target
            self.consecutive += 1
            self.last_error = record.error
            if self.consecutive >= self.limit:
                self.tripped.set()


async def _send(
    client: httpx.AsyncClient,
    target: OpenTarget,
    body: dict[str, Any],
    key: str | None,
    record: ReplayRecord,
    clock_zero: float,
) -> None:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if target.identity.user_header:
        headers[target.identity.user_header] = record.user
    url = f"{target.base_url.rstrip('/')}/chat/completions"
    chunks, usage = 0, None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread())[:200].decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text}"
            else:
                async for line in sse_lines(response.aiter_text()):
                    content, completion = _chunk_tokens(line)
                    if content and record.first_token is None:
                        record.first_token = time.perf_counter() - clock_zero
                    chunks += content
                    usage = completion if completion is not None else usage
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.tokens = usage if usage is not None else chunks
    record.ended = time.perf_counter() - clock_zero


async def replay(
    target: OpenTarget,
    trace: Sequence[TraceRequest],
    plan: Plan,
    *,
    model: str,
    ignore_eos: bool = True,
    request_timeout_s: float = 120.0,
    progress: Progress | None = None,
) -> ReplayRun:
    """Send `trace` to `target` as planned; never more requests, tokens or time than `plan`."""
    if len(trace) > plan.requests or sum(r.max_tokens for r in trace) > plan.output_tokens:
        raise PlanError("the trace is larger than its plan")
    keys = assign_keys(trace, target.identity)
    breaker = _Breaker(plan.stop_after_errors)
    slots = asyncio.Semaphore(plan.concurrency)
    timeout = httpx.Timeout(connect=10.0, read=request_timeout_s, write=10.0, pool=None)
    limits = httpx.Limits(max_connections=plan.concurrency, max_keepalive_connections=64)
    records: list[ReplayRecord] = []
    tasks: list[asyncio.Task[None]] = []
    stopped: str | None = None
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        clock_zero = time.perf_counter()
        deadline = loop.time() + plan.duration_bound_s

        async def one(record: ReplayRecord, body: dict[str, Any], key: str | None) -> None:
            try:
                await _send(client, target, body, key, record, clock_zero)
                breaker.record(record)
            finally:
                slots.release()

        for index, request in enumerate(trace):
            wait = request.at_s / plan.speed - (time.perf_counter() - clock_zero)
            if wait > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(breaker.tripped.wait(), min(wait, plan.duration_bound_s))
            # Checked again once a slot is free: the request that freed it may have failed.
            try:
                await asyncio.wait_for(slots.acquire(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                stopped = f"the plan's time bound ({plan.duration_bound_s:.0f} s)"
                break
            if breaker.tripped.is_set() or loop.time() >= deadline:
                slots.release()
                stopped = (
                    f"{breaker.limit} consecutive errors (last: {breaker.last_error})"
                    if breaker.tripped.is_set()
                    else f"the plan's time bound ({plan.duration_bound_s:.0f} s)"
                )
                break
            body = request_body(request, index, model, target.identity, ignore_eos)
            record = ReplayRecord(
                index, request.user, request.tier, time.perf_counter() - clock_zero,
                request.max_tokens,
            )  # fmt: skip
            records.append(record)
            tasks.append(asyncio.ensure_future(one(record, body, keys[request.user])))
        pending: set[asyncio.Future[Any]] = {task for task in tasks if not task.done()}
        while pending:
            left = deadline - loop.time()
            if left <= 0:
                break
            trip = asyncio.ensure_future(breaker.tripped.wait())
            _, pending = await asyncio.wait(
                pending | {trip}, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            trip.cancel()
            await asyncio.gather(trip, return_exceptions=True)
            pending.discard(trip)
            if breaker.tripped.is_set():
                stopped = stopped or f"{breaker.limit} consecutive errors ({breaker.last_error})"
                break
        if pending:
            stopped = stopped or f"the plan's time bound ({plan.duration_bound_s:.0f} s)"
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for record in records:
                if record.ended is None:
                    record.error = f"cancelled: {stopped}"
                    record.ended = time.perf_counter() - clock_zero
    if progress and stopped:
        progress(f"[{target.name}] stopped early: {stopped}")
    return ReplayRun(records, stopped, len(trace) - len(records))


def errors_by_status(records: Sequence[ReplayRecord]) -> dict[str, int]:
    """Failed requests per HTTP status ("connection" where none came back)."""
    counts: Counter[str] = Counter()
    for record in records:
        if record.error and record.error.startswith("cancelled"):
            counts["cancelled"] += 1
        elif record.error:
            failed = record.status is not None and record.status != 200
            counts[str(record.status) if failed else "connection"] += 1
    return dict(sorted(counts.items()))


__all__ = [
    "Identity",
    "Limits",
    "OpenTarget",
    "Plan",
    "PlanError",
    "ReplayRecord",
    "ReplayRun",
    "assign_keys",
    "errors_by_status",
    "make_plan",
    "replay",
    "users_in_order",
]
