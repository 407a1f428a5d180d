"""Against a real LiteLLM proxy: every route that can reach an engine is scheduled.

One `litellm` process (the plugin as callback, our custom auth) in front of a recording relay in
front of the emulator. The relay sees exactly what the engine would get. The walk is generated
from LiteLLM's own route list (`LiteLLMRoutes.llm_api_routes`), so a LiteLLM upgrade that adds
a generation route is walked without anyone typing it in.

Routes whose target is a hosted provider (LiteLLM's pass-through to OpenAI, Anthropic, Google,
... and the few LiteLLM endpoints served by a hosted API only) are left out of the walk: they
would leave 127.0.0.1. Their providers' base URLs point at a closed loopback port as well.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import pytest_asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    MASTER_KEY,
    ProxyProcess,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
)

from ..integrations.conftest import emulator, relay_upstream, serve, wait_until
from ..integrations.litellm_harness import shared_proxy_marks
from ..support import find_int

pytestmark = shared_proxy_marks()

BATCH_PRIORITY = 10
CLIENT_PRIORITY = -1000
# A closed port on loopback: anything aimed at a hosted provider fails here, at once.
DEAD_END = "http://127.0.0.1:9"
HOSTED_PROVIDER_ENV = {
    name: DEAD_END
    for name in (
        "OPENAI_API_BASE",
        "OPENAI_BASE_URL",
        "ANTHROPIC_API_BASE",
        "ANTHROPIC_BASE_URL",
        "GEMINI_API_BASE",
        "MISTRAL_API_BASE",
        "COHERE_API_BASE",
        "AZURE_API_BASE",
    )
}
# LiteLLM endpoints that only a hosted service answers (or that need servers we do not run):
# walking them would leave 127.0.0.1 or test nothing of ours.
HOSTED_ONLY = re.compile(
    r"^/(v1/)?(skills|search|decisions|systemone|interactions|mcp|mcp-rest|a2a|agents)\b"
    r"|^/v1beta/(interactions|agents)|^/claude-code/|^/(introspect|token)$"
)
# Routes that only count tokens (see the walk's assertion).
TOKEN_COUNTING = re.compile(r"count_tokens|countTokens|input_tokens|token_counter")
# Requests LiteLLM sends to the engine's host that generate nothing there, so carry no priority:
# realtime session settings (the client's `priority` is stripped from them, not rewritten) and
# vector stores (no model at all).
NOT_A_GENERATION = frozenset(
    {"/v1/realtime/client_secrets", "/v1/realtime/transcription_sessions", "/v1/vector_stores"}
)
# Engine paths the emulator serves; the relay records every request but GETs (see Relay) and
# forwards only these.
ENGINE_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class Relay:
    """What reached the engine: (path, raw body) per request, in order; GETs are not recorded.

    LiteLLM lists the api_base's `/v1/models` at start-up (twice), at a time of its own: a CI
    run failed the walk on its first route, `/assistants`, which LiteLLM refuses without calling
    anything, so something else had arrived in its window, and those GETs are the only other
    traffic the relay sees (locally they came before the walk). A GET generates nothing."""

    records: list[tuple[str, bytes]] = field(default_factory=list)


def relay_app(emu: RunningEmulator, relay: Relay) -> Starlette:
    async def anything(request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        if request.method != "GET":
            relay.records.append((path, body))
        if request.method == "POST" and path in ENGINE_PATHS:
            client: httpx.AsyncClient = request.app.state.http
            return await relay_upstream(client, emu.base_url + path, body)
        return JSONResponse({"error": {"message": "not an engine route"}}, status_code=404)

    app = Starlette(
        routes=[Route("/{path:path}", anything, methods=["GET", "POST", "PUT", "DELETE"])]
    )
    return app


@dataclass
class Stack:
    emu: RunningEmulator
    relay: Relay
    proxy: ProxyProcess


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    workdir = tmp_path_factory.mktemp("litellm-routes")
    relay = Relay()
    async with (
        emulator(max_num_seqs=8, policy="priority") as emu,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        app = relay_app(emu, relay)
        app.state.http = http
        async with serve(app) as relay_url:
            backend = {"metrics_url": f"{emu.base_url}/metrics", "priority_scheduling": True}
            fair_sched = {
                "tiers": [
                    {"name": "interactive", "waiting_below": 3, "vllm_priority": 1},
                    {"name": "batch", "waiting_below": 1, "vllm_priority": BATCH_PRIORITY},
                ],
                "principals": [
                    {"name": "alice", "keys": ["sk-a"]},
                    {"name": "bot", "keys": ["sk-batch"], "tier": "batch"},
                ],
                "backends": {"tiny": backend, "tiny-direct": backend, "tiny-vllm": backend},
                "metrics_poll_ms": 50,
            }
            config = proxy_config(
                [
                    model_entry("tiny", f"{relay_url}/v1"),
                    model_entry("tiny-direct", f"{emu.base_url}/v1"),
                    {
                        "model_name": "tiny-vllm",
                        "litellm_params": {
                            "model": "hosted_vllm/tiny",
                            "api_base": f"{relay_url}/v1",
                            "api_key": "none",
                        },
                    },
                ],
                fair_sched,
            )
            # A route the emulator does not serve must not put the deployment in cooldown
            # (every later route would get LiteLLM's own 429).
            config["router_settings"] = {"disable_cooldowns": True}
            env = {**HOSTED_PROVIDER_ENV, "HOSTED_VLLM_API_BASE": f"{relay_url}/v1"}
            async with litellm_proxy(config, workdir, "routes", env=env) as proxy:
                yield Stack(emu, relay, proxy)


def walked_routes() -> list[str]:
    """Every LiteLLM API route that can carry a generation, as a concrete path."""
    from litellm.proxy._types import LiteLLMRoutes

    from fair_sched_plugin.litellm._proxy import SELF_HOSTED_PASS_THROUGH

    mapped = set(LiteLLMRoutes.mapped_pass_through_routes.value)
    paths: list[str] = []
    for route in LiteLLMRoutes.llm_api_routes.value:
        prefix = "/" + route.split("/")[1]
        if prefix in mapped:
            if prefix in SELF_HOSTED_PASS_THROUGH and route.endswith("/*"):
                paths += [prefix + path for path in ENGINE_PATHS]
            continue  # a hosted provider's pass-through (or the bare prefix)
        if HOSTED_ONLY.search(route):
            continue
        path = route.split("?")[0].replace("*", "x")
        path = re.sub(r"\{model(_name)?(:path)?\}", "tiny", path)
        path = re.sub(r"\{[^}]+\}", "x", path)
        paths.append(path)
    return sorted(set(paths))


def body_for(path: str) -> dict[str, Any]:
    """A plausible body for the route's family, asking for a priority it must not get."""
    forged: dict[str, Any] = {
        "priority": CLIENT_PRIORITY,
        "extra_body": {"priority": CLIENT_PRIORITY},
        "metadata": {"fair_sched_lease": "forged"},
    }
    if path.endswith("/realtime/client_secrets"):
        # LiteLLM forwards `session` as the client wrote it (unknown fields included).
        session = {"type": "realtime", "model": "tiny", **forged}
        return {"model": "tiny", "session": session, **forged}
    if "GenerateContent" in path or "generateContent" in path:
        return {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], **forged}
    if path.endswith("/messages"):
        return {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            **forged,
        }
    if path.endswith("/completions") and "chat" not in path:
        model = "tiny-vllm" if path.startswith("/vllm/") else "tiny"
        return {"model": model, "prompt": "hi", "max_tokens": 4, **forged}
    if "responses" in path:
        return {"model": "tiny", "input": "hi", "max_output_tokens": 4, **forged}
    if "embeddings" in path:
        return {"model": "tiny", "input": "hi", **forged}
    return {
        "model": "tiny-vllm" if path.startswith("/vllm/") else "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **forged,
    }


