"""`fair-sched demo` (the flood, side by side) and `fair-sched bench` (every scenario).

    fair-sched demo  [--out demo-output] [--flood 100] [--quick] [--replicas]
    fair-sched demo  --runs 5 [--update-docs] [--quick]    (median and range of several runs)
    fair-sched bench [--out report] [--engine URL] [--quick] [--scenarios flood,tiers,...]
    fair-sched bench --target [NAME=]URL --keys K1,K2 --model NAME [--trace FILE] [--out DIR]

Both start their own emulators and proxies as child processes and stop them however the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from .loadtest.doc_tables import (
    Stamp,
    check_doc_markers,
    flood_spread_table,
    readme_table,
    write_doc_tables,
)
from .loadtest.flood import (
    DEMO_ENGINE,
    DEMO_SIZE,
    QUICK_ENGINE,
    QUICK_SIZE,
    FloodResult,
    FloodSize,
    run_flood,
    standard_variants,
)
from .loadtest.open_bench import DEFAULT_SCENARIOS, add_open_arguments
from .loadtest.processes import kill_leftover_groups, plugin_available, terminate_as_interrupt
from .loadtest.report import STAND_IN_NOTE, Progress, flood_json, write_flood_outputs
from .loadtest.runner import ALL_SCENARIOS, replica_sections, run_bench
from .loadtest.trace import SHAPES

__all__ = ["add_demo_parsers"]

DEMO_OUT = "demo-output"
# --runs: enough for a median and its spread; more is an afternoon on a 2-core machine.
MAX_RUNS = 20


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


def _command(args: argparse.Namespace) -> str:
    """The command line that gives these results (the output directory only where it moved)."""
    words = ["fair-sched demo"]
    words += [f"--runs {args.runs}"] if args.runs != 1 else []
    words += ["--quick"] if args.quick else []
    words += [f"--flood {args.flood}"] if args.flood else []
    words += ["--update-docs"] if args.update_docs else []
    words += [f"--out {args.out}"] if args.out != DEMO_OUT else []
    return " ".join(words)


def _flood_once(args: argparse.Namespace, out_dir: Path, command: str) -> list[FloodResult] | None:
    """One run of the flood, its table printed and its files written; None if interrupted."""
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    if not plugin_available():
        progress("note: fair_sched_plugin.litellm is not installed; the fair proxy stands in")
    engine = QUICK_ENGINE if args.quick else DEMO_ENGINE
    try:
        with terminate_as_interrupt():
            results = asyncio.run(
                run_flood(
                    standard_variants(), _flood_size(args), engine, None, out_dir / "logs", progress
                )
            )
    except KeyboardInterrupt:
        print("interrupted; stopping every child process", file=sys.stderr)
        return None
    finally:
        kill_leftover_groups()
    table = write_flood_outputs(results, out_dir, command)
    print()
    print(table)
    if not plugin_available():
        print(STAND_IN_NOTE)
    print(f"\nwrote {out_dir}/results.json, summary.md and PNG plots")
    return results


def _write_spread(out_dir: Path, runs: list[dict[str, Any]], stamp: Stamp) -> None:
    """The median and range of several runs: printed, and in OUT/summary.md."""
    readme, full = readme_table(runs), flood_spread_table(runs)
    summary = ["# fair-sched flood demo, several runs", "", stamp.text(), "", readme, "", full, ""]
    (out_dir / "summary.md").write_text("\n".join(summary))
    print(f"\n{stamp.text()}\n\n{readme}\n\nwrote {out_dir}/summary.md, with every row")


def run_demo(args: argparse.Namespace) -> int:
    if args.replicas:
        if args.runs != 1 or args.update_docs:
            print("--runs and --update-docs: the flood demo only", file=sys.stderr)
            return 2
        return run_replicas_demo(args)
    root = Path.cwd()
    if args.update_docs:
        try:
            if not plugin_available():
                raise ValueError("the tables show LiteLLM + plugin, which is not installed here")
            check_doc_markers(root)
        except ValueError as problem:
            print(f"--update-docs: {problem}", file=sys.stderr)
            return 2
    out_dir = Path(args.out)
    command = _command(args)
    # Taken before the first run: the commit as it was run, the machine's load before it.
    stamp = Stamp.begin(command, args.runs, root)
    runs = []
    for number in range(1, args.runs + 1):
        run_dir, run_command = out_dir, command
        if args.runs > 1:
            load = os.getloadavg()[0]
            print(f"\n== run {number} of {args.runs} (load average {load:.2f}) ==", flush=True)
            run_dir, run_command = out_dir / f"run-{number}", f"{command} (run {number})"
        results = _flood_once(args, run_dir, run_command)
        if results is None:
            return 130
        runs.append(flood_json(results))
    stamp = stamp.finish()
    failed = any(variant["summary"]["errors"] for run in runs for variant in run.values())
    if args.runs > 1:
        _write_spread(out_dir, runs, stamp)
    if args.update_docs and failed:
        print("some requests failed: README.md and docs/results.md left as they were")
    elif args.update_docs:
        written = write_doc_tables(root, runs, stamp)
        print("rewrote the demo tables of " + ", ".join(str(path) for path in written))
    return 1 if failed else 0


def _run_count(text: str) -> int:
    count = int(text)
    if not 1 <= count <= MAX_RUNS:
        raise argparse.ArgumentTypeError(f"between 1 and {MAX_RUNS}")
    return count


def add_demo_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `fair-sched demo` and `fair-sched bench` (handlers in ``args.handler``)."""
    demo = subparsers.add_parser("demo", help="the flood demo on the built-in engine emulator")
    demo.add_argument("--out", default=DEMO_OUT, help="directory for results and plots")
    demo.add_argument("--flood", type=int, default=None, help="power user's requests (100)")
    demo.add_argument("--quick", action="store_true", help="a smaller flood for CI (~40 s)")
    demo.add_argument(
        "--runs",
        type=_run_count,
        default=1,
        help="run the flood N times in a row (OUT/run-1, ...), then print each cell's median "
        "and range and write them in OUT/summary.md",
    )
    demo.add_argument(
        "--update-docs",
        action="store_true",
        help="write the runs' median and range into the demo tables of README.md and "
        "docs/results.md (between their demo-table markers), stamped with the command, date, "
        "commit and machine; run from the repository's root",
    )
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
        # Measured on a 2-core machine also running other work: 448 s in all; flood 87,
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
