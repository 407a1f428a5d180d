"""What a request body costs `fair-sched proxy` (principal keys configured): a stranger's body is
never read, a body is parsed once with its element counts bounded, slow headers and bodies are
cut, and a parked request holds its bytes, not its parsed body. Real servers on 127.0.0.1: the
proxy as `fair-sched proxy` serves it (`proxy_server_config`), in this loop; the emulator as
its engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from fair_sched_plugin.proxy import build_proxy_app, proxy_server_config
from fair_sched_plugin.request.body import MAX_BODY_BYTES, MAX_BODY_CONTAINERS
from fair_sched_plugin.runtime.service import SchedulingService

from ..integrations.conftest import (
    MODEL,
    assert_idle,
    chat_body,
    emulator,
    fair_config,
    json_error,
    park_behind_full_engine,
    wait_until,
)
from ..support import LOOPBACK

# Bounds on how long a test waits for an answer it expects; never asserted as timings.
ANSWER_WAIT_S = 20.0


@contextlib.asynccontextmanager
async def proxy(
    engine: dict[str, Any] | None = None,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    **overrides: Any,
) -> AsyncIterator[tuple[str, SchedulingService, Any]]:
    """`fair-sched proxy` in this loop in front of an emulator (`engine` its settings; the
    requests forwarded go through `transport` where given): (base URL, service, emulator)."""
    async with emulator(**(engine or {})) as emu:
        app = build_proxy_app(fair_config(emu, **overrides), transport=transport)
        server = uvicorn.Server(
            proxy_server_config(app, host=LOOPBACK, port=0, log_level="warning")
        )
        serving = asyncio.get_running_loop().create_task(server.serve())
        try:
            await wait_until(lambda: server.started or serving.done())
            if serving.done():
                serving.result()
            port = server.servers[0].sockets[0].getsockname()[1]
            yield f"http://{LOOPBACK}:{port}", app.state.fair_sched, emu
        finally:
            server.should_exit = True
            try:
                await asyncio.wait_for(serving, 10)
            except asyncio.TimeoutError:
                server.force_exit = True


@contextlib.asynccontextmanager
async def behind_full_engine(**overrides: Any) -> AsyncIterator[tuple[str, SchedulingService, Any]]:
    """`proxy()` in front of a one-slot engine that two long streams hold: the next request
    parks. (base URL, service, emulator)."""
    async with (
        proxy({"max_num_seqs": 1}, waiting_below=1, **overrides) as (base_url, service, emu),
        httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=60) as client,
    ):
        client.headers["authorization"] = "Bearer sk-b"
        hogs = await park_behind_full_engine(emu, service, client)
        try:
            yield base_url, service, emu
        finally:
            for hog in hogs:
                hog.cancel()


async def connect(base_url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = int(base_url.rsplit(":", 1)[1])
    return await asyncio.open_connection(LOOPBACK, port)


def post_head(key: str, length: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {LOOPBACK}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and everything after it up to the connection's close."""
    data = await asyncio.wait_for(reader.read(), ANSWER_WAIT_S)
    return int(data.split(b" ", 2)[1]), data


async def answer_logged(
    base_url: str, body: bytes, caplog: pytest.LogCaptureFixture
) -> tuple[int, bytes]:
    """`read_answer` of one request from `sk-a` on a connection of its own, with the server's
    error log in `caplog` (uvicorn's loggers do not propagate, and its config, made with the
    server, resets them)."""
    server_log = logging.getLogger("uvicorn.error")
    server_log.addHandler(caplog.handler)
    try:
        reader, writer = await connect(base_url)
        writer.write(post_head("sk-a", len(body)) + body)
        await writer.drain()
        answer = await read_answer(reader)
        writer.close()
    finally:
        server_log.removeHandler(caplog.handler)
    return answer


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (reads to its end, a bounded wait)."""
    try:
        await asyncio.wait_for(reader.read(), ANSWER_WAIT_S)
    except (asyncio.TimeoutError, ConnectionError):
        return False
    return True


def element_bomb(elements: int) -> bytes:
    return b'{"model":"%s","messages":[%s]}' % (MODEL.encode(), b",".join([b"{}"] * elements))


async def test_an_unknown_key_is_refused_before_its_body_is_read() -> None:
    """The headers alone answer a stranger: 401 while none of its declared 8 MiB was sent, and
    the connection closed (the rest would otherwise be read and thrown away)."""
    async with proxy() as (base_url, _service, _emu):
        reader, writer = await connect(base_url)
        writer.write(post_head("sk-stranger", MAX_BODY_BYTES))
        await writer.drain()
        status, answer = await read_answer(reader)
        writer.close()
    assert status == 401
    assert b"invalid_api_key" in answer


async def test_a_body_declared_larger_than_the_limit_is_refused_from_its_header() -> None:
    async with proxy() as (base_url, _service, _emu):
        reader, writer = await connect(base_url)
        writer.write(post_head("sk-a", MAX_BODY_BYTES + 1))
        await writer.drain()
        status, answer = await read_answer(reader)
        writer.close()
    assert status == 413
    assert str(MAX_BODY_BYTES).encode() in answer


async def test_an_element_bomb_from_a_known_key_is_refused_naming_the_limit() -> None:
    async with (
        proxy() as (base_url, _service, emu),
        httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=30) as client,
    ):
        response = await client.post(
            "/v1/chat/completions",
            content=element_bomb(MAX_BODY_CONTAINERS + 1),
            headers={"authorization": "Bearer sk-a", "content-type": "application/json"},
        )
    assert response.status_code == 400
    assert str(MAX_BODY_CONTAINERS) in json_error(response)["message"]
    assert not emu.engine.received


async def test_a_scheduled_body_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The middleware parses it and hands the model on: the route does not parse it again."""
    body = json.dumps(chat_body(user="parsed-once")).encode()
    parses = []
    real_loads = json.loads

    def counting_loads(text: Any, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        # Ours only: the emulator behind the proxy parses what it is sent, as an engine would.
        ours = caller.startswith("fair_sched_plugin") and ".emulator" not in caller
        if text in (body, body.decode()) and ours:
            parses.append(caller)
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting_loads)
    async with (
        proxy() as (base_url, _service, _emu),
        httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=30) as client,
    ):
        response = await client.post(
            "/v1/chat/completions",
            content=body,
            headers={"authorization": "Bearer sk-a", "content-type": "application/json"},
        )
    assert response.status_code == 200
    assert len(parses) == 1, parses


