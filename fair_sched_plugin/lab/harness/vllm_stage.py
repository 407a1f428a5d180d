"""A real vLLM (CPU build) engine as the real-vLLM tests and benchmarks start it.

Every engine runs in its own process group, killed by `stop()`, at interpreter exit, and by the
kernel should this process die first. `FAIR_SCHED_VLLM_LAYOUT` picks the process layout:
`shared` (the default) keeps the engine in the caller's session; `sessions` starts it in a
session of its own, a separate autogroup CPU scheduling group (`processes.py`). The vLLM
virtualenv and the tiny model live under `cache_dir()` (`scripts/vllm_env.sh`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from .loopback import LOOPBACK, free_port
from .processes import group_cpu_seconds, kill_group, own_process_group


class EngineStartError(RuntimeError):
    """The engine exited or did not answer /health in time; the message ends with its log."""


VLLM_VERSION = "0.32.0"  # keep in step with scripts/vllm_env.sh
LAYOUTS = ("shared", "sessions")
SERVED_MODEL = "tiny"
# ~35-55 s on an idle 2-core machine; much longer while other processes compete for the cores.
ENGINE_START_TIMEOUT_S = 300.0
ENGINE_STOP_TIMEOUT_S = 15.0


def layout() -> str:
    """`FAIR_SCHED_VLLM_LAYOUT`: `shared` (default) or `sessions` (see `own_sessions`)."""
    name = os.environ.get("FAIR_SCHED_VLLM_LAYOUT", "").strip().lower() or LAYOUTS[0]
    if name not in LAYOUTS:
        raise ValueError(f"FAIR_SCHED_VLLM_LAYOUT must be one of {LAYOUTS}, not {name!r}")
    return name


def own_sessions() -> bool:
    """Engine and LiteLLM proxy each in a session of their own (`FAIR_SCHED_VLLM_LAYOUT`)."""
    return layout() == "sessions"


def cache_dir() -> Path:
    root = os.environ.get("FAIR_SCHED_CACHE") or str(Path.home() / ".cache" / "fair-sched")
    return Path(root).expanduser()


def engine_environment(vllm_python: Path, scratch: Path) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        # The dev venv must not leak into the engine's interpreter.
        if name not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    }
    env["PATH"] = f"{vllm_python.parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(scratch / "vllm-cache"),
        HF_HOME=str(scratch / "hf-home"),
        TMPDIR=str(scratch / "tmp"),
        NO_PROXY="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
        # vLLM closes a keep-alive connection idle for 5 s (uvicorn's timer). LiteLLM's aiohttp
        # pool then sometimes sends a request on a connection vLLM is closing at that instant
        # and answers 500 ("Server disconnected", no retry with num_retries 0): seen on a loaded
        # machine, where parked requests leave pooled connections idle for seconds. The
        # measurement is of scheduling, not of that race, so idle connections live longer.
        VLLM_HTTP_TIMEOUT_KEEP_ALIVE="120",
    )
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        env.pop(name, None)
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies, also by SIGKILL
    or an unhandled SIGTERM, which skip both fixture teardown and atexit. vLLM's API server
    stops its engine processes on SIGTERM."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    kill_group(process, ENGINE_STOP_TIMEOUT_S)


@dataclass
class VllmEngine:
    """A running `vllm.entrypoints.openai.api_server`; `base_url` has no `/v1`."""

    policy: str
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    start_s: float

    @property
    def api_base(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    def log_tail(self, characters: int = 6000) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-characters:]

    def cpu_seconds(self) -> float:
        """User + system CPU time so far of every live process in the engine's process group:
        the API server, its engine core and workers (on this CPU build a token made
        in a small batch costs the engine several times the CPU of one made in a full batch)."""
        return group_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        _kill_group(self.process)


def start_engine(vllm_python: Path, model_dir: Path, scratch: Path, policy: str) -> VllmEngine:
    port = free_port()
    argv = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(model_dir), "--served-model-name", SERVED_MODEL]
    argv += ["--host", LOOPBACK, "--port", str(port), "--enforce-eager"]
    argv += ["--max-num-seqs", "8", "--max-model-len", "512", "--dtype", "float32"]
    # Prefix caching (vLLM 0.32's default, named so it cannot change under us) and
    # the cached prompt tokens in `usage.prompt_tokens_details`, which the `tokens` policy uses.
    argv += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    if policy == "priority":
        argv += ["--scheduling-policy", "priority"]
    log_path = scratch / f"engine-{policy}.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=engine_environment(vllm_python, scratch),
            cwd=str(scratch),
            # Killed as a whole; a session of its own in the `sessions` layout.
            **own_process_group(_die_with_parent, new_session=own_sessions()),
        )
    atexit.register(_kill_group, process)
    engine = VllmEngine(policy, f"http://{LOOPBACK}:{port}", process, log_path, 0.0)
    try:
        _wait_healthy(engine)
    except BaseException:
        engine.stop()
        raise
    engine.start_s = time.monotonic() - started
    print(f"\n[vllm] engine ({policy}) started in {engine.start_s:.1f} s on port {port}")
    return engine


def _wait_healthy(engine: VllmEngine) -> None:
    give_up_at = time.monotonic() + ENGINE_START_TIMEOUT_S
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while True:
            code = engine.process.poll()
            if code is not None:
                raise EngineStartError(
                    f"vLLM ({engine.policy}) exited with {code} while starting:\n"
                    f"{engine.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{engine.base_url}/health").status_code == 200:
                    return
            if time.monotonic() > give_up_at:
                raise EngineStartError(
                    f"vLLM ({engine.policy}) did not answer /health within "
                    f"{ENGINE_START_TIMEOUT_S:.0f} s:\n{engine.log_tail()}"
                )
            time.sleep(0.5)


class Engines:
    """At most one engine at a time, started on demand with the scheduling policy asked for."""

    def __init__(self, vllm_python: Path, model_dir: Path, scratch: Path) -> None:
        self._python = vllm_python
        self._model_dir = model_dir
        self._scratch = scratch
        self._current: VllmEngine | None = None
        self.start_times: dict[str, float] = {}

    def get(self, policy: str) -> VllmEngine:
        current = self._current
        if current is not None and current.policy == policy and current.process.poll() is None:
            return current
        self.close()
        self._current = start_engine(self._python, self._model_dir, self._scratch, policy)
        self.start_times[policy] = self._current.start_s
        return self._current

    def close(self) -> None:
        current, self._current = self._current, None
        if current is not None:
            current.stop()
