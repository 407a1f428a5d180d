"""The metrics watcher and gate against the live emulator: bursts, ceilings, faults, idle cost."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import pytest

from fair_sched_plugin.core import BackendSnapshot
from fair_sched_plugin.engine_metrics.profiles import engine_profile
from fair_sched_plugin.engine_metrics.watcher import MetricsWatcher
from fair_sched_plugin.lab.emulator.server import RunningEmulator, run_emulator
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.service import SchedulingService

from .conftest import (
    MODEL,
    cancel_all,
    completion_body,
    emulator,
    emulator_config,
    fair_config,
    wait_until,
)


async def _forward(
    service: SchedulingService, client: httpx.AsyncClient, user: str, body: dict[str, Any]
) -> None:
    """What an integration does: admit, forward (streaming), mark the first byte, release."""
    principal = service.identify(Credentials(api_key=user))
    admission = await service.admit(principal, MODEL, body)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_raw():
                admission.lease.mark_started()
    finally:
        admission.lease.release()


def _fast_watcher(emu: RunningEmulator, seen: list[BackendSnapshot]) -> MetricsWatcher:
    """The emulator's /metrics read every 20 ms as vLLM's, every snapshot appended to `seen`."""
    return MetricsWatcher(
        f"{emu.base_url}/metrics",
        engine_profile("vllm"),
        model_name=None,
        interval_s=0.02,
        timeout_s=1.0,
        on_snapshot=seen.append,
    )


async def test_watcher_reads_the_live_engine_rising_and_falling() -> None:
    async with emulator(max_num_seqs=2, base_step_ms=5.0) as emu:
        seen: list[BackendSnapshot] = []
        watcher = _fast_watcher(emu, seen)
        async with watcher, httpx.AsyncClient(base_url=emu.base_url, timeout=30) as client:
            burst = [
                asyncio.ensure_future(
                    client.post("/v1/completions", json=completion_body(max_tokens=20))
                )
                for _ in range(12)
            ]
            await asyncio.wait_for(asyncio.gather(*burst), timeout=30)
            await wait_until(
                lambda: (
                    bool(seen) and seen[-1].ok and seen[-1].running == 0 and seen[-1].waiting == 0
                )
            )
        waiting = [snapshot.waiting for snapshot in seen if snapshot.ok]
        running = [snapshot.running for snapshot in seen if snapshot.ok]
        assert max(waiting) > 0 and max(running) == 2
        assert waiting[-1] == 0 and running[-1] == 0
        assert any(snapshot.tpot_s is not None for snapshot in seen)


async def test_watcher_reads_the_filtered_page_with_every_signal() -> None:
    """`metrics_filter` (the default): the emulator serves `/metrics/?name[]=...` as vLLM does,
    and every signal the whole page gives comes from it, the histograms' means included."""
    async with emulator(max_num_seqs=2, base_step_ms=5.0) as emu:
        seen: list[BackendSnapshot] = []
        watcher = _fast_watcher(emu, seen)
        async with watcher, httpx.AsyncClient(base_url=emu.base_url, timeout=30) as client:
            body = completion_body(max_tokens=20)
            burst = (client.post("/v1/completions", json=body) for _ in range(6))
            await asyncio.wait_for(asyncio.gather(*burst), timeout=30)
            await wait_until(lambda: bool(seen) and seen[-1].ok and seen[-1].running == 0)
            assert watcher.filtering
        assert all(snapshot.ok for snapshot in seen)
        assert max(snapshot.waiting for snapshot in seen) > 0
        assert any(snapshot.tpot_s is not None for snapshot in seen)
        assert any(snapshot.ttft_s is not None for snapshot in seen)
        assert seen[-1].requests_finished == 6
        assert seen[-1].kv_usage is not None


