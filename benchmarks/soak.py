"""Soak: mixed traffic through the standalone fair proxy for minutes; memory must stay flat.

    python benchmarks/soak.py --minutes 10          # the documented run (not part of CI)
    python benchmarks/soak.py --minutes 2           # a quick one

~20 users (a few heavy, a few in the batch tier) send a rate-bounded mix of streamed and
non-streamed requests to the proxy (uvicorn, in this process) in front of the engine emulator (a
subprocess, so this process's RSS is the proxy's plus the load generator's). Clients disconnect
at random, mid-stream and while parked; the engine fails every Nth completion for stretches of
time and its metrics turn to garbage now and then. Every `--sample-s` seconds RSS, queued and
in-flight are recorded. At the end the traffic stops and the script checks that queues and
in-flight return to zero and that RSS is flat: the mean of the last third of the samples after
warm-up is within `--rss-tolerance` of the first third's. The curve goes to
``report/soak/soak.csv`` (and ``soak.png`` when matplotlib is importable). Exit status 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import gc
import json
import logging
import random
import statistics
import sys
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from fair_sched_plugin.lab.emulator.engine import EmulatorConfig
from fair_sched_plugin.lab.emulator.server import run_emulator_subprocess
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.runtime.service import SchedulingService

LOOPBACK = "127.0.0.1"
MODEL = "soak"
MIB = 1024 * 1024


def rss_bytes() -> int:
    gc.collect()
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclass
class Sample:
    t_s: float
    rss_mib: float
    queued: int
    in_flight: int
    gate_mode: str
    outcomes: dict[str, int]


@dataclass
class Soak:
    args: argparse.Namespace
    service: SchedulingService
    base_url: str
    engine_url: str
    rng: random.Random
    outcomes: Counter[str] = field(default_factory=Counter)
    samples: list[Sample] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    # ------------------------------------------------------------------ one request

    async def one_request(self, client: httpx.AsyncClient) -> None:
        rng = self.rng
        stream = rng.random() < 0.6
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "soak " * rng.randint(5, 200)}],
            "max_tokens": rng.randint(8, 96),
            "stream": stream,
        }
        roll = rng.random()
        if roll < 0.05:
            # Leave early, most likely while parked (or before the first byte).
            request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            if not request.done():
                request.cancel()
                self.outcomes["left_early"] += 1
            await asyncio.gather(request, return_exceptions=True)
            if not request.cancelled():
                self._count(request)
            return
        try:
            if stream:
                leave_after = rng.randint(1, 5) if roll < 0.15 else None
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        self.outcomes[f"http_{response.status_code}"] += 1
                        return
                    chunks = 0
                    async for _ in response.aiter_raw():
                        chunks += 1
                        if leave_after is not None and chunks >= leave_after:
                            self.outcomes["left_mid_stream"] += 1
                            return
                self.outcomes["ok"] += 1
            else:
                response = await client.post("/v1/chat/completions", json=body)
                key = "ok" if response.status_code == 200 else f"http_{response.status_code}"
                self.outcomes[key] += 1
        except httpx.HTTPError as exc:
            self.outcomes[f"error_{type(exc).__name__}"] += 1

    def _count(self, request: asyncio.Future[httpx.Response]) -> None:
        if request.exception() is not None:
            self.outcomes[f"error_{type(request.exception()).__name__}"] += 1
            return
        status = request.result().status_code
        self.outcomes["ok" if status == 200 else f"http_{status}"] += 1

    # ------------------------------------------------------------------ drivers

    async def traffic(self, clients: list[httpx.AsyncClient], until: float) -> None:
        """Poisson arrivals at `--rate`, users Zipf-weighted (user 0 heaviest)."""
        loop = asyncio.get_running_loop()
        weights = [1 / (rank + 1) for rank in range(len(clients))]
        while loop.time() < until:
            await asyncio.sleep(self.rng.expovariate(self.args.rate))
            if len(self.tasks) >= self.args.max_outstanding:
                self.outcomes["skipped_outstanding_cap"] += 1
                continue
            (client,) = self.rng.choices(clients, weights)
            task = asyncio.ensure_future(self.one_request(client))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            self.outcomes["sent"] += 1

    async def faults(self, until: float) -> None:
        """Engine failures in stretches: every 30 s, 10 s of failing every 5th completion; every
        60 s, 3 s of garbage metrics."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with httpx.AsyncClient(base_url=self.engine_url, trust_env=False) as admin:

            async def set_faults(**switches: Any) -> None:
                with contextlib.suppress(httpx.HTTPError):
                    await admin.post("/emulator/faults", json=switches)

            while loop.time() < until:
                elapsed = loop.time() - started
                failing = elapsed % 30 >= 20
                garbage = elapsed % 60 >= 57
                await set_faults(
                    fail_every_nth_completion=5 if failing else 0,
                    metrics_mode="garbage" if garbage else "ok",
                )
                await asyncio.sleep(min(1.0, max(0.0, until - loop.time())))
            await set_faults(fail_every_nth_completion=0, metrics_mode="ok")

    def sample(self, started: float) -> Sample:
        stats = self.service.scheduler.statistics()
        modes = {status.mode for status in self.service.gate.status()}
        sample = Sample(
            t_s=round(time.monotonic() - started, 1),
            rss_mib=round(rss_bytes() / MIB, 2),
            queued=stats.queued,
            in_flight=stats.in_flight,
            gate_mode="/".join(sorted(modes)),
            outcomes=dict(self.outcomes),
        )
        self.samples.append(sample)
        print(
            f"t={sample.t_s:7.1f}s rss={sample.rss_mib:8.2f} MiB queued={sample.queued:4d} "
            f"in_flight={sample.in_flight:3d} gate={sample.gate_mode:8s} "
            f"sent={self.outcomes['sent']} ok={self.outcomes['ok']}",
            flush=True,
        )
        return sample

    async def sampler(self, started: float, until: float) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < until:
            await asyncio.sleep(min(self.args.sample_s, max(0.0, until - loop.time())))
            self.sample(started)


