"""Keep-alive while parked through a real `litellm --config` proxy process.

The engine (emulator, one slot) is filled by two long streams sent to it directly, so the
proxy's gate parks what comes through it. The official `openai` SDK and `litellm.acompletion`
stream through an idle-timeout relay (`relay.py`) in front of a proxy with keep-alive, and the
SDK through one in front of a proxy without it (the control, which the relay cuts).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fair_sched_plugin.lab.emulator.server import RunningEmulator, run_emulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    MASTER_KEY,
    litellm_proxy,
    model_entry,
    proxy_config,
)

from .conftest import MODEL, emulator_config, wait_until
from .litellm_harness import NEEDS_LITELLM
from .relay import idle_timeout_relay
from .test_waiting_clients import (
    KEEPALIVE_OFF,
    KEEPALIVE_ON,
    RELAY_IDLE_S,
    expected_text,
    import_litellm,
    litellm_stream,
    openai_stream,
)

pytestmark = [
    pytest.mark.litellm,
    pytest.mark.slow,
    NEEDS_LITELLM,
]


def section(queue: dict[str, Any]) -> dict[str, Any]:
    return {
        "tiers": [{"name": "interactive", "waiting_below": 1}],
        "principals": [
            {"name": "alice", "keys": ["sk-a"]},
            {"name": "bob", "keys": ["sk-b"]},
            {"name": "carol", "keys": ["sk-c"]},
        ],
        "queue": {"max_wait_s": 120, **queue},
        "metrics_poll_ms": 50,
    }


async def status(base_url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=10) as client:
        response = await client.get(
            "/fair-sched/status", headers={"authorization": f"Bearer {MASTER_KEY}"}
        )
        response.raise_for_status()
        document: dict[str, Any] = response.json()
        return document


async def wait_for_status(base_url: str, check: Any, timeout_s: float = 120.0) -> None:
    # Generous: see wait_queued (a fresh virtualenv's first litellm.acompletion call is slow).
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while not check(await status(base_url)):
        if loop.time() > give_up_at:
            pytest.fail(f"the proxy's status never matched: {await status(base_url)}")
        await asyncio.sleep(0.05)


def engine_waiting(document: dict[str, Any]) -> bool:
    return (document["models"][MODEL]["gate"].get("waiting") or 0) >= 1


def queued(count: int) -> Any:
    return lambda document: document["totals"]["queued"] >= count


async def fill_engine(emu: RunningEmulator, client: httpx.AsyncClient) -> list[asyncio.Task[Any]]:
    """One stream runs, one waits in the engine: the gate (waiting_below: 1) parks the rest."""

    async def hog(tag: str) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hog"}],
            "max_tokens": 5000,
            "stream": True,
            "user": tag,
        }
        async with client.stream("POST", f"{emu.base_url}/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_raw():
                pass

    before = emu.engine.statistics().requests_received
    tasks = [asyncio.ensure_future(hog("hog-1")), asyncio.ensure_future(hog("hog-2"))]
    await wait_until(lambda: emu.engine.statistics().requests_received == before + 2)
    return tasks


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_parked_streams_through_litellm_survive_an_idle_timeout_relay(
    tmp_path: Path,
) -> None:
    import_litellm()
    async with contextlib.AsyncExitStack() as exits:
        emu = await exits.enter_async_context(run_emulator(emulator_config(max_num_seqs=1)))
        expected = await expected_text(emu)
        models = [model_entry(MODEL, f"{emu.base_url}/v1")]
        on, off = await asyncio.gather(
            exits.enter_async_context(
                litellm_proxy(proxy_config(models, section(KEEPALIVE_ON)), tmp_path, "on")
            ),
            exits.enter_async_context(
                litellm_proxy(proxy_config(models, section(KEEPALIVE_OFF)), tmp_path, "off")
            ),
        )
        # Warm both (first-request imports) while the engine is free.
        for proxy in (on, off):
            assert await openai_stream(proxy.base_url, "sk-a") == expected
        async with httpx.AsyncClient(base_url=on.base_url, trust_env=False, timeout=30) as client:
            served = await client.post(
                "/v1/chat/completions",
                headers={"authorization": "Bearer sk-a"},
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert served.status_code == 200
            assert served.headers["x-fair-sched-tier"] == "interactive"
            assert float(served.headers["x-fair-sched-queued-s"]) >= 0
        on_relay = await exits.enter_async_context(idle_timeout_relay(on.base_url, RELAY_IDLE_S))
        off_relay = await exits.enter_async_context(idle_timeout_relay(off.base_url, RELAY_IDLE_S))
        hog_client = await exits.enter_async_context(
            httpx.AsyncClient(trust_env=False, timeout=120)
        )
        hogs = await fill_engine(emu, hog_client)
        try:
            await wait_for_status(on.base_url, engine_waiting)
            await wait_for_status(off.base_url, engine_waiting)
            sdk = asyncio.ensure_future(openai_stream(on_relay.url, "sk-a"))
            via_litellm = asyncio.ensure_future(litellm_stream(on_relay.url, "sk-b"))
            await wait_for_status(on.base_url, queued(2))
            control = asyncio.ensure_future(openai_stream(off_relay.url, "sk-c"))
            await wait_for_status(off.base_url, queued(1))
            with pytest.raises(openai.APIConnectionError):
                await asyncio.wait_for(control, RELAY_IDLE_S * 4)
            assert not sdk.done() and not via_litellm.done()
            assert (await status(on.base_url))["totals"]["queued"] == 2
            # Where do I stand, with the caller's own key: its one parked request, only.
            async with httpx.AsyncClient(base_url=on.base_url, trust_env=False) as client:
                mine = await client.get(
                    "/fair-sched/queue", headers={"authorization": "Bearer sk-a"}
                )
                assert [e["position"] for e in mine.json()["models"][MODEL]["parked"]] in (
                    [1],
                    [2],
                )
                carol = await client.get(
                    "/fair-sched/queue", headers={"authorization": "Bearer sk-c"}
                )
                assert carol.json() == {"models": {}}
        finally:
            for task in hogs:
                task.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)
        assert await asyncio.wait_for(sdk, 60) == expected
        assert await asyncio.wait_for(via_litellm, 60) == expected
        assert on_relay.dropped == 0 and off_relay.dropped >= 1
        await wait_for_status(off.base_url, lambda d: d["totals"]["queued"] == 0)
