"""`fair-sched bench --target URL ...`: the fairness scenarios against endpoints we do not start.

Each scenario is a trace (synthetic, from :mod:`.trace`, or the user's own with ``--trace``);
each target replays it in turn (never two at once), after the plan has been printed. The report
(``results.json``, ``report.md``, ``index.html`` and PNGs) reads without this code.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .fairness import fairness_summary, service_over_time
from .replay import (
    Identity,
    Limits,
    OpenTarget,
    Plan,
    PlanError,
    ReplayRecord,
    ReplayRun,
    errors_by_status,
    make_plan,
    replay,
    users_in_order,
)
from .report import Progress, markdown_table
from .trace import SHAPES, TraceError, TraceRequest, TraceShape, make_trace, read_trace

DEFAULT_SCENARIOS = ("flood", "zipf", "burst")
TRACE_SCENARIO = "trace"


@dataclass(frozen=True)
class Scenario:
    name: str
    trace: list[TraceRequest]
    description: str


@dataclass
class Measured:
    target: OpenTarget
    scenario: Scenario
    run: ReplayRun
    summary: dict[str, Any]


# ----------------------------------------------------------------------------- arguments


def parse_targets(values: Sequence[str]) -> list[tuple[str, str]]:
    """`URL` or `NAME=URL`, each a base URL ending in /v1 (added if missing)."""
    targets: list[tuple[str, str]] = []
    for index, value in enumerate(values):
        name, sep, url = value.partition("=")
        if not sep or "://" in name:
            name, url = (f"target{index + 1}" if len(values) > 1 else "target"), value
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--target {value!r}: the URL must start with http:// or https://")
        if not url.endswith("/v1"):
            url += "/v1"
        if any(name == other for other, _ in targets):
            raise ValueError(f"--target {value!r}: the name {name!r} is used twice")
        targets.append((name, url))
    return targets


def _split_keys(text: str) -> tuple[str, ...]:
    return tuple(key.strip() for key in text.split(",") if key.strip())


def parse_keys(
    values: Sequence[str], target_names: Sequence[str]
) -> dict[str | None, tuple[str, ...]]:
    """`K1,K2` for every target, or `NAME=K1,K2` for one (None: the default)."""
    keys: dict[str | None, tuple[str, ...]] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if sep and name in target_names:
            keys[name] = _split_keys(rest)
        else:
            keys[None] = _split_keys(value)
    return keys


def parse_tier_keys(values: Sequence[str]) -> dict[str, tuple[str, ...]]:
    tiers = {}
    for value in values:
        tier, sep, rest = value.partition("=")
        if not sep or not tier:
            raise ValueError(f"--tier-keys {value!r}: expected TIER=K1,K2")
        tiers[tier] = _split_keys(rest)
    return tiers


def build_targets(args: argparse.Namespace) -> list[OpenTarget]:
    named = parse_targets(args.target)
    keys = parse_keys(args.keys or [], [name for name, _ in named])
    tier_keys = parse_tier_keys(args.tier_keys or [])
    return [
        OpenTarget(
            name,
            url,
            Identity(
                keys=keys.get(name, keys.get(None, ())),
                tier_keys=tier_keys,
                user_field=not args.no_user_field,
                user_header=args.user_header,
            ),
        )
        for name, url in named
    ]


def scenario_shapes(args: argparse.Namespace, names: Sequence[str]) -> list[TraceShape]:
    quick = args.quick
    requests = args.requests or (40 if quick else 200)
    users = args.users or (4 if quick else 10)
    tokens = args.max_tokens_per_request or (32 if quick else 64)
    duration = args.duration or (6.0 if quick else 20.0)
    base = TraceShape(
        requests=requests,
        users=users,
        max_tokens=tokens,
        prompt_tokens=args.prompt_tokens,
        duration_s=duration,
        prefix_tokens=300 if quick else 1500,
        idle_s=2.0 if quick else 5.0,
        seed=args.seed,
    )
    return [replace(base, shape=name, users=max(users, 2)) for name in names]


_DESCRIPTIONS = {
    "flood": "the heavy user sends most requests at once; light users send theirs one at a time "
    "from 1 s on",
    "zipf": "users' request counts Zipf-shaped (s = {zipf_s}), arrivals uniform, 1/4, 1/2 or all "
    "of max_tokens",
    "tiers": "batch users (tier `batch`) send 70% of the requests at once; interactive users come "
    "and go",
    "prefix": "each user has its own ~{prefix_tokens}-token system prompt and asks short questions",
    "burst": "one request per user, {idle_s:g} s of quiet, then everyone at once (the heavy user "
    "half of it)",
}


def build_scenarios(args: argparse.Namespace) -> list[Scenario]:
    names = [name.strip() for name in (args.scenarios or "").split(",") if name.strip()]
    if not names and not args.trace:
        names = list(DEFAULT_SCENARIOS)
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown} with --target; known: {SHAPES}")
    scenarios = []
    for shape in scenario_shapes(args, names):
        trace = make_trace(shape)
        text = _DESCRIPTIONS[shape.shape].format(**shape.__dict__)
        size = f"{len(trace)} requests, {shape.users} users, max_tokens {shape.max_tokens}"
        scenarios.append(Scenario(shape.shape, trace, f"{size}: {text}."))
    if args.trace:
        trace = read_trace(args.trace)
        scenarios.append(
            Scenario(
                TRACE_SCENARIO,
                trace,
                f"{len(trace)} requests of {len({r.user for r in trace})} users replayed from "
                f"`{Path(args.trace).name}` at {args.speed:g}x speed.",
            )
        )
    return scenarios


# ----------------------------------------------------------------------------- measuring


def heavy_users(scenario: Scenario) -> set[str]:
    """Tier `batch` where the trace has tiers, else the user with the most requests."""
    batch = {r.user for r in scenario.trace if r.tier == "batch"}
    return batch or {users_in_order(scenario.trace)[0]}


def summarize(target: OpenTarget, scenario: Scenario, run: ReplayRun) -> dict[str, Any]:
    records = run.records
    ok = [r for r in records if not r.error]
    ends = [r.ended for r in records if r.ended is not None]
    starts = [r.started for r in records]
    makespan = (max(ends) - min(starts)) if ends and starts else 0.0
    tokens = sum(r.tokens for r in records)
    tiers = {r.user: r.tier or "" for r in scenario.trace}
    interval = max(0.25, makespan / 40) if makespan else 1.0
    service: dict[str, int] = {}
    for record in records:
        service[record.user] = service.get(record.user, 0) + record.tokens
    return {
        "target": target.name,
        "url": target.base_url,
        "scenario": scenario.name,
        "requests_planned": len(scenario.trace),
        "requests_sent": len(records),
        "requests_ok": len(ok),
        "errors": len(records) - len(ok),
        "errors_by_status": errors_by_status(records),
        "stopped": run.stopped,
        "tokens": tokens,
        "makespan_s": makespan,
        "tokens_per_s": tokens / makespan if makespan else 0.0,
        **fairness_summary(
            records,
            heavy_users=heavy_users(scenario),
            largest_request_tokens=max(r.max_tokens for r in scenario.trace),
            interval_s=interval,
            classes=tiers if any(tiers.values()) else None,
        ),
        "service_tokens_by_user": dict(sorted(service.items())),
        "service_over_time": _service_samples(records, makespan),
    }


def _service_samples(records: Sequence[ReplayRecord], makespan: float) -> dict[str, Any]:
    """Each user's cumulative streamed tokens at 40 points in time (what the plots draw)."""
    times, curves = service_over_time(records, max(makespan, 0.001) / 40)
    return {"t_s": [round(t, 3) for t in times], "tokens_by_user": curves}