async def test_an_engine_without_the_filtered_page_is_read_whole_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The filtered page answers 404 (an engine or reverse proxy that serves only /metrics):
    the first scrape reads the whole page instead, no scrape fails, and one INFO line says so."""
    async with emulator(max_num_seqs=2, base_step_ms=5.0) as emu:
        emu.engine.faults.update({"metrics_filter": False})
        seen: list[BackendSnapshot] = []
        watcher = _fast_watcher(emu, seen)
        with caplog.at_level(logging.INFO, logger="fair_sched_plugin.engine_metrics.watcher"):
            async with watcher:
                assert watcher.filtering
                await wait_until(lambda: len(seen) >= 5)
                assert not watcher.filtering
        assert all(snapshot.ok for snapshot in seen)
        said = [r for r in caplog.records if "filtered by series name" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.INFO
        assert "HTTP 404" in said[0].getMessage()


async def test_a_server_error_fails_the_scrape_and_keeps_the_filter() -> None:
    """HTTP 500 says nothing about the filter (a restarting engine behind a reverse proxy):
    those scrapes fail as on the whole page, and the filtered page is read again after."""
    async with emulator(max_num_seqs=2, base_step_ms=5.0) as emu:
        seen: list[BackendSnapshot] = []
        emu.engine.faults.update({"metrics_mode": "error"})
        async with _fast_watcher(emu, seen) as watcher:
            await wait_until(lambda: len(seen) >= 3)
            assert not any(snapshot.ok for snapshot in seen) and watcher.filtering
            emu.engine.faults.update({"metrics_mode": "ok"})
            await wait_until(lambda: seen[-1].ok)
            assert watcher.filtering


@pytest.mark.parametrize("metrics_filter", [True, False])
async def test_the_services_watchers_follow_backends_metrics_filter(metrics_filter: bool) -> None:
    """`backends.<model>.metrics_filter` reaches the watcher: on (the default), the service
    reads the filtered page; off, the whole page. The gate gets fresh metrics either way."""
    async with emulator(max_num_seqs=2, base_step_ms=5.0) as emu:
        backend = {} if metrics_filter else {"metrics_filter": False}
        async with SchedulingService(fair_config(emu, backend=backend)) as service:
            await wait_until(lambda: service.gate.status()[0].mode == "metrics")
            (watcher,) = service.watchers()[MODEL]
            assert watcher.filtering is metrics_filter


@pytest.mark.timing
async def test_burst_of_1000_parked_requests_never_floods_the_engine_queue() -> None:
    """1,000 requests from 10 users wait in our queues; the engine's waiting queue stays within
    the threshold (the scrape lag is covered by the pending credits)."""
    async with emulator(max_num_seqs=8, base_step_ms=2.0) as emu:
        settings = fair_config(
            emu, waiting_below=3, queue={"max_per_user": 1000, "max_total": 2000}
        )
        async with (
            SchedulingService(settings) as service,
            httpx.AsyncClient(
                base_url=emu.base_url, timeout=120, limits=httpx.Limits(max_connections=None)
            ) as client,
        ):
            await wait_until(lambda: service.gate.status()[0].mode == "metrics")
            body = completion_body(max_tokens=4, stream=True)
            requests = [
                asyncio.ensure_future(_forward(service, client, f"sk-user-{i % 10}", body))
                for i in range(1000)
            ]
            try:
                await asyncio.wait_for(asyncio.gather(*requests), timeout=240)
            finally:
                await cancel_all(requests)
            stats = emu.engine.statistics()
            print(
                f"\n1000-request burst: engine max waiting {stats.max_waiting_seen} (threshold 3)"
            )
            assert stats.requests_finished == 1000
            assert stats.max_waiting_seen <= 3
            scheduler_stats = service.scheduler.statistics()
            assert (scheduler_stats.queued, scheduler_stats.in_flight) == (0, 0)


@pytest.mark.timing
async def test_tpot_ceiling_pauses_release_and_release_resumes() -> None:
    async with emulator(max_num_seqs=4, base_step_ms=8.0) as emu:
        settings = fair_config(emu, waiting_below=8)
        settings["tiers"][0]["tpot_below_ms"] = 2  # below what the engine can do while busy
        async with (
            SchedulingService(settings) as service,
            httpx.AsyncClient(base_url=emu.base_url, timeout=60) as client,
        ):
            await wait_until(lambda: service.gate.status()[0].mode == "metrics")
            # Tokens flowing: the engine's recent TPOT (~8 ms) is above the 2 ms ceiling.
            busy = [
                asyncio.ensure_future(
                    _forward(
                        service, client, "sk-busy", completion_body(max_tokens=150, stream=True)
                    )
                )
                for _ in range(2)
            ]
            await wait_until(lambda: (service.gate.status()[0].tpot_s or 0) > 0.002)
            later = [
                asyncio.ensure_future(
                    _forward(service, client, f"sk-{i}", completion_body(max_tokens=4, stream=True))
                )
                for i in range(6)
            ]
            try:
                await wait_until(lambda: service.scheduler.statistics().queued == 6)
                await wait_until(lambda: service.gate.status()[0].blocked_reason == "tpot")
                assert emu.engine.statistics().requests_received == 2
                # Once the long requests end, no tokens flow, TPOT is unknown: release resumes.
                await asyncio.wait_for(asyncio.gather(*busy, *later), timeout=60)
            finally:
                await cancel_all([*busy, *later])
            assert emu.engine.statistics().requests_finished == 8


async def _cpu_share(seconds: float) -> float:
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    return (time.process_time() - cpu_before) / (time.perf_counter() - wall_before)


async def _gate_modes_under(emu: RunningEmulator, fault: dict[str, Any]) -> list[str]:
    settings = fair_config(emu, metrics_poll_ms=20, stale_after_ms=200, metrics_timeout_ms=100)
    async with (
        SchedulingService(settings) as service,
        httpx.AsyncClient(base_url=emu.base_url) as admin,
    ):
        await wait_until(lambda: service.gate.status()[0].mode == "metrics")
        await admin.post("/emulator/faults", json=fault)
        await wait_until(lambda: service.gate.status()[0].mode == "fallback", timeout_s=10)
        # While the metrics are out, the in-flight cap still lets requests through.
        principal = service.identify(Credentials(api_key="sk-a"))
        admission = await asyncio.wait_for(
            service.admit(principal, MODEL, completion_body()), timeout=5
        )
        admission.lease.release()
        await admin.post("/emulator/faults", json={"metrics_mode": "ok", "metrics_delay_s": 0})
        await wait_until(lambda: service.gate.status()[0].mode == "metrics", timeout_s=10)
        return [transition.new for transition in service.observability.view.recent_transitions()]


async def test_failing_garbage_missing_and_slow_metrics_fall_back_and_recover() -> None:
    faults = [
        {"metrics_mode": "error"},
        {"metrics_mode": "garbage"},
        {"metrics_mode": "missing"},
        {"metrics_delay_s": 1.0},
    ]
    async with emulator() as emu:
        for fault in faults:
            modes = await _gate_modes_under(emu, fault)
            assert modes == ["metrics", "fallback", "metrics"], (fault, modes)


async def test_engine_down_falls_back_and_recovers_when_it_returns() -> None:
    async with emulator() as emu:
        port = emu.port
        settings = fair_config(emu, metrics_poll_ms=20, stale_after_ms=200, metrics_timeout_ms=100)
    # The engine is gone now; the service starts against a dead address.
    async with SchedulingService(settings) as service:
        await wait_until(lambda: service.gate.status()[0].mode == "fallback", timeout_s=10)
        async with run_emulator(emulator_config(), port=port) as emu_again:
            assert emu_again.port == port
            await wait_until(lambda: service.gate.status()[0].mode == "metrics", timeout_s=10)


@pytest.mark.timing
async def test_idle_gate_with_parked_requests_burns_almost_no_cpu() -> None:
    """Parked requests cost nothing while the gate is closed: only the watcher's scrapes run."""
    async with emulator(max_num_seqs=1, base_step_ms=5.0) as emu:
        settings = fair_config(emu, waiting_below=1)
        async with (
            SchedulingService(settings) as service,
            httpx.AsyncClient(base_url=emu.base_url, timeout=60) as client,
        ):
            await wait_until(lambda: service.gate.status()[0].mode == "metrics")
            # Hold the engine: one long request keeps everything else parked.
            blocker = asyncio.ensure_future(
                _forward(service, client, "sk-block", completion_body(max_tokens=5000, stream=True))
            )
            await wait_until(lambda: service.scheduler.statistics().in_flight == 1)
            baseline = await _cpu_share(1.0)
            parked = [
                asyncio.ensure_future(
                    _forward(service, client, f"sk-{i}", completion_body(max_tokens=1, stream=True))
                )
                for i in range(200)
            ]
            # One more fits into the engine's waiting queue (waiting_below 1); the rest park.
            await wait_until(lambda: service.scheduler.statistics().queued == 199)
            with_parked = await _cpu_share(1.0)
            print(
                f"\nidle gate: CPU share of this process (emulator streaming one request + watcher) "
                f"{baseline:.1%} without parked requests, {with_parked:.1%} with 199 parked"
            )
            assert service.scheduler.statistics().queued == 199
            # Nothing polls parked requests: they add (almost) nothing to the baseline.
            assert with_parked < baseline * 1.5 + 0.05
            await cancel_all([blocker, *parked])


