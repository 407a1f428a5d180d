"""FairSchedulerMiddleware with invalid settings stops the app at start-up, as `fair-sched proxy`
(exit 2) and the LiteLLM adapter (exit 3) do, instead of starting and answering 500."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fair_sched_plugin.lab.harness.processes import own_process_group

# uvicorn's exit status when the application's start-up failed.
UVICORN_STARTUP_FAILURE = 3

APP_MODULE = """
from fastapi import FastAPI
from starlette.applications import Starlette

from fair_sched_plugin.asgi import FairSchedulerMiddleware

app = {framework}()
app.add_middleware(FairSchedulerMiddleware, config={config!r})
"""


async def run_uvicorn(directory: Path, framework: str, config: str) -> tuple[int, str]:
    """Serve `app` with uvicorn's defaults (lifespan "auto") on a free port; (exit code, output).

    Fails the test if the server says it started instead of exiting."""
    (directory / "startup_app.py").write_text(
        textwrap.dedent(APP_MODULE.format(framework=framework, config=config))
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "uvicorn", "startup_app:app", "--app-dir", str(directory),
        "--host", "127.0.0.1", "--port", "0",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        **own_process_group(),
    )  # fmt: skip
    assert process.stdout is not None
    lines = []
    try:
        while line := (await asyncio.wait_for(process.stdout.readline(), 60)).decode():
            lines.append(line)
            if "Application startup complete" in line:
                pytest.fail("the app started with invalid settings:\n" + "".join(lines))
        return await asyncio.wait_for(process.wait(), 30), "".join(lines)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("framework", ["Starlette", "FastAPI"])
async def test_a_misspelled_key_stops_uvicorn_at_start_up(tmp_path: Path, framework: str) -> None:
    config = tmp_path / "fair_sched.yaml"
    config.write_text("fair_sched:\n  metrics_pol_ms: 100\n")

    code, output = await run_uvicorn(tmp_path, framework, str(config))

    assert code == UVICORN_STARTUP_FAILURE, output
    assert "fair_sched.metrics_pol_ms: unknown key, did you mean metrics_poll_ms?" in output
    assert "lifespan' protocol appears unsupported" not in output


async def test_a_missing_config_file_stops_uvicorn_at_start_up(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.yaml"

    code, output = await run_uvicorn(tmp_path, "Starlette", str(missing))

    assert code == UVICORN_STARTUP_FAILURE, output
    assert f"cannot read fair_sched config file {str(missing)!r}" in output
