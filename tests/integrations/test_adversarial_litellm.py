"""Hostile clients against the LiteLLM adapter, through one real LiteLLM proxy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from fair_sched_plugin.lab.emulator.engine import EmulatorConfig
from fair_sched_plugin.lab.emulator.server import run_emulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    CHAT,
    MASTER_KEY,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
)
from fair_sched_plugin.lab.harness.litellm_proxy import EmulatedStack as Stack

from .conftest import cancel_all, wait_until
from .litellm_harness import shared_proxy_marks

pytestmark = shared_proxy_marks(pytest.mark.litellm_range)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """One emulator behind one LiteLLM proxy with the plugin, trusting `x-fair-sched-user` (as
    behind a gateway that sets it)."""
    async with run_emulator(
        EmulatorConfig(models=("tiny",), max_num_seqs=4, base_step_ms=15.0)
    ) as emu:
        config = proxy_config(
            [model_entry("tiny", f"{emu.base_url}/v1")],
            {
                "identity": {"source": "header"},
                "observability": {"user_labels": "principals"},
                "principals": [
                    {"name": "alice", "match": {"user_id": "nobody-a"}},
                    {"name": "bob", "match": {"user_id": "nobody-b"}},
                ],
            },
        )
        async with litellm_proxy(config, tmp_path_factory.mktemp("adv")) as proxy:
            yield Stack(emu, proxy)


async def test_litellm_sends_extra_body_max_tokens_over_the_top_level_one(stack: Stack) -> None:
    """Why the estimate below reads `extra_body`: the engine generates what it says."""
    async with open_client(stack.proxy.base_url, MASTER_KEY) as client:
        response = await client.post(
            CHAT,
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "extra_body": {"max_tokens": 37},
            },
            headers={"x-fair-sched-user": "bob"},
        )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 37
    assert [r.max_tokens for r in stack.emu.engine.received][-1:] == [37]


async def test_max_tokens_in_extra_body_is_what_the_request_is_estimated_at() -> None:
    """LiteLLM sends `extra_body`'s fields as the engine's top-level ones, over the top-level
    `max_tokens` (the way the tier's priority reaches the engine). A request that says
    `max_tokens: 1` there and 4000 in `extra_body` generates 4000 tokens: its estimate (the
    charge at its grant, and all it is charged if the client leaves mid-stream) must say so."""
    import types

    from fair_sched_plugin.litellm._callback import FairSchedCallback
    from fair_sched_plugin.request.watch import ensure_current_request
    from fair_sched_plugin.runtime.service import SchedulingService

    async with SchedulingService({"unknown_model_max_inflight": 4}) as service:
        callback = FairSchedCallback(lambda: service)
        auth = types.SimpleNamespace(
            metadata={}, user_id="mallory", team_id=None, key_alias=None, token="h"
        )
        data: dict[str, object] = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "extra_body": {"max_tokens": 4000},
        }
        await callback.async_pre_call_hook(auth, None, data, "acompletion")
        lease = ensure_current_request().lease
        assert lease is not None
        try:
            assert lease.ticket.cost >= 4000
        finally:
            lease.release()


async def test_a_stream_left_before_its_first_chunk_at_the_engine_is_charged(
    stack: Stack,
) -> None:
    """The engine answered the stream's headers and holds it in its queue (its slots are taken):
    a client that leaves then had its lease abandoned by the streaming hook (uncharged, the turn
    passed on), though the request went on to the engine; the other adapters charge what the
    engine can have generated."""
    abandoned_before = _counter(stack, "fair_sched_abandoned_total")
    hog_body = {**_chat(4000), "stream": True}

    async def hog(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", CHAT, json=hog_body, headers=BOB) as response:
            async for _ in response.aiter_bytes():
                pass

    async with open_client(stack.proxy.base_url, MASTER_KEY) as client:
        hogs = [asyncio.ensure_future(hog(client)) for _ in range(4)]
        try:
            await wait_until(lambda: stack.emu.engine.statistics().running == 4, timeout_s=30)
            received = stack.emu.engine.statistics().requests_received
            body = {**_chat(8), "stream": True}
            # LiteLLM sends no headers before the first chunk: the client waits, then leaves.
            leaving = asyncio.ensure_future(client.post(CHAT, json=body, headers=BOB))
            try:
                await wait_until(
                    lambda: stack.emu.engine.statistics().requests_received == received + 1,
                    timeout_s=30,
                )
            finally:
                await cancel_all([leaving])
        finally:
            await cancel_all(hogs)
        await wait_until(lambda: stack.emu.engine.statistics().running == 0, timeout_s=30)
    assert _counter(stack, "fair_sched_abandoned_total") == abandoned_before


async def test_a_request_litellm_times_out_at_the_engine_is_charged_not_abandoned(
    stack: Stack,
) -> None:
    """A client's own `timeout` makes LiteLLM give up on a non-streamed request the engine has
    been generating for: the failure hook abandoned its lease (uncharged, the turn passed on),
    so a client could use the engine for `timeout` seconds per request for free."""
    before = stack.emu.engine.statistics().requests_received
    async with open_client(stack.proxy.base_url, MASTER_KEY) as client:
        response = await client.post(
            CHAT,
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4000,  # a minute at 15 ms a step
                "timeout": 1,
            },
            headers={"x-fair-sched-user": "bob"},
        )
        assert response.status_code >= 400, response.text
        assert stack.emu.engine.statistics().requests_received == before + 1
        metrics = (await client.get("/fair-sched/metrics")).text
    assert "fair_sched_abandoned_total 0.0" in metrics


async def test_a_body_metadata_header_does_not_name_the_user_on_litellm_metadata_routes(
    stack: Stack,
) -> None:
    """identity.source header: the trusted gateway in front sets `x-fair-sched-user: bob`. On
    /v1/responses LiteLLM keeps the request's headers in `litellm_metadata` and leaves the body's
    own `metadata` as the client wrote it, so a client that writes `metadata.headers` there
    must not be queued as the user it names. (Last: the emulator's 404 to /v1/responses puts the
    deployment in LiteLLM's cooldown.)"""
    async with open_client(stack.proxy.base_url, MASTER_KEY) as client:
        response = await client.post(
            "/v1/responses",
            json={
                "model": "tiny",
                "input": "hi",
                "max_output_tokens": 4,
                "metadata": {"headers": {"x-fair-sched-user": "alice"}},
            },
            headers={"x-fair-sched-user": "bob"},
        )
    assert response.headers.get("x-fair-sched-principal") == "bob"


BOB = {"x-fair-sched-user": "bob"}


def _chat(max_tokens: int) -> dict[str, object]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }


def _counter(stack: Stack, name: str) -> float:
    """A counter of the proxy's /fair-sched/metrics."""
    text = httpx.get(
        f"{stack.proxy.base_url}/fair-sched/metrics",
        headers={"authorization": f"Bearer {MASTER_KEY}"},
        timeout=10.0,
        trust_env=False,
    ).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics")
