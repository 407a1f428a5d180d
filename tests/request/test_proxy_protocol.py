"""`fair-sched proxy`'s protocol parks a scheduled request at the server: until its turn it
holds no task (its app starts when its wait is over), and everything else about the request is
as before: answered when released, withdrawn when its client leaves, refused by a drain, and
requests the middleware does not take (a client waiting for `100 Continue`) run as uvicorn
runs them. Real servers on 127.0.0.1 (the proxy in this loop, as `fair-sched proxy` serves
it; the emulator as its engine)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from fair_sched_plugin.asgi import FairSchedulerMiddleware

from ..hardening.test_request_body_cost import (
    ANSWER_WAIT_S,
    answer_logged,
    behind_full_engine,
    connect,
    post_head,
    proxy,
)
from ..integrations.conftest import chat_body, wait_until

PARKED = 20


def make_room(emu: Any) -> None:
    """The engine, full of two long streams, gets slots for every other request."""
    emu.engine.config = dataclasses.replace(emu.engine.config, max_num_seqs=PARKED + 4)


async def test_parked_requests_hold_no_task_and_are_answered_once_released() -> None:
    body = json.dumps(chat_body(user="parked")).encode()
    async with behind_full_engine() as (base_url, service, emu):
        before = len(asyncio.all_tasks())
        connections = []
        for _ in range(PARKED):
            reader, writer = await connect(base_url)
            writer.write(post_head("sk-a", len(body)) + body)
            await writer.drain()
            connections.append((reader, writer))
        await wait_until(lambda: service.scheduler.statistics().queued == PARKED)
        # None holds a task (a request run by its app holds two: uvicorn's and the app's);
        # the client's own connections here make none.
        assert len(asyncio.all_tasks()) - before < PARKED // 4
        statuses = []
        make_room(emu)  # the gate releases them
        for reader, writer in connections:
            status, _answer = await read_answer_on(reader)
            statuses.append(status)
            writer.close()
    assert statuses == [200] * PARKED


async def read_answer_on(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """A kept-alive connection's answer: its head and a body of `Content-Length` or chunks."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT_S)
    if b"transfer-encoding: chunked" in head.lower():
        body = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), ANSWER_WAIT_S)
    else:
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = await asyncio.wait_for(reader.readexactly(length), ANSWER_WAIT_S)
    return int(head.split(b" ", 2)[1]), head + body


async def test_a_drain_refuses_a_request_parked_at_the_server() -> None:
    """A SIGTERM's drain refuses what is parked (503 `shutting_down`), with no app task made
    for it until then."""
    body = json.dumps(chat_body(user="drained")).encode()
    async with behind_full_engine() as (base_url, service, _emu):
        reader, writer = await connect(base_url)
        writer.write(post_head("sk-a", len(body)) + body)
        await writer.drain()
        await wait_until(lambda: service.scheduler.statistics().queued == 1)
        service.begin_drain()
        status, answer = await read_answer_on(reader)
        writer.close()
    assert status == 503, answer
    assert b"shutting_down" in answer


async def test_a_client_waiting_for_100_continue_gets_it_and_its_answer() -> None:
    """Not taken at the server (it sends its body only when the app asks for it)."""
    body = json.dumps(chat_body(user="expects")).encode()
    async with behind_full_engine() as (base_url, service, emu):
        reader, writer = await connect(base_url)
        head = post_head("sk-a", len(body))
        writer.write(head[:-2] + b"Expect: 100-continue\r\n\r\n")
        await writer.drain()
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT_S)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        writer.write(body)
        await writer.drain()
        await wait_until(lambda: service.scheduler.statistics().queued == 1)
        make_room(emu)
        status, answer = await read_answer_on(reader)
        writer.close()
    assert status == 200, answer


async def test_a_failure_taking_a_request_in_is_a_500_and_the_next_request_is_served(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug while the middleware takes a request in (at the server, outside any app task) is
    answered as uvicorn answers an app that raised: 500, logged, the connection closed."""
    body = json.dumps(chat_body(user="bug")).encode()

    def failing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug while taking the request in")

    async with proxy() as (base_url, service, _emu):
        with monkeypatch.context() as patched:
            patched.setattr(FairSchedulerMiddleware, "take_in", failing)
            status, _answer = await answer_logged(base_url, body, caplog)
        reader, writer = await connect(base_url)
        writer.write(post_head("sk-a", len(body)) + body)
        await writer.drain()
        served, _answer = await read_answer_on(reader)
        writer.close()
        assert service.scheduler.statistics().queued == 0
    assert status == 500
    assert "a bug while taking the request in" in caplog.text
    assert served == 200


async def test_a_request_released_with_bytes_after_its_body_hears_its_client_leave() -> None:
    """A stray line end after the body pauses reading, as a pipelined request does; the running
    request still hears its client leave, and the engine's work stops."""
    body = json.dumps(chat_body(max_tokens=100_000, user="crlf")).encode()
    async with proxy() as (base_url, service, emu):
        _reader, writer = await connect(base_url)
        writer.write(post_head("sk-a", len(body)) + body + b"\r\n")
        await writer.drain()
        await wait_until(lambda: service.scheduler.statistics().in_flight == 1)
        writer.close()
        await wait_until(lambda: service.scheduler.statistics().in_flight == 0)
        await wait_until(lambda: emu.engine.statistics().requests_aborted == 1)
