"""Faults: the engine dies, slows down, fails requests or loses its metrics; the proxy restarts.

Every wait is bounded; after each fault nothing is left queued or in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from fair_sched_plugin.lab.emulator.server import run_emulator_subprocess
from fair_sched_plugin.proxy import build_proxy_app

from ..integrations.conftest import (
    LOOPBACK,
    STARTUP_TIMEOUT_S,
    assert_idle,
    chat_body,
    emulator,
    emulator_config,
    fair_config,
    gate_sees_metrics,
    open_client,
    park_behind_full_engine,
    serve,
    sse_events,
    wait_until,
)
from ..support import service_of

POLL_MS = 50


async def stream_outcome(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """Run a stream to its end: "done" ([DONE] seen), "cut" (ended without it), "error:<...>"
    (the connection broke), or "status:<code>"."""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"status:{response.status_code}"
            text = b""
            async for chunk in response.aiter_raw():
                text += chunk
        return "done" if sse_events(text.decode())[-1:] == ["[DONE]"] else "cut"
    except httpx.TransportError as exc:
        return f"error:{type(exc).__name__}"


async def post_outcome(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    try:
        response = await client.post("/v1/chat/completions", json=body)
    except httpx.TransportError as exc:
        return f"error:{type(exc).__name__}"
    if response.status_code >= 400:
        try:
            code = response.json()["error"].get("code")
        except ValueError:
            code = response.text[:40]  # e.g. uvicorn's own plain-text 500
        return f"status:{response.status_code}:{code}"
    return "ok"


# ----------------------------------------------------------------------------- engine down


async def test_engine_killed_mid_run() -> None:
    """The engine process is killed with two streams running, one request in its queue and
    three parked here. The streams break, the queued request gets a clear 502, every lease is
    released, the gate falls back when the metrics go stale, and the parked requests proceed
    under the fallback cap and fail cleanly (502): nothing hangs, nothing leaks."""
    config = emulator_config(max_num_seqs=2)
    async with run_emulator_subprocess(config) as emu:
        fair = fair_config(
            emu,  # type: ignore[arg-type]  # only its base_url is read
            waiting_below=1,
            on_metrics_unavailable={"max_inflight": 1},
            metrics_poll_ms=POLL_MS,
        )
        app = build_proxy_app(fair)
        service = service_of(app)
        async with (
            serve(app) as url,
            open_client(url, key="sk-a", timeout=30) as alice,
            open_client(url, key="sk-b", timeout=30) as bob,
            open_client(url, key="sk-c", timeout=30) as carol,
            httpx.AsyncClient(base_url=emu.base_url, trust_env=False) as engine_admin,
        ):
            await gate_sees_metrics(service)

            async def engine_received() -> int:
                stats = (await engine_admin.get("/emulator/stats")).json()
                return int(stats["requests_received"])

            long_stream = chat_body(max_tokens=100_000, stream=True)
            streams = [
                asyncio.ensure_future(stream_outcome(client, long_stream))
                for client in (alice, bob)
            ]
            await wait_until(lambda: service.scheduler.statistics().in_flight == 2)
            in_engine_queue = asyncio.ensure_future(post_outcome(carol, chat_body(max_tokens=8)))
            for _ in range(200):
                if await engine_received() == 3:
                    break
                await asyncio.sleep(0.02)
            await wait_until(lambda: all((s.waiting or 0) >= 1 for s in service.gate.status()))
            parked = [
                asyncio.ensure_future(post_outcome(client, chat_body(max_tokens=8)))
                for client in (alice, bob, carol)
            ]
            await wait_until(lambda: service.scheduler.statistics().queued == 3)

            emu.process.send_signal(signal.SIGKILL)
            outcomes = await asyncio.wait_for(
                asyncio.gather(*streams, in_engine_queue, *parked), timeout=30
            )
            await assert_idle(service)
            await wait_until(
                lambda: (
                    ("metrics", "fallback")
                    in [(t.old, t.new) for t in service.observability.view.recent_transitions()]
                )
            )
            modes = [(t.old, t.new) for t in service.observability.view.recent_transitions()]

    print(f"\nengine killed: outcomes {outcomes}; gate transitions {modes}")
    assert all(outcome.startswith(("error:", "cut")) for outcome in outcomes[:2])
    assert outcomes[2] == "status:502:upstream_unavailable"
    assert outcomes[3:] == ["status:502:upstream_unavailable"] * 3
    stats = service.scheduler.statistics()
    # The two broken streams had started; the four requests the dead engine never took end
    # abandoned (uncharged, no first byte), not completed.
    counts = (stats.released_total, stats.completed_total, stats.abandoned_total, stats.queued)
    assert counts == (6, 2, 4, 0)


# ----------------------------------------------------------------------------- engine slow


async def test_engine_slow_to_first_byte() -> None:
    """Every response starts only after a delay: requests still complete, a client that gives
    up while waiting for the first byte ends its lease (and the engine never runs it)."""
    async with emulator() as emu:
        emu.engine.faults.first_byte_delay_s = 1.0
        app = build_proxy_app(fair_config(emu, metrics_poll_ms=POLL_MS))
        service = service_of(app)
        async with (
            serve(app) as url,
            open_client(url, key="sk-a") as alice,
            open_client(url, key="sk-b") as bob,
            httpx.AsyncClient(
                base_url=url,
                headers={"authorization": "Bearer sk-c"},
                # Only the wait for the response is short: connecting may be slow under load.
                timeout=httpx.Timeout(10.0, read=0.2),
                trust_env=False,
            ) as impatient,
        ):
            await gate_sees_metrics(service)
            requests = [
                post_outcome(client, chat_body(max_tokens=2)) for client in (alice, bob) * 3
            ]
            gave_up = await post_outcome(impatient, chat_body(max_tokens=2))
            outcomes = await asyncio.wait_for(asyncio.gather(*requests), 30)
            await assert_idle(service)
            await wait_until(lambda: emu.engine.statistics()[:2] == (0, 0))
            stats = emu.engine.statistics()
    assert gave_up == "error:ReadTimeout"
    assert outcomes == ["ok"] * 6
    assert stats.requests_received == 6  # the impatient client's request never ran
    # The impatient client's request went on to the engine's server, which had not answered
    # when the client left: completed, charged what the engine can have generated meanwhile
    # (never refunded: the proxy cannot tell how far the engine got).
    final = service.scheduler.statistics()
    assert (final.completed_total, final.abandoned_total) == (7, 0)


# ----------------------------------------------------------------------------- engine errors


async def test_engine_returning_500s() -> None:
    """Every third completion fails with HTTP 500: the error reaches the client as the engine
    sent it, and its lease ends like any other."""
    async with emulator() as emu:
        emu.engine.faults.fail_every_nth_completion = 3
        app = build_proxy_app(fair_config(emu, metrics_poll_ms=POLL_MS))
        service = service_of(app)
        async with contextlib.AsyncExitStack() as stack:
            url = await stack.enter_async_context(serve(app))
            clients = [
                await stack.enter_async_context(open_client(url, key=key))
                for key in ("sk-a", "sk-b", "sk-c")
            ]
            await gate_sees_metrics(service)
            calls = []
            for index in range(12):
                client = clients[index % 3]
                if index % 2:
                    calls.append(stream_outcome(client, chat_body(max_tokens=4, stream=True)))
                else:
                    calls.append(post_outcome(client, chat_body(max_tokens=4)))
            outcomes = await asyncio.wait_for(asyncio.gather(*calls), 30)
            await assert_idle(service)
    failed = [outcome for outcome in outcomes if outcome.startswith("status:500")]
    assert len(failed) == 4, outcomes
    assert sorted(set(outcomes) - set(failed)) == ["done", "ok"]
    stats = service.scheduler.statistics()
    assert (stats.released_total, stats.completed_total) == (12, 12)


# ----------------------------------------------------------------------------- metrics faults


@pytest.mark.parametrize(
    "fault",
    [
        {"metrics_mode": "garbage"},
        {"metrics_mode": "missing"},
        {"metrics_mode": "error"},
        {"metrics_delay_s": 1.0},  # five times the scrape timeout
    ],
    ids=["garbage", "missing", "error", "slow"],
)
async def test_metrics_fault_falls_back_and_recovers(fault: dict[str, Any]) -> None:
    """Metrics go bad mid-run: the gate falls back to the in-flight cap (never deadlocks,
    never floods the engine), and returns to metrics as soon as they are readable again.
    Detection and recovery are counted in scrapes, and printed."""
    cap = 2
    async with emulator(max_num_seqs=8) as emu:
        app = build_proxy_app(
            fair_config(
                emu,
                waiting_below=4,
                metrics_poll_ms=POLL_MS,
                metrics_timeout_ms=200,
                stale_after_ms=10 * POLL_MS,
                on_metrics_unavailable={"max_inflight": cap},
            )
        )
        service = service_of(app)
        async with serve(app) as url, open_client(url, key="sk-a") as alice:
            await gate_sees_metrics(service)
            (watcher,) = service.watchers()["tiny"]

            emu.engine.faults.update(fault)
            at_fault = watcher.scrapes_total
            await wait_until(lambda: service.gate.status()[0].mode == "fallback", timeout_s=15)
            detection_scrapes = watcher.scrapes_total - at_fault

            # Under the fallback requests still flow, at most `cap` at a time.
            most_in_flight = 0
            burst = asyncio.gather(
                *(post_outcome(alice, chat_body(max_tokens=6)) for _ in range(8))
            )
            for _ in range(4000):
                if burst.done():
                    break
                most_in_flight = max(most_in_flight, service.scheduler.statistics().in_flight)
                await asyncio.sleep(0.002)
            outcomes = await asyncio.wait_for(burst, 30)

            emu.engine.faults.update({"metrics_mode": "ok", "metrics_delay_s": 0.0})
            at_restore = watcher.scrapes_total
            await wait_until(lambda: service.gate.status()[0].mode == "metrics", timeout_s=15)
            recovery_scrapes = watcher.scrapes_total - at_restore
            await assert_idle(service)
            transitions = [(t.old, t.new) for t in service.observability.view.recent_transitions()]

    print(
        f"\nmetrics fault {fault}: fallback after {detection_scrapes} scrape(s) "
        f"(stale after {10 * POLL_MS} ms = 10 intervals of {POLL_MS} ms), recovered in "
        f"{recovery_scrapes} "
        f"scrape(s) after the fix; most in flight under fallback {most_in_flight} (cap {cap})"
    )
    assert outcomes == ["ok"] * 8
    assert 1 <= most_in_flight <= cap
    assert transitions[-2:] == [("metrics", "fallback"), ("fallback", "metrics")]
    # The first good scrape ends the fallback (one more may have been in flight, slow).
    assert 1 <= recovery_scrapes <= 3
    assert detection_scrapes >= 1


# ----------------------------------------------------------------------------- proxy restart


@dataclass
class ServedProxy:
    url: str
    port: int
    server: uvicorn.Server
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def serve_on(app: Any, port: int = 0) -> AsyncIterator[ServedProxy]:
    """Like `serve`, but on a chosen port and handing out the server, so a test can stop it
    while it still holds requests."""
    config = uvicorn.Config(
        app, host=LOOPBACK, port=port, log_level="critical", lifespan="on",
        timeout_graceful_shutdown=1,
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + STARTUP_TIMEOUT_S
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped before it started")
            assert loop.time() < give_up_at, "the server did not start in time"
            await asyncio.sleep(0.005)
        bound = server.servers[0].sockets[0].getsockname()[1]
        yield ServedProxy(f"http://{LOOPBACK}:{bound}", bound, server, task)
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), 10)
        except asyncio.TimeoutError:
            server.force_exit = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_proxy_restart_under_load() -> None:
    """The proxy stops with requests running and parked: every client gets an error, none
    hangs; the old scheduler ends with nothing queued or in flight; a new proxy on the same
    port serves at once (the in-memory queues are gone: clients retry)."""
    async with emulator(max_num_seqs=1) as emu:
        old_app = build_proxy_app(fair_config(emu, waiting_below=1, metrics_poll_ms=POLL_MS))
        old_service = service_of(old_app)
        async with serve_on(old_app) as old, open_client(old.url, key="sk-a") as alice:
            await gate_sees_metrics(old_service)
            hogs = await park_behind_full_engine(emu, old_service, alice)
            parked = [
                asyncio.ensure_future(post_outcome(alice, chat_body(user=f"parked-{i}")))
                for i in range(3)
            ]
            await wait_until(lambda: old_service.scheduler.statistics().queued == 3)

            loop = asyncio.get_running_loop()
            stopping_at = loop.time()
            old.server.should_exit = True
            # The old proxy stops listening at once; a new one takes the port.
            await wait_until(lambda: not old.server.servers or not any(
                server.is_serving() for server in old.server.servers
            ))  # fmt: skip
            new_app = build_proxy_app(fair_config(emu, waiting_below=1, metrics_poll_ms=POLL_MS))
            async with (
                serve_on(new_app, port=old.port) as new,
                open_client(new.url, key="sk-b") as bob,
            ):
                parked_outcomes = await asyncio.wait_for(asyncio.gather(*parked), 20)
                hog_outcomes = await asyncio.wait_for(
                    asyncio.gather(*hogs, return_exceptions=True), 20
                )
                await asyncio.wait_for(old.task, 20)
                stopped_s = loop.time() - stopping_at
                old_stats = old_service.scheduler.statistics()
                # The engine freed the old proxy's sequences; the new proxy serves.
                await wait_until(lambda: emu.engine.statistics()[:2] == (0, 0))
                retried = await post_outcome(bob, chat_body(max_tokens=4))
                await assert_idle(service_of(new_app))
    print(
        f"\nproxy restart: parked clients got {parked_outcomes}, streams got "
        f"{[type(o).__name__ if isinstance(o, BaseException) else o for o in hog_outcomes]}; "
        f"old proxy gone after {stopped_s:.1f} s (graceful timeout 1 s)"
    )
    for outcome in parked_outcomes:
        assert outcome.startswith(("error:", "status:5")), outcome
    assert all(outcome is None or isinstance(outcome, BaseException) for outcome in hog_outcomes)
    assert (old_stats.queued, old_stats.in_flight) == (0, 0)
    assert retried == "ok"
    # The parked requests never reached the engine.
    assert [r.user for r in emu.engine.received][:2] == ["hog-1", "hog-2"]
    assert not any((r.user or "").startswith("parked") for r in emu.engine.received)
