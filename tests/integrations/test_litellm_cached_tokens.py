"""Inside LiteLLM, cached prompt tokens reach the `tokens` policy: a real `litellm`
proxy with the plugin in front of the emulator with its prefix cache on; what each request was
charged is read back from a token budget on the status page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fair_sched_plugin.lab.emulator.engine import EmulatorConfig
from fair_sched_plugin.lab.emulator.server import run_emulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    MASTER_KEY,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
)
from fair_sched_plugin.observability import STATUS_PATH

from .litellm_harness import NEEDS_LITELLM

pytestmark = [
    pytest.mark.litellm,
    NEEDS_LITELLM,
]

# 30 whole cache blocks of 16 tokens (the emulator counts 4 characters a token).
SYSTEM_PROMPT = ("Answer as the billing team's assistant. " * 100)[: 30 * 16 * 4]


async def test_litellm_charges_only_uncached_prompt_tokens(tmp_path: Path) -> None:
    config = EmulatorConfig(models=("tiny",), base_step_ms=2.0, prefix_cache_blocks=1000)
    section = {
        "fairness": "tokens",
        "principals": [
            {
                "name": "payer",
                "keys": ["sk-payer"],
                "budget": {"tokens": 1_000_000, "per": "hour", "action": "reject"},
            }
        ],
        "metrics_poll_ms": 50,
    }
    async with run_emulator(config) as emu:
        litellm_config = proxy_config([model_entry("tiny", f"{emu.base_url}/v1")], section)
        async with (
            litellm_proxy(litellm_config, tmp_path, "cached-tokens") as proxy,
            open_client(proxy.base_url, "sk-payer", 60.0) as client,
            open_client(proxy.base_url, MASTER_KEY, 60.0) as admin,
        ):

            async def spent() -> float:
                (payer,) = (await admin.get(STATUS_PATH)).json()["budgets"]
                return float(payer["spent"])

            charges: list[float] = []
            usages: list[dict[str, Any]] = []
            for index, stream in enumerate((False, False, True)):
                body: dict[str, Any] = {
                    "model": "tiny",
                    "messages": [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": f"Invoice {index}?"},
                    ],
                    "max_tokens": 5,
                }
                before = await spent()
                if stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                        assert reply.status_code == 200
                        lines = [line async for line in reply.aiter_lines()]
                    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
                    usages.append(next(c["usage"] for c in reversed(chunks) if c.get("usage")))
                else:
                    reply = await client.post("/v1/chat/completions", json=body)
                    assert reply.status_code == 200, reply.text
                    usages.append(reply.json()["usage"])
                charges.append(await spent() - before)
    prompt = usages[0]["prompt_tokens"]
    assert charges[0] == prompt + 5  # the first request found nothing cached
    for usage, charge in zip(usages[1:], charges[1:], strict=True):
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == 30 * 16, usage  # LiteLLM relays the engine's cached_tokens
        assert charge == usage["prompt_tokens"] - cached + 5
        assert charge < usage["prompt_tokens"] + 5
