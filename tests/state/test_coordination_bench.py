"""`benchmarks/coordination.py` at a tiny size: its counts, not its speed."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from .conftest import RedisServer

pytestmark = pytest.mark.redis

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_admission_through_one_follower_is_granted_once_and_ended(
    own_redis_server: RedisServer, tmp_path: pathlib.Path
) -> None:
    """One leader process, one follower process, 50 admissions in one second: each granted once,
    and the leader's core counts exactly those releases and ends, nothing left in flight."""
    out = tmp_path / "steps.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "coordination.py"),
            "--redis-url", own_redis_server.url,
            "--followers", "1",
            "--rates", "50",
            "--duration", "1",
            "--json", str(out),
        ],
        check=True,
        timeout=120,
        env=env,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    (row,) = json.loads(out.read_text())
    assert row["planned"] == 50
    assert (row["skipped"], row["errors"]) == (0, 0), row["error_samples"]
    assert row["granted"] == 50
    assert row["leader_released"] == row["granted"]
    assert row["leader_completed"] == row["granted"]
    assert (row["leader_in_flight_after"], row["leader_queued_after"]) == (0, 0)
    assert row["still_leading"]
