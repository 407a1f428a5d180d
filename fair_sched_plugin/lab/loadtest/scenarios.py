"""The other `fair-sched bench` scenarios (docs/results.md): tiers, many users, overhead, core
decisions."""

from __future__ import annotations

import asyncio
import functools
import heapq
import importlib.util
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core import FairnessPolicy, InflightLimitGate, Lease, Ticket, TierLimits
from ...runtime.driver import FairScheduler
from .client import Caller, RequestRecord, make_client, stream_one
from .flood import FloodSize, Target, Variant, callers_for
from .processes import group_cpu_seconds
from .stats import jain_index, percentile

Progress = Callable[[str], None]

# ----------------------------------------------------------------------------- tiers


@dataclass(frozen=True)
class TiersSize:
    batch_concurrency: int = 12
    batch_alone_s: float = 6.0
    mixed_s: float = 12.0
    interactive_every_s: float = 1.5
    max_tokens: int = 48


async def _batch_worker(
    target: Target,
    caller: Caller,
    size: TiersSize,
    clock_zero: float,
    stop_at: float,
    records: list[RequestRecord],
    client: Any,
) -> None:
    # A closed loop: one request after another until the deadline (bounded in time and count).
    for _ in range(10_000):
        if time.perf_counter() - clock_zero >= stop_at:
            return
        records.append(
            await stream_one(client, target.base_url, caller, size.max_tokens, clock_zero)
        )


async def play_tiers(target: Target, size: TiersSize, progress: Progress) -> dict[str, Any]:
    """A batch user keeps the engine busy; interactive users come and go.

    Reports interactive TTFT on an idle engine and while batch runs, and the batch user's
    throughput while no interactive request is around (the first phase).
    """
    power, light = callers_for(target.variant, FloodSize(1, size.max_tokens))
    batch_caller = Caller("power", "batch", power[0].api_key)
    async with make_client(connections=size.batch_concurrency + 8) as client:
        clock_zero = time.perf_counter()
        idle = [
            await stream_one(client, target.base_url, light[i % 2], size.max_tokens, clock_zero)
            for i in range(3)
        ]
        progress(f"[tiers/{target.variant.name}] idle-engine TTFT measured; batch load starts")
        batch: list[RequestRecord] = []
        clock_zero = time.perf_counter()
        end_at = size.batch_alone_s + size.mixed_s
        workers = [
            asyncio.ensure_future(
                _batch_worker(target, batch_caller, size, clock_zero, end_at, batch, client)
            )
            for _ in range(size.batch_concurrency)
        ]
        await asyncio.sleep(size.batch_alone_s)
        interactive = []
        arrivals = int(size.mixed_s / size.interactive_every_s)
        for index in range(arrivals):
            started = time.perf_counter()
            interactive.append(
                await stream_one(
                    client, target.base_url, light[index % 2], size.max_tokens, clock_zero
                )
            )
            await asyncio.sleep(
                max(0.0, size.interactive_every_s - (time.perf_counter() - started))
            )
        await asyncio.gather(*workers)
    batch_alone_tokens = sum(r.tokens for r in batch if r.ended and r.ended <= size.batch_alone_s)
    result = {
        "idle_ttft_p50": percentile([r.ttft for r in idle if r.ttft is not None], 50),
        "interactive_ttft_p50": percentile([r.ttft for r in interactive if r.ttft is not None], 50),
        "interactive_ttft_p95": percentile([r.ttft for r in interactive if r.ttft is not None], 95),
        "interactive_requests": len(interactive),
        "batch_alone_tps": batch_alone_tokens / size.batch_alone_s,
        "batch_total_tokens": sum(r.tokens for r in batch),
        "errors": sum(1 for r in [*idle, *interactive, *batch] if r.error),
    }
    progress(f"[tiers/{target.variant.name}] done: {result}")
    return result


# ----------------------------------------------------------------------------- overhead


