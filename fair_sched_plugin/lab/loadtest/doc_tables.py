"""The demo's tables in README.md and docs/results.md, written from several runs of the demo.

Each cell is the median of the runs with their range (min-max) in brackets, so a reader sees
the spread, not the best run. A ratio (light users against direct FIFO, throughput against
LiteLLM alone) is taken inside each run, where both sides shared the machine's state, and then
summarised like any other cell. A stamp line above each table says where the numbers come
from: the command, the date (UTC), the commit, the machine and the number of runs.

Only the text between a file's two marker comments is rewritten:

    <!-- demo-table:begin -->
    (stamp and table)
    <!-- demo-table:end -->
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .report import COUNT, FLOOD_ROWS, RATIO, SECONDS, Measure, markdown_table

__all__ = [
    "DOC_TABLES",
    "MARKER",
    "Stamp",
    "check_doc_markers",
    "commit_of",
    "flood_spread_table",
    "readme_table",
    "replace_between_markers",
    "spread_cell",
    "write_doc_tables",
]

# One run of the demo: each variant's name and its report ("label" and "summary"), as in the
# "variants" of the run's results.json.
Run = Mapping[str, Mapping[str, Any]]

MARKER = "demo-table"

# The README's columns: variant name and heading (the README's own words, not the labels).
README_COLUMNS = (
    ("direct", "direct (FIFO)"),
    ("litellm", "LiteLLM"),
    ("plugin", "LiteLLM + plugin"),
    ("plugin_priority", "+ engine priority"),
)
# The plugin's columns, where the light users' rows are what the table is about (in bold).
PLUGIN_VARIANTS = ("plugin", "plugin_priority")


@dataclass(frozen=True)
class Row:
    """One row of the README's table: each run's value for a variant, and how it is written."""

    label: str
    value: Callable[[Run, str], float | None]
    measure: Measure
    bold: bool = False
    # For a ratio: the variant it is relative to, whose own cell is written "1x".
    reference: str | None = None


def _field(key: str) -> Callable[[Run, str], float | None]:
    def value(run: Run, variant: str) -> float | None:
        found: float | None = run[variant]["summary"].get(key)
        return found

    return value


def _ratio(key: str, reference: str) -> Callable[[Run, str], float | None]:
    def value(run: Run, variant: str) -> float | None:
        mine, theirs = run[variant]["summary"].get(key), run[reference]["summary"].get(key)
        return mine / theirs if mine is not None and theirs else None

    return value


README_ROWS = (
    Row("light users' TTFT p50", _field("light_ttft_p50"), SECONDS, bold=True),
    # The same requests on the idle engine, before the flood: the physical limit.
    Row("light users' TTFT p50, idle engine", _field("light_ttft_idle_p50"), SECONDS),
    Row("light users vs idle engine", _field("light_vs_idle"), RATIO, bold=True),
    Row(
        "light users vs direct FIFO",
        _ratio("light_ttft_p50", "direct"),
        Measure(3, "x"),
        bold=True,
        reference="direct",
    ),
    Row("power user's TTFT p50", _field("power_ttft_p50"), SECONDS),
    Row("throughput (tokens/s)", _field("throughput_tps"), COUNT),
    Row(
        "throughput vs LiteLLM alone",
        _ratio("throughput_tps", "litellm"),
        Measure(2, "x"),
        reference="litellm",
    ),
    Row("engine's max waiting queue", _field("max_waiting_seen"), COUNT),
)


def spread_cell(values: Sequence[float | None], measure: Measure, *, bold: bool = False) -> str:
    """The median of the values and, for more than one, their range: `0.22 s (0.15-0.23)`."""
    present = [value for value in values if value is not None]
    if not present:
        return "-"
    middle = measure(statistics.median(present))
    if bold:
        middle = f"**{middle}**"
    if len(present) == 1:
        return middle
    return f"{middle} ({measure.bare(min(present))}-{measure.bare(max(present))})"


def readme_table(runs: Sequence[Run]) -> str:
    """The README's table: the headline rows, the README's four columns."""
    rows = []
    for row in README_ROWS:
        cells = [row.label]
        for variant, _ in README_COLUMNS:
            if variant == row.reference:
                cells.append("1x")
                continue
            bold = row.bold and variant in PLUGIN_VARIANTS
            values = [row.value(run, variant) for run in runs]
            cells.append(spread_cell(values, row.measure, bold=bold))
        rows.append(cells)
    return markdown_table(["", *(heading for _, heading in README_COLUMNS)], rows)


def flood_spread_table(runs: Sequence[Run]) -> str:
    """docs/results.md's table: every row of the demo's own table, each variant it ran."""
    variants = list(runs[0])
    header = ["", *(runs[0][variant]["label"] for variant in variants)]
    rows = [
        [
            label,
            *(
                spread_cell([run[variant]["summary"].get(key) for run in runs], measure)
                for variant in variants
            ),
        ]
        for label, key, measure in FLOOD_ROWS
    ]
    return markdown_table(header, rows)


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30
    )
    return done.stdout.strip()


def commit_of(root: Path) -> str:
    """The checkout's short commit, with `+dirty` where files differ from it."""
    try:
        head = _git(root, "rev-parse", "--short", "HEAD")
        dirty = _git(root, "status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


@dataclass(frozen=True)
class Stamp:
    """Where a table's numbers come from."""

    command: str
    runs: int
    started: datetime
    commit: str
    cores: int
    load_at_start: float
    ended: datetime | None = None

    @classmethod
    def begin(cls, command: str, runs: int, root: Path) -> Stamp:
        """Taken before the first run (and before any table is written: the commit's state)."""
        return cls(
            command=command,
            runs=runs,
            started=datetime.now(timezone.utc),
            commit=commit_of(root),
            cores=os.cpu_count() or 0,
            load_at_start=os.getloadavg()[0],
        )

    def finish(self) -> Stamp:
        return dataclasses.replace(self, ended=datetime.now(timezone.utc))

    def text(self) -> str:
        ended = self.ended or self.started
        until = ended.strftime("%H:%M" if ended.date() == self.started.date() else "%Y-%m-%d %H:%M")
        what = "One run" if self.runs == 1 else f"Median of {self.runs} runs, range in brackets"
        line = (
            f"{what}: `{self.command}`, {self.started:%Y-%m-%d %H:%M}-{until} UTC, "
            f"commit {self.commit}, {self.cores} cores, load average "
            f"{self.load_at_start:.2f} at the start:"
        )
        # Wrapped like the prose around it; markdown joins the lines again, in a code span too.
        return textwrap.fill(line, 100, break_long_words=False, break_on_hyphens=False)


def replace_between_markers(text: str, name: str, block: str) -> str:
    """The text with what lies between its `name` markers replaced by `block`."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"needs one {begin} and, after it, one {end}")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{block}\n{end}{tail}"


Table = Callable[[Sequence[Run]], str]

# Each file, relative to the repository's root, and the table written into it.
DOC_TABLES: tuple[tuple[str, Table], ...] = (
    ("README.md", readme_table),
    ("docs/results.md", flood_spread_table),
)


def _new_texts(root: Path, block: Callable[[Table], str]) -> dict[Path, str]:
    texts = {}
    for relative, table in DOC_TABLES:
        path = root / relative
        try:
            text = path.read_text(encoding="utf-8")
            texts[path] = replace_between_markers(text, MARKER, block(table))
        except (OSError, ValueError) as problem:
            raise ValueError(f"{path}: {problem} (run from the repository's root)") from None
    return texts


def check_doc_markers(root: Path) -> None:
    """Raise ValueError, naming the file, where a table could not be written (before any run)."""
    _new_texts(root, lambda table: "")


def write_doc_tables(root: Path, runs: Sequence[Run], stamp: Stamp) -> list[Path]:
    """Write each file's table between its markers; every text is made before any is written,
    so a file without markers leaves all of them as they were."""
    texts = _new_texts(root, lambda table: f"{stamp.text()}\n\n{table(runs)}")
    for path, text in texts.items():
        path.write_text(text, encoding="utf-8")
    return list(texts)
