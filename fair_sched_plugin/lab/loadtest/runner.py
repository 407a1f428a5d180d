"""`fair-sched bench`: every scenario, one after another, into ``report/index.md``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .flood import (
    DEMO_ENGINE,
    DEMO_SIZE,
    QUICK_ENGINE,
    QUICK_SIZE,
    FloodResult,
    Variant,
    run_flood_and_screenshot,
    standard_variants,
    started_targets,
)
from .processes import (
    EmulatorSettings,
    kill_leftover_groups,
    plugin_available,
    terminate_as_interrupt,
)
from .replicas import (
    QUICK_SHARED,
    QUICK_UNEQUAL,
    SAMPLE_EVERY_S,
    ReplicaResult,
    SharedPrefixSize,
    UnequalSize,
    replica_json,
    run_shared,
    run_unequal,
)
from .report import (
    STAND_IN_NOTE,
    Progress,
    flood_json,
    flood_table,
    markdown_table,
    results_table,
    write_json,
    write_plots,
)
from .scenarios import (
    ManyUsersSize,
    TiersSize,
    play_core,
    play_many_users,
    play_overhead,
    play_tiers,
)
from .speed_change import (
    COMPARED_FIXED,
    QUICK_SPEED_SIZE,
    SPEED_ENGINE,
    SpeedChangeSize,
    play_speed_change,
    speed_change_variants,
)

ALL_SCENARIOS = (
    "flood",
    "tiers",
    "many-users",
    "overhead",
    "core",
    "speed-change",
    "unequal-replicas",
    "shared-prefixes",
)
# Chromium's picture of /fair-sched/ui during a flood, next to index.md.
UI_SHOT = "fair-sched-ui.png"


def _keep_runnable(variants: Sequence[Variant], args: argparse.Namespace) -> list[Variant]:
    """Against a real engine, engine priority only where it was started with it, and no
    variant that tells the gate the emulator's slots (`max_num_seqs`): the engine's may differ."""
    if args.engine is None:
        return list(variants)
    return [
        variant
        for variant in variants
        if (args.engine_priority or variant.engine_policy != "priority")
        and variant.max_num_seqs is None
    ]


def _pick(variants: Sequence[Variant], *names: str) -> list[Variant]:
    return [variant for variant in variants if variant.name in names]


async def _flood_section(args: argparse.Namespace, out: Path, progress: Progress) -> list[str]:
    size = QUICK_SIZE if args.quick else DEMO_SIZE
    variants = _keep_runnable(standard_variants(with_thresholds=True), args)
    engine = QUICK_ENGINE if args.quick else DEMO_ENGINE
    results, screenshot_note = await run_flood_and_screenshot(
        variants, size, engine, args.engine, out / "logs", progress, screenshot=out / UI_SHOT
    )
    write_json(out / "flood.json", flood_json(results))
    plots = write_plots(results, out)
    shot = [f"![/fair-sched/ui during the flood]({UI_SHOT})", ""]
    return [
        "## Flood",
        "",
        f"One power user sends {size.power_requests} streaming requests at once "
        f"({size.max_tokens} tokens each); 1 s later two light users send one each. "
        f"{_engine_line(engine, args)}",
        "",
        flood_table(results, markdown=True),
        "",
        "![TTFT CDFs](ttft-cdf.png)",
        "",
        *(f"![{path.stem}]({path.name})" for path in plots if path.stem.startswith("timeline")),
        "",
        *_threshold_section(results),
        "### The live page",
        "",
        screenshot_note or "",
        "",
        *(shot if (out / UI_SHOT).exists() else []),
    ]


def _threshold_section(results: Sequence[FloodResult]) -> list[str]:
    """Choosing `waiting_below`: light TTFT and throughput per threshold vs direct FIFO."""
    by_name = {result.variant.name: result for result in results}
    rows = []
    for name, label in (
        ("direct", "direct (FIFO)"),
        ("waiting_below_1", "waiting_below 1"),
        ("plugin", "waiting_below 3"),
        ("waiting_below_8", "waiting_below 8"),
        ("reserve_slots_1", "waiting_below 3, reserve_slots 1"),
    ):
        if name in by_name:
            summary = by_name[name].summary
            rows.append(
                [
                    label,
                    _seconds(summary["light_ttft_p50"]),
                    _ratio(summary.get("light_vs_idle")),
                    _seconds(summary["power_ttft_p50"]),
                    f"{summary['throughput_tps']:,.0f}",
                    f"{summary['makespan_s']:.1f} s",
                    str(summary.get("max_waiting_seen", "-")),
                ]
            )
    header = [
        "",
        "light TTFT p50",
        "light vs idle",
        "power TTFT p50",
        "tokens/s",
        "makespan",
        "max waiting",
    ]
    return ["### Choosing thresholds (all users in one tier)", "", markdown_table(header, rows), ""]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def _engine_line(settings: EmulatorSettings, args: argparse.Namespace) -> str:
    """What the scenario ran against: `--engine`, or the emulator with the settings it got."""
    return f"Engine: {args.engine}." if args.engine else f"Engine: {settings.describe()}."


async def _tiers_section(args: argparse.Namespace, out: Path, progress: Progress) -> list[str]:
    size = TiersSize(batch_alone_s=4, mixed_s=6) if args.quick else TiersSize()
    variants = _keep_runnable(_pick(standard_variants(), "direct", "plugin_priority"), args)
    results = {}
    async with started_targets(
        variants, DEMO_ENGINE, args.engine, out / "logs", progress
    ) as targets:
        for target in targets:
            results[target.variant.label] = await play_tiers(target, size, progress)
    header = ["", "idle TTFT p50", "interactive TTFT p50", "p95", "batch tokens/s alone", "errors"]
    rows = [
        [
            label,
            _seconds(r["idle_ttft_p50"]),
            _seconds(r["interactive_ttft_p50"]),
            _seconds(r["interactive_ttft_p95"]),
            f"{r['batch_alone_tps']:,.0f}",
            str(r["errors"]),
        ]
        for label, r in results.items()
    ]
    write_json(out / "tiers.json", results)
    return [
        "## Tiers",
        "",
        f"A batch user keeps {size.batch_concurrency} requests in flight; after "
        f"{size.batch_alone_s:.0f} s alone, interactive users send one request every "
        f"{size.interactive_every_s} s for {size.mixed_s:.0f} s. Batch throughput is measured "
        f"while no interactive request is around. {_engine_line(DEMO_ENGINE, args)}",
        "",
        markdown_table(header, rows),
        "",
    ]


async def _many_users_section(args: argparse.Namespace, out: Path, progress: Progress) -> list[str]:
    size = ManyUsersSize(requests=5000) if args.quick else ManyUsersSize()
    results = await play_many_users(size, progress)
    write_json(out / "many-users.json", results)
    rows = [
        [
            name,
            f"{r['jain_vs_fair_share']:.3f}",
            f"{r['jain_raw_served']:.3f}",
            str(r["users_served"]),
        ]
        for name, r in results.items()
    ]
    header = ["policy", "Jain (served / fair share)", "Jain (raw served tokens)", "users served"]
    _bar_plot(
        "Jain's index vs max-min fair share",
        {name: r["jain_vs_fair_share"] for name, r in results.items()},
        out / "many-users.png",
    )
    return [
        "## Many users",
        "",
        f"{size.users:,} users, {size.requests:,} requests of 16/64/256 tokens, Zipf (s = "
        f"{size.zipf_s}) load, {size.slots} engine slots, capacity {size.capacity_fraction:.0%} "
        "of the demand. Run through the in-process core scheduler with a simulated engine: "
        "1,000 users over HTTP is too heavy for a 2-core machine. Every tenth user has weight 2 "
        "(honoured by `weighted`, whose fair shares are weighted too).",
        "",
        markdown_table(header, rows),
        "",
        "![many users](many-users.png)",
        "",
    ]


async def _overhead_section(args: argparse.Namespace, out: Path, progress: Progress) -> list[str]:
    requests = 8 if args.quick else 30
    variants = _pick(standard_variants(), "litellm", "plugin")
    results = {}
    async with started_targets(
        variants, DEMO_ENGINE, args.engine, out / "logs", progress
    ) as targets:
        for target in targets:
            results[target.variant.name] = await play_overhead(target, requests, 64, progress)
    write_json(out / "overhead.json", results)
    without, with_plugin = results.get("litellm"), results.get("plugin")
    ratio = (
        with_plugin["e2e_p50"] / without["e2e_p50"]
        if without and with_plugin and without["e2e_p50"] and with_plugin["e2e_p50"]
        else None
    )
    rows = [
        [
            name,
            _seconds(r["ttft_p50"]),
            _seconds(r["e2e_p50"]),
            "-" if r["cpu_s_per_1000_tokens"] is None else f"{r['cpu_s_per_1000_tokens']:.3f}",
        ]
        for name, r in results.items()
    ]
    header = ["proxy", "TTFT p50", "e2e p50", "proxy CPU s / 1,000 tokens"]
    return [
        "## Overhead",
        "",
        f"{requests} requests of 64 tokens, one at a time. CPU is user + system time of the "
        f"proxy's process group from /proc/PID/stat. {_engine_line(DEMO_ENGINE, args)}",
        "",
        markdown_table(header, rows),
        "",
        f"e2e p50 ratio with / without the plugin: {'-' if ratio is None else f'{ratio:.2f}'}",
        "",
    ]


def _core_section(args: argparse.Namespace, out: Path, progress: Progress) -> list[str]:
    pairs = 20_000 if args.quick else 200_000
    result = play_core((10, 1000, 10_000), pairs, progress)
    write_json(out / "core.json", result)
    if "skipped" in result:
        return ["## Core decisions", "", f"Skipped: {result['skipped']}", ""]
    rows = [
        [
            f"{r['users']:,}",
            f"{r['decisions_per_s']:,.0f}",
            f"{r['p50_us']:.1f}",
            f"{r['p99_us']:.1f}",
        ]
        for r in result["rows"]
    ]
    header = ["backlogged users", "decisions/s", "p50 µs", "p99 µs"]
    return [
        "## Core decisions",
        "",
        f"`benchmarks/core_decisions.py`'s measurement, {pairs:,} release+admit pairs, one core, "
        "fake clock.",
        "",
        markdown_table(header, rows),
        "",
        f"Bytes per parked ticket: {result['bytes_per_parked_ticket']:,.0f}",
        "",
    ]


async def _speed_change_section(
    args: argparse.Namespace, out: Path, progress: Progress
) -> list[str]:
    if args.engine is not None:
        return ["## Speed change", "", "Skipped: it needs the emulator's `slow` fault.", ""]
    size = QUICK_SPEED_SIZE if args.quick else SpeedChangeSize()
    variants = speed_change_variants(size)
    results = []
    async with started_targets(variants, SPEED_ENGINE, None, out / "logs", progress) as targets:
        for target in targets:
            results.append(await play_speed_change(target, size, progress))
    write_json(
        out / "speed-change.json",
        {
            r.variant.name: {
                **r.summary,
                "samples": [[s.at, s.running, s.waiting, s.parked, s.allowed] for s in r.samples],
            }
            for r in results
        },
    )
    best_fixed = max(
        (r.summary["tokens_per_s"] for r in results if r.variant.name in COMPARED_FIXED),
        default=0.0,
    )
    rows = []
    for r in results:
        summary = r.summary
        rows.append(
            [
                r.variant.label,
                f"{summary['tokens_per_s']:,.0f}",
                f"{summary['tokens_per_s'] / best_fixed:.2f}" if best_fixed else "-",
                _seconds(summary["light_ttft_p95_steady_s"]),
                _seconds(summary["light_ttft_p95_fast_s"]),
                _seconds(summary["light_ttft_p95_slow_s"]),
                f"{summary['mean_running_while_parked']:.2f} / {summary['max_num_seqs']}",
                _queue(summary["mean_allowed_fast"]),
                _queue(summary["mean_allowed_slow"]),
                str(summary["errors"]),
            ]
        )
    header = [
        "",
        "tokens/s",
        "vs best of fixed 1, 3, 8",
        "light TTFT p95 (outside transitions)",
        "fast",
        "slow",
        "mean running while parked",
        "allowed queue, fast",
        "slow",
        "errors",
    ]
    lines = [
        "## Speed change (`waiting_below: auto`)",
        "",
        f"A power user keeps {size.power_concurrency} streams of {size.power_tokens[0]}-"
        f"{size.power_tokens[1]} tokens in flight, two light users send one request of "
        f"{size.max_tokens} tokens every {size.light_every_s} s each, all in "
        f"one tier. The emulator's `slow` fault makes it {size.slow:g}x slower from "
        f"{size.before_s:.0f} s to {size.before_s + size.slow_s:.0f} s of "
        f"{size.total_s:.0f} s. Transitions: the {size.transition_s:.0f} s after each switch. "
        f"TTFT target of `auto`: {size.ttft_target_ms:.0f} ms. Engine: "
        f"{SPEED_ENGINE.describe()}.",
        "",
        markdown_table(header, rows),
        "",
    ]
    try:
        from .plots import plot_speed_change

        first, second = size.switches
        plot_speed_change(results, first, second, out / "speed-change.png")
        lines += ["![allowed queue and TTFT over time](speed-change.png)", ""]
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    return lines


def _queue(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _bar_plot(title: str, values: dict[str, float], path: Path) -> None:
    try:
        from .plots import plot_bars

        plot_bars(title, values, "Jain's index", path)
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)


ReplicaColumn = tuple[str, Callable[[ReplicaResult], str]]


def _throughput_columns(results: Sequence[ReplicaResult]) -> list[ReplicaColumn]:
    """The first columns of every replica table."""
    return [
        ("tokens/s", lambda r: f"{r.summary['throughput_tps']:,.0f}"),
        ("vs LiteLLM default", lambda r: _times(_vs_litellm(results, r))),
    ]


def _served_columns() -> list[ReplicaColumn]:
    """The last columns of every replica table."""
    return [
        ("requests", lambda r: _per_engine(r, "requests_received")),
        ("errors", lambda r: str(r.summary["errors"])),
    ]


def _per_engine(result: ReplicaResult, key: str, fmt: str = "{:.0f}") -> str:
    values = [engine[key] for engine in result.summary["engines"]]
    return " / ".join("-" if value is None else fmt.format(value) for value in values)


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _vs_litellm(results: Sequence[ReplicaResult], result: ReplicaResult) -> float | None:
    litellm = next((r for r in results if r.variant.name == "litellm"), None)
    if litellm is None or not litellm.summary["throughput_tps"]:
        return None
    return float(result.summary["throughput_tps"] / litellm.summary["throughput_tps"])


def _replica_plot(kind: str, *args: Any) -> bool:
    try:
        from . import plots

        getattr(plots, kind)(*args)
        return True
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False


async def _unequal_section(args: argparse.Namespace, out: Path, progress: Progress) -> list[str]:
    if args.engine is not None:
        return ["## Unequal replicas", "", "Skipped: it needs two emulators of unequal speed.", ""]
    size = QUICK_UNEQUAL if args.quick else UnequalSize()
    results = await run_unequal(size, out / "logs", progress)
    write_json(out / "unequal-replicas.json", replica_json(results))
    table = results_table(
        results,
        lambda r: r.variant.label,
        [
            *_throughput_columns(results),
            ("light TTFT p50", lambda r: _seconds(r.summary["light_ttft_p50"])),
            ("light TTFT p95", lambda r: _seconds(r.summary["light_ttft_p95"])),
            ("light p50 vs direct FIFO", lambda r: _times(r.summary["light_ttft_vs_direct"])),
            ("max waiting (engine's own)", lambda r: _per_engine(r, "max_waiting_seen")),
            ("max waiting (sampled)", lambda r: _per_engine(r, "max_waiting_sampled")),
            ("mean waiting", lambda r: _per_engine(r, "mean_waiting_sampled", "{:.1f}")),
            ("mean running", lambda r: _per_engine(r, "mean_running_sampled", "{:.1f}")),
            *_served_columns(),
        ],
    )
    plotted = _replica_plot(
        "plot_engine_queues",
        results,
        float(size.waiting_below),
        "unequal replicas: each engine's queue",
        out / "unequal-replicas-queues.png",
    )
    engines = " and ".join(
        f"{e.max_num_seqs} slots at {e.step_ms:g} ms a step, speed {e.speed:g}"
        for e in size.engines
    )
    return [
        "## Unequal replicas",
        "",
        f"Two emulators behind one LiteLLM model name ({engines}). One power user sends "
        f"{size.power_requests} streaming requests of {size.max_tokens} tokens at once; two light "
        f"users send one each at {', '.join(f'{t:g}' for t in size.light_at_s)} s. Everyone in "
        f"one tier, `waiting_below: {size.waiting_below}`. Direct FIFO sends every request into "
        "the first (fast) engine's queue. Per-engine columns read engine 1 / engine 2; the "
        "engine's own maximum is taken after each step's scheduling (exact), the sampled ones "
        f"from its /metrics every {SAMPLE_EVERY_S:g} s.",
        "",
        table,
        "",
        *(["![each engine's queue](unequal-replicas-queues.png)", ""] if plotted else []),
    ]


async def _shared_section(args: argparse.Namespace, out: Path, progress: Progress) -> list[str]:
    if args.engine is not None:
        return ["## Shared prefixes", "", "Skipped: it needs two emulators with prefix caches.", ""]
    size = QUICK_SHARED if args.quick else SharedPrefixSize()
    results = await run_shared(size, out / "logs", progress)
    write_json(out / "shared-prefixes.json", replica_json(results))
    best = results[0].summary["best_hit_rate"] if results else None
    table = results_table(
        results,
        lambda r: r.variant.label,
        [
            *_throughput_columns(results),
            ("hit rate", lambda r: _fraction(r.summary["hit_rate"])),
            ("best possible", lambda r: _fraction(r.summary["best_hit_rate"])),
            ("hit rate per engine", lambda r: _per_engine(r, "hit_rate", "{:.2f}")),
            (
                "Jain (while all backlogged)",
                lambda r: _fraction(r.summary["jain_backlogged"], "{:.3f}"),
            ),
            ("max waiting (engine's own)", lambda r: _per_engine(r, "max_waiting_seen")),
            ("mean waiting", lambda r: _per_engine(r, "mean_waiting_sampled", "{:.1f}")),
            *_served_columns(),
        ],
    )
    plotted = _replica_plot(
        "plot_engine_queues",
        results,
        float(size.waiting_below),
        "shared prefixes: each engine's queue",
        out / "shared-prefixes-queues.png",
    ) and _replica_plot("plot_hit_rates", results, best, out / "shared-prefixes-hit-rates.png")
    return [
        "## Shared prefixes",
        "",
        f"{size.users} users, each with its own system prompt of ~{size.system_prompt_tokens:,} "
        f"tokens, send {size.requests_per_user} short questions each, all at once "
        f"({size.max_tokens} tokens out). Two emulators whose prefix caches hold "
        f"{size.cache_blocks:,} blocks of 16 tokens each ({size.cache_share:.0%} of all system "
        "prompts); prefill costs "
        f"{size.prefill_ms_per_token:g} ms per uncached token. Hit rates are the engines' "
        "`vllm:prefix_cache_hits_total` / `queries_total` growth over the run; the best possible "
        "is computed from the workload (every user's first request misses, a cache that never "
        "evicts). Jain's index is over each user's streamed tokens until the first user had "
        "nothing left in flight.",
        "",
        table,
        "",
        *(
            [
                "![each engine's queue](shared-prefixes-queues.png)",
                "",
                "![hit rates](shared-prefixes-hit-rates.png)",
                "",
            ]
            if plotted
            else []
        ),
    ]


def _fraction(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


async def replica_sections(args: argparse.Namespace, out: Path, progress: Progress) -> list[str]:
    """Both replica scenarios (`fair-sched demo --replicas` shows these)."""
    return [
        *await _unequal_section(args, out, progress),
        *await _shared_section(args, out, progress),
    ]


async def _http_sections(
    scenarios: Sequence[str], args: argparse.Namespace, out: Path, progress: Progress
) -> list[str]:
    sections = {
        "flood": _flood_section,
        "tiers": _tiers_section,
        "many-users": _many_users_section,
        "overhead": _overhead_section,
        "speed-change": _speed_change_section,
        "unequal-replicas": _unequal_section,
        "shared-prefixes": _shared_section,
    }
    lines: list[str] = []
    for name in scenarios:
        if name in sections:
            progress(f"== scenario {name}")
            lines += await sections[name](args, out, progress)
    return lines


def run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "target", None) or getattr(args, "trace", None):
        from .open_bench import run_open_bench

        return run_open_bench(args)
    chosen = args.scenarios or ",".join(ALL_SCENARIOS)
    scenarios = [name.strip() for name in chosen.split(",") if name.strip()]
    unknown = sorted(set(scenarios) - set(ALL_SCENARIOS))
    if unknown:
        print(
            f"fair-sched bench: unknown scenario(s) {unknown}; known: {ALL_SCENARIOS}",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    engine = args.engine or "the built-in emulator, set up per scenario as each section says"
    lines = [
        "# fair-sched benchmark report",
        "",
        f"Command: `fair-sched bench --out {args.out}{' --quick' if args.quick else ''} "
        f"--scenarios {','.join(scenarios)}{f' --engine {args.engine}' if args.engine else ''}`",
        "",
        f"Engine: {engine}. Timings vary run to run: compare columns of one run.",
        "",
    ]
    if not plugin_available():
        lines += [STAND_IN_NOTE, ""]
    try:
        with terminate_as_interrupt():
            lines += asyncio.run(_http_sections(scenarios, args, out, progress))
        if "core" in scenarios:
            progress("== scenario core")
            lines += _core_section(args, out, progress)
    except KeyboardInterrupt:
        print("interrupted; stopping every child process", file=sys.stderr)
        return 130
    finally:
        kill_leftover_groups()
    (out / "index.md").write_text("\n".join(lines))
    progress(f"wrote {out / 'index.md'}")
    return 0


__all__ = ["ALL_SCENARIOS", "replica_sections", "run_bench"]
