"""Charge what the engine did: the `usage` of an answer of any size, the first byte before the
end, through the ASGI middleware (a JSON answer an app builds itself) and `fair-sched proxy`
(the engine's bytes relayed), in front of the emulator.

Before: the middleware kept only the first 256 KiB of a non-streamed answer, so past that the
`usage` was lost and the lease charged its estimate (three 46,000-token answers charged 257
tokens each against a 1,000-token budget); and the middleware's own wrapper ended a lease before
the request's watch recorded its first byte, so the gate never learnt from a non-streamed
request's completion.
"""

from __future__ import annotations

from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fair_sched_plugin.core import Lease
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.runtime.service import SchedulingService

from ..hardening.test_bypasses import CHAT, middleware_app, middleware_service
from .conftest import MODEL, assert_idle, emulator, fair_config, open_client, serve

# Every step emits a token at once: a 46,000-token answer takes a few seconds.
INSTANT = {"base_step_ms": 0.0, "step_ms_per_running_seq": 0.0, "prefill_ms_per_token": 0.0}
LONG_ANSWER_TOKENS = 46_000
BUDGET_TOKENS = 1_000


def budget_config(emu: Any) -> dict[str, Any]:
    config = fair_config(emu)
    config["principals"] = [
        {
            "name": "alice",
            "keys": ["sk-a"],
            "budget": {"tokens": BUDGET_TOKENS, "per": "day", "action": "reject"},
        },
        {"name": "bob", "keys": ["sk-b"]},
    ]
    return config


def record_ends(service: SchedulingService) -> list[tuple[int | None, bool, bool]]:
    """(tokens charged, first byte recorded, abandoned) of every lease's end, in order."""
    ends: list[tuple[int | None, bool, bool]] = []

    def on_end(lease: Lease, abandoned: bool) -> None:
        ends.append((lease.tokens_used, lease.started, abandoned))

    service.scheduler.add_end_listener(on_end)
    return ends


def json_app(emu: Any) -> Starlette:
    """An app that answers with a `JSONResponse` it builds from the engine's answer (one body
    message: the response start and the whole answer)."""

    async def endpoint(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.http
        upstream = await client.post(
            f"{emu.base_url}/v1/chat/completions",
            content=await request.body(),
            headers={"content-type": "application/json"},
        )
        return JSONResponse(upstream.json(), status_code=upstream.status_code)

    return Starlette(routes=[Route(CHAT, endpoint, methods=["POST"])])


def long_body() -> dict[str, Any]:
    # No max_tokens: the estimate is the default 256, the engine generates 46,000.
    return {"model": MODEL, "messages": [{"role": "user", "content": "Write a lot."}]}


async def test_a_46000_token_answer_through_the_proxy_is_charged_its_tokens() -> None:
    async with emulator(default_max_tokens=LONG_ANSWER_TOKENS, **INSTANT) as emu:
        app = build_proxy_app(budget_config(emu))
        async with serve(app) as url, open_client(url, key="sk-a", timeout=120) as alice:
            service: SchedulingService = app.state.fair_sched
            ends = record_ends(service)
            answer = await alice.post(CHAT, json=long_body())
            assert answer.status_code == 200
            assert len(answer.content) > 256 * 1024
            usage = answer.json()["usage"]
            assert usage["completion_tokens"] == LONG_ANSWER_TOKENS
            await assert_idle(service)
            [(charged, started, abandoned)] = ends
            assert (charged, started, abandoned) == (usage["total_tokens"], True, False)
            verdict = service.budgets.verdict("alice")
            assert verdict is not None and verdict.spent == usage["total_tokens"]
            # Over its 1,000-token budget now: the next one is refused until the window ends.
            refused = await alice.post(CHAT, json=long_body())
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "budget"


async def test_a_json_response_records_its_first_byte_before_its_end() -> None:
    """A Starlette `JSONResponse` behind the middleware: the first byte and the end arrive in
    one body message. Its lease must end started (the gate's `on_started` ran), charged the
    answer's usage, also when the answer is larger than the old 256 KiB copy."""
    async with emulator(default_max_tokens=LONG_ANSWER_TOKENS, **INSTANT) as emu:
        app = json_app(emu)
        async with middleware_app(app, budget_config(emu)) as url:
            service = middleware_service(app)
            ends = record_ends(service)
            async with open_client(url, key="sk-b", timeout=120) as bob:
                short = await bob.post(CHAT, json={**long_body(), "max_tokens": 5})
                long = await bob.post(CHAT, json=long_body())
            await assert_idle(service)
    assert short.status_code == long.status_code == 200
    expected = [
        (short.json()["usage"]["total_tokens"], True, False),
        (long.json()["usage"]["total_tokens"], True, False),
    ]
    assert ends == expected
