"""A throw-away redis-server and what the state-store and coordination measurements share."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

from fair_sched_plugin.core import TierLimits

TIERS = (TierLimits("interactive", waiting_below=3), TierLimits("batch", waiting_below=1))


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: pass --redis-url or install redis-server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", directory],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            for _ in range(500):
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), 0.1),
                ):
                    break
                time.sleep(0.01)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(5)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
