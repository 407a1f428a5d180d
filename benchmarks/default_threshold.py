"""What a tier gets without tuning, on the emulator: the demo's flood (100 x 64
tokens from one power user, two light users 1 s later, 8 slots) through LiteLLM alone, and
with the plugin at the fixed default (`waiting_below: 3`) and at `auto` (2 s TTFT target), on a
FIFO engine and on one with priority scheduling (power user in the batch tier). The variants of
a round run one after another, rounds interleaved; each on its own emulator and proxy.

Prints each variant's light users' TTFT p50, tokens/s against LiteLLM alone in the same round,
and the engine's longest queue, then the median and range over the rounds. The real-vLLM half of
the comparison is `tests/vllm/test_paired_rounds.py` (docs/choosing-thresholds.md).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/default_threshold.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from fair_sched_plugin.lab.loadtest.flood import DEMO_ENGINE, DEMO_SIZE, Variant, run_flood
from fair_sched_plugin.lab.loadtest.processes import kill_leftover_groups

TARGET_MS = 2000.0
VARIANTS = [
    Variant("litellm", "LiteLLM alone", "litellm"),
    Variant("fixed", "plugin, waiting_below 3", "plugin"),
    Variant("auto", "plugin, auto (2 s)", "plugin", waiting_below="auto", ttft_target_ms=TARGET_MS),
    Variant("fixed_priority", "plugin, 3, engine priority", "plugin", "priority", tiered=True),
    Variant(
        "auto_priority",
        "plugin, auto (2 s), engine priority",
        "plugin",
        "priority",
        tiered=True,
        waiting_below="auto",
        ttft_target_ms=TARGET_MS,
    ),
]


def _span(values: list[float], digits: int) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, choices=range(1, 11))
    args = parser.parse_args()
    rows: dict[str, list[tuple[float, float, int]]] = {v.name: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as workdir:
        try:
            for number in range(1, args.rounds + 1):
                results = asyncio.run(
                    run_flood(VARIANTS, DEMO_SIZE, DEMO_ENGINE, None, Path(workdir), print)
                )
                alone = next(r for r in results if r.variant.name == "litellm")
                for result in results:
                    summary = result.summary
                    ratio = summary["throughput_tps"] / alone.summary["throughput_tps"]
                    light, waiting = summary["light_ttft_p50"], summary["max_waiting_seen"]
                    rows[result.variant.name].append((light, ratio, waiting))
                    print(
                        f"round {number} {result.variant.label:38s} light TTFT p50 "
                        f"{light:.2f} s, {ratio:.3f}x LiteLLM alone, engine max waiting {waiting}",
                        flush=True,
                    )
        finally:
            kill_leftover_groups()
    print(f"\nmedian (range) over {args.rounds} rounds")
    for variant in VARIANTS:
        values = rows[variant.name]
        print(
            f"{variant.label:38s} light TTFT p50 {_span([v[0] for v in values], 2)} s, "
            f"vs LiteLLM alone {_span([v[1] for v in values], 3)}, "
            f"engine max waiting {[v[2] for v in values]}"
        )


if __name__ == "__main__":
    main()