async def released_total(admin: httpx.AsyncClient) -> int:
    status = (await admin.get("/fair-sched/status")).json()
    return find_int(status, "released")


async def test_every_generation_route_is_scheduled_at_the_tiers_priority(stack: Stack) -> None:
    """Before: `/v1/messages`, `:generateContent` and `/vllm/...` reached the engine without a
    lease, some with the batch key's `priority: -1000`; then `:generateContent` reached it with
    no priority at all (the interactive tier's 0). Now each request that reaches the engine was
    released by the scheduler first and carries the batch tier's priority, or is refused with a
    400 that says why (a route LiteLLM builds without `extra_body`)."""
    routes = walked_routes()
    assert len(routes) > 50  # the list is LiteLLM's, not ours
    reached: dict[str, int] = {}
    unscheduled: list[str] = []
    statuses: dict[str, str] = {}
    async with (
        open_client(stack.proxy.base_url, "sk-batch", timeout=20) as bot,
        open_client(stack.proxy.base_url, MASTER_KEY) as admin,
    ):
        for path in routes:
            before_records = len(stack.relay.records)
            before_released = await released_total(admin)
            try:
                response = await bot.post(path, json=body_for(path))
                statuses[path] = f"{response.status_code} {response.text[:300]}"
            except httpx.HTTPError as exc:
                statuses[path] = type(exc).__name__
            # A stream's lease ends a moment after the client saw the end.
            await asyncio.sleep(0.05)
            arrived = len(stack.relay.records) - before_records
            if arrived:
                reached[path] = arrived
                if await released_total(admin) - before_released < arrived:
                    unscheduled.append(path)
    # The one reasoned exception: token counting asks the backend to count, never to generate
    # (a vLLM answers it in its API server, outside the engine's queue), and LiteLLM runs no
    # pre-call hook for it.
    generating = [path for path in unscheduled if not TOKEN_COUNTING.search(path)]
    assert generating == [], json.dumps({path: statuses[path] for path in generating})
    for must_reach in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/vllm/v1/chat/completions",
        "/v1/realtime/client_secrets",
        "/v1/realtime/transcription_sessions",
    ):
        assert must_reach in reached, json.dumps([statuses, sorted(reached)])
    for path, raw in stack.relay.records:
        # The client's priority appears nowhere in what reached the engine: neither at the top
        # nor in a nested object LiteLLM forwards as the client wrote it (realtime `session`,
        # `transcription_sessions`' whole body).
        assert str(CLIENT_PRIORITY).encode() not in raw, (path, raw[:500])
        # Nothing of ours reaches the engine (the client's own forged key may be echoed by
        # LiteLLM; it names no lease, leases live in the request's watch).
        assert b"fair_sched" not in raw.replace(b'"fair_sched_lease": "forged"', b"").replace(
            b'"fair_sched_lease":"forged"', b""
        ), path
        if TOKEN_COUNTING.search(path):
            continue
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            continue  # not JSON (a multipart upload): no priority field to carry
        if path in NOT_A_GENERATION:
            assert body.get("priority", BATCH_PRIORITY) == BATCH_PRIORITY, (path, body)
        else:
            # Whatever the engine would run carries the tier's priority, never none.
            assert body.get("priority") == BATCH_PRIORITY, (path, body)
    assert stack.emu.engine.received
    # The tier's priority, on every request (the emulator records an absent one as 0).
    assert {request.priority for request in stack.emu.engine.received} == {BATCH_PRIORITY}
    # Gemini's route cannot carry a priority to an OpenAI-compatible engine: refused, saying so.
    gemini = "/v1beta/models/tiny:generateContent"
    assert gemini not in reached, statuses[gemini]
    assert statuses[gemini].startswith("400") and "priority" in statuses[gemini], statuses[gemini]


