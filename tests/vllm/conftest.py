"""A real vLLM (CPU build) for the tests in this folder: its virtualenv, a tiny model, the engine.

The vLLM virtualenv lives outside git (`scripts/vllm_env.sh`, which `scripts/test` runs first);
this conftest never installs anything. `FAIR_SCHED_SKIP_VLLM=1` skips the stage on a quick local
run. Under CI (`CI=true`) a missing or broken vLLM fails: the stage can never silently vanish.

One engine runs at a time (two would fight over two cores): `engines.get("priority")` stops an
engine of the other policy first. Every engine runs in its own process group, killed in the
session's teardown and, should that not run, at interpreter exit.

`FAIR_SCHED_VLLM_LAYOUT` picks the process layout: `shared` (the default, and CI's)
keeps the engine and the LiteLLM proxy in the test run's session; `sessions` starts each in a
session of its own, so engine, LiteLLM proxy and client (this process) are three autogroup CPU
scheduling groups, as when the proxy is CPU-starved by other work. The engine itself is
started by `fair_sched_plugin.lab.harness.vllm_stage`, which the benchmarks share.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fair_sched_plugin.lab.harness.vllm_stage import (
    VLLM_VERSION,
    Engines,
    VllmEngine,
    cache_dir,
    engine_environment,
    layout,
)

from ..support import in_ci

ROOT = Path(__file__).resolve().parents[2]
BUILDER = Path(__file__).with_name("tiny_model.py")
MODEL_BUILD_TIMEOUT_S = 300.0


def flood_size() -> tuple[int, int]:
    """(power requests, tokens each) of the floods: `FAIR_SCHED_VLLM_FLOOD` as `NxT` (the larger
    flood is `100x128`), else CI's 56 x 48."""
    value = os.environ.get("FAIR_SCHED_VLLM_FLOOD", "").strip().lower()
    if not value:
        return 56, 48
    requests, _, tokens = value.partition("x")
    if not (requests.isdigit() and tokens.isdigit() and int(requests) >= 8 and int(tokens) >= 1):
        raise pytest.UsageError(f"FAIR_SCHED_VLLM_FLOOD must be NxT with N >= 8, not {value!r}")
    return int(requests), int(tokens)


