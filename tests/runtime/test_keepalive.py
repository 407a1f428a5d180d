"""The loop's keep-alive clock (`_keepalive.KeepAliveTicks`) and a parked stream on it: one
tick wakes every waiting stream; a client that does not take its comment is treated as gone.

The real event loop with short intervals; every wait is for an event, none proves an absence."""

from __future__ import annotations

import asyncio
from typing import Any

from fair_sched_plugin.config import QueueSettings
from fair_sched_plugin.core import Ticket
from fair_sched_plugin.request.watch import RequestWatch
from fair_sched_plugin.runtime.keepalive import KeepAliveTicks, ticks_for

INTERVAL_S = 0.01


class _Stream:
    def __init__(self) -> None:
        self.stalled = asyncio.Event()

    def send_stalled(self) -> None:
        self.stalled.set()


async def test_one_tick_wakes_every_waiting_stream_and_a_cancelled_one_disturbs_none() -> None:
    """Race: a stream's task is cancelled while it waits for the tick (its request was
    released): only its own wait ends; the others are woken by the tick as usual."""
    ticks = KeepAliveTicks(asyncio.get_running_loop(), INTERVAL_S)
    waits = [ticks.next_tick() for _ in range(5)]
    await asyncio.sleep(0)
    waits[2].cancel()
    _, pending = await asyncio.wait(waits, timeout=10)
    assert not pending
    assert [w.cancelled() for w in waits] == [False, False, True, False, False]


async def test_a_send_not_taken_within_the_timeout_is_reported_and_a_taken_one_is_not() -> None:
    ticks = KeepAliveTicks(asyncio.get_running_loop(), INTERVAL_S)
    quick, stuck = _Stream(), _Stream()
    ticks.sending(quick)
    ticks.sending(stuck)
    ticks.sent(quick)  # taken: it leaves the watch before any tick looks
    await asyncio.wait_for(stuck.stalled.wait(), 10)  # after max(interval, 1 s)
    assert not quick.stalled.is_set()


async def test_the_running_loop_has_one_clock_per_interval() -> None:
    assert ticks_for(1.0) is ticks_for(1.0)
    assert ticks_for(1.0) is not ticks_for(2.0)


class _Parked:
    """What the watch reads from a parked request (`service.ParkedRequest`)."""

    queue = QueueSettings(keepalive_after_s=0.001, keepalive_interval_s=INTERVAL_S)
    ticket = Ticket(model="m", user="alice", tier="interactive")

    waited_s = 0.0

    def standing(self) -> tuple[int, float | None, float]:
        return 1, None, self.waited_s

    def wait_s(self) -> float:
        return self.waited_s


async def test_a_client_that_stops_taking_comments_is_treated_as_gone() -> None:
    """Race: the tick finds the comment's send stalled and cancels the keep-alive inside the
    server's `send()`: the request counts as disconnected (so it leaves the queue) and no
    comment follows."""
    comments: list[bytes] = []
    reading = asyncio.Event()

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body":
            comments.append(message["body"])
            if len(comments) == 2:
                await reading.wait()  # the client stopped reading: never set

    watch = RequestWatch(None, send)
    watch.streaming = True
    watch.parked(_Parked())  # type: ignore[arg-type]
    await asyncio.wait_for(watch.disconnected.wait(), 10)
    assert len(comments) == 2 and all(c.startswith(b": queued position=1") for c in comments)
    watch.unparked()
    watch.close()


def _comments_recorded() -> tuple[list[bytes], asyncio.Event, Any]:
    """A server's `send` that keeps the comments sent, and an event set by the first."""
    comments: list[bytes] = []
    first = asyncio.Event()

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body":
            comments.append(message["body"])
            first.set()

    return comments, first, send


async def test_the_first_comment_is_due_from_when_the_request_parked() -> None:
    """A stream the server held while it waited (its app starts when the first comment is
    due) gets that comment at once, not `keepalive_after_s` after its app started."""
    comments, first, send = _comments_recorded()

    class _ParkedLong(_Parked):
        queue = QueueSettings(keepalive_after_s=3600, keepalive_interval_s=INTERVAL_S)
        waited_s = 3600.0

    watch = RequestWatch(None, send)
    watch.streaming = True
    watch.parked(_ParkedLong())  # type: ignore[arg-type]
    await asyncio.wait_for(first.wait(), 10)
    watch.unparked()
    watch.close()
    assert comments[0].startswith(b": queued position=1")


async def test_a_parked_stream_holds_no_task_until_its_first_comment_is_due() -> None:
    """Most streams leave the queue before `keepalive_after_s`: until then a stream waits on a
    timer, and the task that sends its comments is made when the first is due."""
    comments, first, send = _comments_recorded()

    class _ParkedLater(_Parked):
        queue = QueueSettings(keepalive_after_s=0.05, keepalive_interval_s=INTERVAL_S)

    before = asyncio.all_tasks()
    watch = RequestWatch(None, send)
    watch.streaming = True
    watch.parked(_ParkedLater())  # type: ignore[arg-type]
    assert asyncio.all_tasks() == before
    await asyncio.wait_for(first.wait(), 10)
    assert len(asyncio.all_tasks() - before) == 1  # the stream's comment sender
    watch.unparked()
    watch.close()
    assert comments[0].startswith(b": queued position=1")
