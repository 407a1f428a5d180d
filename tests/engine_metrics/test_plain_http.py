"""`PlainHttpConnection` against a scripted HTTP/1.1 server on 127.0.0.1: the framings an
engine's `/metrics` answer can have, kept and dropped connections, and the body bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import pytest

from fair_sched_plugin.engine_metrics._plain_http import (
    BodyTooLarge,
    PlainHttpConnection,
    PlainHttpError,
    plain_http_reachable,
)

MAX_BODY = 1000
KEEPALIVE_S = 2.0


@dataclass
class ScriptedServer:
    """Answers each request with the next scripted bytes; `None` closes the connection
    instead of answering, `close_after` closes it after answering."""

    answers: list[bytes | None]
    close_after: set[int] = field(default_factory=set)
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                index = len(self.requests)
                self.requests.append(head)
                answer = self.answers[index]
                if answer is None:
                    return
                writer.write(answer)
                await writer.drain()
                if index in self.close_after:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    def url(self, path: str = "/metrics") -> httpx.URL:
        return httpx.URL(f"http://127.0.0.1:{self.port}{path}")


Serve = Callable[[ScriptedServer], Awaitable[ScriptedServer]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.Server] = []

    async def start(script: ScriptedServer) -> ScriptedServer:
        server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
        servers.append(server)
        script.port = server.sockets[0].getsockname()[1]
        return script

    yield start
    for server in servers:
        server.close()


def ok(body: bytes, *headers: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n" % len(body)
    return head + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


async def test_a_kept_connection_serves_every_get_and_sends_the_path_with_its_query(
    serve: Serve,
) -> None:
    script = await serve(ScriptedServer([ok(b"first"), ok(b"second")]))
    connection = PlainHttpConnection(script.url(), keepalive_expiry_s=KEEPALIVE_S)
    url = script.url("/metrics/?name%5B%5D=vllm%3Anum_requests_waiting")
    assert await connection.get(url, MAX_BODY) == (200, b"first")
    assert await connection.get(url, MAX_BODY) == (200, b"second")
    assert script.connections == 1
    first_line, host = script.requests[0].split(b"\r\n")[:2]
    assert first_line == b"GET /metrics/?name%5B%5D=vllm%3Anum_requests_waiting HTTP/1.1"
    assert host == b"Host: 127.0.0.1:%d" % script.port
    connection.close()


async def test_a_chunked_answer_is_read_whole_with_extensions_and_trailers(serve: Serve) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n"
    )
    script = await serve(ScriptedServer([chunked, ok(b"after")]))
    connection = PlainHttpConnection(script.url(), keepalive_expiry_s=KEEPALIVE_S)
    assert await connection.get(script.url(), MAX_BODY) == (200, b"hello world")
    assert await connection.get(script.url(), MAX_BODY) == (200, b"after")
    assert script.connections == 1
    connection.close()


async def test_connection_close_and_unframed_answers_are_not_reused(serve: Serve) -> None:
    unframed = b"HTTP/1.0 503 Service Unavailable\r\n\r\nbusy"
    script = await serve(
        ScriptedServer(
            [ok(b"one", b"Connection: close"), unframed, ok(b"three")], close_after={0, 1}
        )
    )
    connection = PlainHttpConnection(script.url(), keepalive_expiry_s=KEEPALIVE_S)
    assert await connection.get(script.url(), MAX_BODY) == (200, b"one")
    assert not connection.connected
    assert await connection.get(script.url(), MAX_BODY) == (503, b"busy")
    assert await connection.get(script.url(), MAX_BODY) == (200, b"three")
    assert script.connections == 3
    connection.close()


async def test_a_kept_connection_the_server_dropped_is_replaced_once(serve: Serve) -> None:
    """The server closes a kept connection without answering (its idle timeout as we sent):
    the GET goes again on a new one."""
    script = await serve(ScriptedServer([ok(b"one"), None, ok(b"two")]))
    connection = PlainHttpConnection(script.url(), keepalive_expiry_s=KEEPALIVE_S)
    assert await connection.get(script.url(), MAX_BODY) == (200, b"one")
    assert await connection.get(script.url(), MAX_BODY) == (200, b"two")
    assert script.connections == 2
    connection.close()


async def test_an_idle_connection_past_the_keepalive_expiry_is_replaced(serve: Serve) -> None:
    script = await serve(ScriptedServer([ok(b"one"), ok(b"two")]))
    connection = PlainHttpConnection(script.url(), keepalive_expiry_s=0.0)
    assert await connection.get(script.url(), MAX_BODY) == (200, b"one")
    assert await connection.get(script.url(), MAX_BODY) == (200, b"two")
    assert script.connections == 2
    connection.close()


@pytest.mark.parametrize(
    "answer",
    [
        ok(b"x" * (MAX_BODY + 1)),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"200\r\n"
        + b"x" * 512
        + b"\r\n"
        + b"200\r\n"
        + b"x" * 512
        + b"\r\n0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * (MAX_BODY + 1),
    ],
    ids=["content-length", "chunked", "until-close"],
)
async def test_a_body_over_the_bound_is_refused_and_the_connection_dropped(
    serve: Serve, answer: bytes
) -> None:
    script = await serve(ScriptedServer([answer], close_after={0}))
    connection = PlainHttpConnection(script.url(), keepalive_expiry_s=KEEPALIVE_S)
    with pytest.raises(BodyTooLarge):
        await connection.get(script.url(), MAX_BODY)
    assert not connection.connected


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
    ],
    ids=["not-http", "two-lengths", "unknown-encoding", "bad-chunk-size", "cut-short"],
)
async def test_an_answer_it_cannot_read_fails_the_get(serve: Serve, answer: bytes) -> None:
    script = await serve(ScriptedServer([answer], close_after={0}))
    connection = PlainHttpConnection(script.url(), keepalive_expiry_s=KEEPALIVE_S)
    with pytest.raises(PlainHttpError):
        await connection.get(script.url(), MAX_BODY)
    assert not connection.connected


async def test_nobody_listening_fails_the_get() -> None:
    url = httpx.URL("http://127.0.0.1:9/metrics")
    with pytest.raises(PlainHttpError):
        await PlainHttpConnection(url, keepalive_expiry_s=KEEPALIVE_S).get(url, MAX_BODY)


def test_only_plain_http_without_credentials_or_a_proxy_is_read_without_httpx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert plain_http_reachable(httpx.URL("http://10.0.0.5:8000/metrics"))
    assert not plain_http_reachable(httpx.URL("https://engine.example/metrics"))
    assert not plain_http_reachable(httpx.URL("http://user:pw@10.0.0.5:8000/metrics"))
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    assert not plain_http_reachable(httpx.URL("http://10.0.0.5:8000/metrics"))
    monkeypatch.setenv("NO_PROXY", "10.0.0.5")
    assert plain_http_reachable(httpx.URL("http://10.0.0.5:8000/metrics"))