async def play_overhead(
    target: Target, requests: int, max_tokens: int, progress: Progress
) -> dict[str, Any]:
    """One request at a time; end-to-end latency and the gateway's CPU per 1,000 tokens."""
    _, light = callers_for(target.variant, FloodSize(1, max_tokens))
    records = []
    async with make_client(connections=4) as client:
        # One warm-up request: the first one through LiteLLM pays for lazy imports.
        await stream_one(client, target.base_url, light[0], max_tokens, time.perf_counter())
        cpu_before = group_cpu_seconds(target.gateway_pid) if target.gateway_pid else 0.0
        for _ in range(requests):
            records.append(
                await stream_one(client, target.base_url, light[0], max_tokens, time.perf_counter())
            )
        cpu_after = group_cpu_seconds(target.gateway_pid) if target.gateway_pid else 0.0
    tokens = sum(r.tokens for r in records)
    result = {
        "e2e_p50": percentile([r.e2e for r in records if r.e2e is not None], 50),
        "ttft_p50": percentile([r.ttft for r in records if r.ttft is not None], 50),
        "cpu_s_per_1000_tokens": (cpu_after - cpu_before) * 1000 / tokens if tokens else None,
        "tokens": tokens,
        "errors": sum(1 for r in records if r.error),
    }
    progress(f"[overhead/{target.variant.name}] {requests} sequential requests: {result}")
    return result


# ----------------------------------------------------------------------------- many users


@dataclass(frozen=True)
class ManyUsersSize:
    users: int = 1000
    requests: int = 20_000
    zipf_s: float = 1.1
    slots: int = 8
    # Served capacity in tokens: less than the demand, so that fairness decides who gets it.
    capacity_fraction: float = 0.4
    seed: int = 7


def _zipf_demands(size: ManyUsersSize, rng: random.Random) -> list[list[int]]:
    """Each user's requests (output tokens each), user i's share of requests ∝ 1/(i+1)^s."""
    weights = [1 / (rank + 1) ** size.zipf_s for rank in range(size.users)]
    owners = rng.choices(range(size.users), weights=weights, k=size.requests)
    demands: list[list[int]] = [[] for _ in range(size.users)]
    for owner in owners:
        # Mixed lengths make request-fair and token-fair differ.
        demands[owner].append(rng.choice((16, 64, 256)))
    return demands


def _user_weight(user: int) -> float:
    # Every tenth user pays for double weight: what `weighted` should honour.
    return 2.0 if user % 10 == 0 else 1.0


def _max_min_shares(
    demands: Sequence[int], weights: Sequence[float], capacity: float
) -> list[float]:
    """Weighted water-filling: each user's fair share of `capacity` given its demand."""
    shares = [0.0] * len(demands)
    active = {u for u, d in enumerate(demands) if d > 0}
    left = capacity
    while active and left > 1e-9:
        level = left / sum(weights[u] for u in active)
        capped = {u for u in active if demands[u] - shares[u] <= level * weights[u]}
        if not capped:
            for u in active:
                shares[u] += level * weights[u]
            break
        for u in capped:
            left -= demands[u] - shares[u]
            shares[u] = demands[u]
        active -= capped
    return shares