async def test_a_stalled_body_is_cut_at_the_body_deadline_and_counted() -> None:
    async with proxy(read_body_timeout_s=0.5) as (base_url, _service, _emu):
        reader, writer = await connect(base_url)
        writer.write(post_head("sk-a", 1000) + b'{"model": "')
        await writer.drain()
        assert await closed_by_server(reader)
        writer.close()
        async with httpx.AsyncClient(base_url=base_url, trust_env=False) as client:
            metrics = (await client.get("/fair-sched/metrics")).text
    assert 'fair_sched_read_timeouts_total{phase="body"} 1.0' in metrics


async def test_partial_headers_are_cut_at_the_header_deadline() -> None:
    async with proxy(read_headers_timeout_s=0.5) as (base_url, _service, _emu):
        reader, writer = await connect(base_url)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        await writer.drain()
        assert await closed_by_server(reader)
        writer.close()


async def test_an_endless_chunked_body_is_cut_at_the_size_limit() -> None:
    """Past the limit the connection is closed: the server does not read (and throw away) a
    body that never ends."""
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    sent = 0
    async with proxy() as (base_url, _service, _emu):
        _reader, writer = await connect(base_url)
        writer.write(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {LOOPBACK}\r\n"
                "Authorization: Bearer sk-a\r\nTransfer-Encoding: chunked\r\n\r\n"
            ).encode()
        )
        with contextlib.suppress(ConnectionError):
            while sent < 8 * MAX_BODY_BYTES:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), ANSWER_WAIT_S)
                sent += len(chunk)
        writer.close()
    assert sent < 8 * MAX_BODY_BYTES


async def test_a_parked_request_holds_its_bytes_not_its_parsed_body() -> None:
    """While it waits behind a full engine, a request of many small messages costs about its
    bytes (parsed, each message a dict: several times its bytes)."""
    messages = [{"role": "user", "content": f"m{index}"} for index in range(15_000)]
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()
    async with (
        proxy({"max_num_seqs": 1}, waiting_below=1) as (base_url, service, emu),
        httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=60) as client,
    ):
        client.headers["authorization"] = "Bearer sk-b"
        hogs = await park_behind_full_engine(emu, service, client)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            parked = asyncio.ensure_future(
                client.post(
                    "/v1/chat/completions",
                    content=body,
                    headers={"authorization": "Bearer sk-a"},
                )
            )
            await wait_until(lambda: parked.done() or service.scheduler.statistics().queued)
            assert not parked.done(), parked.result().text
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            for hog in hogs:
                hog.cancel()
        response = await parked
    assert response.status_code == 200
    assert held < 2 * len(body), (held, len(body))


async def test_parked_body_bytes_past_the_users_cap_are_refused_with_retry_after() -> None:
    body = json.dumps(chat_body(user="bytes") | {"pad": "x" * 3_000}).encode()
    queue = {"max_bytes_per_user": len(body) + 100}
    async with (
        proxy({"max_num_seqs": 1}, waiting_below=1, queue=queue) as (base_url, service, emu),
        httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=60) as client,
    ):
        client.headers["authorization"] = "Bearer sk-b"
        hogs = await park_behind_full_engine(emu, service, client)
        try:
            headers = {"authorization": "Bearer sk-a", "content-type": "application/json"}
            first = asyncio.ensure_future(
                client.post("/v1/chat/completions", content=body, headers=headers)
            )
            await wait_until(lambda: first.done() or service.scheduler.statistics().queued)
            second = await client.post("/v1/chat/completions", content=body, headers=headers)
        finally:
            for hog in hogs:
                hog.cancel()
        assert (await first).status_code == 200
    assert second.status_code == 429
    assert "retry-after" in second.headers


