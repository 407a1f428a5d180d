"""Tables and files: the side-by-side flood table, results.json, markdown."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .flood import FloodResult
from .processes import plugin_available

R = TypeVar("R")

STAND_IN_NOTE = (
    "* The LiteLLM plugin (fair_sched_plugin.litellm) is not installed here, so the standalone "
    "fair-sched proxy, with the same settings and the same scheduler, stands in for it."
)


class Progress:
    """Progress lines with the time since the run started, flushed at once."""

    def __init__(self) -> None:
        self._started = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self._started:5.1f} s] {message}", flush=True)


@dataclass(frozen=True)
class Measure:
    """How a row's numbers are written: called, one value with its unit ("-" for none);
    `bare`, without the unit (the ends of a range)."""

    decimals: int
    unit: str = ""
    scale: float = 1.0

    def bare(self, value: float) -> str:
        return f"{value * self.scale:,.{self.decimals}f}"

    def __call__(self, value: Any) -> str:
        return "-" if value is None else self.bare(value) + self.unit


SECONDS = Measure(2, " s")
COUNT = Measure(0)
PERCENT = Measure(0, "%", scale=100)
RATIO = Measure(1, "x")

# (row label, summary key, how its numbers are written)
FLOOD_ROWS: tuple[tuple[str, str, Measure], ...] = (
    ("light TTFT p50", "light_ttft_p50", SECONDS),
    ("light TTFT p50, idle engine", "light_ttft_idle_p50", SECONDS),
    ("light TTFT vs idle engine", "light_vs_idle", RATIO),
    ("light TTFT p95", "light_ttft_p95", SECONDS),
    ("power TTFT p50", "power_ttft_p50", SECONDS),
    ("power TTFT p95", "power_ttft_p95", SECONDS),
    ("light e2e p50", "light_e2e_p50", SECONDS),
    ("power e2e p50", "power_e2e_p50", SECONDS),
    ("power reqs first-token before light p50", "power_served_before_light", PERCENT),
    ("throughput (tokens/s)", "throughput_tps", COUNT),
    ("makespan", "makespan_s", SECONDS),
    ("engine max waiting seen", "max_waiting_seen", COUNT),
    ("errors", "errors", COUNT),
)


def flood_table(results: Sequence[FloodResult], *, markdown: bool) -> str:
    """Metrics as rows, variants as columns."""
    header = ["", *(result.variant.label for result in results)]
    rows = [
        [label, *(fmt(result.summary.get(key)) for result in results)]
        for label, key, fmt in FLOOD_ROWS
    ]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=False))
        )
        for row in [header, *rows]
    )


def flood_json(results: Sequence[FloodResult]) -> dict[str, Any]:
    return {
        result.variant.name: {
            "label": result.variant.label,
            "gateway": result.variant.gateway,
            "engine_policy": result.variant.engine_policy,
            "summary": result.summary,
            "requests": [record.to_json() for record in result.records],
        }
        for result in results
    }


def write_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2) + "\n")


def write_plots(results: Sequence[FloodResult], out_dir: Path) -> list[Path]:
    """Timelines and TTFT CDFs; none (with a note) where matplotlib is not installed."""
    try:
        from .plots import plot_timelines, plot_ttft_cdfs

        return [*plot_timelines(results, out_dir), plot_ttft_cdfs(results, out_dir)]
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plots", file=sys.stderr)
        return []


def write_flood_outputs(results: Sequence[FloodResult], out_dir: Path, command: str) -> str:
    """results.json, summary.md and the PNGs of a demo run; returns the plain-text table."""
    write_json(out_dir / "results.json", {"command": command, "variants": flood_json(results)})
    plots = write_plots(results, out_dir)
    notes = [] if plugin_available() else [STAND_IN_NOTE, ""]
    summary = [
        "# fair-sched flood demo",
        "",
        f"Command: `{command}`",
        "",
        flood_table(results, markdown=True),
        "",
        *notes,
        "Plots: " + ", ".join(f"`{path.name}`" for path in plots),
        "",
    ]
    (out_dir / "summary.md").write_text("\n".join(summary))
    return flood_table(results, markdown=False)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def results_table(
    results: Sequence[R],
    label: Callable[[R], str],
    columns: Sequence[tuple[str, Callable[[R], str]]],
) -> str:
    """One row a result: its label, then each column's cell; a column's heading and its cell
    are written side by side, so they cannot drift apart."""
    header = ["", *(heading for heading, _ in columns)]
    rows = [[label(result), *(cell(result) for _, cell in columns)] for result in results]
    return markdown_table(header, rows)
