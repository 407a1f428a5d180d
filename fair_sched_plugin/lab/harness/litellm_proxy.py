"""A real `litellm --config FILE` proxy in a subprocess, in front of emulators on 127.0.0.1.

Used by the LiteLLM tests (their model entries, config and proxy come from here) and the
LiteLLM benchmarks. The proxy runs in its own process group with its output captured to a
file; the group is killed on the way out, whatever happened. Starting one costs ~7-11 s
(importing LiteLLM), so callers share a proxy where they can.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.runtime.engine_http import sse_lines

from .loopback import LOOPBACK, free_port, open_client
from .processes import (
    kill_group,
    own_process_group,
    process_cpu_seconds,
    process_cpu_wait_seconds,
)

__all__ = ["LOOPBACK", "free_port", "open_client"]

# Long and random enough that LiteLLM does not refuse it as a well-known weak key.
MASTER_KEY = "sk-fairsched-test-master-7c41d9e2b8a6"
CALLBACK = "fair_sched_plugin.litellm.scheduler"
CUSTOM_AUTH = "fair_sched_plugin.litellm.authenticate"
# A safety net: importing LiteLLM's proxy takes ~10 s of CPU, and a CPU-starved parallel test
# phase (several proxies and a package install at once) can take more than 60 s.
PROXY_STARTUP_TIMEOUT_S = 180.0
PROXY_SHUTDOWN_TIMEOUT_S = 5.0
CHAT = "/v1/chat/completions"


def litellm_executable() -> str:
    """The `litellm` script next to the running interpreter (the dev venv's)."""
    candidate = Path(sys.executable).with_name("litellm")
    return str(candidate) if candidate.exists() else "litellm"


def proxy_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # No price-list download at import, no proxies for loopback traffic.
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        env.pop(name, None)
    env.pop("FAIR_SCHED_CONFIG", None)
    env.pop("CONFIG_FILE_PATH", None)
    env.pop("LITELLM_MASTER_KEY", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # LiteLLM fails a stream after 100 identical chunks in a row ("the model is repeating the
    # same chunk"); the emulator's filler text is exactly that, so lift the limit.
    env["REPEATED_STREAMING_CHUNK_LIMIT"] = "1000000000"
    env.update(extra or {})
    return env


def model_entry(model_name: str, api_base: str, engine_model: str = "tiny") -> dict[str, Any]:
    """One `model_list` entry: `model_name` served by an OpenAI-compatible engine at `api_base`."""
    return {
        "model_name": model_name,
        "litellm_params": {
            "model": f"openai/{engine_model}",
            "api_base": api_base,
            "api_key": "none",
        },
    }


def proxy_config(
    models: Sequence[Mapping[str, Any]],
    fair_sched: Mapping[str, Any] | None,
    *,
    plugin: bool = True,
    custom_auth: bool = True,
    num_retries: int = 0,
    router_settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A LiteLLM config: the plugin as callback, our custom_auth, no retries unless told, and
    `fair_sched:`."""
    litellm_settings: dict[str, Any] = {"num_retries": num_retries}
    general_settings: dict[str, Any] = {"master_key": MASTER_KEY}
    if plugin:
        litellm_settings["callbacks"] = [CALLBACK]
    if custom_auth:
        general_settings["custom_auth"] = CUSTOM_AUTH
    config: dict[str, Any] = {
        "model_list": [dict(model) for model in models],
        "litellm_settings": litellm_settings,
        "general_settings": general_settings,
    }
    if router_settings is not None:
        config["router_settings"] = dict(router_settings)
    if fair_sched is not None:
        config["fair_sched"] = dict(fair_sched)
    return config


def write_config(directory: Path, name: str, config: Mapping[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
    return path


@dataclass
class ProxyProcess:
    """A running proxy; `log_path` holds its stdout and stderr."""

    base_url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    config_path: Path
    master_key: str = MASTER_KEY

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, characters: int = 4000) -> str:
        return self.log_text()[-characters:]

    def cpu_seconds(self) -> float:
        """User + system CPU time of the proxy process so far (from /proc/PID/stat)."""
        return process_cpu_seconds(self.pid)

    def cpu_wait_seconds(self) -> float:
        """Seconds the proxy's threads so far waited for a CPU while runnable."""
        return process_cpu_wait_seconds(self.pid)


def _spawn(
    config_path: Path,
    port: int,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    *,
    new_session: bool = False,
) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [
                litellm_executable(),
                "--config",
                str(config_path),
                "--host",
                LOOPBACK,
                "--port",
                str(port),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=proxy_env(env),
            cwd=str(config_path.parent),
            **own_process_group(new_session=new_session),  # killed as a whole
        )


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    kill_group(process, PROXY_SHUTDOWN_TIMEOUT_S)


@dataclass
class EmulatedStack:
    """One emulator behind one LiteLLM proxy (a module's shared fixture)."""

    emu: RunningEmulator
    proxy: ProxyProcess


class ProxyStartError(RuntimeError):
    pass


class PortTaken(ProxyStartError):
    """The free port we picked was taken before the proxy bound it (LiteLLM binds only after
    its start-up, seconds later, while other workers start servers): start again elsewhere."""


# What uvicorn logs when the port is taken; the proxy then idles without serving, so the
# harness starts it again on another port.
BIND_FAILED = "error while attempting to bind on address"
PORT_ATTEMPTS = 3


async def _wait_live(proxy: ProxyProcess, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=2.0, trust_env=False) as client:
        while True:
            if proxy.process.poll() is not None:
                raise ProxyStartError(
                    f"litellm exited with {proxy.process.returncode} before serving:\n"
                    f"{proxy.log_tail()}"
                )
            if BIND_FAILED in proxy.log_tail():
                raise PortTaken(f"port {proxy.port} was taken:\n{proxy.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/health/liveliness")).status_code == 200:
                    return
            if loop.time() > give_up_at:
                raise ProxyStartError(
                    f"litellm did not answer /health/liveliness within {timeout_s} s:\n"
                    f"{proxy.log_tail()}"
                )
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def litellm_proxy(
    config: Mapping[str, Any],
    directory: Path,
    name: str = "proxy",
    env: Mapping[str, str] | None = None,
    *,
    new_session: bool = False,
) -> AsyncIterator[ProxyProcess]:
    """Start `litellm --config` with `config` written to `directory/name.yaml`; wait until live.
    `env` adds environment variables for the proxy; `new_session` starts it in a session (an
    autogroup CPU scheduling group) of its own (`processes.py`)."""
    config_path = write_config(directory, name, config)
    log_path = directory / f"{name}.log"
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        process = _spawn(config_path, port, log_path, env, new_session=new_session)
        proxy = ProxyProcess(f"http://{LOOPBACK}:{port}", port, process, log_path, config_path)
        try:
            await _wait_live(proxy, PROXY_STARTUP_TIMEOUT_S)
            break
        except PortTaken:
            await asyncio.to_thread(_kill_group, process)
            if attempt == PORT_ATTEMPTS:
                raise
        except BaseException:
            await asyncio.to_thread(_kill_group, process)
            raise
    try:
        yield proxy
    finally:
        await asyncio.to_thread(_kill_group, process)


@contextlib.contextmanager
def _group_killed(process: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        _kill_group(process)


async def run_proxy_to_exit(
    config: Mapping[str, Any], directory: Path, name: str, timeout_s: float = 60.0
) -> tuple[int | None, str]:
    """Start a proxy expected to refuse to start; its exit code (None: still running) and output."""
    config_path = write_config(directory, name, config)
    log_path = directory / f"{name}.log"
    process = _spawn(config_path, free_port(), log_path)
    with _group_killed(process):
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(process.wait, timeout_s)
        code = process.poll()
    return code, log_path.read_text(encoding="utf-8", errors="replace")


@dataclass
class StreamResult:
    """One streamed request as a client saw it (times from `time.perf_counter()`)."""

    sent_at: float
    status: int = 0
    first_token_at: float | None = None
    done_at: float | None = None
    content_chunks: int = 0
    usage: Mapping[str, Any] | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at


async def stream_chat(
    client: httpx.AsyncClient, path: str, body: Mapping[str, Any]
) -> StreamResult:
    """POST a streaming request; note when the first content token arrives and the usage."""
    result = StreamResult(sent_at=time.perf_counter())
    async with client.stream("POST", path, json=dict(body)) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")
            result.done_at = time.perf_counter()
            return result
        async for line in sse_lines(response.aiter_text()):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or choice.get("text")
                if text:
                    if result.first_token_at is None:
                        result.first_token_at = time.perf_counter()
                    result.content_chunks += 1
    result.done_at = time.perf_counter()
    return result
