"""Child processes of a benchmark run: emulators, LiteLLM proxies, fair proxies.

Every child gets its own process group and is killed as a group in ``finally`` (a LiteLLM proxy
may start helpers of its own), also when the run is interrupted with Ctrl-C or fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import httpx
import yaml

T = TypeVar("T")

LOOPBACK = "127.0.0.1"
MASTER_KEY = "sk-demo-master-7c1e9a"
PLUGIN_MODULE = "fair_sched_plugin.litellm"
EMULATOR_READY_PREFIX = "fair-sched emulator listening on "
EMULATOR_START_TIMEOUT_S = 15.0
# Several LiteLLM proxies importing at once on two cores take well over their usual ~10 s.
PROXY_START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ChildProcess:
    """A started child: its pid (also its process group id) and where it serves."""

    pid: int
    base_url: str
    process: asyncio.subprocess.Process


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def plugin_available() -> bool:
    """Whether the LiteLLM plugin module is installed (it is written separately)."""
    import importlib.util

    try:
        return importlib.util.find_spec(PLUGIN_MODULE) is not None
    except ImportError:
        return False


def litellm_executable() -> str | None:
    beside_python = Path(sys.executable).with_name("litellm")
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("litellm")


def child_environment() -> dict[str, str]:
    env = dict(os.environ)
    # Importing LiteLLM must not fetch a price list from the internet.
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    env.setdefault("LITELLM_LOG", "ERROR")
    env["NO_PROXY"] = "127.0.0.1,localhost"
    return env


# Process groups started and not yet stopped. A Ctrl-C can end the event loop before the async
# clean-up has run; `kill_leftover_groups()` then kills these synchronously.
_live_groups: set[int] = set()


def kill_leftover_groups() -> int:
    """SIGKILL every child process group still alive; returns how many there were."""
    leftovers = list(_live_groups)
    for group_id in leftovers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group_id, signal.SIGKILL)
        _live_groups.discard(group_id)
    return len(leftovers)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C while inside, so a terminated run still stops its children."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


async def _stop_group(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the child's process group, then SIGKILL what is left after a grace period."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
    # Helpers may outlive the leader; the group id stays valid while any member lives.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    _live_groups.discard(process.pid)
    if process.returncode is None:
        await process.wait()


@contextlib.asynccontextmanager
async def _process_group(
    argv: Sequence[str], log: TextIO | None, *, pipe_stdout: bool = False
) -> AsyncIterator[asyncio.subprocess.Process]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE if pipe_stdout else (log or asyncio.subprocess.DEVNULL),
        stderr=log or asyncio.subprocess.DEVNULL,
        stdin=asyncio.subprocess.DEVNULL,
        env=child_environment(),
        start_new_session=True,
    )
    _live_groups.add(process.pid)
    try:
        yield process
    finally:
        await _stop_group(process)


async def _read_emulator_url(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    while line := (await process.stdout.readline()).decode():
        if line.startswith(EMULATOR_READY_PREFIX):
            return line.removeprefix(EMULATOR_READY_PREFIX).strip()
    raise RuntimeError(f"the emulator exited (code {await process.wait()}) before it was ready")


@dataclass(frozen=True)
class EmulatorSettings:
    """The emulator's command line, in the units the CLI takes."""

    max_num_seqs: int = 8
    policy: str = "fcfs"
    step_ms: float = 12.0
    step_ms_per_seq: float = 0.5
    # None: the emulator's own default. The flags below are passed only where set, so the
    # scenarios that do not need them run on any emulator version.
    prefill_ms_per_token: float | None = None
    # 0.33: every step and prefill takes three times as long.
    speed: float = 1.0
    prefix_cache_blocks: int = 0
    block_tokens: int | None = None

    def argv(self) -> list[str]:
        """The emulator's command-line flags for these settings."""
        argv = ["--max-num-seqs", str(self.max_num_seqs), "--policy", self.policy]
        argv += ["--step-ms", repr(self.step_ms), "--step-ms-per-seq", repr(self.step_ms_per_seq)]
        if self.prefill_ms_per_token is not None:
            argv += ["--prefill-ms-per-token", repr(self.prefill_ms_per_token)]
        if self.speed != 1.0:
            argv += ["--speed", repr(self.speed)]
        if self.prefix_cache_blocks:
            argv += ["--prefix-cache-blocks", str(self.prefix_cache_blocks)]
        if self.block_tokens is not None:
            argv += ["--block-tokens", str(self.block_tokens)]
        return argv

    def describe(self) -> str:
        """These settings in words, for a report."""
        words = [
            f"{self.max_num_seqs} slots",
            "priority scheduling" if self.policy == "priority" else "FCFS",
            f"steps of {self.step_ms:g} ms + {self.step_ms_per_seq:g} ms per running sequence",
        ]
        if self.prefill_ms_per_token is not None:
            words.append(f"{self.prefill_ms_per_token:g} ms prefill per prompt token")
        if self.speed != 1.0:
            words.append(f"speed {self.speed:g}")
        if self.prefix_cache_blocks:
            words.append(f"a prefix cache of {self.prefix_cache_blocks} blocks")
        return f"the built-in emulator ({', '.join(words)})"


@contextlib.asynccontextmanager
async def emulator_process(settings: EmulatorSettings) -> AsyncIterator[ChildProcess]:
    """``python -m fair_sched_plugin.lab.emulator`` on a free port, serving model ``tiny``."""
    argv = [
        sys.executable,
        "-m",
        "fair_sched_plugin.lab.emulator",
        "--port",
        "0",
        "--model",
        "tiny",
    ]
    argv += settings.argv()
    async with _process_group(argv, None, pipe_stdout=True) as process:
        base_url = await asyncio.wait_for(_read_emulator_url(process), EMULATOR_START_TIMEOUT_S)
        # The emulator writes nothing more worth reading; drain so its pipe never fills.
        drain = asyncio.get_running_loop().create_task(_drain(process))
        try:
            yield ChildProcess(process.pid, base_url, process)
        finally:
            drain.cancel()


