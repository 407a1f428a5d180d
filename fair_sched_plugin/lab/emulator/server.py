"""Serving the emulator: in-process for tests, as a subprocess, and from the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import uvicorn

from .app import Emulator
from .engine import METRICS_MODES, EmulatedEngine, EmulatorConfig, FaultSwitches

LOOPBACK = "127.0.0.1"
READY_LINE_PREFIX = "fair-sched emulator listening on "
STARTUP_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 5.0
# An idle keep-alive connection is kept this long (uvicorn's default is 5 s). Clients pool
# connections longer (LiteLLM's aiohttp 15 s): with 5 s, one that reuses a connection idle for
# 5-15 s can write its request while the server closes it, and LiteLLM answers 500 ("Cannot write
# to closing transport"), measured in bench runs where the plugin held requests for seconds.
KEEP_ALIVE_S = 75


@dataclass(frozen=True)
class RunningEmulator:
    """An emulator serving on loopback; valid inside ``run_emulator``'s ``async with``."""

    base_url: str
    port: int
    engine: EmulatedEngine
    emulator: Emulator


def _uvicorn_server(emulator: Emulator, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        emulator.app,
        host=LOOPBACK,
        port=port,
        log_level="warning",
        lifespan="on",
        timeout_keep_alive=KEEP_ALIVE_S,
        # Streams still open at shutdown are cut after this, never waited on forever.
        timeout_graceful_shutdown=2,
    )
    return uvicorn.Server(config)


async def _wait_until_started(server: uvicorn.Server, serving: asyncio.Task[None]) -> int:
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + STARTUP_TIMEOUT_S
    while not server.started:
        if serving.done():
            serving.result()  # re-raises why uvicorn stopped
            raise RuntimeError("uvicorn stopped before it started serving")
        if loop.time() > give_up_at:
            raise TimeoutError(f"the emulator did not start within {STARTUP_TIMEOUT_S} s")
        await asyncio.sleep(0.005)
    port: int = server.servers[0].sockets[0].getsockname()[1]
    return port


@contextlib.asynccontextmanager
async def run_emulator(
    config: EmulatorConfig | None = None, *, port: int = 0
) -> AsyncIterator[RunningEmulator]:
    """Serve an emulator in this event loop on 127.0.0.1 (``port=0``: a free port).

    On exit the engine is closed first, so open streams end and uvicorn shuts down promptly.
    """
    emulator = Emulator(config)
    server = _uvicorn_server(emulator, port)
    serving = asyncio.get_running_loop().create_task(server.serve(), name="emulator-uvicorn")
    try:
        bound_port = await _wait_until_started(server, serving)
        yield RunningEmulator(
            f"http://{LOOPBACK}:{bound_port}", bound_port, emulator.engine, emulator
        )
    finally:
        await emulator.engine.aclose()
        server.should_exit = True
        try:
            await asyncio.wait_for(serving, SHUTDOWN_TIMEOUT_S)
        except asyncio.TimeoutError:
            server.force_exit = True
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)


# ----------------------------------------------------------------------------- subprocess


@dataclass(frozen=True)
class EmulatorProcess:
    """An emulator in a child process; flip faults with ``POST {base_url}/emulator/faults``."""

    base_url: str
    port: int
    process: asyncio.subprocess.Process


def config_to_argv(config: EmulatorConfig) -> list[str]:
    """Command-line arguments that rebuild ``config`` in another process."""
    faults = config.faults
    argv = ["--model", *config.models]
    argv += ["--max-num-seqs", str(config.max_num_seqs), "--policy", config.policy]
    argv += ["--step-ms", repr(config.base_step_ms)]
    argv += ["--step-ms-per-seq", repr(config.step_ms_per_running_seq)]
    argv += ["--prefill-ms-per-token", repr(config.prefill_ms_per_token)]
    argv += ["--kv-capacity-tokens", str(config.kv_capacity_tokens)]
    argv += ["--metrics-profile", config.metrics_profile]
    argv += ["--success-counter" if config.success_counter else "--no-success-counter"]
    argv += ["--default-max-tokens", str(config.default_max_tokens)]
    argv += ["--max-new-tokens", str(config.max_new_tokens)]
    argv += ["--speed", repr(config.speed)]
    argv += ["--prefix-cache-blocks", str(config.prefix_cache_blocks)]
    argv += ["--block-tokens", str(config.block_tokens)]
    argv += ["--metrics-delay-s", repr(faults.metrics_delay_s)]
    argv += ["--metrics-mode", faults.metrics_mode]
    argv += ["--fail-every-nth-completion", str(faults.fail_every_nth_completion)]
    argv += ["--first-byte-delay-s", repr(faults.first_byte_delay_s)]
    argv += ["--slow", repr(faults.slow)]
    argv += ["--metrics-filter" if faults.metrics_filter else "--no-metrics-filter"]
    argv += ["--fail-prompt", faults.fail_prompt, "--drop-prompt", faults.drop_prompt]
    return argv


