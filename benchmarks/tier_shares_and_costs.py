"""Cost fairness, tier shares and promotion through real `litellm` proxies and emulators.

    PYTHONPATH=. .venv/bin/python benchmarks/tier_shares_and_costs.py \
        [--window 60] [--parts cost,promotion]

Prints: the money delivered to two teams weighted 3:1 under `fairness: cost` while both are
backlogged for `--window` seconds (target 3:1 within +-10%); the request shares of two tiers
sharing 0.8/0.2 over the same window; and how many releases went between a batch request's
promotion time and the request itself (target: at most one round of the interactive tier's two
users). Takes about 2 x window + 40 s on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from fair_sched_plugin.lab.harness.tier_scenarios import cost_fairness, promotion, tier_shares


async def main(window_s: float, parts: set[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="fair-sched-tiers-") as directory:
        path = Path(directory)
        if "cost" in parts:
            await measure_cost(path, window_s)
        if "shares" in parts:
            await measure_shares(path, window_s)
        if "promotion" in parts:
            await measure_promotion(path)


async def measure_cost(path: Path, window_s: float) -> None:
    cost = await cost_fairness(path, warmup_s=3.0, window_s=window_s)
    print(
        f"cost fairness, weights 3:1, {window_s:.0f} s window: delivered "
        f"team-a {cost.delivered['team-a']:.4f}, team-b {cost.delivered['team-b']:.4f} "
        f"({cost.requests['team-a']} / {cost.requests['team-b']} requests), "
        f"ratio {cost.ratio:.3f} (target 2.7-3.3)"
    )


async def measure_shares(path: Path, window_s: float) -> None:
    served = await tier_shares(path, warmup_s=2.0, window_s=window_s)
    total = served["interactive"] + served["batch"]
    print(
        f"tier shares 0.8/0.2, {window_s:.0f} s window: interactive "
        f"{served['interactive']}, batch {served['batch']} requests, interactive share "
        f"{served['interactive'] / total:.3f} (target 0.72-0.88)"
    )


async def measure_promotion(path: Path) -> None:
    promoted = await promotion(path, promote_after_s=1.5, count=5)
    print(
        "promotion after 1.5 s: releases between promotion time and the batch request "
        f"{promoted.released_after_promotion} (one round is 2)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured")
    parser.add_argument("--parts", default="cost,shares,promotion", help="what to measure")
    args = parser.parse_args()
    asyncio.run(main(args.window, set(args.parts.split(","))))
