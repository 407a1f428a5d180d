"""The coordination measurement at a tiny size: its counts, not its speed."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from .conftest import RedisServer

pytestmark = pytest.mark.redis

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_bench(url: str, out: pathlib.Path, *options: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fair_sched_plugin.lab.harness.coordination",
            "--redis-url", url,
            "--followers", "1",
            "--rates", "50",
            "--duration", "1",
            "--json", str(out),
            *options,
        ],
        check=True,
        timeout=120,
        env=env,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    (row,) = json.loads(out.read_text())
    assert isinstance(row, dict)
    return row


def test_every_admission_through_one_follower_is_granted_once_and_ended(
    own_redis_server: RedisServer, tmp_path: pathlib.Path
) -> None:
    """One leader process, one follower process, 50 admissions in one second: each granted once,
    and the leader's core counts exactly those releases and ends, nothing left in flight."""
    row = run_bench(own_redis_server.url, tmp_path / "steps.json")
    assert row["planned"] == 50
    assert (row["skipped"], row["errors"]) == (0, 0), row["error_samples"]
    assert row["granted"] == 50
    assert row["leader_released"] == row["granted"]
    assert row["leader_completed"] == row["granted"]
    assert (row["leader_in_flight_after"], row["leader_queued_after"]) == (0, 0)
    assert row["still_leading"]


def test_with_a_leader_per_model_each_leader_grants_its_models_admissions(
    own_redis_server: RedisServer, tmp_path: pathlib.Path
) -> None:
    """`--models 2`: two leader processes, each leading one model's group; 50 admissions, for
    the two models in turn, each granted once, by the two leaders' cores together (25 each)."""
    row = run_bench(own_redis_server.url, tmp_path / "steps.json", "--models", "2")
    assert (row["models"], row["planned"], row["granted"]) == (2, 50, 50)
    assert (row["skipped"], row["errors"]) == (0, 0), row["error_samples"]
    assert row["leader_released"] == row["leader_completed"] == 50
    assert len(row["granted_per_s_by_leader"]) == 2
    assert all(rate > 0 for rate in row["granted_per_s_by_leader"])
    assert (row["leader_in_flight_after"], row["leader_queued_after"]) == (0, 0)
    assert row["still_leading"]
