"""A request refused for its deadline spills over through LiteLLM's fallbacks: a real `litellm`
proxy with the plugin, model group `local` on a one-slot emulator with `fallbacks: [{local:
[cloud]}]`, group `cloud` on another emulator. The refusal is raised in LiteLLM's router (the
proxy's pre-call hook runs before it, where an error would not reach the fallbacks), and the
fallback group schedules the request as its own. The client's call is unchanged; the response's
`x-litellm-model-group` says which group served it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

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

pytestmark = [pytest.mark.litellm, pytest.mark.litellm_range, pytest.mark.slow]

STEPS: dict[str, Any] = {
    "base_step_ms": 4.0,
    "step_ms_per_running_seq": 0.0,
    "prefill_ms_per_token": 0.0,
}


@contextlib.asynccontextmanager
async def local_with_cloud_fallback(
    workdir: Any, *, fallbacks: bool
) -> AsyncIterator[tuple[str, Any, Any]]:
    async with (
        run_emulator(EmulatorConfig(models=("tiny",), max_num_seqs=1, **STEPS)) as local,
        run_emulator(EmulatorConfig(models=("tiny",), max_num_seqs=8, **STEPS)) as cloud,
    ):
        config = proxy_config(
            [model_entry("local", f"{local.base_url}/v1"), model_entry("cloud", f"{cloud.base_url}/v1")],
            {
                "tiers": [{"name": "interactive", "waiting_below": 3}],
                "principals": [{"name": name, "keys": [f"sk-{name}"]} for name in ("alice", "bob")],
                "metrics_poll_ms": 50,
                "queue": {"max_wait_s": 120},
                "observability": {"admin_key": MASTER_KEY},
            },
            router_settings={"fallbacks": [{"local": ["cloud"]}]} if fallbacks else None,
        )  # fmt: skip
        async with litellm_proxy(config, workdir, "deadlines") as proxy:
            yield proxy.base_url, local, cloud


async def _send(
    client: httpx.AsyncClient, max_tokens: int, limit_s: float | None = None, model: str = "local"
) -> Any:
    headers = {} if limit_s is None else {"x-fair-sched-max-wait-s": f"{limit_s:g}"}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about deadlines."}],
        "max_tokens": max_tokens,
    }
    return await client.post(CHAT, json=body, headers=headers)


async def _flood_then_burst(base_url: str) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """Alice's backlog drains through `local`'s one slot (the rate gets measured); then bob
    sends eight at once with 1 s each, of which the later ones cannot start in time there."""
    async with (
        open_client(base_url, key="sk-alice", timeout=120) as alice,
        open_client(base_url, key="sk-bob", timeout=120) as bob,
    ):
        # The fallback group's gate has read its engine's metrics (a cold gate waits for its
        # first scrape, longer than the 0.3 s limit on a loaded machine).
        assert (await _send(alice, 1, model="cloud")).status_code == 200
        backlog = [asyncio.ensure_future(_send(alice, 40)) for _ in range(40)]
        async with open_client(base_url, key=MASTER_KEY, timeout=30) as admin:
            for _ in range(600):  # bounded: a minute at most
                status = (await admin.get("/fair-sched/status")).json()
                # The drain rate is known after two runs of eight releases from the backlog
                # (the first fills the engine and is not sampled): nothing is refused before.
                if status["totals"]["released"] >= 20:
                    break
                await asyncio.sleep(0.1)
        burst = await asyncio.gather(*(_send(bob, 4, limit_s=1.0) for _ in range(8)))
        return list(burst), list(await asyncio.gather(*backlog))


async def test_a_request_refused_for_its_deadline_is_served_by_the_fallback_group(
    tmp_path: Any,
) -> None:
    async with local_with_cloud_fallback(tmp_path, fallbacks=True) as (base_url, _local, cloud):
        burst, backlog = await _flood_then_burst(base_url)
        served_by_cloud = len(cloud.engine.received) - 1  # less the warm-up
    assert all(response.status_code == 200 for response in backlog)
    assert all(response.status_code == 200 for response in burst), "\n".join(
        f"{r.status_code} {r.text[-600:]}" for r in burst if r.status_code != 200
    )
    groups = [response.headers.get("x-litellm-model-group") for response in burst]
    assert "cloud" in groups, groups
    assert served_by_cloud == groups.count("cloud")


async def test_without_fallbacks_the_refusal_is_the_clients_429(tmp_path: Any) -> None:
    async with local_with_cloud_fallback(tmp_path, fallbacks=False) as (base_url, _local, cloud):
        burst, _backlog = await _flood_then_burst(base_url)
        assert len(cloud.engine.received) == 1  # the warm-up only
    refused = [response for response in burst if response.status_code == 429]
    assert refused, [response.status_code for response in burst]
    assert refused[-1].json()["error"]["code"] == "deadline_unreachable"
