"""Property: a request's lease lives once, through the real request path.

Hypothesis draws a few requests at a time (`lifecycle.plans`: who sends it, streamed or not, its
size, when its client leaves, whether the engine fails it or breaks its stream, whether the
observers of its admission and of its end raise) and sends them at once over HTTP to
`FairSchedulerMiddleware` in a Starlette app (gated on the engine's metrics), and to
`fair-sched proxy` (on its fallback in-flight cap, keeping parked streams alive), each in front of
the emulator on 127.0.0.1 with room for two requests, so that some park. Once nothing is queued
or in flight and the engine has no sequence left, for every lease:

- it ended exactly once; every admission the observers heard of ended, and every lease the core
  granted ended;
- its first byte was recorded when a byte of the engine's answer reached the client;
- it was charged the `usage` the engine reported, when that reached the client; the engine's own
  500 charged nothing reported (its estimate); a stream cut before its `usage` at least a token
  per event that reached the client; a request left before its answer at most its estimate;
- a request whose client left before sending its whole body holds none.

One server per integration serves every example (`stack`); each example's leases are found by their
ticket's estimate, which each request's own `max_tokens` makes unique.
`test_lifecycle_properties_litellm.py` drives the LiteLLM plugin with the same plans.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, event, given, settings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fair_sched_plugin.asgi import FairSchedulerMiddleware
from fair_sched_plugin.core import Lease
from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.service import Admission, SchedulingService

from ..support import LOOPBACK, eventually, free_port
from .conftest import MODEL, relay_upstream, serve
from .lifecycle import (
    CHAT,
    ENGINE_SLOTS,
    IDLE_TIMEOUT_S,
    KEYS,
    Leave,
    Outcome,
    Plan,
    lifecycle_emulator,
    plans,
    play_all,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Ended:
    """A lease's end as its end listener heard it."""

    lease_id: int
    estimate: int
    started: bool
    tokens_used: int | None
    abandoned: bool


class LeaseLog:
    """Every lease end and admission the service reports, for the example running now; its
    observers raise for the plans that say so (after recording)."""

    def __init__(self, service: SchedulingService) -> None:
        self.service = service
        self.ends: list[Ended] = []
        self.admitted_ids: set[int] = set()
        self.admitted_estimates: set[int] = set()
        self.by_estimate: dict[int, Plan] = {}
        service.scheduler.add_end_listener(self.on_end)
        service.add_admission_observer(self)

    def start(self, examples: list[Plan]) -> None:
        self.ends.clear()
        self.admitted_ids.clear()
        self.admitted_estimates.clear()
        self.by_estimate = {self.estimate(plan): plan for plan in examples}
        assert len(self.by_estimate) == len(examples)

    def estimate(self, plan: Plan) -> int:
        """The estimate (ticket cost) of `plan`'s request, as the scheduler computes it."""
        principal = self.service.identify(Credentials(api_key=plan.key))
        return self.service.ticket_for(principal, MODEL, plan.body()).cost

    def _raise_for(self, lease: Lease) -> None:
        plan = self.by_estimate.get(lease.ticket.cost)
        if plan is not None and plan.observers_raise:
            raise RuntimeError("an observer failed (injected)")

    def on_end(self, lease: Lease, abandoned: bool) -> None:
        self.ends.append(
            Ended(lease.lease_id, lease.ticket.cost, lease.started, lease.tokens_used, abandoned)
        )
        self._raise_for(lease)

    def admitted(self, admission: Admission) -> None:
        self.admitted_ids.add(admission.lease.lease_id)
        self.admitted_estimates.add(admission.lease.ticket.cost)
        self._raise_for(admission.lease)

    def rejected(self, *args: object) -> None:
        pass

    def reached(self, plan: Plan, stage: Leave) -> bool:
        """Whether `plan`'s request is parked, or was granted (by its estimate)."""
        estimate = self.estimate(plan)
        if stage == "granted":
            return estimate in self.admitted_estimates
        return any(
            parked.ticket.cost == estimate
            for mine in self.service.standings.parked_of(KEYS[plan.key]).values()
            for parked in mine
        )


@dataclass
class Stack:
    """A server under test in this process, in front of its emulator."""

    url: str
    service: SchedulingService
    emu: RunningEmulator
    log: LeaseLog


def fair_sched_section(emu: RunningEmulator, **backend: Any) -> dict[str, Any]:
    return {
        "tiers": [{"name": "interactive", "waiting_below": 1}],
        "principals": [{"name": name, "keys": [key]} for key, name in KEYS.items()],
        "backends": {MODEL: {"api_base": f"{emu.base_url}/v1", **backend}},
        "metrics_poll_ms": 50,
        "fairness": "tokens",
    }


