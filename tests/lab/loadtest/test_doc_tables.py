"""The demo's tables in README.md and docs/results.md: each cell the median and range of several
runs, a stamp saying where they come from, and nothing changed outside the markers.

The runs are canned (tests/fixtures/demo-quick-runs.json: three real `fair-sched demo --quick`
runs); tests/lab/test_demo.py writes the tables from a live run.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from fair_sched_plugin.cli import main
from fair_sched_plugin.lab.loadtest.doc_tables import (
    DOC_TABLES,
    MARKER,
    Stamp,
    check_doc_markers,
    commit_of,
    flood_spread_table,
    readme_table,
    replace_between_markers,
    spread_cell,
    write_doc_tables,
)
from fair_sched_plugin.lab.loadtest.report import COUNT, SECONDS

ROOT = Path(__file__).resolve().parents[3]
RUNS: list[dict[str, Any]] = json.loads(
    (ROOT / "tests" / "fixtures" / "demo-quick-runs.json").read_text()
)["runs"]
BEGIN, END = f"<!-- {MARKER}:begin -->", f"<!-- {MARKER}:end -->"

STAMP = Stamp(
    command="fair-sched demo --runs 3 --update-docs",
    runs=3,
    started=datetime(2026, 12, 3, 17, 49, tzinfo=timezone.utc),
    ended=datetime(2026, 12, 3, 17, 54, tzinfo=timezone.utc),
    commit="4eec290+dirty",
    cores=2,
    load_at_start=0.42,
)


def _summary(run: dict[str, Any], variant: str, key: str) -> float:
    value: float = run[variant]["summary"][key]
    return value


def _rows(table: str) -> dict[str, list[str]]:
    """A markdown table's cells by row label (the header under "")."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]
    return {row[0]: row[1:] for row in rows if not row[0].startswith("---")}


def test_a_cell_is_the_median_and_the_range() -> None:
    assert spread_cell([0.3, 0.1, 0.2], SECONDS) == "0.20 s (0.10-0.30)"
    # An even count: the mean of the middle two.
    assert spread_cell([1.0, 2.0], SECONDS) == "1.50 s (1.00-2.00)"
    assert spread_cell([3.0, 3.0], COUNT, bold=True) == "**3** (3-3)"
    assert spread_cell([0.25], SECONDS) == "0.25 s"
    assert spread_cell([None, 4.0, 2.0], COUNT) == "3 (2-4)"
    assert spread_cell([None], SECONDS) == "-"


def test_the_readme_table_summarises_the_runs_cell_by_cell() -> None:
    rows = _rows(readme_table(RUNS))
    assert rows[""] == ["direct (FIFO)", "LiteLLM", "LiteLLM + plugin", "+ engine priority"]
    light = sorted(_summary(run, "plugin", "light_ttft_p50") for run in RUNS)
    assert rows["light users' TTFT p50"][2] == (
        f"**{light[1]:.2f} s** ({light[0]:.2f}-{light[2]:.2f})"
    )
    # A ratio is taken inside each run, then summarised.
    ratios = sorted(
        _summary(run, "plugin_priority", "light_ttft_p50")
        / _summary(run, "direct", "light_ttft_p50")
        for run in RUNS
    )
    assert rows["light users vs direct FIFO"][0] == "1x"
    assert rows["light users vs direct FIFO"][3] == (
        f"**{ratios[1]:.3f}x** ({ratios[0]:.3f}-{ratios[2]:.3f})"
    )
    tps = sorted(
        _summary(run, "plugin", "throughput_tps") / _summary(run, "litellm", "throughput_tps")
        for run in RUNS
    )
    assert rows["throughput vs LiteLLM alone"][1] == "1x"
    assert rows["throughput vs LiteLLM alone"][2] == f"{tps[1]:.2f}x ({tps[0]:.2f}-{tps[2]:.2f})"
    assert rows["engine's max waiting queue"][2] == "3 (3-3)"
    assert rows["power user's TTFT p50"][0].endswith(")")  # the direct column has its range too


def test_the_results_table_has_every_row_and_the_variants_own_labels() -> None:
    rows = _rows(flood_spread_table(RUNS[:2]))
    assert rows[""] == [variant["label"] for variant in RUNS[0].values()]
    tokens = [_summary(run, "litellm", "throughput_tps") for run in RUNS[:2]]
    low, high = sorted(tokens)
    assert rows["throughput (tokens/s)"][1] == f"{(low + high) / 2:,.0f} ({low:,.0f}-{high:,.0f})"
    assert rows["errors"] == ["0 (0-0)"] * 4
    assert len(rows) == 14  # the header and the demo's 13 rows