@contextlib.asynccontextmanager
async def run_emulator_subprocess(
    config: EmulatorConfig | None = None, *, port: int = 0
) -> AsyncIterator[EmulatorProcess]:
    """Start ``python -m fair_sched_plugin.lab.emulator`` and wait for its ready line."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fair_sched_plugin.lab.emulator",
        "--port",
        str(port),
        *config_to_argv(config or EmulatorConfig()),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        base_url = await asyncio.wait_for(_read_ready_url(process), STARTUP_TIMEOUT_S)
        yield EmulatorProcess(base_url, int(base_url.rsplit(":", 1)[1]), process)
    finally:
        if process.returncode is None:
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), SHUTDOWN_TIMEOUT_S)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()


async def _read_ready_url(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    while line := (await process.stdout.readline()).decode():
        if line.startswith(READY_LINE_PREFIX):
            return line.removeprefix(READY_LINE_PREFIX).strip()
    raise RuntimeError(f"the emulator exited (code {await process.wait()}) before it was ready")


# ----------------------------------------------------------------------------- command line


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EmulatorConfig()
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--model", nargs="+", default=list(defaults.models), help="served model name(s)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--policy", choices=["fcfs", "priority"], default=defaults.policy)
    parser.add_argument(
        "--step-ms", type=float, default=defaults.base_step_ms, help="base decode step time"
    )
    parser.add_argument(
        "--step-ms-per-seq",
        type=float,
        default=defaults.step_ms_per_running_seq,
        help="extra step time per running sequence",
    )
    parser.add_argument("--prefill-ms-per-token", type=float, default=defaults.prefill_ms_per_token)
    parser.add_argument("--kv-capacity-tokens", type=int, default=defaults.kv_capacity_tokens)
    parser.add_argument(
        "--metrics-profile", choices=["vllm", "sglang", "tgi"], default=defaults.metrics_profile
    )
    parser.add_argument(
        "--success-counter",
        action=argparse.BooleanOptionalAction,
        default=defaults.success_counter,
        help="export vllm:request_success_total with the vllm profile (off: an engine whose "
        "finished requests the gate cannot count, as SGLang and TGI)",
    )
    parser.add_argument("--default-max-tokens", type=int, default=defaults.default_max_tokens)
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=defaults.max_new_tokens,
        help="cap on every request's max_tokens (0: none)",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=defaults.speed,
        help="relative speed of this instance: 0.33 makes every step three times longer",
    )
    parser.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=defaults.prefix_cache_blocks,
        help="LRU prefix cache size in blocks of --block-tokens prompt tokens; 0 = off",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=defaults.block_tokens,
        help="prompt tokens per prefix-cache block",
    )
    faults = parser.add_argument_group("fault switches (also at runtime: POST /emulator/faults)")
    faults.add_argument("--metrics-delay-s", type=float, default=0.0)
    faults.add_argument("--metrics-mode", choices=list(METRICS_MODES), default="ok")
    faults.add_argument("--fail-every-nth-completion", type=int, default=0)
    faults.add_argument("--first-byte-delay-s", type=float, default=0.0)
    faults.add_argument(
        "--slow", type=float, default=1.0, help="every step takes this many times longer"
    )
    faults.add_argument(
        "--metrics-filter",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve /metrics/?name[]=... filtered by sample name, as vLLM does (else 404)",
    )
    faults.add_argument("--fail-prompt", default="", help="prompts with this text get 500")
    faults.add_argument(
        "--drop-prompt", default="", help="streams of prompts with this text break after a token"
    )


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    return EmulatorConfig(
        models=tuple(args.model),
        max_num_seqs=args.max_num_seqs,
        policy=args.policy,
        base_step_ms=args.step_ms,
        step_ms_per_running_seq=args.step_ms_per_seq,
        prefill_ms_per_token=args.prefill_ms_per_token,
        kv_capacity_tokens=args.kv_capacity_tokens,
        metrics_profile=args.metrics_profile,
        success_counter=args.success_counter,
        default_max_tokens=args.default_max_tokens,
        max_new_tokens=args.max_new_tokens,
        speed=args.speed,
        prefix_cache_blocks=args.prefix_cache_blocks,
        block_tokens=args.block_tokens,
        faults=FaultSwitches(
            metrics_delay_s=args.metrics_delay_s,
            metrics_mode=args.metrics_mode,
            fail_every_nth_completion=args.fail_every_nth_completion,
            first_byte_delay_s=args.first_byte_delay_s,
            slow=args.slow,
            metrics_filter=args.metrics_filter,
            fail_prompt=args.fail_prompt,
            drop_prompt=args.drop_prompt,
        ),
    )


async def serve_forever(config: EmulatorConfig, port: int) -> None:
    """Serve until cancelled (Ctrl-C / SIGTERM stop uvicorn, which ends this)."""
    emulator = Emulator(config)
    server = _uvicorn_server(emulator, port)
    serving = asyncio.get_running_loop().create_task(server.serve(), name="emulator-uvicorn")
    bound_port = await _wait_until_started(server, serving)
    # The ready line tells a parent process (and a human) which port was bound.
    print(f"{READY_LINE_PREFIX}http://{LOOPBACK}:{bound_port}", flush=True)
    await serving


def run_from_args(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"fair-sched emulate: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve_forever(config, args.port))
    return 0


def add_emulate_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``fair-sched emulate``; the handler is in ``args.handler``."""
    parser = subparsers.add_parser(
        "emulate", help="serve a vLLM-compatible engine emulator on 127.0.0.1"
    )
    _add_arguments(parser)
    parser.set_defaults(handler=run_from_args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fair_sched_plugin.lab.emulator",
        description="Serve a vLLM-compatible engine emulator on 127.0.0.1.",
    )
    _add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
