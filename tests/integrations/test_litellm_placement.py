"""Several deployments behind one LiteLLM model name: a real `litellm` proxy with the plugin
sends each request exactly to the deployment the scheduler bound its lease to, also when that
deployment fails while LiteLLM's retries, cooldowns and fallbacks are configured.

One proxy for the module: model `tiny` on emulators A and B (retries 2, a fallback to `spare`),
model `spare` on emulator C. The emulators run in this test's event loop, so the tests count what
each engine received; the deployment a request was bound to is its response's
`x-fair-sched-deployment` header.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from fair_sched_plugin.lab.emulator.engine import EmulatorConfig
from fair_sched_plugin.lab.emulator.server import RunningEmulator, run_emulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    CHAT,
    MASTER_KEY,
    ProxyProcess,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
)
from fair_sched_plugin.observability import STATUS_PATH

from .litellm_harness import shared_proxy_marks

pytestmark = shared_proxy_marks(pytest.mark.litellm_range)

DEPLOYMENT_HEADER = "x-fair-sched-deployment"
REQUESTS = 16
STEPS: dict[str, Any] = {
    "base_step_ms": 20.0,
    "step_ms_per_running_seq": 0.0,
    "prefill_ms_per_token": 0.0,
}


@dataclass
class Stack:
    a: RunningEmulator
    b: RunningEmulator
    spare: RunningEmulator
    proxy: ProxyProcess

    def received(self) -> dict[str, int]:
        return {key(emu): len(emu.engine.received) for emu in (self.a, self.b, self.spare)}


def key(emu: RunningEmulator) -> str:
    return f"{emu.base_url}/v1"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    workdir = tmp_path_factory.mktemp("litellm-placement")
    async with contextlib.AsyncExitStack() as exits:
        engines = [
            await exits.enter_async_context(
                run_emulator(EmulatorConfig(models=("tiny",), max_num_seqs=4, **STEPS))
            )
            for _ in range(3)
        ]
        a, b, spare = engines
        config = proxy_config(
            [
                model_entry("tiny", f"{a.base_url}/v1"),
                model_entry("tiny", f"{b.base_url}/v1/"),
                model_entry("spare", f"{spare.base_url}/v1"),
                # No api_base: LiteLLM finds the engine from the environment, the plugin its
                # metrics from `backends` (the documented way for such an entry).
                {
                    "model_name": "solo",
                    "litellm_params": {"model": "hosted_vllm/tiny", "api_key": "none"},
                },
            ],
            {
                "backends": {"solo": {"metrics_url": f"{spare.base_url}/metrics"}},
                "tiers": [{"name": "interactive", "waiting_below": 2}],
                "principals": [
                    {"name": name, "keys": [f"sk-{name}"]} for name in ("alice", "bob", "carol")
                ],
                "metrics_poll_ms": 50,
            },
            # What a production config has: retries, and a fallback to another model group.
            num_retries=2,
            # The first failure puts a deployment in LiteLLM's cooldown for the rest of the
            # module.
            router_settings={
                "fallbacks": [{"tiny": ["spare"]}],
                "allowed_fails": 0,
                "cooldown_time": 120,
                "model_group_alias": {"tiny-alias": "tiny"},
            },
        )
        env = {"HOSTED_VLLM_API_BASE": f"{spare.base_url}/v1"}
        proxy = await exits.enter_async_context(
            litellm_proxy(config, workdir, "placement", env=env)
        )
        yield Stack(a, b, spare, proxy)


async def burst(stack: Stack) -> list[httpx.Response]:
    """REQUESTS requests at once from three users, each with a prompt of its own."""
    clients = [open_client(stack.proxy.base_url, key=f"sk-{name}") for name in ("alice", "bob")]
    clients.append(open_client(stack.proxy.base_url, key="sk-carol"))
    try:
        return list(
            await asyncio.gather(
                *(
                    clients[index % len(clients)].post(
                        CHAT,
                        json={
                            "model": "tiny",
                            "messages": [
                                {"role": "user", "content": f"Question {index}: " + "why? " * index}
                            ],
                            "max_tokens": 12,
                        },
                    )
                    for index in range(REQUESTS)
                )
            )
        )
    finally:
        for client in clients:
            await client.aclose()


async def test_every_request_reaches_the_deployment_its_lease_names(stack: Stack) -> None:
    before = stack.received()
    responses = await burst(stack)
    assert [response.status_code for response in responses] == [200] * REQUESTS
    placed = collections.Counter(response.headers[DEPLOYMENT_HEADER] for response in responses)
    arrived = {k: count - before[k] for k, count in stack.received().items()}
    # The trailing "/" of B's api_base in the model_list is not part of its key.
    assert set(placed) <= {key(stack.a), key(stack.b)}
    assert arrived == {key(stack.a): placed[key(stack.a)], key(stack.b): placed[key(stack.b)]} | {
        key(stack.spare): 0
    }
    # Both deployments took part: the burst is larger than one engine's room.
    assert placed[key(stack.a)] > 0 and placed[key(stack.b)] > 0


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_a_name_for_one_deployment_is_refused_and_an_alias_is_its_group(stack: Stack) -> None:
    """Before: a deployment's id (named in every response's `x-litellm-model-id`) or its
    `litellm_params.model` made LiteLLM's router call that deployment directly, and the plugin,
    seeing a name it did not know, scheduled it on the shared in-flight cap: past both engines'
    gates, with no deployment bound. Now those are refused; an alias is scheduled (and bound)
    as the group it names. Runs before A is put in LiteLLM's cooldown below."""
    before = stack.received()
    async with open_client(stack.proxy.base_url, key="sk-alice") as client:
        normal = await client.post(CHAT, json=chat("tiny"))
        assert normal.status_code == 200, normal.text
        by_id = await client.post(CHAT, json=chat(normal.headers["x-litellm-model-id"]))
        by_engine_name = await client.post(CHAT, json=chat("openai/tiny"))
        alias = await client.post(CHAT, json=chat("tiny-alias"))
    assert (by_id.status_code, by_engine_name.status_code) == (400, 400), by_id.text
    assert "scheduler chooses the deployment" in by_id.json()["error"]["message"]
    assert alias.status_code == 200, alias.text
    assert alias.headers[DEPLOYMENT_HEADER] in {key(stack.a), key(stack.b)}
    arrived = {k: count - before[k] for k, count in stack.received().items()}
    assert sum(arrived.values()) == 2  # the group's request and the alias's


