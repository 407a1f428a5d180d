"""`fair-sched demo` (the flood, side by side) and `fair-sched bench` (every scenario).

    fair-sched demo  [--out demo-output] [--flood 100] [--quick] [--replicas]
    fair-sched bench [--out report] [--engine URL] [--quick] [--scenarios flood,tiers,...]
    fair-sched bench --target [NAME=]URL --keys K1,K2 --model NAME [--trace FILE] [--out DIR]

Both start their own emulators and proxies as child processes and stop them however the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from .bench.flood import (
    DEMO_ENGINE,
    DEMO_SIZE,
    QUICK_ENGINE,
    QUICK_SIZE,
    FloodSize,
    run_flood,
    standard_variants,
)
from .bench.open_bench import DEFAULT_SCENARIOS, add_open_arguments
from .bench.processes import kill_leftover_groups, plugin_available, terminate_as_interrupt
from .bench.report import STAND_IN_NOTE, Progress, write_flood_outputs
from .bench.runner import ALL_SCENARIOS, replica_sections, run_bench
from .bench.trace import SHAPES

__all__ = ["add_demo_parsers"]


def _flood_size(args: argparse.Namespace) -> FloodSize:
    base = QUICK_SIZE if args.quick else DEMO_SIZE
    return FloodSize(args.flood or base.power_requests, base.max_tokens)


def run_replicas_demo(args: argparse.Namespace) -> int:
    """Placement across two emulators: the unequal-replicas and shared-prefixes scenarios,
    LiteLLM's default router against the same proxy with the plugin."""
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    command = "fair-sched demo --replicas --out " + args.out + (" --quick" if args.quick else "")
    # The bench's replica sections read `engine` (none: the built-in emulators) and `quick`.
    settings = argparse.Namespace(engine=None, quick=args.quick)
    try:
        with terminate_as_interrupt():
            lines = asyncio.run(replica_sections(settings, out_dir, progress))
    except KeyboardInterrupt:
        print("interrupted; stopping every child process", file=sys.stderr)
        return 130
    finally:
        kill_leftover_groups()
    summary = ["# fair-sched replicas demo", "", f"Command: `{command}`", "", *lines]
    (out_dir / "summary.md").write_text("\n".join(summary))
    print("\n".join(lines))
    print(f"\nwrote {out_dir}/summary.md, unequal-replicas.json, shared-prefixes.json and plots")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    if args.replicas:
        return run_replicas_demo(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    if not plugin_available():
        progress("note: fair_sched_plugin.litellm is not installed; the fair proxy stands in")
    size = _flood_size(args)
    engine = QUICK_ENGINE if args.quick else DEMO_ENGINE
    command = f"fair-sched demo --out {args.out}" + (" --quick" if args.quick else "")
    command += f" --flood {args.flood}" if args.flood else ""
    try:
        with terminate_as_interrupt():
            results = asyncio.run(
                run_flood(standard_variants(), size, engine, None, out_dir / "logs", progress)
            )
    except KeyboardInterrupt:
        print("interrupted; stopping every child process", file=sys.stderr)
        return 130
    finally:
        kill_leftover_groups()
    table = write_flood_outputs(results, out_dir, command)
    print()
    print(table)
    if not plugin_available():
        print(STAND_IN_NOTE)
    print(f"\nwrote {out_dir}/results.json, summary.md and PNG plots")
    return 1 if any(result.summary["errors"] for result in results) else 0


def add_demo_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `fair-sched demo` and `fair-sched bench` (handlers in ``args.handler``)."""
    demo = subparsers.add_parser("demo", help="the flood demo on the built-in engine emulator")
    demo.add_argument("--out", default="demo-output", help="directory for results and plots")
    demo.add_argument("--flood", type=int, default=None, help="power user's requests (100)")
    demo.add_argument("--quick", action="store_true", help="a smaller flood for CI (~40 s)")
    demo.add_argument(
        "--replicas",
        action="store_true",
        help="instead of the flood: two emulators behind one model name (one 3x slower; then "
        "20 users with long system prompts), LiteLLM's router vs the plugin's placement",
    )
    demo.set_defaults(handler=run_demo)

    bench = subparsers.add_parser(
        "bench",
        help="run the benchmark scenarios (docs/results.md), write a report; with --target, "
        "measure your own stack (docs/measure-your-stack.md)",
        description="Run the benchmark scenarios on the built-in emulator (or --engine) and "
        "write a report; docs/results.md discusses their results. With --target, measure "
        "OpenAI-compatible endpoints this command did not start (docs/measure-your-stack.md).",
    )
    bench.add_argument("--out", default="report", help="directory for index.md and plots")
    bench.add_argument("--engine", default=None, help="a real engine's base URL (with /metrics)")
    bench.add_argument(
        "--engine-priority",
        action="store_true",
        help="the --engine was started with priority scheduling (vLLM --scheduling-policy)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        # Measured (3 Dec, a 2-core machine also running other work): 448 s in all; flood 87,
        # tiers 37, many-users 2, overhead 34, speed-change 210, unequal-replicas 50,
        # shared-prefixes 25, core 2.
        help="smaller scenarios: all of them took 7.5 minutes on a busy 2-core machine "
        "(speed-change 3.5, the flood 1.5); pick some with --scenarios",
    )
    bench.add_argument(
        "--scenarios",
        default=None,
        help=f"comma-separated subset of {','.join(ALL_SCENARIOS)} (all); with --target, of "
        f"{','.join(SHAPES)} ({','.join(DEFAULT_SCENARIOS)})",
    )
    add_open_arguments(bench)
    bench.set_defaults(handler=run_bench)
