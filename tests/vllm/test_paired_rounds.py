"""The throughput ratio measured in paired rounds, on demand (never in CI).

One flood's tokens/s on this kind of machine moves by more than the differences asked about
(LiteLLM alone read 611-1214 tokens/s for the same flood on one machine within an hour), so a
ratio of two runs says little. `FAIR_SCHED_VLLM_ROUNDS` names floods to run in that order in one
engine session, all through a LiteLLM proxy: `plain` (no plugin), `auto` (the plugin with
`waiting_below: auto`) or a whole number (the plugin with that fixed `waiting_below`), either of
the last two prefixed `fair-` for the backend's `fair_engine_queue` (vLLM's queue in user order),
e.g.

    FAIR_SCHED_VLLM_ROUNDS=plain,auto,3,plain,auto,3,plain FAIR_SCHED_VLLM_FLOOD=100x128 \\
        pytest -s tests/vllm/test_paired_rounds.py

The session summary gives each plugin round against the mean of the `plain` rounds on either side
of it, and their median per kind (docs/real-vllm.md). With the plugin, light users must still
finish before the power user's median request in every round.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fair_sched_plugin.lab.harness.vllm_stage import VllmEngine

from .conftest import PAIRED_ROUNDS
from .test_real_engine import litellm_flood


def rounds() -> list[str]:
    named = os.environ.get("FAIR_SCHED_VLLM_ROUNDS", "").strip()
    kinds = [kind.strip() for kind in named.split(",")] if named else []
    for kind in kinds:
        setting = kind.removeprefix("fair-")
        if kind != "plain" and setting != "auto" and not (setting.isdigit() and int(setting) >= 1):
            raise pytest.UsageError(
                f"FAIR_SCHED_VLLM_ROUNDS: {kind!r} is not plain, auto or a whole number >= 1 "
                "(the last two optionally prefixed fair-)"
            )
    return kinds


ROUNDS = rounds()


@pytest.mark.skipif(not ROUNDS, reason="FAIR_SCHED_VLLM_ROUNDS is not set (on demand only)")
@pytest.mark.parametrize("step", range(len(ROUNDS)) or [0])
async def test_round(step: int, priority_engine: VllmEngine, tmp_path: Path) -> None:
    kind = ROUNDS[step]
    plugin = kind != "plain"
    setting = kind.removeprefix("fair-")
    flood = await litellm_flood(
        f"round {step}: LiteLLM + plugin, waiting_below {kind}"
        if plugin
        else f"round {step}: LiteLLM alone",
        priority_engine,
        tmp_path,
        plugin=plugin,
        auto=setting == "auto",
        fair_engine_queue=kind.startswith("fair-"),
        **({"waiting_below": int(setting)} if setting.isdigit() else {}),
    )
    PAIRED_ROUNDS.append(
        (f"waiting_below {kind}" if plugin else "plain", flood.numbers()["tokens_per_s"])
    )
    if plugin:
        assert flood.light_done_before_heavy_median(), flood.numbers()