@pytest.mark.parametrize("pipelined", ["none", "with_it", "once_parked"])
async def test_a_parked_request_whose_client_leaves_is_withdrawn(pipelined: str) -> None:
    """The server tells the parked request that the client closed the connection, also where
    the client pipelined more requests behind it, with it or once it had parked (bytes after a
    body pause reading: behind a parked request it goes on, up to a bound)."""
    body = json.dumps(chat_body(user="leaves")).encode()
    request = post_head("sk-a", len(body)) + body
    async with behind_full_engine() as (base_url, service, emu):
        _reader, writer = await connect(base_url)
        writer.write(request * 2 if pipelined == "with_it" else request)
        await writer.drain()
        await wait_until(lambda: service.scheduler.statistics().queued == 1)
        if pipelined == "once_parked":
            for _ in range(2):
                writer.write(request)
                await writer.drain()
                await asyncio.sleep(0.1)
        writer.close()
        await wait_until(lambda: service.scheduler.statistics().queued == 0)
    assert all(request.user != "leaves" for request in emu.engine.received)


async def test_requests_one_after_another_on_one_connection_are_answered() -> None:
    """Each request cycle on a keep-alive connection gets its own event, the second one made
    when the first response completes."""
    body = json.dumps(chat_body(user="kept")).encode()
    async with proxy() as (base_url, _service, _emu):
        reader, writer = await connect(base_url)
        # Both at once: the second is read as the first's response completes.
        writer.write((post_head("sk-a", len(body)) + body) * 2)
        await writer.drain()
        statuses = []
        for _ in range(2):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT_S)
            statuses.append(int(head.split(b" ", 2)[1]))
            assert b"transfer-encoding: chunked" in head.lower(), head  # relayed as it comes
            await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), ANSWER_WAIT_S)
        writer.close()
    assert statuses == [200, 200]


class _FailingTransport(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug on the way to the engine")


async def test_an_exception_in_the_app_is_a_500_and_the_connection_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The proxy is served without Starlette's error layer: the server answers what escapes the
    app (a 500, the connection closed) and logs it, as that layer did."""
    body = json.dumps(chat_body(user="bug")).encode()
    async with proxy(transport=_FailingTransport()) as (base_url, service, _emu):
        status, answer = await answer_logged(base_url, body, caplog)
        assert service.scheduler.statistics().queued == 0
    assert status == 500, answer
    assert "a bug on the way to the engine" in caplog.text


async def test_a_client_leaving_mid_stream_ends_the_engines_work() -> None:
    """Released and streaming, the request is stopped when its connection is lost (with the
    watch told by the proxy's protocol, the app alone reads `receive()`): the upstream request
    is closed and the engine aborts the sequence."""
    body = json.dumps(chat_body(max_tokens=100_000, stream=True, user="mid-stream")).encode()
    async with proxy() as (base_url, service, emu):
        reader, writer = await connect(base_url)
        writer.write(post_head("sk-a", len(body)) + body)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT_S)
        assert head.startswith(b"HTTP/1.1 200"), head
        await asyncio.wait_for(reader.readuntil(b"data: "), ANSWER_WAIT_S)  # tokens flow
        writer.close()
        await assert_idle(service)
        await wait_until(lambda: emu.engine.statistics().requests_aborted == 1)
    assert emu.engine.statistics().running == 0


async def test_a_kept_alive_parked_stream_is_withdrawn_when_its_client_leaves() -> None:
    """Its keep-alive comments go out under the proxy's protocol, and only the protocol's
    callback tells the watch that the connection is gone (nothing reads `receive()`)."""
    body = json.dumps(chat_body(stream=True, user="kept-alive")).encode()
    queue = {"keepalive_after_s": 0.2, "keepalive_interval_s": 0.5}
    async with behind_full_engine(queue=queue) as (base_url, service, emu):
        reader, writer = await connect(base_url)
        writer.write(post_head("sk-a", len(body)) + body)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT_S)
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
        await asyncio.wait_for(reader.readuntil(b": queued"), ANSWER_WAIT_S)
        await asyncio.wait_for(reader.readuntil(b": queued"), ANSWER_WAIT_S)  # and again
        assert service.scheduler.statistics().queued == 1
        writer.close()
        await wait_until(lambda: service.scheduler.statistics().queued == 0)
    assert all(request.user != "kept-alive" for request in emu.engine.received)
