from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from fair_sched_plugin.core.snapshot import BackendSnapshot
from fair_sched_plugin.engine_metrics import VLLM_PROFILE, MetricsWatcher

from .conftest import FakeEngine, LoopbackServer, vllm_text

# Upper bound on any single wait in these tests; the scrapes themselves take milliseconds.
WAIT_S = 3.0


class Snapshots:
    """Collects what a watcher reports, so a test can await the next one."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[BackendSnapshot] = asyncio.Queue()
        self.seen: list[BackendSnapshot] = []

    def __call__(self, snapshot: BackendSnapshot) -> None:
        self.seen.append(snapshot)
        self.queue.put_nowait(snapshot)

    async def next(self, timeout: float = WAIT_S) -> BackendSnapshot:
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def until(
        self, accept: Callable[[BackendSnapshot], bool], attempts: int = 20
    ) -> BackendSnapshot:
        for _ in range(attempts):
            snapshot = await self.next()
            if accept(snapshot):
                return snapshot
        raise AssertionError(f"no matching snapshot in {attempts}: {self.seen[-3:]}")


@pytest.fixture
def snapshots() -> Snapshots:
    return Snapshots()


def make_watcher(
    url: str, on_snapshot: Callable[[BackendSnapshot], None], **options: object
) -> MetricsWatcher:
    settings: dict[str, object] = {"model_name": "tiny", "interval_s": 0.05, "timeout_s": 0.5}
    settings.update(options)
    return MetricsWatcher(url, VLLM_PROFILE, on_snapshot=on_snapshot, **settings)  # type: ignore[arg-type]


@pytest.fixture
async def watcher(loopback: LoopbackServer, snapshots: Snapshots) -> AsyncIterator[MetricsWatcher]:
    async with make_watcher(loopback.url, snapshots) as running:
        yield running


# -- against a real server on 127.0.0.1 ----------------------------------------------------------


async def test_scrape_reports_the_engines_numbers(
    watcher: MetricsWatcher, snapshots: Snapshots
) -> None:
    snapshot = await snapshots.next()
    assert snapshot.ok and snapshot.error is None
    assert (snapshot.waiting, snapshot.running, snapshot.kv_usage) == (2, 5, 0.5)
    assert snapshot.url == watcher.url
    assert snapshot.tpot_s is None  # nothing to compare with yet
    assert watcher.last_snapshot is not None and watcher.last_snapshot.ok
    assert watcher.scrapes_total >= 1 and watcher.failures_total == 0


async def test_real_capture_served_over_http(
    loopback: LoopbackServer, engine: FakeEngine, snapshots: Snapshots, midburst_text: str
) -> None:
    engine.text = midburst_text
    async with make_watcher(loopback.url, snapshots):
        snapshot = await snapshots.next()
    assert snapshot.ok
    assert (snapshot.waiting, snapshot.running) == (22, 8)
    assert snapshot.requests_finished == 116  # request_success_total over its five reasons


async def test_recent_tpot_comes_from_consecutive_scrapes(
    watcher: MetricsWatcher, engine: FakeEngine, snapshots: Snapshots
) -> None:
    await snapshots.next()
    engine.text = vllm_text(tpot_sum=1.0 + 20 * 0.08, tpot_count=100 + 20)
    snapshot = await snapshots.until(lambda s: s.tpot_s is not None)
    assert snapshot.tpot_s == pytest.approx(0.08)


async def test_recent_engine_ttft_and_queue_time_come_from_consecutive_scrapes(
    watcher: MetricsWatcher, engine: FakeEngine, snapshots: Snapshots
) -> None:
    """Inputs of `waiting_below: auto`: the means over the last interval."""
    histograms = (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="tiny"}} {ttft_sum}\n'
        'vllm:time_to_first_token_seconds_count{{engine="0",model_name="tiny"}} {count}\n'
        "# TYPE vllm:request_queue_time_seconds histogram\n"
        'vllm:request_queue_time_seconds_sum{{engine="0",model_name="tiny"}} {queue_sum}\n'
        'vllm:request_queue_time_seconds_count{{engine="0",model_name="tiny"}} {count}\n'
    )
    engine.text = vllm_text() + histograms.format(ttft_sum=10.0, queue_sum=5.0, count=20)
    await snapshots.until(lambda s: s.ok and s.ttft_s is None)
    # 10 more requests: 15 s more to first token, 12 s more queued.
    engine.text = vllm_text() + histograms.format(ttft_sum=25.0, queue_sum=17.0, count=30)
    snapshot = await snapshots.until(lambda s: s.ttft_s is not None)
    assert snapshot.ttft_s == pytest.approx(1.5)
    assert snapshot.queue_time_s == pytest.approx(1.2)


async def test_prefix_cache_hit_rate_comes_from_consecutive_scrapes(
    watcher: MetricsWatcher, engine: FakeEngine, snapshots: Snapshots
) -> None:
    counters = (
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        'vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {queries}\n'
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {hits}\n'
    )
    engine.text = vllm_text() + counters.format(queries=1000, hits=100)
    await snapshots.until(lambda s: watcher.prefix_cache_hit_rate is None and s.ok)
    # 400 more prompt tokens looked up, 300 of them found: 75 % in this interval.
    engine.text = vllm_text() + counters.format(queries=1400, hits=400)
    await snapshots.until(lambda s: watcher.prefix_cache_hit_rate is not None)
    assert watcher.prefix_cache_hit_rate == pytest.approx(0.75)


async def test_garbage_then_500_then_recovery(
    watcher: MetricsWatcher, engine: FakeEngine, snapshots: Snapshots
) -> None:
    assert (await snapshots.next()).ok
    engine.mode = "garbage"
    garbage = await snapshots.until(lambda s: not s.ok)
    assert garbage.error is not None and "not Prometheus text" in garbage.error
    engine.mode = "error"
    server_error = await snapshots.until(lambda s: s.error == "HTTP 500")
    assert server_error.waiting == 0  # meaningless on a failed snapshot; `ok` is what counts
    engine.mode = "ok"
    recovered = await snapshots.until(lambda s: s.ok)
    assert recovered.waiting == 2
    assert watcher.failures_total >= 2
    assert watcher.scrapes_total > watcher.failures_total


async def test_slow_endpoint_fails_with_a_timeout(
    loopback: LoopbackServer, engine: FakeEngine, snapshots: Snapshots
) -> None:
    engine.mode = "slow"
    async with make_watcher(loopback.url, snapshots, timeout_s=0.2):
        snapshot = await snapshots.next()
    assert not snapshot.ok
    assert snapshot.error is not None and "timed out" in snapshot.error


async def test_a_slow_but_answering_engine_gets_a_longer_deadline(
    loopback: LoopbackServer, engine: FakeEngine, snapshots: Snapshots
) -> None:
    """vLLM's /metrics on a starved CPU can take longer than the scrape timeout every
    time; cut off at the timeout, every scrape would fail and the gate fall back although the engine
    answers. Answers 3x later than `timeout_s`: the deadline doubles after each timeout (up to 4x) and
    the scrapes then succeed; once they come back quickly the deadline shrinks towards `timeout_s`."""
    engine.delay_s = 0.3
    async with make_watcher(loopback.url, snapshots, timeout_s=0.1) as watcher:
        assert not (await snapshots.next()).ok
        good = await snapshots.until(lambda s: s.ok, attempts=6)
        assert good.waiting == 2
        slow_deadline = watcher.deadline_s
        assert slow_deadline > 0.1
        engine.delay_s = 0.0
        for _ in range(20):
            await snapshots.until(lambda s: s.ok)
            if watcher.deadline_s < slow_deadline / 2:
                break
        assert 0.1 <= watcher.deadline_s < slow_deadline / 2


async def test_a_hung_engine_is_given_up_on_within_the_longest_deadline(
    loopback: LoopbackServer, engine: FakeEngine, snapshots: Snapshots
) -> None:
    """The deadline never exceeds `longest_timeout_s`: a hung engine still fails each scrape."""
    engine.mode = "slow"
    async with make_watcher(
        loopback.url, snapshots, timeout_s=0.05, longest_timeout_s=0.1
    ) as watcher:
        for _ in range(4):
            failed = await snapshots.next()
            assert not failed.ok and failed.error is not None and "timed out" in failed.error
        assert watcher.deadline_s == 0.1


async def test_engine_down_then_back(
    watcher: MetricsWatcher, loopback: LoopbackServer, snapshots: Snapshots
) -> None:
    assert (await snapshots.next()).ok
    await loopback.stop()
    down = await snapshots.until(lambda s: not s.ok)
    assert down.error
    await loopback.start()
    assert (await snapshots.until(lambda s: s.ok)).ok


async def test_early_scrape_comes_before_the_interval(
    loopback: LoopbackServer, snapshots: Snapshots
) -> None:
    async with make_watcher(loopback.url, snapshots, interval_s=5.0, min_gap_s=0.01) as watcher:
        first = await snapshots.next()
        watcher.request_early_scrape()
        # Well under the 5 s interval: only the early request can explain a second scrape.
        second = await snapshots.next(timeout=2.0)
    assert second.started_at > first.started_at


async def test_early_scrapes_respect_the_minimum_gap(
    loopback: LoopbackServer, engine: FakeEngine, snapshots: Snapshots
) -> None:
    loop = asyncio.get_running_loop()
    async with make_watcher(loopback.url, snapshots, interval_s=5.0, min_gap_s=0.2) as watcher:
        await snapshots.next()
        began = loop.time()
        for _ in range(50):  # a request every ~10 ms
            watcher.request_early_scrape()
            await asyncio.sleep(0.01)
        elapsed = loop.time() - began
    # At most one early scrape per gap (plus the first and one in flight); ignoring the gap would
    # mean ~50.
    assert 2 <= engine.requests <= 2 + elapsed / 0.2 + 1


async def test_idle_watcher_is_not_a_hot_loop(
    loopback: LoopbackServer, engine: FakeEngine, snapshots: Snapshots
) -> None:
    """Each scrape waits its interval: five readings take at least four intervals (a lower
    bound on elapsed time, which a slow machine only makes longer), one request each."""
    loop = asyncio.get_running_loop()
    async with make_watcher(loopback.url, snapshots, interval_s=0.05):
        await snapshots.next()
        began = loop.time()
        for _ in range(4):
            await snapshots.next()
        elapsed = loop.time() - began
        requests = engine.requests
    assert elapsed >= 4 * 0.05 * 0.9
    assert requests <= 5 + 1  # the five read, and at most one more already on its way


async def test_started_at_is_taken_from_the_clock_before_the_request(
    snapshots: Snapshots,
) -> None:
    now = [1000.0]

    def slow_engine(request: httpx.Request) -> httpx.Response:
        now[0] += 100.0  # time passes while the engine answers
        return httpx.Response(200, text=vllm_text())

    async with (
        mock_client(slow_engine) as client,
        make_watcher("http://engine.test/metrics", snapshots, client=client, clock=lambda: now[0]),
    ):
        snapshot = await snapshots.next()
    assert snapshot.ok
    assert snapshot.started_at == 1000.0


# -- lifecycle -----------------------------------------------------------------------------------


async def test_aclose_stops_the_task_and_closes_its_own_connection(
    loopback: LoopbackServer, engine: FakeEngine, snapshots: Snapshots
) -> None:
    watcher = make_watcher(loopback.url, snapshots)
    watcher.start()
    await snapshots.next()
    connection = watcher._plain  # a plain http:// engine: read without httpx
    assert connection is not None and connection.connected
    await watcher.aclose()
    assert not watcher.is_running
    assert not connection.connected
    # The loop's task is done (not only cancelled): nothing is left to send another request.
    assert watcher._task is None or watcher._task.done()
    await watcher.aclose()  # idempotent


async def test_behind_a_proxy_from_the_environment_it_scrapes_with_its_own_httpx_client(
    monkeypatch: pytest.MonkeyPatch, snapshots: Snapshots
) -> None:
    """httpx honours HTTP_PROXY; the plain connection would not, so it is not used."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    watcher = make_watcher("http://engine.test/metrics", snapshots)
    assert watcher._plain is None
    watcher.start()
    owned_client = watcher._client
    await watcher.aclose()
    assert owned_client is not None and owned_client.is_closed


