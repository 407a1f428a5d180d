"""What waiting clients cost: keep-alive comments, `Retry-After` and `/fair-sched/queue`.

    .venv/bin/python benchmarks/keepalive_cost.py [--parked 10000] [--big 1000] [--intervals 3]\
        [--sample 500] [--no-streams]

`--parked` requests wait for one in-flight slot that never frees: one caller ("big") has `--big`
of them, every other caller one. Measured in CPU time (`time.process_time`), so other work on
the machine does not count:

- the estimate one keep-alive comment carries (position, ETA, wait), per comment and per
  keep-alive interval for all the parked requests (`--sample` comments are timed);
- the streams themselves: every parked request is a streaming `RequestWatch` whose keep-alive
  sends its comment to a no-op ASGI `send` every `keepalive_interval_s` (1 s), for
  `--intervals` intervals of real time; CPU seconds per interval / interval is the share of a
  core they take (the target: under 5 % for 10,000);
- `Retry-After` of a refusal (the service's estimate from the drain rate) and the
  where-do-I-stand document (`standing_of`, what `GET /fair-sched/queue` serves) for "big".
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from typing import Any

from fair_sched_plugin.errors import QueueTimeout
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.request.watch import RequestWatch
from fair_sched_plugin.runtime.service import UNKNOWN_MODELS, SchedulingService

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
INTERVAL_S = 1.0


SENT = [0]  # comments sent


async def _noop_send(message: Any) -> None:
    if message["type"] == "http.response.body":
        SENT[0] += 1


def _cpu_per_call(calls: int, fn: Any) -> float:
    """CPU seconds per call of `fn` over `calls` calls."""
    gc.collect()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls


async def main(parked_total: int, big: int, intervals: int, sample: int, streams: bool) -> None:
    others = parked_total - big
    principals = [{"name": "big", "keys": ["sk-big"]}]
    principals += [{"name": f"u{i}", "keys": [f"sk-{i}"]} for i in range(others)]
    svc = SchedulingService(
        {
            "unknown_model_max_inflight": 1,
            "principals": principals,
            "queue": {
                "max_per_user": max(big, 1) + 10,
                "max_total": parked_total + 10,
                "max_wait_s": 86_400,
                # Without the streams measured, their first comment never comes.
                "keepalive_after_s": INTERVAL_S if streams else 86_400,
                "keepalive_interval_s": INTERVAL_S,
            },
        }
    )
    holder = await svc.admit(svc.identify(Credentials(api_key="sk-big")), "m", BODY)
    # Two releases a second apart: a measured drain rate, so ETAs and Retry-After are computed.
    now = svc.clock.now()
    svc.drain.record(UNKNOWN_MODELS, now - 2.0)
    svc.drain.record(UNKNOWN_MODELS, now - 1.0)

    watches: list[RequestWatch] = []
    tasks: list[asyncio.Task[Any]] = []
    keys = ["sk-big"] * big + [f"sk-{i}" for i in range(others)]
    for key in keys:
        watch = RequestWatch(None, _noop_send)
        watch.streaming = True
        watches.append(watch)
        principal = svc.identify(Credentials(api_key=key))
        tasks.append(asyncio.ensure_future(svc.admit(principal, "m", BODY, waiting=watch)))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    parked = [w._parked for w in watches if w._parked is not None]
    assert len(parked) == parked_total, (len(parked), parked_total)

    # One comment's estimate, for a sample spread over the parked requests.
    step = max(1, len(parked) // sample)
    chosen = parked[::step][:sample]
    gc.collect()
    start = time.process_time()
    for p in chosen:
        # What `RequestWatch._keep_alive` reads (before `standing()`: position and ETA apart).
        if hasattr(p, "standing"):
            position, eta, wait_s = p.standing()
        else:
            position, eta, wait_s = p.position(), p.eta_s(), p.wait_s()
        _ = f": queued position={position} wait_s={wait_s:.1f} eta_s={eta}"
    per_comment = (time.process_time() - start) / len(chosen)
    print(
        f"keep-alive estimate: {per_comment * 1e6:.1f} us per comment; "
        f"{per_comment * parked_total:.4f} CPU s per {INTERVAL_S:g} s interval for "
        f"{parked_total} parked = {per_comment * parked_total / INTERVAL_S:.1%} of a core"
    )

    if streams:
        # Let every stream send its first comment, then measure whole intervals.
        await asyncio.sleep(INTERVAL_S * 1.5)
        gc.collect()
        sent_before = SENT[0]
        start = time.process_time()
        await asyncio.sleep(INTERVAL_S * intervals)
        cpu = (time.process_time() - start) / intervals
        comments = (SENT[0] - sent_before) / intervals
        started = sum(w.keepalive_started for w in watches)
        print(
            f"keep-alive streams: {started} streaming, {comments:.0f} comments per interval, "
            f"{cpu:.4f} CPU s per {INTERVAL_S:g} s interval = {cpu / INTERVAL_S:.1%} of a core "
            "(target < 5%)"
        )

    big_principal = svc.identify(Credentials(api_key="sk-big"))
    big_ticket = svc.ticket_for(big_principal, UNKNOWN_MODELS, BODY)
    calls = max(20, sample // 5)

    def refuse() -> None:
        svc.standings.estimate_retry_after(QueueTimeout("timed out", retry_after_s=1.0), big_ticket)

    def suggest() -> None:
        svc.standings.suggest_retry_after(UNKNOWN_MODELS, user="u0")

    refusal = _cpu_per_call(calls, refuse)
    print(f"Retry-After of a refusal (a timed-out request): {refusal * 1e6:.1f} us")
    print(f"suggest_retry_after (the proxy's 429): {_cpu_per_call(calls, suggest) * 1e6:.1f} us")
    standing = _cpu_per_call(max(5, calls // 10), lambda: svc.standings.standing_of(big_principal))
    print(f"/fair-sched/queue for a caller with {big} parked: {standing * 1e6:.1f} us")

    holder.lease.release()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await svc.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parked", type=int, default=10_000)
    parser.add_argument("--big", type=int, default=1_000)
    parser.add_argument("--intervals", type=int, default=3)
    parser.add_argument("--sample", type=int, default=500)
    parser.add_argument("--no-streams", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.parked, args.big, args.intervals, args.sample, not args.no_streams))
