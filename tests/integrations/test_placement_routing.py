"""Several deployments behind one model name: each request reaches exactly the deployment
its lease is bound to, through `fair-sched proxy` and through an app behind the ASGI middleware.

Two emulators on 127.0.0.1 serve model `tiny`; the engines count what they received. The
deployment a request was bound to is read from the response's `x-fair-sched-deployment` header,
so "count per engine equals the scheduler's placements" is checked request by request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fair_sched_plugin.asgi import DEPLOYMENT_STATE, FairSchedulerMiddleware
from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.runtime.service import SchedulingService

from .conftest import (
    MODEL,
    assert_idle,
    emulator,
    fair_config,
    gate_sees_metrics,
    http_state,
    open_client,
    relay_upstream,
    serve,
    wait_until,
)

DEPLOYMENT_HEADER = "x-fair-sched-deployment"
REQUESTS = 16
# Slow enough that a burst is still running when the next requests are placed.
STEPS = {"base_step_ms": 20.0, "step_ms_per_running_seq": 0.0, "prefill_ms_per_token": 0.0}


@contextlib.asynccontextmanager
async def two_engines() -> AsyncIterator[tuple[RunningEmulator, RunningEmulator]]:
    async with (
        emulator(max_num_seqs=4, **STEPS) as first,
        emulator(max_num_seqs=4, **STEPS) as second,
    ):
        yield first, second


def two_deployment_config(first: RunningEmulator, second: RunningEmulator) -> dict[str, Any]:
    return fair_config(
        first,
        waiting_below=2,
        backend={"api_bases": [f"{first.base_url}/v1", f"{second.base_url}/v1/"]},
    )


def key_of(emu: RunningEmulator) -> str:
    return f"{emu.base_url}/v1"


def body(index: int) -> dict[str, Any]:
    # A prompt of its own per request: placement is by load here, not by a shared prefix.
    prompt = f"Request {index}: " + "tell me about fair scheduling. " * (index + 1)
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 12,
    }


async def burst_responses(url: str) -> list[httpx.Response]:
    """REQUESTS requests at once from four users."""
    keys = ["sk-a", "sk-b", "sk-c", "sk-a"]
    clients = [open_client(url, key=key) for key in keys]
    try:
        responses = await asyncio.gather(
            *(
                clients[index % len(clients)].post("/v1/chat/completions", json=body(index))
                for index in range(REQUESTS)
            )
        )
    finally:
        for client in clients:
            await client.aclose()
    return list(responses)


async def burst(url: str) -> collections.Counter[str]:
    """REQUESTS requests at once, all answered; the deployment each response names."""
    responses = await burst_responses(url)
    assert [response.status_code for response in responses] == [200] * REQUESTS
    return collections.Counter(response.headers[DEPLOYMENT_HEADER] for response in responses)


def assert_each_engine_got_its_placements(
    placed: collections.Counter[str], first: RunningEmulator, second: RunningEmulator
) -> None:
    received = {key_of(emu): len(emu.engine.received) for emu in (first, second)}
    assert dict(placed) == {key: count for key, count in received.items() if count}
    # Both deployments took part: the burst is larger than one engine's room.
    assert all(received.values()), received


async def test_proxy_forwards_each_request_to_its_leases_deployment() -> None:
    async with two_engines() as (first, second):
        app = build_proxy_app(two_deployment_config(first, second))
        service: SchedulingService = app.state.fair_sched
        async with serve(app) as url:
            await gate_sees_metrics(service)
            async with open_client(url, key="sk-a") as client:
                # One model, whatever the number of deployments behind it.
                models = (await client.get("/v1/models")).json()
                assert [model["id"] for model in models["data"]] == [MODEL]
            placed = await burst(url)
            await assert_idle(service)
        assert_each_engine_got_its_placements(placed, first, second)


async def test_proxy_sends_nothing_elsewhere_when_the_bound_deployment_fails() -> None:
    """The first engine answers every completion with a 500: requests bound to it get that
    answer (the proxy retries only connection failures, and only there); the second engine
    receives exactly the requests bound to it."""
    async with two_engines() as (first, second):
        app = build_proxy_app(two_deployment_config(first, second))
        service: SchedulingService = app.state.fair_sched
        first.engine.faults.update({"fail_every_nth_completion": 1})
        async with serve(app) as url:
            await gate_sees_metrics(service)
            responses = await burst_responses(url)
            await assert_idle(service)
    by_deployment = collections.defaultdict(list)
    for response in responses:
        by_deployment[response.headers[DEPLOYMENT_HEADER]].append(response.status_code)
    assert set(by_deployment[key_of(first)]) == {500}
    assert set(by_deployment[key_of(second)]) <= {200}
    assert len(second.engine.received) == len(by_deployment[key_of(second)])
    assert len(first.engine.received) == 0  # failures are answered before the engine queues


def forwarding_app() -> Starlette:
    """What an app author writes behind the middleware: send the body to the deployment the
    scheduler chose (docs/configuration.md's example)."""

    async def endpoint(request: Request) -> Response:
        deployment = getattr(request.state, DEPLOYMENT_STATE)
        # The same key arrives as a request header, for apps that only see headers.
        assert request.headers[DEPLOYMENT_HEADER] == deployment
        return await relay_upstream(
            request.app.state.http, f"{deployment}/chat/completions", await request.body()
        )

    app = Starlette(
        routes=[Route("/v1/chat/completions", endpoint, methods=["POST"])],
        lifespan=http_state,
    )
    return app


async def test_middleware_tells_the_app_the_deployment_and_it_forwards_there() -> None:
    async with two_engines() as (first, second):
        app = forwarding_app()
        service = SchedulingService(two_deployment_config(first, second))
        app.add_middleware(FairSchedulerMiddleware, service=service)
        async with serve(app) as url:
            await gate_sees_metrics(service)
            placed = await burst(url)
            await assert_idle(service)
        assert_each_engine_got_its_placements(placed, first, second)


async def test_a_clients_own_deployment_header_never_reaches_the_app() -> None:
    seen: list[list[str]] = []

    async def endpoint(request: Request) -> Response:
        seen.append(request.headers.getlist(DEPLOYMENT_HEADER))
        return JSONResponse({"deployment": getattr(request.state, DEPLOYMENT_STATE)})

    async with two_engines() as (first, second):
        app = Starlette(routes=[Route("/v1/chat/completions", endpoint, methods=["POST"])])
        service = SchedulingService(two_deployment_config(first, second))
        app.add_middleware(FairSchedulerMiddleware, service=service)
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            await gate_sees_metrics(service)
            response = await client.post(
                "/v1/chat/completions",
                json=body(0),
                headers={DEPLOYMENT_HEADER: "http://attacker.example/v1"},
            )
        chosen = response.json()["deployment"]
        assert chosen in {key_of(first), key_of(second)}
        assert seen == [[chosen]]
        assert response.headers[DEPLOYMENT_HEADER] == chosen


async def test_a_model_without_deployments_tells_the_app_none() -> None:
    """A model the service has no engine for (scheduled on the shared in-flight cap): nothing
    to place, so no deployment; a client's header is still removed."""
    seen: list[Any] = []

    async def endpoint(request: Request) -> Response:
        seen.append(
            (getattr(request.state, DEPLOYMENT_STATE), request.headers.get(DEPLOYMENT_HEADER))
        )
        return JSONResponse({})

    async with emulator() as emu:
        app = Starlette(routes=[Route("/v1/chat/completions", endpoint, methods=["POST"])])
        service = SchedulingService(fair_config(emu))
        app.add_middleware(FairSchedulerMiddleware, service=service)
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            response = await client.post(
                "/v1/chat/completions",
                json={**body(0), "model": "not-configured"},
                headers={DEPLOYMENT_HEADER: "http://attacker.example/v1"},
            )
    assert response.status_code == 200
    assert DEPLOYMENT_HEADER not in response.headers
    assert seen == [(None, None)]


async def test_proxy_with_one_api_base_in_front_of_engines_known_by_metrics() -> None:
    """Deployments keyed by their metrics URLs (one forwarding address): the proxy forwards to
    its one api_base, never to a metrics URL."""
    async with two_engines() as (first, second):
        config = fair_config(
            first,
            backend={"metrics_urls": [f"{first.base_url}/metrics", f"{second.base_url}/metrics"]},
        )
        app = build_proxy_app(config)
        service: SchedulingService = app.state.fair_sched
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            await gate_sees_metrics(service)
            responses = [
                await client.post("/v1/chat/completions", json=body(index)) for index in range(4)
            ]
    assert [response.status_code for response in responses] == [200] * 4
    assert len(first.engine.received) == 4
    assert len(second.engine.received) == 0


async def test_a_clients_deployment_header_is_removed_on_unscheduled_routes_too() -> None:
    """Before: only scheduled requests lost a client's `x-fair-sched-deployment`; on a route
    the middleware passes (embeddings, a GET, a body it passes unmodelled) the app got the
    client's value, and an app that forwards by that header (as the docs say it may trust it)
    sent the call where the client chose, past that deployment's gate."""
    seen: list[list[str]] = []

    async def endpoint(request: Request) -> Response:
        seen.append(request.headers.getlist(DEPLOYMENT_HEADER))
        return JSONResponse({})

    async with emulator() as emu:
        app = Starlette(
            routes=[Route("/v1/embeddings", endpoint, methods=["POST", "GET"])],
        )
        service = SchedulingService(fair_config(emu))
        app.add_middleware(FairSchedulerMiddleware, service=service)
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            headers = {DEPLOYMENT_HEADER: "http://attacker.example/v1"}
            post = await client.post(
                "/v1/embeddings", json={"model": MODEL, "input": "x"}, headers=headers
            )
            get = await client.get("/v1/embeddings", headers=headers)
    assert (post.status_code, get.status_code) == (200, 200)
    assert seen == [[], []]


def refusing_base() -> str:
    """An address on 127.0.0.1 where nothing listens (the port was bound, never listened on)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


async def test_proxy_abandons_the_lease_of_a_request_its_deployment_refused() -> None:
    """The second deployment refuses connections (its metrics, from a second emulator, look
    healthy, so it gets its share). Requests bound to it get a 502 that says when to retry,
    and their leases end abandoned (uncharged, no first byte for the gate), as LiteLLM's
    adapter does when no byte came back. Before: the proxy's own 502 body counted as the
    engine's first byte, and the lease as completed and charged."""
    dead = refusing_base()
    async with two_engines() as (live, decoy):
        backend = {
            "api_bases": [f"{live.base_url}/v1", dead],
            "metrics_urls": [f"{live.base_url}/metrics", f"{decoy.base_url}/metrics"],
        }
        app = build_proxy_app(fair_config(live, backend=backend))
        service: SchedulingService = app.state.fair_sched
        async with serve(app) as url:
            await gate_sees_metrics(service)
            responses = await burst_responses(url)
            await assert_idle(service)
    refused = [r for r in responses if r.headers[DEPLOYMENT_HEADER] == dead]
    served = [r for r in responses if r.headers[DEPLOYMENT_HEADER] != dead]
    assert refused and served, [r.headers[DEPLOYMENT_HEADER] for r in responses]
    assert {r.status_code for r in refused} == {502}
    assert all("retry-after" in r.headers for r in refused)
    assert {r.status_code for r in served} == {200}
    stats = service.scheduler.statistics()
    assert (stats.abandoned_total, stats.completed_total) == (len(refused), len(served))


async def test_a_deployment_without_metrics_gets_nothing_while_one_with_metrics_has_room() -> None:
    """The second deployment is down: connections and scrapes refused. Before: it had no
    metrics, so it counted only its in-flight requests against the fallback cap; each refused
    request ended at once, it always looked least loaded, and every request of a light load
    was bound there and failed (6 of 6). Now a deployment without fresh metrics is placed on
    only when no deployment with fresh metrics has room."""
    dead = refusing_base()
    async with emulator(max_num_seqs=4, **STEPS) as live:
        config = fair_config(live, backend={"api_bases": [f"{live.base_url}/v1", dead]})
        app = build_proxy_app(config)
        service: SchedulingService = app.state.fair_sched
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            await wait_until(
                lambda: (
                    {row.mode for row in service.gate.status()[0].per_deployment}
                    == {"metrics", "fallback"}
                )
            )
            responses = [
                await client.post("/v1/chat/completions", json=body(index)) for index in range(6)
            ]
            await assert_idle(service)
    assert [r.status_code for r in responses] == [200] * 6
    assert {r.headers[DEPLOYMENT_HEADER] for r in responses} == {key_of(live)}