async def test_injected_client_is_left_open(loopback: LoopbackServer, snapshots: Snapshots) -> None:
    async with httpx.AsyncClient() as client:
        async with make_watcher(loopback.url, snapshots, client=client):
            assert (await snapshots.next()).ok
        assert not client.is_closed


async def test_closed_watcher_cannot_restart(snapshots: Snapshots) -> None:
    watcher = make_watcher("http://127.0.0.1:9/metrics", snapshots)
    await watcher.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        watcher.start()


async def test_start_twice_is_an_error(loopback: LoopbackServer, snapshots: Snapshots) -> None:
    async with make_watcher(loopback.url, snapshots) as watcher:
        with pytest.raises(RuntimeError, match="already started"):
            watcher.start()


def test_start_needs_a_running_loop() -> None:
    watcher = make_watcher("http://127.0.0.1:9/metrics", lambda snapshot: None)
    with pytest.raises(RuntimeError):
        watcher.start()


async def test_aclose_while_a_scrape_hangs(
    loopback: LoopbackServer, engine: FakeEngine, snapshots: Snapshots
) -> None:
    engine.mode = "slow"
    watcher = make_watcher(loopback.url, snapshots, timeout_s=30.0)
    watcher.start()
    for _ in range(100):  # until the request is at the server
        if engine.requests:
            break
        await asyncio.sleep(0.01)
    await asyncio.wait_for(watcher.aclose(), timeout=WAIT_S)
    assert not watcher.is_running
    assert snapshots.seen == []


