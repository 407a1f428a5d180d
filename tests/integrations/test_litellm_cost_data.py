"""Inside LiteLLM, a model without `backends.<model>.price` is charged at LiteLLM's own prices:
the deployment's `model_info.input_cost_per_token` / `output_cost_per_token`, or
LiteLLM's cost map for the deployment's model. A real `litellm` proxy in front of the emulator;
the spend is read back from the budget on the status page."""

from __future__ import annotations

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

# Money per token, as LiteLLM's model_info spells it.
INPUT_COST, OUTPUT_COST = 2e-6, 6e-6
# LiteLLM's bundled cost map (LITELLM_LOCAL_MODEL_COST_MAP=True) for openai/gpt-4o-mini.
MAP_INPUT_COST, MAP_OUTPUT_COST = 0.15e-6, 0.6e-6


def section() -> dict[str, Any]:
    # No `backends.<model>.price` anywhere: inside LiteLLM both are accepted.
    return {
        "fairness": "cost",
        "principals": [
            {
                "name": "payer",
                "keys": ["sk-payer"],
                "budget": {"usd": 1.0, "per": "hour", "action": "reject"},
            }
        ],
        "metrics_poll_ms": 50,
    }


async def test_models_without_a_price_are_charged_at_litellms_prices(tmp_path: Path) -> None:
    config = EmulatorConfig(models=("tiny", "gpt-4o-mini"), base_step_ms=2.0)
    async with run_emulator(config) as emu:
        priced = model_entry("priced", f"{emu.base_url}/v1")
        priced["model_info"] = {
            "input_cost_per_token": INPUT_COST,
            "output_cost_per_token": OUTPUT_COST,
        }
        mapped = model_entry("mapped", f"{emu.base_url}/v1", engine_model="gpt-4o-mini")
        litellm_config = proxy_config([priced, mapped], section())
        async with (
            litellm_proxy(litellm_config, tmp_path, "cost-data") as proxy,
            open_client(proxy.base_url, "sk-payer", 60.0) as client,
            open_client(proxy.base_url, MASTER_KEY, 60.0) as admin,
        ):

            async def spent() -> float:
                status = (await admin.get(STATUS_PATH)).json()
                (payer,) = status["budgets"]
                return float(payer["spent"])

            expected = 0.0
            for model, input_cost, output_cost in (
                ("priced", INPUT_COST, OUTPUT_COST),
                ("mapped", MAP_INPUT_COST, MAP_OUTPUT_COST),
            ):
                response = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": model,
                        "messages": [{"role": "user", "content": "How much is this? " * 8}],
                        "max_tokens": 20,
                    },
                )
                assert response.status_code == 200, response.text
                usage = response.json()["usage"]
                expected += (
                    usage["prompt_tokens"] * input_cost + usage["completion_tokens"] * output_cost
                )
                # Charged at the end of the request with its actual usage.
                assert await spent() == pytest.approx(expected, rel=1e-3)
