"""`fair-sched bench --target` as a command: the plan first, refusals before anything is sent,
and a whole run against an emulator it did not start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from fair_sched_plugin.cli import main
from fair_sched_plugin.lab.emulator.server import run_emulator

from .conftest import MODEL, emulator_config


@contextlib.contextmanager
def listener() -> Iterator[tuple[str, socket.socket]]:
    """A socket that accepts nothing: a connection attempt would wait in its backlog."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        sock.setblocking(False)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", sock


def connections(sock: socket.socket) -> int:
    count = 0
    while True:
        try:
            accepted, _ = sock.accept()
        except BlockingIOError:
            return count
        accepted.close()
        count += 1


def test_dry_run_prints_the_plan_and_sends_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with listener() as (url, sock):
        code = main(
            [
                "bench",
                "--target",
                f"prod={url}",
                "--keys",
                "k1,k2",
                "--model",
                MODEL,
                "--scenarios",
                "flood,zipf",
                "--requests",
                "30",
                "--users",
                "3",
                "--dry-run",
            ]
        )
        assert connections(sock) == 0
    out = capsys.readouterr().out
    assert code == 0
    assert "flood: 30 requests from 3 users" in out
    assert "in all: 1 target(s) x 2 scenario(s) = 60 requests" in out


def test_a_bad_trace_line_is_refused_before_anything_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "day.jsonl"
    trace.write_text(
        '{"t": 0, "user": "a", "prompt_tokens": 4, "max_tokens": 8}\n'
        '{"t": 1, "user": "b", "prompt_tokens": 4, "max_tokens": "eight"}\n'
    )
    with listener() as (url, sock):
        code = main(["bench", "--target", url, "--model", MODEL, "--trace", str(trace)])
        assert connections(sock) == 0
    assert code == 2
    assert "day.jsonl:2: 'max_tokens' must be an integer" in capsys.readouterr().err


def test_a_scenario_beyond_the_limits_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with listener() as (url, sock):
        code = main(
            [
                "bench",
                "--target",
                url,
                "--model",
                MODEL,
                "--scenarios",
                "flood",
                "--requests",
                "40",
                "--max-requests",
                "10",
            ]
        )
        assert connections(sock) == 0
    assert code == 2
    assert "40 requests exceed --max-requests 10" in capsys.readouterr().err


def test_target_needs_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--target", "http://127.0.0.1:9"]) == 2
    assert "--model" in capsys.readouterr().err


@pytest.mark.slow
async def test_a_run_writes_the_report_and_sends_exactly_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "report"
    async with run_emulator(emulator_config(max_num_seqs=2)) as emu:
        argv = ["bench", "--target", f"emu={emu.base_url}", "--model", MODEL, "--quick"]
        argv += ["--scenarios", "flood,burst", "--requests", "12", "--users", "3"]
        argv += ["--max-tokens-per-request", "8", "--out", str(out)]
        code = await asyncio.to_thread(main, argv)
        received = list(emu.engine.received)
    assert code == 0
    assert len(received) == 24  # two scenarios of 12, nothing else
    assert all(r.max_tokens == 8 for r in received)
    results = json.loads((out / "results.json").read_text())
    for scenario in ("flood", "burst"):
        cell = results["targets"]["emu"][scenario]
        for key in ("light_ttft_p50_s", "heavy_ttft_p50_s", "jain_index", "tokens_per_s"):
            assert key in cell
        assert cell["max_service_gap_tokens"] >= 0 and cell["errors"] == 0
        assert cell["requests_sent"] == 12
        assert sum(cell["service_tokens_by_user"].values()) == 12 * 8
        over_time = cell["service_over_time"]["tokens_by_user"]
        assert {user: curve[-1] for user, curve in over_time.items()} == cell[
            "service_tokens_by_user"
        ]
    assert (out / "index.html").read_text().count("<table>") == 2
    assert "## flood" in (out / "report.md").read_text()
    if (out / "comparison.png").exists():  # matplotlib installed
        assert (out / "service-emu-flood.png").exists()