async def measure(
    targets: Sequence[OpenTarget],
    scenarios: Sequence[Scenario],
    plans: Mapping[str, Plan],
    *,
    model: str,
    ignore_eos: bool,
    request_timeout_s: float,
    progress: Progress,
) -> list[Measured]:
    """Every scenario against every target, one at a time."""
    measured = []
    for scenario in scenarios:
        for target in targets:
            progress(f"[{target.name}] {scenario.name}: {len(scenario.trace)} requests ...")
            run = await replay(
                target,
                scenario.trace,
                plans[scenario.name],
                model=model,
                ignore_eos=ignore_eos,
                request_timeout_s=request_timeout_s,
                progress=progress,
            )
            summary = summarize(target, scenario, run)
            progress(
                f"[{target.name}] {scenario.name}: {summary['requests_ok']} ok, "
                f"{summary['errors']} errors, Jain {_fmt(summary['jain_index'], '{:.3f}')}, "
                f"gap {summary['max_service_gap_tokens']:.0f} tokens "
                f"(bound {summary['vtc_bound_tokens']})"
            )
            measured.append(Measured(target, scenario, run, summary))
    return measured


# ----------------------------------------------------------------------------- report


def _fmt(value: Any, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


ROWS: tuple[tuple[str, str, str], ...] = (
    ("light TTFT p50 (s)", "light_ttft_p50_s", "{:.2f}"),
    ("heavy TTFT p50 (s)", "heavy_ttft_p50_s", "{:.2f}"),
    ("light / heavy TTFT p50", "light_heavy_ttft_ratio", "{:.2f}"),
    ("Jain's index (while backlogged)", "jain_index", "{:.3f}"),
    ("max service gap (tokens)", "max_service_gap_tokens", "{:,.0f}"),
    ("VTC bound (2 x largest request)", "vtc_bound_tokens", "{:,.0f}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("requests ok / sent", "", ""),
    ("errors", "errors", "{:,.0f}"),
)


def _table_rows(cells: Sequence[Measured]) -> list[list[str]]:
    rows = []
    for label, key, fmt in ROWS:
        if not key:
            rows.append(
                [
                    label,
                    *(f"{m.summary['requests_ok']} / {m.summary['requests_sent']}" for m in cells),
                ]
            )
        else:
            rows.append([label, *(_fmt(m.summary.get(key), fmt) for m in cells)])
    return rows


def _errors_line(cells: Sequence[Measured]) -> str:
    parts = []
    for m in cells:
        errors = m.summary["errors_by_status"]
        if errors or m.summary["stopped"]:
            detail = ", ".join(f"{status}: {n}" for status, n in errors.items()) or "none"
            stop = f"; stopped: {m.summary['stopped']}" if m.summary["stopped"] else ""
            parts.append(f"{m.target.name}: {detail}{stop}")
    return "Errors by status: " + "; ".join(parts) if parts else ""


def write_report(
    measured: Sequence[Measured],
    scenarios: Sequence[Scenario],
    plans: Mapping[str, Plan],
    out: Path,
    command: str,
    model: str,
) -> list[Path]:
    """results.json, records-*.jsonl, report.md, index.html and (with matplotlib) PNGs."""
    out.mkdir(parents=True, exist_ok=True)
    targets = list(dict.fromkeys(m.target.name for m in measured))
    results: dict[str, Any] = {
        "command": command,
        "model": model,
        "plans": {name: plan.to_json() for name, plan in plans.items()},
        "targets": {
            name: {"url": next(m.target.base_url for m in measured if m.target.name == name)}
            for name in targets
        },
    }
    for m in measured:
        results["targets"][m.target.name][m.scenario.name] = m.summary
        with (out / f"records-{m.target.name}-{m.scenario.name}.jsonl").open("w") as file:
            for record in m.run.records:
                file.write(json.dumps(record.to_json()) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    pictures = _plots(measured, scenarios, out)
    md = [
        "# Fairness report",
        "",
        f"Command: `{command}`",
        "",
        f"Model `{model}`; targets: "
        + ", ".join(f"**{name}** ({results['targets'][name]['url']})" for name in targets)
        + ". Each scenario was replayed against one target at a time.",
        "",
        "How to read it: *backlogged* = has a request sent and not yet started (no first token); "
        "a request's *service* is its output tokens, counted when its first token arrives. "
        "Jain's index: of the service of users backlogged throughout an interval (1 = equal); "
        "service gap: the largest difference in service two users of the same tier got over a "
        "time both were backlogged, next to VTC's bound (2 x the largest request's tokens). "
        "Light / heavy: the heavy user is the one with the most requests (or tier `batch`).",
        "",
    ]
    page = [
        "<!doctype html><meta charset='utf-8'><title>Fairness report</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;"
        "text-align:right}td:first-child{text-align:left}img{max-width:100%}</style>",
        "<h1>Fairness report</h1>",
        f"<p>Command: <code>{html.escape(command)}</code></p>",
        f"<p>{html.escape(md[4])}</p><p>{html.escape(md[6])}</p>",
    ]
    if "comparison" in pictures:
        md += ["![comparison](comparison.png)", ""]
        page.append("<img src='comparison.png' alt='comparison'>")
    for scenario in scenarios:
        cells = [m for m in measured if m.scenario.name == scenario.name]
        header = ["", *(m.target.name for m in cells)]
        rows = _table_rows(cells)
        errors = _errors_line(cells)
        md += [
            f"## {scenario.name}",
            "",
            scenario.description,
            f"Plan: {plans[scenario.name].describe()}.",
            "",
            markdown_table(header, rows),
            "",
            *([errors, ""] if errors else []),
        ]
        page += [
            f"<h2>{html.escape(scenario.name)}</h2>",
            f"<p>{html.escape(scenario.description)}<br>Plan: "
            f"{html.escape(plans[scenario.name].describe())}.</p>",
            "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>",
            *(
                "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                for row in rows
            ),
            "</table>",
            *([f"<p>{html.escape(errors)}</p>"] if errors else []),
        ]
        for m in cells:
            name = f"service-{m.target.name}-{scenario.name}"
            if name in pictures:
                md += [f"![{name}]({name}.png)", ""]
                page.append(f"<img src='{name}.png' alt='{html.escape(name)}'>")
    (out / "report.md").write_text("\n".join(md))
    (out / "index.html").write_text("\n".join(page) + "\n")
    return [out / "results.json", out / "report.md", out / "index.html"]


def _plots(measured: Sequence[Measured], scenarios: Sequence[Scenario], out: Path) -> set[str]:
    try:
        from .plots import plot_fairness_comparison, plot_service_curves
    except ImportError:
        print("matplotlib is not installed: no plots (pip install '.[bench]')", file=sys.stderr)
        return set()
    made = set()
    for m in measured:
        name = f"service-{m.target.name}-{m.scenario.name}"
        makespan = m.summary["makespan_s"] or 1.0
        times, curves = service_over_time(m.run.records, max(0.05, makespan / 200))
        plot_service_curves(
            times,
            curves,
            heavy_users(m.scenario),
            f"{m.target.name}, {m.scenario.name}: tokens streamed per user",
            out / f"{name}.png",
        )
        made.add(name)
    plot_fairness_comparison(
        [(m.target.name, m.scenario.name, m.summary) for m in measured], out / "comparison.png"
    )
    made.add("comparison")
    return made


# ----------------------------------------------------------------------------- the command


def limits_from(args: argparse.Namespace) -> Limits:
    return Limits(
        max_requests=args.max_requests,
        max_output_tokens=args.max_total_tokens,
        max_duration_s=args.max_duration,
        concurrency=args.concurrency,
        stop_after_errors=args.stop_after_errors,
        request_timeout_s=args.request_timeout,
    )


def run_open_bench(args: argparse.Namespace) -> int:
    progress = Progress()
    try:
        if not args.target:
            raise ValueError("--trace needs at least one --target")
        if not args.model:
            raise ValueError("--target needs --model (the model name the target serves)")
        targets = build_targets(args)
        scenarios = build_scenarios(args)
        limits = limits_from(args)
        plans = {
            s.name: make_plan(s.trace, limits, args.speed if s.name == TRACE_SCENARIO else 1.0)
            for s in scenarios
        }
    except (ValueError, TraceError, PlanError) as exc:
        print(f"fair-sched bench: {exc}", file=sys.stderr)
        return 2
    print("Plan (per target; nothing else is sent, no /metrics is read):")
    for scenario in scenarios:
        print(f"  {scenario.name}: {plans[scenario.name].describe()}")
    total_requests = sum(p.requests for p in plans.values()) * len(targets)
    total_tokens = sum(p.output_tokens for p in plans.values()) * len(targets)
    bound = sum(p.duration_bound_s for p in plans.values()) * len(targets)
    print(
        f"  in all: {len(targets)} target(s) x {len(scenarios)} scenario(s) = {total_requests} "
        f"requests, <= {total_tokens:,} output tokens, <= {bound:.0f} s",
        flush=True,
    )
    if args.dry_run:
        return 0
    try:
        measured = asyncio.run(
            measure(
                targets,
                scenarios,
                plans,
                model=args.model,
                ignore_eos=not args.no_ignore_eos,
                request_timeout_s=args.request_timeout,
                progress=progress,
            )
        )
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    command = "fair-sched " + " ".join(_redacted(sys.argv[1:]))
    write_report(measured, scenarios, plans, Path(args.out), command, args.model)
    progress(f"wrote {args.out}/results.json, report.md, index.html")
    return 1 if any(m.run.stopped for m in measured) else 0


def _redacted(argv: Sequence[str]) -> list[str]:
    """The command line without keys (a shared report never carries them)."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append("…")
            hide = False
        elif arg in ("--keys", "--tier-keys"):
            out.append(arg)
            hide = True
        elif arg.startswith(("--keys=", "--tier-keys=")):
            out.append(arg.split("=", 1)[0] + "=…")
        else:
            out.append(arg)
    return out


def add_open_arguments(bench: argparse.ArgumentParser) -> None:
    """The options of `fair-sched bench --target ...` (measuring a stack we do not start)."""
    group = bench.add_argument_group(
        "measure your own stack (--target)",
        "Replays the scenarios (flood, zipf, tiers, prefix, burst; default flood,zipf,burst) "
        "and/or a --trace against OpenAI-compatible endpoints the bench does not start, one at "
        "a time. "
        "Users: one synthetic user per key (the heavy user gets the first key); with fewer keys "
        "than users, keys are shared round-robin, so a gateway that tells users apart by key "
        "needs one key per user. Every request also carries the user's name in the body's "
        "`user` field (--no-user-field to omit), and, with --user-header NAME, in that header: "
        "one key may then stand for all users where the gateway identifies users that way "
        "(fair-sched: identity.source body_user or header). The plan is printed first and never "
        "exceeded; nothing but the planned requests is sent.",
    )
    group.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="an OpenAI-compatible base URL (…/v1); repeat to compare targets side by side",
    )
    group.add_argument(
        "--keys",
        action="append",
        default=[],
        metavar="[NAME=]K1,K2",
        help="API keys, one per synthetic user (first = heavy); NAME= for one target only",
    )
    group.add_argument(
        "--tier-keys",
        action="append",
        default=[],
        metavar="TIER=K1,K2",
        help="keys for the users of one tier (the tiers scenario, or a trace's `tier`)",
    )
    group.add_argument("--model", default=None, help="the model name to ask for")
    group.add_argument(
        "--trace", default=None, help="a JSONL trace to replay (fair-sched make-trace)"
    )
    group.add_argument("--speed", type=float, default=1.0, help="trace replay speed (2 = twice)")
    group.add_argument("--requests", type=int, default=None, help="requests per scenario (200)")
    group.add_argument("--users", type=int, default=None, help="users per scenario (10)")
    group.add_argument(
        "--max-tokens-per-request", type=int, default=None, help="output tokens per request (64)"
    )
    group.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per request")
    group.add_argument("--duration", type=float, default=None, help="arrival span, s (20)")
    group.add_argument("--seed", type=int, default=7)
    group.add_argument("--concurrency", type=int, default=256, help="requests in flight, at most")
    group.add_argument("--max-requests", type=int, default=5000, help="refuse larger scenarios")
    group.add_argument(
        "--max-total-tokens", type=int, default=1_000_000, help="refuse scenarios asking more"
    )
    group.add_argument(
        "--max-duration", type=float, default=1800, help="stop a scenario after this many s"
    )
    group.add_argument(
        "--stop-after-errors", type=int, default=10, help="stop after N consecutive failures"
    )
    group.add_argument("--request-timeout", type=float, default=120, help="seconds per request")
    group.add_argument("--no-user-field", action="store_true", help="do not send `user`")
    group.add_argument("--user-header", default=None, help="also send the user in this header")
    group.add_argument(
        "--no-ignore-eos", action="store_true", help="do not send ignore_eos (non-vLLM servers)"
    )
    group.add_argument("--dry-run", action="store_true", help="print the plan, send nothing")


__all__ = [
    "DEFAULT_SCENARIOS",
    "Measured",
    "Scenario",
    "add_open_arguments",
    "build_scenarios",
    "build_targets",
    "measure",
    "run_open_bench",
    "summarize",
    "write_report",
]