def forwarding_app(emu: RunningEmulator) -> Starlette:
    """What an app author writes behind the middleware: a stream relayed as it comes, a whole
    answer as a `JSONResponse` it builds (the first byte and the end in one body message)."""

    async def endpoint(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.http
        body = await request.body()
        url = f"{emu.base_url}/v1/chat/completions"
        if json.loads(body).get("stream"):
            return await relay_upstream(client, url, body)
        upstream = await client.post(
            url, content=body, headers={"content-type": "application/json"}
        )
        return JSONResponse(upstream.json(), status_code=upstream.status_code)

    return Starlette(routes=[Route(CHAT, endpoint, methods=["POST"])])


@contextlib.asynccontextmanager
async def middleware_stack() -> AsyncIterator[Stack]:
    """The middleware in front of an app relaying to the emulator, gated on its metrics."""
    async with lifecycle_emulator() as emu, httpx.AsyncClient(trust_env=False, timeout=30) as http:
        app = forwarding_app(emu)
        app.state.http = http
        middleware = FairSchedulerMiddleware(app, config=fair_sched_section(emu))
        async with serve(middleware) as url:
            yield Stack(url, middleware.service, emu, LeaseLog(middleware.service))


@contextlib.asynccontextmanager
async def proxy_stack() -> AsyncIterator[Stack]:
    """`fair-sched proxy` on its fallback in-flight cap (no metrics), keeping parked streams
    alive with a `200` and comments after 50 ms."""
    async with lifecycle_emulator() as emu:
        config = fair_sched_section(
            emu,
            metrics_url=f"http://{LOOPBACK}:{free_port()}/metrics",
            on_metrics_unavailable={"max_inflight": ENGINE_SLOTS},
        )
        config["queue"] = {"keepalive_after_s": 0.05, "keepalive_interval_s": 0.05}
        app = build_proxy_app(config)
        async with serve(app) as url:
            service: SchedulingService = app.state.fair_sched
            yield Stack(url, service, emu, LeaseLog(service))


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["middleware", "proxy"])
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """One server for every example of the test: the middleware's, or the proxy's."""
    serving = middleware_stack if request.param == "middleware" else proxy_stack
    async with serving() as running:
        yield running


async def wait_idle(service: SchedulingService, emu: RunningEmulator) -> None:
    """Nothing queued or in flight here, no sequence left in the engine."""

    def idle() -> bool:
        stats = service.scheduler.statistics()
        engine = emu.engine.statistics()
        return (stats.queued, stats.in_flight, engine.waiting, engine.running) == (0, 0, 0, 0)

    await eventually(idle, IDLE_TIMEOUT_S, what="nothing queued or in flight")


def check_leases(log: LeaseLog, outcomes: list[Outcome]) -> None:
    """The properties of the module docstring, for one example."""
    by_id: dict[int, list[Ended]] = {}
    for ended in log.ends:
        by_id.setdefault(ended.lease_id, []).append(ended)
    assert all(len(ends) == 1 for ends in by_id.values()), log.ends
    assert log.admitted_ids <= set(by_id), (log.admitted_ids, log.ends)
    by_estimate: dict[int, list[Ended]] = {}
    for ended in log.ends:
        by_estimate.setdefault(ended.estimate, []).append(ended)
    for outcome in outcomes:
        plan = outcome.plan
        mine = by_estimate.get(log.estimate(plan), [])
        assert len(mine) <= 1, (plan, mine)  # one request, one lease
        if plan.leave == "before_body":
            assert mine == [], plan
            continue
        event(outcome.kind())
        if outcome.engine_bytes():
            assert mine and mine[0].started, (outcome, mine)
        usage = outcome.usage()
        if usage is not None:
            assert [(e.tokens_used, e.abandoned) for e in mine] == [(usage["total_tokens"], False)]
        elif outcome.engine_failed():
            # The engine reported nothing: nothing reported is charged (the estimate stays).
            assert [e.tokens_used for e in mine] == [None], outcome
        elif outcome.engine_events():
            # Cut before its `usage` (the client left, or the engine broke the stream): a token
            # per event that went through at least.
            [ended] = mine
            assert ended.tokens_used is not None and ended.tokens_used >= outcome.engine_events()
        elif not outcome.engine_bytes():
            # Left before the answer: at most its estimate (none reported: the estimate).
            assert all(e.tokens_used is None or e.tokens_used <= e.estimate for e in mine), mine


async def run_example(stack: Stack, examples: list[Plan]) -> None:
    stats = stack.service.scheduler.statistics
    before = stats()
    stack.log.start(examples)
    outcomes = await play_all(stack.url, examples, stack.log.reached)
    await wait_idle(stack.service, stack.emu)
    after = stats()
    released = after.released_total - before.released_total
    ended = (after.completed_total - before.completed_total) + (
        after.abandoned_total - before.abandoned_total
    )
    # Every lease the core granted ended. Its listeners hear of the leases handed to requests:
    # a grant that arrives for a request already gone is given back unused without one.
    assert released == ended >= len(stack.log.ends), (released, ended, stack.log.ends)
    assert not stack.service.observability.view.in_flight_by_user()
    check_leases(stack.log, outcomes)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(examples=plans(max_size=8))
async def test_every_lease_ends_once_started_and_charged(
    stack: Stack, examples: list[Plan]
) -> None:
    await run_example(stack, examples)
