"""How the tests start servers in child processes (vLLM, the LiteLLM proxy).

Each child gets its own process group, so it is killed as a whole, but stays in the test run's
session. With the kernel's autogroup scheduling (on by default), a new session is a new
scheduling group that is given as much CPU as everything else together: a busy vLLM in its own
session starved the proxy under test, whose event loop then lagged about 100 ms per wake-up, and
a flood through it ran at a third of the direct throughput (`tests/vllm`).

The real-vLLM stage measures that other layout too: `new_session=True` puts a child
in a session of its own (`setsid`, also its own process group), as a server started by hand or
by a service manager would be.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def own_process_group(
    preexec: Callable[[], None] | None = None, *, new_session: bool = False
) -> dict[str, Any]:
    """`subprocess.Popen` options: a new process group in this session (or, with `new_session`,
    a session of its own), then `preexec`."""
    if new_session:
        session: dict[str, Any] = {"start_new_session": True}
        if preexec is not None:
            session["preexec_fn"] = preexec
        return session
    if sys.version_info >= (3, 11):
        options: dict[str, Any] = {"process_group": 0}
        if preexec is not None:
            options["preexec_fn"] = preexec
        return options

    def setpgid_then_preexec() -> None:
        os.setpgid(0, 0)
        if preexec is not None:
            preexec()

    return {"preexec_fn": setpgid_then_preexec}


def kill_group(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """End `process` and its process group (what it started lives there): SIGTERM and up to
    `timeout_s` to exit, then SIGKILL to the whole group."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout_s)


def _stat(path: Path) -> tuple[int, float]:
    """A process's group and its user + system CPU seconds so far, from /proc/PID/stat."""
    # After the command name: pgrp is field 5, utime 14 and stime 15 (1-based, man 5 proc).
    fields = path.read_text().rsplit(")", 1)[1].split()
    return int(fields[2]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    return _stat(Path(f"/proc/{pid}/stat"))[1]


def process_cpu_wait_seconds(pid: int) -> float:
    """Seconds the process's threads so far spent runnable but waiting for a CPU (the second
    field of each /proc/PID/task/TID/schedstat, in nanoseconds); NaN where the kernel keeps no
    scheduler statistics."""
    total = 0
    tasks = list(Path(f"/proc/{pid}/task").glob("*/schedstat"))
    for path in tasks:
        with contextlib.suppress(OSError, IndexError, ValueError):  # a thread that ended
            total += int(path.read_text().split()[1])
    return total / 1e9 if tasks else float("nan")


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU time so far of every live process in a process group."""
    total = 0.0
    for path in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # gone, or not a process
            group, seconds = _stat(path)
            if group == pgid:
                total += seconds
    return total
