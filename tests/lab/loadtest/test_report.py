"""`fair-sched bench`: its help names what is in the repository, its report the engine it ran."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

from fair_sched_plugin.cli import main
from fair_sched_plugin.lab.loadtest.flood import DEMO_ENGINE, QUICK_ENGINE
from fair_sched_plugin.lab.loadtest.processes import EmulatorSettings
from fair_sched_plugin.lab.loadtest.runner import _engine_line

ROOT = Path(__file__).resolve().parents[3]


def bench_help() -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        main(["bench", "--help"])
    return printed.getvalue()


def test_bench_help_names_only_files_that_are_in_the_repository() -> None:
    # argparse wraps a long name at its hyphens: joined again before the names are read.
    text = re.sub(r"-\n\s*", "-", bench_help())
    # index.md is the report it writes; any other name is a document to read.
    named = [name for name in re.findall(r"[\w./-]+\.md\b", text) if name != "index.md"]
    assert named, text
    assert [name for name in named if not (ROOT / name).is_file()] == []


def test_the_report_describes_the_emulator_each_flood_ran_on() -> None:
    args = argparse.Namespace(engine=None)
    quick, full = _engine_line(QUICK_ENGINE, args), _engine_line(DEMO_ENGINE, args)
    assert "8 slots, FCFS, steps of 30 ms + 0.5 ms per running sequence" in quick
    assert "steps of 12 ms" in full
    slow = EmulatorSettings(speed=0.33, policy="priority", prefix_cache_blocks=64)
    assert "priority scheduling" in slow.describe() and "speed 0.33" in slow.describe()
    assert "prefix cache of 64 blocks" in slow.describe()
    real = argparse.Namespace(engine="http://127.0.0.1:8000")
    assert _engine_line(QUICK_ENGINE, real) == "Engine: http://127.0.0.1:8000."


def test_the_report_header_does_not_describe_one_engine_for_all(tmp_path: Path) -> None:
    out = tmp_path / "report"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["bench", "--quick", "--scenarios", "core", "--out", str(out)]) == 0
    index = (out / "index.md").read_text()
    assert "Engine: the built-in emulator, set up per scenario as each section says." in index
