"""Graceful drain on SIGTERM, with real server processes.

`fair-sched proxy` and a `litellm --config` proxy, each in front of the emulator (8 slots): 8
streams run, 12 requests are parked (the gate's in-flight cap is 8: the engine's metrics URL
answers nothing), then the server gets SIGTERM. Every parked client gets a clean 503
`shutting_down` with `Retry-After`, every stream completes, the process exits within
`drain_grace_s`, and nothing is left running in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fair_sched_plugin.lab.emulator.server import RunningEmulator, run_emulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    MASTER_KEY,
    ProxyProcess,
    free_port,
    litellm_proxy,
    model_entry,
    proxy_config,
    proxy_env,
    write_config,
)
from fair_sched_plugin.lab.harness.processes import own_process_group

from ..support import wait_healthy
from .conftest import MODEL, emulator_config, wait_until

pytestmark = pytest.mark.slow

# Any number parked behind the full gate shows the drain; 12 keeps LiteLLM's per-refusal
# traceback logging (CPU on two cores) small.
STREAMS, PARKED = 8, 12
STREAM_TOKENS = 200
GRACE_S = 60.0
ADMIN_KEY = "fair-sched-test-admin-3f9c2a"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# Steps of 10 ms (a stream: ~2 s), stalled to 1 s (the `slow` fault) from the streams' start
# until every parked client has its 503: the signal lands mid-stream however long parking takes
# through a slow LiteLLM proxy, and no fixed stream length has to outlast it.
ENGINE = emulator_config(max_num_seqs=STREAMS, base_step_ms=10.0)
STALLED = {"slow": 100.0}


def section(emu: RunningEmulator) -> dict[str, Any]:
    return {
        "tiers": [{"name": "interactive", "waiting_below": 4}],
        "principals": [{"name": "alice", "keys": ["sk-a"]}, {"name": "bob", "keys": ["sk-b"]}],
        "backends": {
            MODEL: {
                "api_base": f"{emu.base_url}/v1",
                # Nothing answers there: the gate runs on its in-flight cap (8), so exactly 8
                # requests run and the rest park, whatever the engine's timing.
                "metrics_url": f"http://127.0.0.1:{free_port()}/metrics",
                "on_metrics_unavailable": {"max_inflight": STREAMS},
            }
        },
        "metrics_poll_ms": 50,
        "drain_grace_s": GRACE_S,
        "queue": {"max_wait_s": 300},
        "observability": {"admin_key": ADMIN_KEY},
    }


def spawn_fair_sched_proxy(config_path: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "fair_sched_plugin.cli", "proxy", "--config", str(config_path),
             "--port", str(port), "--log-level", "warning"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=proxy_env(),
            **own_process_group(),
        )  # fmt: skip


@contextlib.asynccontextmanager
async def fair_sched_proxy(config: dict[str, Any], directory: Path) -> AsyncIterator[ProxyProcess]:
    config_path = write_config(directory, "fair", {"fair_sched": config})
    port = free_port()
    log_path = directory / "fair.log"
    process = spawn_fair_sched_proxy(config_path, port, log_path)
    proxy = ProxyProcess(f"http://127.0.0.1:{port}", port, process, log_path, config_path)
    try:
        await wait_healthy(proxy.base_url, process, lambda: proxy.log_tail())
        yield proxy
    finally:
        if process.poll() is None:
            process.kill()
        await asyncio.to_thread(process.wait, 10)


async def queued(base_url: str, headers: dict[str, str]) -> int:
    # A LiteLLM proxy taking 58 requests on a busy two-core machine can be slow to answer.
    async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=60) as client:
        response = await client.get("/fair-sched/status", headers=headers)
        response.raise_for_status()
        count: int = response.json()["totals"]["queued"]
        return count


async def stream_text(client: httpx.AsyncClient) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
        "max_tokens": STREAM_TOKENS,
        "stream": True,
    }
    events = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]", events[-3:]
    return "".join(
        choice["delta"].get("content") or ""
        for event in events[:-1]
        for choice in json.loads(event)["choices"]
    )


async def drain_scenario(
    emu: RunningEmulator,
    proxy: ProxyProcess,
    status_headers: dict[str, str],
    *,
    traceback_free_log: bool = True,
) -> None:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(
            base_url=proxy.base_url,
            trust_env=False,
            timeout=120,
            limits=limits,
            headers={"authorization": "Bearer sk-a"},
        ) as streamer,
        httpx.AsyncClient(
            base_url=proxy.base_url,
            trust_env=False,
            timeout=120,
            limits=limits,
            headers={"authorization": "Bearer sk-b"},
        ) as waiter,
    ):
        # Warm up (LiteLLM imports on its first request), while nothing is measured.
        assert (await waiter.post("/v1/chat/completions", json=BODY)).status_code == 200
        before = emu.engine.statistics().requests_received
        emu.engine.faults.update(STALLED)
        streams = [asyncio.ensure_future(stream_text(streamer)) for _ in range(STREAMS)]
        await wait_until(lambda: emu.engine.statistics().running == STREAMS, timeout_s=60)
        parked = [
            asyncio.ensure_future(waiter.post("/v1/chat/completions", json=BODY))
            for _ in range(PARKED)
        ]
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + 120
        while await queued(proxy.base_url, status_headers) < PARKED:
            assert loop.time() < give_up_at, "the requests did not all park"
            await asyncio.sleep(0.05)
        assert not any(task.done() for task in streams)

        proxy.process.send_signal(signal.SIGTERM)
        refused = await asyncio.gather(*parked)
        emu.engine.faults.update({"slow": 1.0})  # the streams may finish now
        texts = await asyncio.gather(*streams)
        # Past `drain_grace_s` the server would be cut off; it exits once its streams are done.
        # A wait past the grace period fails (subprocess.TimeoutExpired): that bound is the
        # claim, not a measured duration.
        code = await asyncio.to_thread(proxy.process.wait, GRACE_S)

    for response in refused:
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "shutting_down"
        assert int(response.headers["retry-after"]) >= 1
    assert len(set(texts)) == 1 and texts[0]  # every stream complete and alike
    # Only the streams reached the engine; it has nothing left to run.
    assert emu.engine.statistics().requests_received == before + STREAMS
    await wait_until(lambda: emu.engine.statistics().running == 0, timeout_s=10)
    if traceback_free_log:
        # (LiteLLM logs a traceback for every refusal a pre-call hook raises, 429 or 503.)
        log = proxy.log_text()
        assert "Traceback" not in log, log[-3000:]
    print(f"\n{type(proxy).__name__} drained: exit {code}")


async def test_fair_sched_proxy_drains_on_sigterm(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as exits:
        emu = await exits.enter_async_context(run_emulator(ENGINE))
        proxy = await exits.enter_async_context(fair_sched_proxy(section(emu), tmp_path))
        await drain_scenario(emu, proxy, {"authorization": f"Bearer {ADMIN_KEY}"})


@pytest.mark.litellm
@pytest.mark.skipif(importlib.util.find_spec("litellm") is None, reason="needs the litellm extra")
async def test_litellm_proxy_drains_on_sigterm(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as exits:
        emu = await exits.enter_async_context(run_emulator(ENGINE))
        fair = section(emu)
        fair.pop("observability")  # LiteLLM's master key guards the status
        models = [model_entry(MODEL, f"{emu.base_url}/v1")]
        proxy = await exits.enter_async_context(
            litellm_proxy(proxy_config(models, fair), tmp_path, "drain")
        )
        await drain_scenario(
            emu, proxy, {"authorization": f"Bearer {MASTER_KEY}"}, traceback_free_log=False
        )
