"""Property: a request's lease lives once through the LiteLLM plugin (a real `litellm` proxy).

The plans of `test_lifecycle_properties.py` (`lifecycle.plans`), sent to one LiteLLM proxy (for
every example: starting one takes ~15 s) with the plugin on its fallback in-flight cap of two (no
metrics), in front of the emulator; beside the plugin, another callback
(`lifecycle_observer.raising`) raises in its success hook and its loggers for the plans that say
so. The plugin's state lives in the proxy's process, so what is
checked is what its `/fair-sched/status` shows, after each example:

- nothing queued or in flight, and every lease granted in the example ended (completed or
  abandoned; the core's counts), at least one completed for each answer whose `usage` the
  client read, with the engine holding no sequence;
- a request whose client read the engine's `usage` was charged exactly that, and one never sent
  whole nothing: each request of an example is sent as a principal of its own, whose spend
  (`budgets` in the status) is that request's charge.

Not visible from outside the process: whether a lease's first byte was recorded, and how often
each lease's end was heard (the status counts ends, not leases).
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, event, given, settings

from fair_sched_plugin.lab.harness.litellm_proxy import (
    MASTER_KEY,
    litellm_proxy,
    model_entry,
    proxy_config,
)
from fair_sched_plugin.lab.harness.litellm_proxy import EmulatedStack as Stack

from ..support import LOOPBACK, eventually, free_port, open_client
from .conftest import MODEL
from .lifecycle import (
    ENGINE_SLOTS,
    IDLE_TIMEOUT_S,
    OBSERVERS_RAISE,
    Leave,
    Plan,
    lifecycle_emulator,
    plans,
    play_all,
)
from .litellm_harness import shared_proxy_marks

pytestmark = shared_proxy_marks()

MAX_PLANS = 6
# Each request of an example is sent as a principal of its own, so that the status's spend per
# principal is that one request's charge.
LITELLM_KEYS = {f"sk-{index}": f"caller-{index}" for index in range(MAX_PLANS)}
BUDGET_TOKENS = 10**9  # never reached: the budget is there to show each principal's spend


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def litellm_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    workdir = tmp_path_factory.mktemp("lifecycle")
    # LiteLLM loads a callback named `module.attribute` from its config file's directory.
    observer = Path(__file__).with_name("lifecycle_observer.py")
    assert f'OBSERVERS_RAISE = "{OBSERVERS_RAISE}"' in observer.read_text(encoding="utf-8")
    shutil.copy(observer, workdir / observer.name)
    async with lifecycle_emulator() as emu:
        section = {
            "tiers": [{"name": "interactive", "waiting_below": 1}],
            "principals": [
                {"name": name, "keys": [key], "budget": {"tokens": BUDGET_TOKENS, "per": "day"}}
                for key, name in LITELLM_KEYS.items()
            ],
            "backends": {
                MODEL: {
                    "metrics_url": f"http://{LOOPBACK}:{free_port()}/metrics",
                    "on_metrics_unavailable": {"max_inflight": ENGINE_SLOTS},
                }
            },
            "metrics_poll_ms": 50,
            "fairness": "tokens",
        }
        config = proxy_config([model_entry(MODEL, f"{emu.base_url}/v1")], section)
        config["litellm_settings"]["callbacks"].append("lifecycle_observer.raising")
        async with litellm_proxy(config, workdir, "lifecycle") as proxy:
            yield Stack(emu, proxy)


async def read_status(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get(
        "/fair-sched/status", headers={"authorization": f"Bearer {MASTER_KEY}"}
    )
    response.raise_for_status()
    document: dict[str, Any] = response.json()
    return document


def spent_by_user(status: dict[str, Any]) -> dict[str, int]:
    return {row["user"]: row["spent"] for row in status["budgets"]}


async def run_example(stack: Stack, examples: list[Plan]) -> None:
    try:
        await check_example(stack, examples)
    except httpx.TransportError:
        process = stack.proxy.process
        if process.poll() is None:
            raise
        # Not a property of ours that failed: say so (a rare segfault of the proxy was seen).
        pytest.fail(
            f"the LiteLLM proxy exited ({process.returncode}):\n{stack.proxy.log_tail()}",
            pytrace=False,
        )


async def check_example(stack: Stack, examples: list[Plan]) -> None:
    examples = [replace(plan, key=key) for plan, key in zip(examples, LITELLM_KEYS, strict=False)]
    async with open_client(stack.proxy.base_url, timeout=30.0) as client:
        before = await read_status(client)

        async def reached(plan: Plan, stage: Leave) -> bool:
            if stage == "granted":
                running = (await read_status(client))["models"][MODEL]["in_flight_by_user"]
                return any(row["user"] == LITELLM_KEYS[plan.key] for row in running)
            answer = await client.get(
                "/fair-sched/queue", headers={"authorization": f"Bearer {plan.key}"}
            )
            mine = answer.json().get("models", {}).get(MODEL, {})
            return bool(mine.get("parked"))

        outcomes = await play_all(stack.proxy.base_url, examples, reached)

        async def idle() -> bool:
            totals = (await read_status(client))["totals"]
            engine = stack.emu.engine.statistics()
            busy = (totals["queued"], totals["in_flight"], engine.waiting, engine.running)
            return busy == (0, 0, 0, 0)

        await eventually(idle, IDLE_TIMEOUT_S, what="nothing queued or in flight in LiteLLM")
        after = await read_status(client)
    totals = {
        name: after["totals"][name] - before["totals"][name]
        for name in ("released", "completed", "abandoned")
    }
    assert totals["released"] == totals["completed"] + totals["abandoned"], totals
    # A request whose client read the engine's `usage` was served: its lease completed.
    assert totals["completed"] >= sum(o.usage() is not None for o in outcomes), totals
    spent, spent_before = spent_by_user(after), spent_by_user(before)
    for outcome in outcomes:
        event(outcome.kind())
        user = LITELLM_KEYS[outcome.plan.key]
        charged = spent[user] - spent_before[user]
        usage = outcome.usage()
        if usage is not None:
            assert charged == usage["total_tokens"], (charged, outcome)
        elif outcome.plan.leave == "before_body":
            assert charged == 0, (charged, outcome)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(examples=plans(max_size=MAX_PLANS))
async def test_every_lease_through_litellm_ends_and_is_charged_its_usage(
    litellm_stack: Stack, examples: list[Plan]
) -> None:
    await run_example(litellm_stack, examples)