async def test_a_deployment_known_by_its_metrics_url_only_is_served(stack: Stack) -> None:
    """A model_list entry without api_base, its metrics URL in `backends`: the gate knows the
    deployment by that URL, which names no LiteLLM deployment. Before: the routing hooks found
    no deployment with that key and refused every request with a 503 (the binding cannot be
    enforced there, and with one engine there is nothing to choose)."""
    before = stack.received()
    async with open_client(stack.proxy.base_url, key="sk-carol") as client:
        responses = [await client.post(CHAT, json=chat("solo")) for _ in range(2)]
    assert [response.status_code for response in responses] == [200, 200], responses[0].text
    assert {response.headers[DEPLOYMENT_HEADER] for response in responses} == {
        f"{stack.spare.base_url}/metrics"
    }
    assert stack.received()[key(stack.spare)] - before[key(stack.spare)] == 2


async def test_body_fields_that_pick_a_deployment_do_not_move_a_request(stack: Stack) -> None:
    """A client's own `api_base` (LiteLLM refuses client-side credentials unless configured),
    `specific_deployment`, `model_id` or `x-fair-sched-deployment` header: each request either
    fails or reaches exactly the deployment its lease names, never `spare` (all held when tried:
    `api_base` is a 500 from LiteLLM, `specific_deployment` our 503, the others are ignored)."""
    attempts: list[tuple[dict[str, Any], dict[str, str]]] = [
        ({"api_base": f"{stack.spare.base_url}/v1"}, {}),
        ({"base_url": f"{stack.spare.base_url}/v1"}, {}),
        ({"specific_deployment": True}, {}),
        ({"model_id": "spare"}, {}),
        ({"metadata": {"model_id": "spare"}}, {}),
        ({}, {DEPLOYMENT_HEADER: key(stack.spare)}),
    ]
    async with open_client(stack.proxy.base_url, key="sk-bob") as client:
        for fields, headers in attempts:
            before = stack.received()
            try:
                response = await client.post(CHAT, json={**chat("tiny"), **fields}, headers=headers)
            except httpx.TransportError:
                # LiteLLM 1.94.0 drops the connection for a body `base_url`: a failure too.
                response = None
            arrived = {k: n - before[k] for k, n in stack.received().items() if n > before[k]}
            if response is None:
                assert arrived == {}, (fields, "connection dropped", arrived)
            elif response.status_code == 200:
                assert arrived == {response.headers[DEPLOYMENT_HEADER]: 1}, (fields, arrived)
            else:
                assert arrived == {}, (fields, response.status_code, arrived)


async def test_a_failing_bound_deployment_is_neither_retried_elsewhere_nor_fallen_back(
    stack: Stack,
) -> None:
    """A answers every completion with a 500. LiteLLM would retry those on B, put A in
    cooldown and fall back to `spare`; bound requests instead stay on A (A in cooldown: refused
    with a message that names A) and fail, and B and `spare` receive only what was bound to B."""
    before = stack.received()
    stack.a.engine.faults.update({"fail_every_nth_completion": 1})
    try:
        responses = await burst(stack)
    finally:
        stack.a.engine.faults.update({"fail_every_nth_completion": 0})
    bound = collections.defaultdict(list)
    for response in responses:
        bound[response.headers[DEPLOYMENT_HEADER]].append(response)
    on_a, on_b = bound[key(stack.a)], bound[key(stack.b)]
    assert on_a and len(on_a) + len(on_b) == REQUESTS
    assert all(response.status_code == 200 for response in on_b)
    messages = []
    for response in on_a:
        assert response.status_code >= 500, response.text
        messages.append(response.json()["error"]["message"])
    # A's own error, or (once LiteLLM has A in cooldown) ours naming it; LiteLLM appends that
    # the fallback failed, in our words (it masks the host of the URL we name).
    assert all("injected failure" in text or "fair_sched" in text for text in messages), messages
    assert any("no healthy deployment" in text for text in messages), messages
    assert all("not falling back to model group `spare`" in text for text in messages), messages
    arrived = {k: count - before[k] for k, count in stack.received().items()}
    # Injected failures are answered before the engine queues them: A counts none.
    assert arrived == {key(stack.a): 0, key(stack.b): len(on_b), key(stack.spare): 0}


async def test_every_lease_ended_after_the_failures(stack: Stack) -> None:
    """Failed attempts do not end a lease (retries run within it), so the proxy's answer must:
    nothing stays in flight or queued (the plugin's status, read with the master key)."""
    async with open_client(stack.proxy.base_url, key=MASTER_KEY) as client:
        totals: dict[str, Any] = {}
        for _ in range(100):  # bounded: 5 s
            totals = (await client.get(STATUS_PATH)).json()["totals"]
            if totals["in_flight"] == 0 and totals["queued"] == 0:
                break
            await asyncio.sleep(0.05)
    assert (totals["in_flight"], totals["queued"]) == (0, 0), totals