def unavailable(reason: str) -> None:
    """Skip on a developer's machine; fail under CI, where this stage must run."""
    if in_ci():
        pytest.fail(f"real-vLLM stage cannot run under CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            # All of them in scripts/test's second phase, alone: the engine starts once (a
            # minute or two of both cores), and its venv is built during the first phase.
            item.add_marker(pytest.mark.timing)
    if os.environ.get("FAIR_SCHED_SKIP_VLLM") and not in_ci():
        skip = pytest.mark.skip(reason="FAIR_SCHED_SKIP_VLLM is set: real-vLLM stage skipped")
        for item in items:
            if here in Path(str(item.fspath)).parents:
                item.add_marker(skip)


# Flood numbers by scenario, filled by the tests and printed at the end of the session so that
# they appear in the CI log.
FLOOD_REPORT: dict[str, dict[str, float]] = {}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not FLOOD_REPORT:
        return
    requests, tokens = flood_size()
    terminalreporter.section(
        f"real vLLM (CPU) flood numbers, layout: {layout()}, flood: {requests} x {tokens} tokens"
    )
    for name, numbers in FLOOD_REPORT.items():
        terminalreporter.write_line(
            f"{name:42s} light TTFT p50 {numbers['light_ttft_p50_s']:5.2f} s | "
            f"power TTFT p50 {numbers['power_ttft_p50_s']:5.2f} s | "
            f"light done (max) {numbers['light_done_max_s']:5.2f} s | "
            f"power done p50 {numbers['power_done_p50_s']:5.2f} s | "
            f"{numbers['tokens_per_s']:5.0f} tokens/s | "
            f"engine running {numbers['engine_running_mean']:4.1f}, "
            f"waiting {numbers['engine_waiting_mean']:4.1f} while work waits"
            + f" | engine CPU {numbers['engine_cpu_ms_per_token']:.2f} ms/token"
            + (
                f" | LiteLLM CPU {numbers['proxy_cpu_ms_per_token']:.2f} ms/token"
                f", waited for a CPU {numbers['proxy_cpu_wait_per_s']:.2f} s/s"
                if not math.isnan(numbers["proxy_cpu_ms_per_token"])
                else ""
            )
        )
    for name, baseline in THROUGHPUT_RATIOS:
        if name in FLOOD_REPORT and baseline in FLOOD_REPORT:
            ratio = FLOOD_REPORT[name]["tokens_per_s"] / FLOOD_REPORT[baseline]["tokens_per_s"]
            terminalreporter.write_line(f"throughput {name} / {baseline}: {ratio:.2f}")
    for kind, ratios in bracketed_ratios(PAIRED_ROUNDS).items():
        terminalreporter.write_line(
            f"paired rounds, {kind} / LiteLLM alone on either side: median "
            f"{statistics.median(ratios):.2f} of {len(ratios)} ("
            + " ".join(f"{ratio:.2f}" for ratio in sorted(ratios))
            + ")"
        )


# Paired rounds (test_paired_rounds.py): (what ran, tokens/s) in the order they ran; "plain" is
# LiteLLM alone, anything else the plugin.
PAIRED_ROUNDS: list[tuple[str, float]] = []


def bracketed_ratios(rounds: list[tuple[str, float]]) -> dict[str, list[float]]:
    """Each plugin round's tokens/s against the mean of the LiteLLM-alone rounds next to it
    (before and after; one where it is first or last): the machine's speed drifts by more than
    the differences measured, and a baseline on both sides cancels a steady drift."""
    plain = [(index, rate) for index, (kind, rate) in enumerate(rounds) if kind == "plain"]
    ratios: dict[str, list[float]] = {}
    for index, (kind, rate) in enumerate(rounds):
        if kind == "plain":
            continue
        before = [base for at, base in plain if at < index][-1:]
        after = [base for at, base in plain if at > index][:1]
        if before or after:
            ratios.setdefault(kind, []).append(rate / statistics.mean(before + after))
    return ratios


DIRECT_FLOOD = "direct to vLLM (FIFO)"
FAIR_PROXY_FLOOD = "fair-sched proxy"
PLAIN_LITELLM_FLOOD = "LiteLLM proxy, no plugin"
PLUGIN_LITELLM_FLOOD = "LiteLLM proxy + plugin"
AUTO_LITELLM_FLOOD = "LiteLLM proxy + plugin, waiting_below auto"
FAIR_QUEUE_LITELLM_FLOOD = "LiteLLM + plugin, auto, fair_engine_queue"
THROUGHPUT_RATIOS = (
    (FAIR_PROXY_FLOOD, DIRECT_FLOOD),
    (PLAIN_LITELLM_FLOOD, DIRECT_FLOOD),
    (PLUGIN_LITELLM_FLOOD, PLAIN_LITELLM_FLOOD),
    # >= 0.90 is the goal, in both process layouts (docs/real-vllm.md).
    (AUTO_LITELLM_FLOOD, PLAIN_LITELLM_FLOOD),
    (AUTO_LITELLM_FLOOD, PLUGIN_LITELLM_FLOOD),
    (FAIR_QUEUE_LITELLM_FLOOD, PLAIN_LITELLM_FLOOD),
    (FAIR_QUEUE_LITELLM_FLOOD, AUTO_LITELLM_FLOOD),
)


# ----------------------------------------------------------------------------- environment


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's interpreter: `FAIR_SCHED_VLLM_PYTHON` (set by scripts/test) or the cache."""
    if os.environ.get("FAIR_SCHED_SKIP_VLLM"):
        unavailable("FAIR_SCHED_SKIP_VLLM is set")
    named = os.environ.get("FAIR_SCHED_VLLM_PYTHON")
    venv = cache_dir() / f"vllm-venv-{VLLM_VERSION}"
    python = Path(named) if named else venv / "bin" / "python"
    stamp = python.parent.parent / ".fair-sched-vllm-installed"
    if not python.exists() or not stamp.exists():
        unavailable(
            f"no vLLM virtualenv at {python.parent.parent}: run scripts/vllm_env.sh "
            "(scripts/test does), or set FAIR_SCHED_SKIP_VLLM=1"
        )
    return python


@pytest.fixture(scope="session")
def vllm_scratch() -> Path:
    path = cache_dir() / "vllm-run"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, vllm_scratch: Path) -> Path:
    """The tiny random Llama, built once per version of the builder script and reused."""
    digest = hashlib.sha256(BUILDER.read_bytes()).hexdigest()[:12]
    model_dir = cache_dir() / f"tiny-llama-{digest}"
    if (model_dir / ".complete").exists():
        return model_dir
    started = time.monotonic()
    result = subprocess.run(
        [str(vllm_python), str(BUILDER), str(model_dir)],
        env=engine_environment(vllm_python, vllm_scratch),
        capture_output=True,
        text=True,
        timeout=MODEL_BUILD_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0 or not (model_dir / ".complete").exists():
        pytest.fail(
            f"building the tiny model failed (exit {result.returncode}):\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}",
            pytrace=False,
        )
    print(f"\n[vllm] tiny model built in {time.monotonic() - started:.1f} s at {model_dir}")
    return model_dir


# ----------------------------------------------------------------------------- engines


@pytest.fixture(scope="session")
def engines(vllm_python: Path, tiny_model: Path, vllm_scratch: Path) -> Iterator[Engines]:
    manager = Engines(vllm_python, tiny_model, vllm_scratch)
    try:
        yield manager
    finally:
        manager.close()


@pytest.fixture
def priority_engine(engines: Engines) -> VllmEngine:
    """vLLM with `--scheduling-policy priority` (lower `priority` first)."""
    return engines.get("priority")


@pytest.fixture
def fcfs_engine(engines: Engines) -> VllmEngine:
    """vLLM with its default first-come-first-served policy (a non-zero `priority` is an error)."""
    return engines.get("fcfs")


if sys.platform != "linux":  # process groups and /proc are assumed throughout
    collect_ignore_glob = ["test_*.py"]
