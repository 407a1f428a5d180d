"""The shared decision's cost: the latency a request gains when another replica decides.

    .venv/bin/python benchmarks/state_store.py [--redis-url redis://127.0.0.1:6379/0]
        [--requests 2000]

Without --redis-url a throw-away redis-server (no persistence) is started on a free port.

One request at a time through `acquire()` + `release()`, open gate, 10 users:

- the core alone (`FairScheduler.acquire()`, no replica layer), for reference;
- `memory://`: the replica is its own leader (the core decides in-process);
- `redis://` leader: a request entering at the replica that leads (still in-process);
- `redis://` follower: a request entering at another replica: ticket to the leader's inbox,
  its decision, the grant back through Redis (two round trips and the leader's turn).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from fair_sched_plugin.core import InflightLimitGate, Ticket
from fair_sched_plugin.lab.harness.redis_store import TIERS, percentile, redis_server
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.state import ReplicaScheduler, open_state


def core() -> FairScheduler:
    return FairScheduler(TIERS, InflightLimitGate(10**6), max_per_user=10**6, max_total=10**8)


async def request_latency(replica: ReplicaScheduler | FairScheduler, requests: int) -> list[float]:
    latencies = []
    for index in range(requests):
        begin = time.perf_counter()
        lease = await replica.acquire(Ticket("m", f"u{index % 10}", "interactive"))
        latencies.append(time.perf_counter() - begin)
        lease.release()
        await asyncio.sleep(0)  # let the end go out, as in the service
    return latencies


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise SystemExit("no leader elected within 10 s")


async def main(args: argparse.Namespace, url: str) -> None:
    memory = open_state("memory://", core())
    options = {"prefix": "bench:", "heartbeat_s": 0.5, "lease_ttl_s": 5.0}
    leader = open_state(url, core(), replica="bench-leader", **options)  # type: ignore[arg-type]
    leader.start()
    await until(lambda: leader.leading)
    follower = open_state(url, core(), replica="bench-follower", **options)  # type: ignore[arg-type]
    follower.start()
    await until(lambda: follower.state_statistics().leader == leader.replica)
    print(f"== acquire latency, one request at a time, open gate, {args.requests} requests")
    print(f"{'scheduler':28} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}")
    results = {}
    candidates: tuple[tuple[str, ReplicaScheduler | FairScheduler], ...] = (
        ("FairScheduler alone", core()),
        ("memory://", memory),
        ("redis:// at the leader", leader),
        ("redis:// at a follower", follower),
    )
    for name, replica in candidates:
        await request_latency(replica, 100)  # warm up (scripts, connections)
        values = await request_latency(replica, args.requests)
        results[name] = values
        print(
            f"{name:28} "
            + " ".join(f"{percentile(values, q) * 1e3:>8.3f}" for q in (0.5, 0.95, 0.99))
        )
    base = results["memory://"]
    shared = results["redis:// at a follower"]
    print(
        "shared decision's added latency (follower - memory): "
        f"p50 {(percentile(shared, 0.5) - percentile(base, 0.5)) * 1e3:.3f} ms, "
        f"p99 {(percentile(shared, 0.99) - percentile(base, 0.99)) * 1e3:.3f} ms"
    )
    for replica in (follower, leader, memory):
        await replica.aclose()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url")
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    if args.redis_url:
        asyncio.run(main(args, args.redis_url))
        return
    with redis_server() as url:
        asyncio.run(main(args, url))


if __name__ == "__main__":
    cli()