@pytest.mark.timing
async def test_two_deployments_each_hold_their_own_threshold_and_the_faster_serves_more() -> None:
    """Unequal deployments on real servers: two emulators behind one model name, one three times slower
    per step, 200 parked requests. Each engine's own waiting queue stays within the threshold
    (summed, the slow one's grew past it while the fast one had room), every request goes to the
    deployment its lease is bound to, and the faster engine serves more of them."""
    async with (
        emulator(max_num_seqs=4, base_step_ms=10.0) as fast,
        emulator(max_num_seqs=4, base_step_ms=30.0) as slow,
    ):
        settings = fair_config(
            fast,
            waiting_below=3,
            backend={"api_bases": [f"{slow.base_url}/v1"]},
            queue={"max_per_user": 1000, "max_total": 2000},
        )
        engines = {f"{fast.base_url}/v1": fast, f"{slow.base_url}/v1": slow}
        async with (
            SchedulingService(settings) as service,
            httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client,
        ):
            await wait_until(lambda: service.gate.status()[0].mode == "metrics")
            body = completion_body(max_tokens=8, stream=True)

            async def forward(user: str) -> None:
                principal = service.identify(Credentials(api_key=user))
                admission = await service.admit(principal, MODEL, body)
                deployment = admission.lease.deployment
                assert deployment in engines
                try:
                    url = f"{deployment}/completions"
                    async with client.stream("POST", url, json=body) as response:
                        async for _ in response.aiter_raw():
                            admission.lease.mark_started()
                finally:
                    admission.lease.release()

            requests = [asyncio.ensure_future(forward(f"sk-user-{i % 10}")) for i in range(200)]
            try:
                await asyncio.wait_for(asyncio.gather(*requests), timeout=240)
            finally:
                await cancel_all(requests)
        fast_stats, slow_stats = fast.engine.statistics(), slow.engine.statistics()
        print(
            f"\ntwo deployments: fast served {fast_stats.requests_finished} (max waiting "
            f"{fast_stats.max_waiting_seen}), slow {slow_stats.requests_finished} (max waiting "
            f"{slow_stats.max_waiting_seen}), threshold 3 each"
        )
        assert fast_stats.requests_finished + slow_stats.requests_finished == 200
        assert fast_stats.max_waiting_seen <= 3
        assert slow_stats.max_waiting_seen <= 3
        # In proportion to speed (2.4 to 1 measured here; a router blind to load splits evenly).
        assert fast_stats.requests_finished > 1.5 * slow_stats.requests_finished > 0