async def _drain(process: asyncio.subprocess.Process) -> None:
    assert process.stdout is not None
    while await process.stdout.read(4096):
        pass


def litellm_config(
    engine_api_base: str | Sequence[str], fair_sched: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A LiteLLM proxy config for model ``tiny``, one deployment per api_base (LiteLLM's router
    picks among several); with `fair_sched`, the plugin is switched on."""
    api_bases = [engine_api_base] if isinstance(engine_api_base, str) else list(engine_api_base)
    config: dict[str, Any] = {
        "model_list": [
            {
                "model_name": "tiny",
                "litellm_params": {"model": "openai/tiny", "api_base": api_base, "api_key": "none"},
            }
            for api_base in api_bases
        ],
        "litellm_settings": {"num_retries": 0, "request_timeout": 120},
        "general_settings": {"master_key": MASTER_KEY},
    }
    if fair_sched is not None:
        config["litellm_settings"]["callbacks"] = [f"{PLUGIN_MODULE}.scheduler"]
        config["general_settings"]["custom_auth"] = f"{PLUGIN_MODULE}.authenticate"
        config["fair_sched"] = dict(fair_sched)
    return config


async def wait_until_live(
    url: str, process: asyncio.subprocess.Process, timeout_s: float, what: str
) -> None:
    """Poll `url` until it answers 200; fail early if the process exits."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while loop.time() < give_up_at:
            if process.returncode is not None:
                raise RuntimeError(f"{what} exited with code {process.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.25)
    raise TimeoutError(f"{what} did not answer {url} within {timeout_s:.0f} s")


def _write_yaml(path: Path, payload: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(json_ready(payload), sort_keys=False))
    return path


def json_ready(value: Any) -> Any:
    """Plain dicts and lists (yaml.safe_dump refuses other mappings)."""
    if isinstance(value, Mapping):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value


@contextlib.asynccontextmanager
async def litellm_proxy(
    config: Mapping[str, Any], workdir: Path, name: str
) -> AsyncIterator[ChildProcess]:
    """``litellm --config`` on a free port; yields once ``/health/liveliness`` answers."""
    executable = litellm_executable()
    if executable is None:
        raise RuntimeError("the `litellm` command is not installed (pip install '.[litellm]')")
    config_path = _write_yaml(workdir / f"litellm-{name}.yaml", dict(config))
    port = free_port()
    argv = [executable, "--config", str(config_path), "--host", LOOPBACK, "--port", str(port)]
    with (workdir / f"litellm-{name}.log").open("w") as log:
        async with _process_group(argv, log) as process:
            base = f"http://{LOOPBACK}:{port}"
            await wait_until_live(
                f"{base}/health/liveliness", process, PROXY_START_TIMEOUT_S, f"LiteLLM ({name})"
            )
            yield ChildProcess(process.pid, f"{base}/v1", process)


@contextlib.asynccontextmanager
async def fair_proxy(
    fair_sched: Mapping[str, Any], workdir: Path, name: str
) -> AsyncIterator[ChildProcess]:
    """``fair-sched proxy`` (the standalone fair proxy) on a free port."""
    config_path = _write_yaml(workdir / f"fair-proxy-{name}.yaml", {"fair_sched": dict(fair_sched)})
    port = free_port()
    argv = [sys.executable, "-m", "fair_sched_plugin.cli", "proxy", "--config", str(config_path)]
    argv += ["--host", LOOPBACK, "--port", str(port), "--log-level", "warning"]
    with (workdir / f"fair-proxy-{name}.log").open("w") as log:
        async with _process_group(argv, log) as process:
            base = f"http://{LOOPBACK}:{port}"
            await wait_until_live(
                f"{base}/health", process, PROXY_START_TIMEOUT_S, f"fair proxy ({name})"
            )
            yield ChildProcess(process.pid, f"{base}/v1", process)


def group_cpu_seconds(group_id: int) -> float:
    """User + system CPU seconds of every live process in the process group `group_id`."""
    ticks_per_second = os.sysconf("SC_CLK_TCK")
    total_ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # the process ended while we looked
        # The command name (field 2) may contain spaces; the fields after it are fixed.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == group_id:
            total_ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return total_ticks / ticks_per_second


async def engine_stats(client: httpx.AsyncClient, engine_base: str) -> dict[str, Any]:
    """The emulator's ``/emulator/stats``; empty for an engine that has none."""
    try:
        response = await client.get(f"{engine_base.rstrip('/')}/emulator/stats")
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    stats: dict[str, Any] = response.json()
    return stats


async def enter_side_by_side(
    stack: contextlib.AsyncExitStack,
    starts: Sequence[contextlib.AbstractAsyncContextManager[T]],
    progress: Callable[[str], None],
    starting: str,
) -> list[T]:
    """Enter every start on `stack` at once: LiteLLM imports slowly, so side by side they cost
    one start-up instead of one each. Every start finishes (or fails) before the first failure
    is raised, so nothing starts late and escapes the stack."""
    began = time.perf_counter()
    progress(starting)
    outcomes = await asyncio.gather(
        *(stack.enter_async_context(start) for start in starts), return_exceptions=True
    )
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        raise failures[0]
    progress(f"all started in {time.perf_counter() - began:.1f} s")
    return [o for o in outcomes if not isinstance(o, BaseException)]