async def _simulate_policy(
    policy: FairnessPolicy | None, demands: list[list[int]], size: ManyUsersSize, rng: random.Random
) -> list[int]:
    """Served tokens per user when the engine's capacity runs out; None = engine FIFO."""
    order = [(user, tokens) for user, requests in enumerate(demands) for tokens in requests]
    rng.shuffle(order)  # arrival order: everybody's requests interleaved at random
    capacity = size.capacity_fraction * sum(tokens for _, tokens in order)
    served = [0] * size.users
    if policy is None:
        used = 0.0
        for user, tokens in order:
            if used >= capacity:
                break
            served[user] += tokens
            used += tokens
        return served
    scheduler = FairScheduler(
        (TierLimits("interactive"),),
        InflightLimitGate(size.slots),
        fairness=policy,
        max_per_user=size.requests,
        max_total=size.requests,
        max_wait_s=3600,
    )
    running: list[tuple[float, int, Lease, int]] = []  # (finish time, seq, lease, tokens)
    sequence = 0

    def on_granted(user: int, tokens: int, future: asyncio.Future[Lease]) -> None:
        nonlocal sequence
        if future.cancelled() or future.exception():
            return
        sequence += 1
        heapq.heappush(running, (now + tokens, sequence, future.result(), tokens))
        served[user] += tokens

    now = 0.0
    waiters = []
    for user, cost in order:
        ticket = Ticket("m", f"u{user}", "interactive", _user_weight(user), cost=cost)
        task = asyncio.ensure_future(scheduler.acquire(ticket))
        task.add_done_callback(functools.partial(on_granted, user, cost))
        waiters.append(task)
    await asyncio.sleep(0)
    used = 0.0
    # Each slot decodes one token per time unit; a lease ends when its tokens are done.
    for _ in range(size.requests):
        await _let_grants_land(running, size.slots)
        if not running or used >= capacity:
            break
        now, _, lease, tokens = heapq.heappop(running)
        used += tokens
        lease.release(tokens_used=tokens)
    scheduler.close()
    await asyncio.gather(*waiters, return_exceptions=True)
    return served


async def _let_grants_land(running: list[Any], slots: int) -> None:
    # A granted waiter's task and its done-callback each need a loop iteration.
    for _ in range(8):
        if len(running) >= slots:
            return
        await asyncio.sleep(0)


async def play_many_users(size: ManyUsersSize, progress: Progress) -> dict[str, Any]:
    """Jain's index of served tokens normalised by each user's max-min fair share, per policy."""
    demands = _zipf_demands(size, random.Random(size.seed))
    totals = [sum(requests) for requests in demands]
    capacity = size.capacity_fraction * sum(totals)
    results: dict[str, Any] = {}
    policies: tuple[FairnessPolicy | None, ...] = (None, "round_robin", "weighted", "tokens")
    for policy in policies:
        name = policy or "engine FIFO"
        started = time.perf_counter()
        served = await _simulate_policy(policy, demands, size, random.Random(size.seed))
        weights = [(_user_weight(u) if policy == "weighted" else 1.0) for u in range(size.users)]
        shares = _max_min_shares(totals, weights, capacity)
        normalised = [served[u] / shares[u] for u in range(size.users) if shares[u] > 0]
        results[name] = {
            "jain_vs_fair_share": jain_index(normalised),
            "jain_raw_served": jain_index([float(s) for s in served if s]),
            "users_served": sum(1 for s in served if s),
            "seconds": time.perf_counter() - started,
        }
        progress(f"[many-users] {name}: Jain {results[name]['jain_vs_fair_share']:.3f}")
    return results


# ----------------------------------------------------------------------------- core


def _load_core_benchmark() -> Any | None:
    """`benchmarks/core_decisions.py` of this checkout (not part of the installed package)."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "core_decisions.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("_fair_sched_core_decisions", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def play_core(users: Sequence[int], pairs: int, progress: Progress) -> dict[str, Any]:
    """Decisions per second and per-decision latency at each backlog, bytes per parked ticket."""
    bench = _load_core_benchmark()
    if bench is None:
        return {"skipped": "benchmarks/core_decisions.py is not in this installation"}
    rows = []
    for count in users:
        rate, latencies = asyncio.run(bench._run_pairs(count, pairs, "round_robin"))
        quantiles = statistics.quantiles(latencies, n=100)
        rows.append(
            {
                "users": count,
                "decisions_per_s": rate,
                "p50_us": quantiles[49],
                "p99_us": quantiles[98],
            }
        )
        progress(f"[core] {count} backlogged users: {rate:,.0f} decisions/s")
    per_ticket = asyncio.run(bench._bytes_per_ticket(min(50_000, pairs)))
    return {"rows": rows, "bytes_per_parked_ticket": per_ticket}


__all__ = [
    "ManyUsersSize",
    "TiersSize",
    "Variant",
    "play_core",
    "play_many_users",
    "play_overhead",
    "play_tiers",
]