# ----------------------------------------------------------------------------- setup


def proxy_config(engine_url: str, users: int) -> dict[str, Any]:
    batch_users = max(1, users // 7)
    return {
        "tiers": [
            {"name": "interactive", "waiting_below": 3, "vllm_priority": 0},
            {"name": "batch", "waiting_below": 1, "vllm_priority": 10},
        ],
        "principals": [
            {
                "name": f"u{index:02d}",
                "keys": [f"sk-soak-{index:02d}"],
                "tier": "batch" if index >= users - batch_users else "interactive",
            }
            for index in range(users)
        ],
        "backends": {MODEL: {"api_base": f"{engine_url}/v1"}},
        "queue": {"max_per_user": 50, "max_total": 2_000, "max_wait_s": 30},
        "metrics_poll_ms": 100,
        "on_metrics_unavailable": {"max_inflight": 4},
        "observability": {"admin_key": "soak-admin"},
    }


@contextlib.asynccontextmanager
async def serve(app: Any) -> Any:
    config = uvicorn.Config(
        app, host=LOOPBACK, port=0, log_level="critical", lifespan="on",
        timeout_graceful_shutdown=2,
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        for _ in range(2_000):
            if server.started or task.done():
                break
            await asyncio.sleep(0.005)
        if not server.started:
            raise RuntimeError("the proxy did not start")
        yield f"http://{LOOPBACK}:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 10)
        except asyncio.TimeoutError:
            server.force_exit = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def soak(args: argparse.Namespace) -> int:
    engine = EmulatorConfig(
        models=(MODEL,), max_num_seqs=8, base_step_ms=5.0, step_ms_per_running_seq=0.5,
        prefill_ms_per_token=0.0,
    )  # fmt: skip
    duration_s = args.minutes * 60
    out = Path(args.out)
    if args.trace_memory:
        tracemalloc.start(12)
    baseline: list[tracemalloc.Snapshot] = []

    async def memory_baseline() -> None:
        # After a third of the run: warm-up allocations (imports, pools, caches) are done.
        await asyncio.sleep(duration_s / 3)
        if args.trace_memory:
            gc.collect()
            baseline.append(tracemalloc.take_snapshot())

    async with run_emulator_subprocess(engine) as emu:
        app = build_proxy_app(proxy_config(emu.base_url, args.users))
        service: SchedulingService = app.state.fair_sched
        async with serve(app) as url, contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(
                    httpx.AsyncClient(
                        base_url=url,
                        headers={"authorization": f"Bearer sk-soak-{index:02d}"},
                        timeout=60,
                        limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
                        trust_env=False,
                    )
                )
                for index in range(args.users)
            ]
            run = Soak(args, service, url, emu.base_url, random.Random(args.seed))
            loop = asyncio.get_running_loop()
            started = time.monotonic()
            until = loop.time() + duration_s
            run.sample(started)
            await asyncio.gather(
                run.traffic(clients, until),
                run.faults(until),
                run.sampler(started, until),
                memory_baseline(),
            )
            # Drain: let what is running finish (bounded), then look for leftovers.
            drain_until = loop.time() + 60
            while run.tasks and loop.time() < drain_until:
                await asyncio.wait(set(run.tasks), timeout=1)
            stuck = len(run.tasks)
            for task in list(run.tasks):
                task.cancel()
            await asyncio.gather(*run.tasks, return_exceptions=True)
            idle_until = loop.time() + 30
            while loop.time() < idle_until:
                stats = service.scheduler.statistics()
                if stats.queued == 0 and stats.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
            final = run.sample(started)
            final_stats = service.scheduler.statistics()
            if baseline:
                gc.collect()
                print_memory_growth(baseline[0], tracemalloc.take_snapshot())
    return report(args, run, final, final_stats, stuck, out)


def print_memory_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> None:
    """Where the traced Python heap grew between the two snapshots (largest first)."""
    ignored = [
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
        tracemalloc.Filter(False, "<unknown>"),
    ]
    before, after = before.filter_traces(ignored), after.filter_traces(ignored)
    by_line = after.compare_to(before, "lineno")
    total = sum(stat.size_diff for stat in by_line)
    print(f"\ntraced heap growth after the first third of the run: {total / 1024:+.1f} KiB")
    for stat in by_line[:12]:
        print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  {stat.traceback}")
    print("largest growth by call stack:")
    for stat in after.compare_to(before, "traceback")[:3]:
        print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks")
        for line in stat.traceback.format(limit=8, most_recent_first=True):
            print(f"      {line}")


def report(
    args: argparse.Namespace,
    run: Soak,
    final: Sample,
    final_stats: Any,
    stuck: int,
    out: Path,
) -> int:
    warm_up_s = max(30.0, 0.2 * args.minutes * 60)
    steady = [s for s in run.samples[:-1] if s.t_s >= warm_up_s]
    third = max(1, len(steady) // 3)
    first_mean = statistics.fmean(s.rss_mib for s in steady[:third]) if steady else float("nan")
    last_mean = statistics.fmean(s.rss_mib for s in steady[-third:]) if steady else float("nan")
    drift = (last_mean - first_mean) / first_mean if steady else float("nan")

    csv_path = out / "soak.csv"
    with csv_path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["t_s", "rss_mib", "queued", "in_flight", "gate_mode", "sent", "ok"])
        for s in run.samples:
            writer.writerow(
                [s.t_s, s.rss_mib, s.queued, s.in_flight, s.gate_mode,
                 s.outcomes.get("sent", 0), s.outcomes.get("ok", 0)]
            )  # fmt: skip
    plotted = plot(run.samples, warm_up_s, out / "soak.png")

    checks = {
        "queued returns to 0": final.queued == 0,
        "in_flight returns to 0": final.in_flight == 0,
        "no client task stuck after the drain": stuck == 0,
        f"RSS flat (last third within {args.rss_tolerance:.0%} of first third)": (
            len(steady) >= 3 and abs(drift) <= args.rss_tolerance
        ),
        "traffic was served": run.outcomes["ok"] > 0,
    }
    summary = {
        "minutes": args.minutes,
        "users": args.users,
        "rate_per_s": args.rate,
        "outcomes": dict(sorted(run.outcomes.items())),
        "scheduler": {
            "released": final_stats.released_total,
            "completed": final_stats.completed_total,
            "cancelled_while_parked": final_stats.cancelled_total,
            "abandoned": final_stats.abandoned_total,
            "rejected_full": final_stats.rejected_full_total,
            "timed_out": final_stats.timed_out_total,
        },
        "rss_mib": {
            "warm_up_s": warm_up_s,
            "first_third_mean": round(first_mean, 2),
            "last_third_mean": round(last_mean, 2),
            "drift": round(drift, 4),
            "min": min(s.rss_mib for s in run.samples),
            "max": max(s.rss_mib for s in run.samples),
        },
        "checks": checks,
        "files": [str(csv_path)] + ([str(out / "soak.png")] if plotted else []),
    }
    (out / "soak.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=2))
    failed = [name for name, passed in checks.items() if not passed]
    if failed:
        print(f"SOAK FAILED: {failed}", file=sys.stderr)
        return 1
    print("soak passed")
    return 0


def plot(samples: list[Sample], warm_up_s: float, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (rss_axis, queue_axis) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    times = [s.t_s for s in samples]
    rss_axis.plot(times, [s.rss_mib for s in samples], marker="o")
    rss_axis.axvline(warm_up_s, color="grey", linestyle="--", label="end of warm-up")
    rss_axis.set_ylabel("RSS (MiB)")
    rss_axis.legend()
    queue_axis.plot(times, [s.queued for s in samples], label="queued")
    queue_axis.plot(times, [s.in_flight for s in samples], label="in flight")
    queue_axis.set_xlabel("time (s)")
    queue_axis.legend()
    figure.suptitle("fair-sched soak: proxy + load generator")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--rate", type=float, default=12.0, help="requests per second")
    parser.add_argument("--max-outstanding", type=int, default=300)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="report/soak")
    parser.add_argument(
        "--trace-memory",
        action="store_true",
        help="trace the Python heap (slower) and print where it grew after the first third",
    )
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The engine's injected failures and the clients' disconnects are expected here.
    logging.getLogger("fair_sched").setLevel(logging.ERROR)
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
