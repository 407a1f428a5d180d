"""`queue.order: shortest_first` end to end: a real `litellm` proxy process in front of the
emulator, one user with 40 long and 10 short requests queued at once."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from typing import Any

import httpx
import pytest

from fair_sched_plugin.lab.emulator.engine import EmulatorConfig
from fair_sched_plugin.lab.emulator.server import RunningEmulator, run_emulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
)

from .litellm_harness import NEEDS_LITELLM

pytestmark = [
    pytest.mark.litellm,
    NEEDS_LITELLM,
    pytest.mark.timing,
]

LONG, SHORT = 64, 2  # output tokens
LONG_COUNT, SHORT_COUNT = 40, 10
SLOTS = 4
STEPS: dict[str, Any] = {
    "base_step_ms": 6.0,
    "step_ms_per_running_seq": 0.0,
    "prefill_ms_per_token": 0.0,
}


def section(order: str) -> dict[str, Any]:
    return {
        "tiers": [{"name": "interactive", "waiting_below": 1}],
        "principals": [{"name": "alice", "keys": ["sk-a"]}],
        "queue": {"order": order},
        "metrics_poll_ms": 50,
    }


async def one_user_burst(base_url: str) -> tuple[list[float], float]:
    """Send every request at once (a short one after every four long ones); the short ones'
    latencies and the makespan."""
    sizes = []
    for index in range(LONG_COUNT + SHORT_COUNT):
        sizes.append(SHORT if index % 5 == 4 else LONG)
    async with open_client(base_url, "sk-a", timeout=120.0) as client:

        async def send(max_tokens: int) -> float:
            started = time.perf_counter()
            response = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
                    "max_tokens": max_tokens,
                },
            )
            assert response.status_code == 200, response.text
            return time.perf_counter() - started

        started = time.perf_counter()
        tasks = []
        for size in sizes:
            tasks.append(asyncio.create_task(send(size)))
            await asyncio.sleep(0.005)  # arrive in this order
        latencies = await asyncio.gather(*tasks)
        makespan = time.perf_counter() - started
    short = [latency for latency, size in zip(latencies, sizes, strict=True) if size == SHORT]
    return short, makespan


async def test_shortest_first_lets_a_users_short_requests_pass_its_long_ones(
    tmp_path: Any,
) -> None:
    config = EmulatorConfig(models=("tiny",), max_num_seqs=SLOTS, **STEPS)
    async with contextlib.AsyncExitStack() as exits:
        emu: RunningEmulator = await exits.enter_async_context(run_emulator(config))
        models = [model_entry("tiny", f"{emu.base_url}/v1")]
        fifo, short_first = await asyncio.gather(
            exits.enter_async_context(
                litellm_proxy(proxy_config(models, section("fifo")), tmp_path, "fifo")
            ),
            exits.enter_async_context(
                litellm_proxy(
                    proxy_config(models, section("shortest_first")), tmp_path, "short_first"
                )
            ),
        )
        # Warm both proxies (first-request imports) before measuring.
        for proxy in (fifo, short_first):
            async with httpx.AsyncClient(base_url=proxy.base_url, trust_env=False) as warm:
                await warm.post(
                    "/v1/chat/completions",
                    headers={"authorization": "Bearer sk-a"},
                    json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                    timeout=60,
                )
        fifo_short, fifo_makespan = await one_user_burst(fifo.base_url)
        sf_short, sf_makespan = await one_user_burst(short_first.base_url)
    ratio = statistics.mean(sf_short) / statistics.mean(fifo_short)
    throughput = fifo_makespan / sf_makespan
    print(
        f"\nshort requests' mean latency: fifo {statistics.mean(fifo_short):.2f} s, "
        f"shortest_first {statistics.mean(sf_short):.2f} s (ratio {ratio:.2f}); makespan "
        f"fifo {fifo_makespan:.2f} s, shortest_first {sf_makespan:.2f} s "
        f"(throughput ratio {throughput:.3f})"
    )
    assert ratio <= 0.5
    # The same work in another order keeps the engine as busy; the makespan ratio is printed,
    # not asserted: a timing ratio on a loaded 2-core runner (0.82 to 1.10 between runs of the same
    # code) is a benchmark number, not a behaviour; through the fair proxy the emulator runs
    # 3.4-3.6 of its 4 slots in both orders, so the spread is timing noise, not a cost.