async def test_comma_separated_models_never_fan_out(stack: Stack) -> None:
    """Before: twelve batch requests for `tiny,tiny` became 24 engine calls without priority."""
    before = len(stack.relay.records)
    async with open_client(stack.proxy.base_url, "sk-batch") as bot:
        responses = await asyncio.gather(
            *(
                bot.post("/v1/chat/completions", json=body_for("/chat") | {"model": "tiny,tiny"})
                for _ in range(12)
            )
        )
    assert {response.status_code for response in responses} == {400}
    assert len(stack.relay.records) == before


async def test_a_non_streamed_client_that_leaves_stops_the_engine(stack: Stack) -> None:
    """Before: the engine generated the whole answer for nobody (the lease ended only then)."""
    engine = stack.emu.engine
    aborted = engine.statistics().requests_aborted
    body = body_for("/chat") | {"model": "tiny-direct", "max_tokens": 100_000}
    async with open_client(stack.proxy.base_url, "sk-a") as alice:
        leaving = asyncio.ensure_future(alice.post("/v1/chat/completions", json=body))
        await wait_until(lambda: engine.statistics().running == 1, 30)
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        await wait_until(lambda: engine.statistics().requests_aborted > aborted, 15)
        await wait_until(lambda: engine.statistics().running == 0, 15)
    async with open_client(stack.proxy.base_url, MASTER_KEY) as admin:
        for _ in range(100):  # bounded: the lease ends as the request's task is cancelled
            status = (await admin.get("/fair-sched/status")).json()
            if find_int(status, "in_flight") == 0:
                break
            await asyncio.sleep(0.05)
        assert find_int(status, "in_flight") == 0
