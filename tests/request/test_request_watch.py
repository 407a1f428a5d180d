"""`RequestWatch`'s send timeout with one timer per request: a client that reads slowly but
keeps reading is served; one that stops reading for `send_timeout_s` is cut off.

The app and the server's `send` are plain ASGI callables: no network, the real event loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fair_sched_plugin.core import Lease
from fair_sched_plugin.errors import InvalidRequest, LeaseExpired
from fair_sched_plugin.request.watch import CONNECTION_LOST_EXTENSION, RequestWatch
from fair_sched_plugin.testing import GateLeaseOwner, make_ticket

SEND_TIMEOUT_S = 0.5
# Each send of the slow reader takes a tenth of the timeout; there are thirty of them.
SLOW_SEND_S = SEND_TIMEOUT_S / 10
CHUNKS = 30


class _Gate:
    def on_started(self, lease: Lease) -> None:
        pass

    def on_ended(self, lease: Lease) -> None:
        pass


def _lease() -> Lease:
    return Lease(GateLeaseOwner(_Gate()), make_ticket("u"), 1, 0.0, 0.0, 0.0)


async def _receive() -> dict[str, Any]:
    await asyncio.Event().wait()  # the client never leaves
    raise AssertionError("unreachable")


def _streaming_app(watch_holder: list[RequestWatch], lease: Lease) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        watch_holder[0].hold(lease)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(CHUNKS):
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def test_a_slow_reader_that_keeps_reading_is_served_past_the_send_timeout() -> None:
    """Every send takes a tenth of `send_timeout_s` and all of them three times it: the
    timer set at the first send moves on to the running send's deadline, never ends it."""
    sent: list[dict[str, Any]] = []

    async def slow_send(message: dict[str, Any]) -> None:
        await asyncio.sleep(SLOW_SEND_S)
        sent.append(message)

    lease = _lease()
    watch = RequestWatch(_receive, slow_send, send_timeout_s=SEND_TIMEOUT_S)
    await watch.run(_streaming_app([watch], lease), {"type": "http", "headers": []})
    assert watch.stopped is None
    assert len(sent) == CHUNKS + 2
    assert lease.started and not lease.active


async def test_a_reader_that_stops_is_cut_off_after_quick_sends_before() -> None:
    """Quick sends first (the timer is set by the first and outlives them), then one that never
    returns: the request is stopped for the send timeout and its lease ends."""
    sent: list[dict[str, Any]] = []
    stall = asyncio.Event()

    async def stalling_send(message: dict[str, Any]) -> None:
        if len(sent) == 5:
            await stall.wait()  # the client stopped reading: its buffers are full
        sent.append(message)

    lease = _lease()
    watch = RequestWatch(_receive, stalling_send, send_timeout_s=SEND_TIMEOUT_S)
    await asyncio.wait_for(
        watch.run(_streaming_app([watch], lease), {"type": "http", "headers": []}),
        SEND_TIMEOUT_S * 20,
    )
    assert isinstance(watch.stopped, LeaseExpired)
    assert "stopped reading" in str(watch.stopped)
    assert len(sent) == 5
    assert not lease.active


class _RecordingOwner:
    """A lease owner that records what it hears, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int | None]] = []

    def lease_started(self, lease: Lease) -> None:
        self.events.append(("started", None))

    def lease_ended(self, lease: Lease, tokens_used: int | None, *, abandoned: bool) -> None:
        self.events.append(("abandoned" if abandoned else "ended", tokens_used))


async def _run_hook_app(report: Any) -> list[tuple[str, int | None]]:
    """A request whose app holds a lease, reports to the watch as LiteLLM's hooks do
    (`report(watch, lease)`), then answers with a body; what the lease's owner heard."""
    owner = _RecordingOwner()
    lease = Lease(owner, make_ticket("u"), 1, 0.0, 0.0, 0.0)
    watch = RequestWatch(_receive, _server_send)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        watch.hold(lease)
        watch.forwarded()
        report(watch, lease)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})
        report(watch, lease)  # a late hook (LiteLLM's success log event): ignored

    await watch.run(app, {"type": "http", "headers": []})
    return owner.events


async def _server_send(message: dict[str, Any]) -> None:
    pass


async def test_the_watch_marks_the_first_byte_then_ends_the_lease_once_with_the_usage() -> None:
    def answered(watch: RequestWatch, lease: Lease) -> None:
        watch.engine_answered(lease)
        watch.report(lease, 42, None)

    assert await _run_hook_app(answered) == [("started", None), ("ended", 42)]


async def test_no_answer_from_the_engine_ends_the_lease_before_our_own_answer() -> None:
    """Our error answer goes out after: it is not the engine's first byte."""

    def never(watch: RequestWatch, lease: Lease) -> None:
        watch.engine_never_answered(lease)

    assert await _run_hook_app(never) == [("abandoned", None)]


async def test_a_timeout_is_charged_what_the_engine_can_have_generated() -> None:
    def timed_out(watch: RequestWatch, lease: Lease) -> None:
        watch.interrupted_tokens = lambda lease: 7
        watch.engine_timed_out(lease)

    assert await _run_hook_app(timed_out) == [("ended", 7)]


async def test_a_server_that_calls_back_on_a_lost_connection_replaces_the_watching_task() -> None:
    """With the scope's `CONNECTION_LOST_EXTENSION` the watch registers a callback instead of
    starting a task that reads `receive()`; the callback stops the app holding a lease (the
    client left), the app keeps `receive()` to itself, and the watch forgets the callback once
    it closes."""
    registered: list[Any] = []
    body = {"type": "http.request", "body": b"{}", "more_body": False}
    received: list[dict[str, Any]] = [body]

    async def receive() -> dict[str, Any]:
        return received.pop(0) if received else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    lease = _lease()
    watch = RequestWatch(receive, send)
    stopped = asyncio.Event()

    async def app(scope: Any, app_receive: Any, app_send: Any) -> None:
        assert await app_receive() == body
        watch.hold(lease)
        tasks_before = len(asyncio.all_tasks())
        assert watch.watch() is watch.disconnected
        assert len(asyncio.all_tasks()) == tasks_before, "a task watches the client"
        assert len(registered) == 1 and callable(registered[0])
        try:
            await asyncio.Event().wait()  # parked until the client leaves
        except asyncio.CancelledError:
            stopped.set()
            raise

    def when_lost(callback: Any, call: bool) -> None:
        registered.append(callback if call else None)

    scope = {"type": "http", "extensions": {CONNECTION_LOST_EXTENSION: when_lost}}
    running = asyncio.ensure_future(watch.run(app, scope))
    await _until(lambda: bool(registered))
    registered[0]()  # the connection is lost
    await running
    assert stopped.is_set()
    assert watch.disconnected.is_set()
    assert registered[-1] is None, "the callback is still registered after the request"


async def _until(condition: Any) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never")


def test_the_max_wait_header_takes_plain_decimal_seconds() -> None:
    def read(value: bytes, configured_s: float = 60.0) -> float | None:
        return RequestWatch(None, None, max_wait_header=value).max_wait_s(configured_s)

    assert read(b"2") == 2.0
    assert read(b" 1.5 ") == 1.5
    assert read(b".25") == 0.25
    assert read(b"3.") == 3.0
    assert read(b"90") is None  # not below the configured wait: the configured one holds
    for bad in (b"1_0", b"1e3", b"+5", b"0", b"0.000", b"1" * 10, b"1.5.2", b""):
        with pytest.raises(InvalidRequest):
            read(bad)
