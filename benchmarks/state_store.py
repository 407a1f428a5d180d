"""Shared state cost: store decisions per second and the latency a request gains, Redis vs memory.

    .venv/bin/python benchmarks/state_store.py [--redis-url redis://127.0.0.1:6379/0]
        [--users 10 1000] [--pairs 5000] [--requests 2000]

Without --redis-url a throw-away redis-server (no persistence) is started on a free port.

1. Decisions: U backlogged users, a one-slot in-flight cap; each pair is one `end` (which
   releases the next ticket atomically: one decision) plus one `enqueue` to keep the backlog.
   Sequential from one client, so it is the per-call latency that bounds it.
2. Added latency: one request at a time through `acquire()` + `release()`, open gate:
   FairScheduler (memory://, today) vs SharedScheduler on MemoryStore vs on RedisStore.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

from fair_sched_plugin.core import FairScheduler, InflightLimitGate, Ticket, TierLimits
from fair_sched_plugin.state import (
    MemoryStore,
    ModelPolicy,
    PolicyBook,
    SharedScheduler,
    StateStore,
)
from fair_sched_plugin.state.redis_store import RedisStore

TIERS = (TierLimits("interactive", waiting_below=3), TierLimits("batch", waiting_below=1))


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: pass --redis-url or install redis-server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", directory],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            for _ in range(500):
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), 0.1),
                ):
                    break
                time.sleep(0.01)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(5)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def decisions(store: StateStore, users: int, pairs: int) -> tuple[float, float, float]:
    """(decisions/s, p50 ms, p99 ms) of end+enqueue pairs with `users` backlogged users."""
    policy = ModelPolicy(tiers=TIERS, unknown_max_inflight=1, max_per_user=10**6, max_total=10**8)
    now = time.time()
    leases = []
    for index in range(users * 2):
        queued = await store.enqueue(
            "bench", Ticket("m", f"u{index % users}", "interactive"), policy, now
        )
        leases += [grant.lease_id for grant in queued.grants]
    latencies = []
    started = time.perf_counter()
    for index in range(pairs):
        begin = time.perf_counter()
        grants = await store.end(
            "bench", "m", leases.pop(), policy, now, tokens_used=None, abandoned=False
        )
        leases += [grant.lease_id for grant in grants]
        await store.enqueue("bench", Ticket("m", f"u{index % users}", "interactive"), policy, now)
        latencies.append(time.perf_counter() - begin)
    elapsed = time.perf_counter() - started
    return pairs / elapsed, percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3


async def request_latency(scheduler: FairScheduler | SharedScheduler, requests: int) -> list[float]:
    latencies = []
    for index in range(requests):
        begin = time.perf_counter()
        lease = await scheduler.acquire(Ticket("m", f"u{index % 10}", "interactive"))
        latencies.append(time.perf_counter() - begin)
        lease.release()
        await asyncio.sleep(0)  # let the shared scheduler's store update go out, as in service
    return latencies


def shared(store: StateStore) -> SharedScheduler:
    policies = PolicyBook(
        TIERS, {}, fairness="round_robin", stale_after_s=1.0, unknown_max_inflight=10**6,
        max_per_user=10**6, max_total=10**8, lease_ttl_s=10.0,
    )  # fmt: skip
    local = FairScheduler(TIERS, InflightLimitGate(10**6))
    return SharedScheduler(store, policies, local, heartbeat_s=1.0, lease_ttl_s=10.0)


async def main(args: argparse.Namespace, url: str) -> None:
    print("== decisions (end + enqueue pairs, sequential, one client)")
    print(f"{'store':8} {'users':>6} {'pairs/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for users in args.users:
        for name in ("memory", "redis"):
            store: StateStore = (
                MemoryStore() if name == "memory" else RedisStore(url, prefix=f"bench{users}:")
            )
            rate, p50, p99 = await decisions(store, users, args.pairs)
            await store.aclose()
            print(f"{name:8} {users:>6} {rate:>9.0f} {p50:>8.3f} {p99:>8.3f}")
    print("== acquire latency, one request at a time, open gate")
    print(f"{'scheduler':24} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}")
    candidates: list[tuple[str, FairScheduler | SharedScheduler]] = [
        ("FairScheduler (memory://)", FairScheduler(TIERS, InflightLimitGate(10**6))),
        ("Shared + MemoryStore", shared(MemoryStore())),
        ("Shared + RedisStore", shared(RedisStore(url, prefix="benchlat:"))),
    ]
    for name, scheduler in candidates:
        if isinstance(scheduler, SharedScheduler):
            scheduler.start()
        await request_latency(scheduler, 100)  # warm up (script load, connections)
        values = await request_latency(scheduler, args.requests)
        print(
            f"{name:24} "
            + " ".join(f"{percentile(values, q) * 1e3:>8.3f}" for q in (0.5, 0.95, 0.99))
        )
        if isinstance(scheduler, SharedScheduler):
            await scheduler.aclose()
        else:
            scheduler.close()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url")
    parser.add_argument("--users", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--pairs", type=int, default=5000)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    if args.redis_url:
        asyncio.run(main(args, args.redis_url))
        return
    with redis_server() as url:
        asyncio.run(main(args, url))


if __name__ == "__main__":
    cli()
