"""Abuse: one client tries to park far more requests than it may.

100,000 admissions are driven through `SchedulingService.admit` in-process (a rejected one is
refused before it waits, so this is fast); a smaller flood of 2,000 goes over HTTP through the
standalone proxy. Memory is read from /proc/self/status (VmRSS) and compared as ratios, never
against absolute limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import tracemalloc
from collections.abc import Iterator
from typing import Any, NamedTuple

import httpx

from fair_sched_plugin.core.queues import MAX_IDLE_USERS_REMEMBERED
from fair_sched_plugin.errors import QueueFull
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.service import ClientDisconnected, SchedulingService
from fair_sched_plugin.state import ReplicaScheduler
from fair_sched_plugin.testing import settle

from ..integrations.conftest import (
    assert_idle,
    cancel_all,
    chat_body,
    emulator,
    fair_config,
    open_client,
    serve,
    wait_until,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 8}
PER_USER_CAP = 100
MIB = 1024 * 1024
# 1,000 keeps the suite light on a shared 2-core machine; FAIR_SCHED_HTTP_FLOOD=2000 for more.
HTTP_FLOOD_TOTAL = int(os.environ.get("FAIR_SCHED_HTTP_FLOOD", "1000"))


class Traced(NamedTuple):
    """The Python heap as tracemalloc counts it: live bytes, and live memory blocks."""

    bytes: int
    blocks: int

    @classmethod
    def now(cls) -> Traced:
        gc.collect()
        return cls(tracemalloc.get_traced_memory()[0], len(tracemalloc.take_snapshot().traces))

    def __sub__(self, other: object) -> Traced:
        assert isinstance(other, Traced)
        return Traced(self.bytes - other.bytes, self.blocks - other.blocks)


def rss_bytes() -> int:
    gc.collect()
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@contextlib.contextmanager
def rejection_lines_silenced() -> Iterator[None]:
    """Each rejection logs one WARNING line. Over 100,000 of them pytest's log capture would
    hold megabytes of text and blur what the scheduler itself keeps, so they are silenced
    while memory is measured (their volume is a documented operational concern)."""
    logger = logging.getLogger("fair_sched")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def make_service(**queue: Any) -> SchedulingService:
    # Model "m" has no backend: the gate is an in-flight cap of 1 and needs no engine.
    return SchedulingService(
        {"unknown_model_max_inflight": 1, "queue": {"max_per_user": PER_USER_CAP, **queue}}
    )


def scheduler_internals(scheduler: object) -> dict[str, int]:
    """Sizes of every structure that could grow (tests may look inside; the code may not)."""
    assert isinstance(scheduler, ReplicaScheduler) and not scheduler.coordinated  # memory://
    core = scheduler.core
    tiers = [tier for queues in core._models.values() for tier in queues.tiers]
    term = scheduler._term
    assert term is not None
    return {
        "models": len(core._models),
        "users": sum(len(tier.users) for tier in tiers),
        "heap": sum(len(tier.heap) for tier in tiers),
        "deadlines": len(core._deadlines),
        # The replica's own requests and its term's view of them.
        "parked": len(scheduler._parked),
        "held": len(scheduler._held),
        "term": len(term.reservations) + len(term.leases),
    }


async def flood(service: SchedulingService, attempts: int) -> tuple[list[asyncio.Task[Any]], int]:
    """One abuser makes `attempts` admissions: the first PER_USER_CAP park, the rest are refused
    at once. Returns the parked tasks and the number refused."""
    abuser = service.identify(Credentials(api_key="sk-abuser"))
    parked = [asyncio.ensure_future(service.admit(abuser, "m", BODY)) for _ in range(PER_USER_CAP)]
    await settle()
    refused = 0
    for _ in range(attempts - PER_USER_CAP):
        try:
            await service.admit(abuser, "m", BODY)
        except QueueFull as exc:
            assert exc.scope == "user" and exc.status_code == 429
            refused += 1
    return parked, refused


async def test_a_hundred_thousand_admissions_are_capped_and_leave_nothing_behind() -> None:
    """100,000 attempts by one client: 100 park, the rest get 429 at once. A light user's
    request is served while the abuser's queue is full (second in line, not 101st), and memory
    grows no more with 100,000 attempts than with 10,000: a refused request keeps nothing."""
    growth: dict[int, int] = {}
    for attempts in (10_000, 100_000):
        service = make_service()
        holder = await service.admit(service.identify(Credentials(api_key="sk-h")), "m", BODY)
        with rejection_lines_silenced():
            before = rss_bytes()
            parked, refused = await flood(service, attempts)
            growth[attempts] = rss_bytes() - before
        stats = service.scheduler.statistics()
        assert refused == attempts - PER_USER_CAP
        assert (stats.queued, stats.rejected_full_total) == (PER_USER_CAP, refused)
        assert scheduler_internals(service.scheduler)["deadlines"] == PER_USER_CAP

        # The light user arrives after the flood yet is released second (round robin across
        # users), ahead of the abuser's other 99.
        light = asyncio.ensure_future(
            service.admit(service.identify(Credentials(api_key="sk-light")), "m", BODY)
        )
        await settle()
        holder.lease.release()
        await settle()
        first = [task for task in parked if task.done()]
        assert len(first) == 1 and not light.done()
        first[0].result().lease.release()
        await settle()
        assert light.done() and sum(task.done() for task in parked) == 1
        light.result().lease.release()
        await cancel_all(parked)
        stats = service.scheduler.statistics()
        assert (stats.queued, stats.in_flight) == (0, 0)
        # Idle users still ahead of the tier's virtual time are remembered (bounded).
        assert scheduler_internals(service.scheduler)["users"] <= 3
        await service.aclose()

    print(
        f"\nRSS growth while refusing: 10,000 attempts {growth[10_000] / MIB:.2f} MiB, "
        f"100,000 attempts {growth[100_000] / MIB:.2f} MiB"
    )
    # A leak of even 50 bytes per refused request would add > 4 MiB over the 90,000 extra.
    assert growth[100_000] <= 2 * growth[10_000] + 4 * MIB


async def test_memory_per_parked_request_is_small_and_returned() -> None:
    """What a parked request costs in-process (its waiter, future and ticket), and that it is all
    given back when they leave. Counted by tracemalloc (the Python heap's live bytes), not by
    RSS: the allocator keeps freed pages, so RSS moved by megabytes either way between rounds."""
    parked_count = 5_000
    service = make_service(max_per_user=parked_count)
    holder = await service.admit(service.identify(Credentials(api_key="sk-h")), "m", BODY)
    abuser = service.identify(Credentials(api_key="sk-abuser"))
    held: list[Traced] = []  # the heap while parked, above the start
    kept: list[Traced] = []  # the heap after they left, above the start
    tracemalloc.start()
    try:
        start = Traced.now()
        for _ in range(2):
            parked = [
                asyncio.ensure_future(service.admit(abuser, "m", BODY)) for _ in range(parked_count)
            ]
            await settle()
            assert service.scheduler.statistics().queued == parked_count
            held.append(Traced.now() - start)
            await cancel_all(parked)
            parked.clear()
            kept.append(Traced.now() - start)
            assert service.scheduler.statistics().queued == 0
            internals = scheduler_internals(service.scheduler)
            # Only the holder's user entry is left; stale heap and deadline entries are
            # compacted once they outnumber live ones (at most 64 linger).
            assert internals["users"] == 1 and internals["heap"] <= 65
            assert internals["deadlines"] <= 64
    finally:
        tracemalloc.stop()
    print(
        f"\nlive bytes per parked request (in-process, incl. its task): "
        f"{held[0].bytes / parked_count:.0f} in {held[0].blocks / parked_count:.1f} blocks; "
        f"kept after they left: {kept[0].blocks} blocks ({kept[0].bytes / 1024:.0f} KiB) after "
        f"the first round, {kept[1].blocks} ({kept[1].bytes / 1024:.0f} KiB) after the second"
    )
    # Given back, not accumulated: the second round keeps no more objects than the first did
    # (what a round leaves is its cancelled tasks, still referenced from the test's gather
    # until the next one replaces them). Counted in blocks, not bytes: a hash table that
    # resizes (asyncio's set of every task, sized by what other tests left) moves bytes by
    # hundreds of KiB in one block, while a leak of one object per request adds 5,000.
    assert kept[1].blocks - kept[0].blocks <= 0.02 * held[0].blocks
    holder.lease.release()
    await service.aclose()


async def test_rotating_identities_are_bounded_by_the_total_cap() -> None:
    """A client that invents a new key per request gets a new queue each time (the proxy does
    not authenticate; see the docs), but `queue.max_total` bounds them and refused ones keep
    nothing: no user queue is created for a request that is refused."""
    service = make_service(max_total=500)
    holder = await service.admit(service.identify(Credentials(api_key="sk-h")), "m", BODY)
    parked = []
    refused = 0
    with rejection_lines_silenced():
        for index in range(20_000):
            principal = service.identify(Credentials(api_key=f"sk-rotating-{index}"))
            if index < 500:
                parked.append(asyncio.ensure_future(service.admit(principal, "m", BODY)))
                await asyncio.sleep(0)
                continue
            try:
                await service.admit(principal, "m", BODY)
            except QueueFull as exc:
                assert exc.scope == "total"
                refused += 1
    assert refused == 19_500
    internals = scheduler_internals(service.scheduler)
    assert internals["users"] == 501 and internals["deadlines"] == 500
    await cancel_all(parked)
    holder.lease.release()
    assert scheduler_internals(service.scheduler)["users"] <= 1
    await service.aclose()


async def test_users_served_and_gone_are_not_remembered_forever() -> None:
    """15,000 distinct callers, each served once on an idle engine (never queued): the scheduler
    remembers at most MAX_IDLE_USERS_REMEMBERED of them per tier, not every caller ever seen.

    Regression: an idle user whose virtual time was ahead of the tier's was kept forever, and
    a tier's virtual time does not move while nothing queues, so every distinct caller stayed."""
    service = SchedulingService({"unknown_model_max_inflight": 64})
    for index in range(MAX_IDLE_USERS_REMEMBERED + 5_000):
        principal = service.identify(Credentials(api_key=f"sk-once-{index}"))
        (await service.admit(principal, "m", BODY)).lease.release()
    assert scheduler_internals(service.scheduler)["users"] <= MAX_IDLE_USERS_REMEMBERED
    await service.aclose()


async def test_submit_and_cancel_churn_leaves_nothing() -> None:
    """20,000 requests park and leave again (task cancelled, or client disconnected), from
    rotating users: the scheduler's queues, heaps, user table and deadline deque stay bounded,
    and memory grows no more over 20,000 cycles than over 2,000."""
    service = make_service(max_per_user=1_000)
    holder = await service.admit(service.identify(Credentials(api_key="sk-h")), "m", BODY)
    largest: dict[str, int] = {}
    growth: dict[int, int] = {}
    done = 0
    before = rss_bytes()
    for batch in range(100):
        gone = asyncio.Event()
        tasks = []
        for index in range(200):
            principal = service.identify(Credentials(api_key=f"sk-churn-{batch}-{index % 20}"))
            disconnected = gone if index % 2 else None
            tasks.append(
                asyncio.ensure_future(
                    service.admit(principal, "m", BODY, disconnected=disconnected)
                )
            )
        await settle()
        assert service.scheduler.statistics().queued == 200
        for name, size in scheduler_internals(service.scheduler).items():
            largest[name] = max(largest.get(name, 0), size)
        gone.set()
        for index, task in enumerate(tasks):
            if index % 2 == 0:
                task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(
            isinstance(outcome, (asyncio.CancelledError, ClientDisconnected))
            for outcome in outcomes
        )
        done += len(tasks)
        if done in (2_000, 20_000):
            growth[done] = rss_bytes() - before
    stats = service.scheduler.statistics()
    assert (stats.queued, stats.in_flight, stats.cancelled_total) == (0, 1, 20_000)
    left = scheduler_internals(service.scheduler)
    print(
        f"\nchurn of 20,000: largest structures {largest}, left {left}; RSS growth after "
        f"2,000 {growth[2_000] / MIB:.2f} MiB, after 20,000 {growth[20_000] / MIB:.2f} MiB"
    )
    assert left["users"] == 1 and left["heap"] <= 65 and left["deadlines"] <= 64
    # While 200 wait from 20 users, nothing exceeds what those 200 need (plus compaction slack).
    assert (
        largest["users"] <= 21 and largest["heap"] <= 20 + 65 and largest["deadlines"] <= 200 + 65
    )
    assert growth[20_000] <= 2 * growth[2_000] + 4 * MIB
    holder.lease.release()
    await service.aclose()


async def test_http_flood_is_capped_and_a_light_user_is_served_next() -> None:
    """1,000 (or FAIR_SCHED_HTTP_FLOOD) requests from one key through the proxy, with a per-user
    cap of 100: 100 park, the rest get 429 with Retry-After and never reach the engine. A light user who comes after
    the flood is served right after the abuser's first request; the abuser's parked requests
    leave the queue when their clients go away."""
    total, concurrency = HTTP_FLOOD_TOTAL, 50
    async with emulator() as emu:
        emu.engine.faults.metrics_mode = "error"  # in-flight cap 1: the queue is what we see
        config = fair_config(
            emu,
            on_metrics_unavailable={"max_inflight": 1},
            queue={"max_per_user": PER_USER_CAP},
        )
        app = build_proxy_app(config)
        service: SchedulingService = app.state.fair_sched
        async with (
            serve(app) as url,
            open_client(url, key="sk-a", timeout=120) as abuser,
            open_client(url, key="sk-b") as light,
            open_client(url, key="sk-c") as carol,
        ):

            async def hog() -> None:
                body = chat_body(max_tokens=100_000, stream=True)
                async with carol.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for _ in response.aiter_raw():
                        pass

            holding = asyncio.ensure_future(hog())
            await wait_until(lambda: service.scheduler.statistics().in_flight == 1)
            finished: list[str] = []

            async def request(client: httpx.AsyncClient, who: str) -> httpx.Response:
                response = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
                if response.status_code == 200:
                    finished.append(who)
                return response

            before = rss_bytes()
            parked = [asyncio.ensure_future(request(abuser, "abuser")) for _ in range(PER_USER_CAP)]
            await wait_until(
                lambda: service.scheduler.statistics().queued == PER_USER_CAP, timeout_s=30
            )
            rss_parked = rss_bytes()
            statuses: dict[int, int] = {}
            retry_after_seen = 0
            semaphore = asyncio.Semaphore(concurrency)

            async def refused_one() -> None:
                nonlocal retry_after_seen
                async with semaphore:
                    response = await request(abuser, "abuser")
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                retry_after_seen += int(response.headers.get("retry-after", "0")) >= 1

            loop = asyncio.get_running_loop()
            started = loop.time()
            with rejection_lines_silenced():
                await asyncio.wait_for(
                    asyncio.gather(*(refused_one() for _ in range(total - PER_USER_CAP))), 90
                )
            refusing_s = loop.time() - started
            rss_after = rss_bytes()
            assert statuses == {429: total - PER_USER_CAP}
            assert retry_after_seen == total - PER_USER_CAP
            assert service.scheduler.statistics().queued == PER_USER_CAP

            light_request = asyncio.ensure_future(request(light, "light"))
            await wait_until(lambda: service.scheduler.statistics().queued == PER_USER_CAP + 1)
            await cancel_all([holding])
            assert (await asyncio.wait_for(light_request, 30)).status_code == 200
            # At most the abuser's first parked request (and one more, on a slow machine) ran
            # before the light user's.
            assert finished.index("light") <= 2, finished[:5]
            await cancel_all(parked)
            await assert_idle(service)
            received = emu.engine.statistics().requests_received
            assert received <= 10, received  # the hog, a few of the abuser's, the light user

    print(
        f"\nHTTP flood of {total}: 429s {statuses.get(429)}, engine received {received}; "
        f"RSS +{(rss_parked - before) / MIB:.1f} MiB for {PER_USER_CAP} parked over HTTP "
        f"(~{(rss_parked - before) / PER_USER_CAP / 1024:.0f} KiB each, client side included), "
        f"+{(rss_after - rss_parked) / MIB:.1f} MiB over {total - PER_USER_CAP} refused "
        f"({refusing_s:.1f} s)"
    )