# -- with httpx.MockTransport ----------------------------------------------------------------------


def mock_client(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_mock_transport_ok(snapshots: Snapshots) -> None:
    async with (
        mock_client(lambda request: httpx.Response(200, text=vllm_text(waiting=7))) as client,
        make_watcher("http://engine.test/metrics", snapshots, client=client),
    ):
        snapshot = await snapshots.next()
    assert snapshot.ok and snapshot.waiting == 7


async def test_oversized_body_fails(snapshots: Snapshots) -> None:
    body = vllm_text().encode() + b"# padding\n" * 200
    async with (
        mock_client(lambda request: httpx.Response(200, content=body)) as client,
        make_watcher("http://engine.test/metrics", snapshots, client=client, max_body_bytes=1000),
    ):
        snapshot = await snapshots.next()
    assert not snapshot.ok
    assert snapshot.error is not None and "larger than 1000 bytes" in snapshot.error


async def test_oversized_streamed_body_without_length_fails(snapshots: Snapshots) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b"# padding\n" * 10

    async with (
        mock_client(lambda request: httpx.Response(200, content=chunks())) as client,
        make_watcher("http://engine.test/metrics", snapshots, client=client, max_body_bytes=1000),
    ):
        snapshot = await snapshots.next()
    assert snapshot.error is not None and "larger than" in snapshot.error


async def test_non_utf8_body_fails(snapshots: Snapshots) -> None:
    async with (
        mock_client(lambda request: httpx.Response(200, content=b"\xff\xfe\x00junk")) as client,
        make_watcher("http://engine.test/metrics", snapshots, client=client),
    ):
        snapshot = await snapshots.next()
    assert snapshot.error == "body is not UTF-8 text"


async def test_connection_error_is_translated(snapshots: Snapshots) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with (
        mock_client(refuse) as client,
        make_watcher("http://engine.test/metrics", snapshots, client=client),
    ):
        snapshot = await snapshots.next()
    assert snapshot.error == "ConnectError: connection refused"


async def test_failures_are_not_logged_as_warnings(
    snapshots: Snapshots, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="fair_sched_plugin.engine_metrics")
    async with (
        mock_client(lambda request: httpx.Response(503)) as client,
        make_watcher("http://engine.test/metrics", snapshots, client=client),
    ):
        for _ in range(3):
            assert (await snapshots.next()).error == "HTTP 503"
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert any("HTTP 503" in record.getMessage() for record in caplog.records)


async def test_a_bug_does_not_kill_the_loop(
    snapshots: Snapshots, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    def flaky(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise KeyError("a bug in a transport")
        return httpx.Response(200, text=vllm_text())

    async with (
        mock_client(flaky) as client,
        make_watcher("http://engine.test/metrics", snapshots, client=client),
    ):
        first = await snapshots.next()
        recovered = await snapshots.until(lambda s: s.ok)
    assert first.error == "internal error: KeyError"
    assert recovered.ok
    # One traceback for the streak, not one per scrape.
    assert len([record for record in caplog.records if record.levelno >= logging.ERROR]) == 1


async def test_a_failing_callback_does_not_kill_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    delivered = 0

    def broken_gate(snapshot: BackendSnapshot) -> None:
        nonlocal delivered
        delivered += 1
        raise RuntimeError("gate bug")

    async with (
        mock_client(lambda request: httpx.Response(200, text=vllm_text())) as client,
        make_watcher("http://engine.test/metrics", broken_gate, client=client) as watcher,
    ):
        for _ in range(100):
            if delivered >= 3:
                break
            await asyncio.sleep(0.02)
        assert watcher.is_running
    assert delivered >= 3
    assert len([record for record in caplog.records if record.levelno >= logging.ERROR]) == 1