def test_the_readme_table_has_the_light_users_on_the_idle_engine() -> None:
    runs = []
    for idle in (0.05, 0.06, 0.07):
        run = json.loads(json.dumps(RUNS[0]))
        for variant in run.values():
            summary = variant["summary"]
            summary["light_ttft_idle_p50"] = idle
            summary["light_vs_idle"] = summary["light_ttft_p50"] / idle
        runs.append(run)
    rows = _rows(readme_table(runs))
    assert rows["light users' TTFT p50, idle engine"] == ["0.06 s (0.05-0.07)"] * 4
    plugin_ratio = RUNS[0]["plugin"]["summary"]["light_ttft_p50"] / 0.06
    assert rows["light users vs idle engine"][2].startswith(f"**{plugin_ratio:.1f}x**")


def test_runs_from_before_the_idle_row_leave_its_cells_empty() -> None:
    rows = _rows(readme_table(RUNS))
    assert rows["light users' TTFT p50, idle engine"] == ["-"] * 4


def test_the_stamp_says_the_command_date_commit_machine_and_runs() -> None:
    text = STAMP.text()
    assert " ".join(text.split()) == (
        "Median of 3 runs, range in brackets: `fair-sched demo --runs 3 --update-docs`, "
        "2026-12-03 17:49-17:54 UTC, commit 4eec290+dirty, 2 cores, load average 0.42 at the "
        "start:"
    )
    assert max(len(line) for line in text.splitlines()) <= 100


def test_the_commit_is_marked_dirty_when_files_differ(tmp_path: Path) -> None:
    assert commit_of(tmp_path).startswith("unknown")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "a.txt").write_text("a\n")
    subprocess.run([*git, "add", "a.txt"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "a"], cwd=tmp_path, check=True)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert commit_of(tmp_path) == head
    (tmp_path / "a.txt").write_text("b\n")
    assert commit_of(tmp_path) == f"{head}+dirty"


def _docs(root: Path) -> dict[Path, str]:
    texts = {}
    for relative, _ in DOC_TABLES:
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"# {relative}\n\nprose before\n\n{BEGIN}\nold table\n{END}\n\nprose after\n"
        )
        texts[path] = path.read_text()
    return texts


def test_only_the_text_between_the_markers_changes(tmp_path: Path) -> None:
    before = _docs(tmp_path)
    written = write_doc_tables(tmp_path, RUNS, STAMP)
    assert written == list(before)
    for (relative, table), path in zip(DOC_TABLES, written, strict=True):
        after = path.read_text()
        head, tail = before[path].split(BEGIN)[0], before[path].split(END)[1]
        assert after == f"{head}{BEGIN}\n{STAMP.text()}\n\n{table(RUNS)}\n{END}{tail}", relative
    # Written again: the same text (nothing accumulates around the markers).
    texts = {path: path.read_text() for path in written}
    write_doc_tables(tmp_path, RUNS, STAMP)
    assert {path: path.read_text() for path in written} == texts


def test_a_file_without_markers_leaves_every_file_as_it_was(tmp_path: Path) -> None:
    before = _docs(tmp_path)
    last = list(before)[-1]
    last.write_text("no markers here\n")
    before[last] = last.read_text()
    with pytest.raises(ValueError, match=r"results\.md"):
        write_doc_tables(tmp_path, RUNS, STAMP)
    assert {path: path.read_text() for path in before} == before
    with pytest.raises(ValueError, match="demo-table:begin"):
        replace_between_markers(f"{END}\n{BEGIN}\n", MARKER, "x")


def test_the_repository_docs_have_the_markers_and_the_readme_its_columns() -> None:
    check_doc_markers(ROOT)
    readme = (ROOT / "README.md").read_text()
    between = readme.split(BEGIN)[1].split(END)[0]
    header = next(line for line in between.splitlines() if line.startswith("|"))
    assert _rows(header)[""] == _rows(readme_table(RUNS))[""]


def test_update_docs_refuses_before_running_where_there_are_no_markers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        assert main(["demo", "--update-docs", "--out", str(tmp_path / "out")]) == 2
        assert main(["demo", "--replicas", "--runs", "2"]) == 2
        with pytest.raises(SystemExit):
            main(["demo", "--runs", "0"])
    assert "--update-docs: " in printed.getvalue()
    assert not (tmp_path / "out").exists()
