"""The standalone fair proxy, end to end: clients -> proxy (uvicorn) -> emulator, on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import pathlib
from typing import Any

import httpx
import pytest
import uvicorn

from fair_sched_plugin.lab.loadtest.processes import fair_proxy
from fair_sched_plugin.proxy import (
    CLIENT_KEEP_ALIVE_S,
    add_proxy_parser,
    build_proxy_app,
    upstream_url,
)

from ..support import free_port, service_of
from .conftest import (
    MODEL,
    assert_idle,
    cancel_all,
    chat_body,
    completion_body,
    emulator,
    fair_config,
    gate_sees_metrics,
    get_on_connection,
    json_error,
    open_client,
    park_behind_full_engine,
    serve,
    sse_events,
    wait_until,
)

FLOOD_SIZE = 60


# ----------------------------------------------------------------------------- plain routes


async def test_models_health_and_non_streamed_completion() -> None:
    async with emulator() as emu:
        app = build_proxy_app(fair_config(emu))
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            models = (await client.get("/v1/models")).json()
            assert [model["id"] for model in models["data"]] == [MODEL]
            assert (await client.get("/health")).status_code == 200

            response = await client.post("/v1/chat/completions", json=chat_body(max_tokens=5))
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("application/json")
            assert response.json()["usage"]["completion_tokens"] == 5

            text = await client.post("/v1/completions", json=completion_body(max_tokens=3))
            assert text.status_code == 200
            assert text.json()["object"] == "text_completion"
            assert service_of(app).scheduler.statistics().released_total == 2
            await assert_idle(service_of(app))


async def test_an_api_base_with_a_query_gets_the_path_before_the_query() -> None:
    """Before: `api_base + "/chat/completions"` put the path after the query
    (`/v1?api-version=1/chat/completions`), and the engine answered 404."""
    async with emulator() as emu:
        config = fair_config(emu, backend={"api_base": f"{emu.base_url}/v1?api-version=1"})
        app = build_proxy_app(config)
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            response = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            assert response.status_code == 200, response.text
            assert len(emu.engine.received) == 1
            await assert_idle(service_of(app))


def test_upstream_url_keeps_the_query_after_the_path() -> None:
    assert (
        upstream_url("http://u:p@h:8000/v1/?api-version=1&token=t", "/chat/completions")
        == "http://u:p@h:8000/v1/chat/completions?api-version=1&token=t"
    )
    assert upstream_url("http://h/v1", "/completions") == "http://h/v1/completions"


async def test_upstream_status_and_content_type_are_preserved() -> None:
    """The emulator has no /v1/responses: its 404 comes back as is; so does its 400."""
    async with emulator() as emu:
        app = build_proxy_app(fair_config(emu))
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            missing = await client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
            assert missing.status_code == 404
            assert missing.headers["content-type"].startswith("text/plain")

            # Empty messages: within every bound of ours, refused by the engine.
            bad = await client.post("/v1/chat/completions", json={**chat_body(), "messages": []})
            assert bad.status_code == 400
            assert json_error(bad)["type"] == "BadRequestError"
            await assert_idle(service_of(app))


async def test_unknown_model_is_404_in_openai_shape() -> None:
    async with emulator() as emu:
        app = build_proxy_app(fair_config(emu))
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            response = await client.post("/v1/chat/completions", json={**chat_body(), "model": "x"})
            assert response.status_code == 404
            error = json_error(response)
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert len(emu.engine.received) == 0
            await assert_idle(service_of(app))


async def test_unreachable_backend_is_502() -> None:
    api_base = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    app = build_proxy_app(
        {
            "backends": {MODEL: {"api_base": api_base}},
            "metrics_poll_ms": 50,
            "on_metrics_unavailable": {"max_inflight": 2},
        }
    )
    async with serve(app) as url, open_client(url, key="sk-a") as client:
        response = await client.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 502
        assert json_error(response)["code"] == "upstream_unavailable"
        assert int(response.headers["retry-after"]) >= 1
        await assert_idle(service_of(app))


class ClosingKeepAliveServer:
    """An HTTP/1.1 server on 127.0.0.1 that answers the first request on each connection and
    keeps it open, then closes it, unanswered, when a second request arrives on it: the race a
    proxy meets when it reuses a pooled connection the engine's idle timeout is closing."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0
        self.dropped = 0
        self._server: asyncio.AbstractServer | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for turn in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                if turn == 1:
                    self.dropped += 1
                    return
                body = b'{"ok":true}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> Any:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            self._server.close()
            await self._server.wait_closed()


async def test_a_pooled_connection_closed_by_the_engine_is_retried_on_a_fresh_one() -> None:
    upstream = ClosingKeepAliveServer()
    async with emulator() as emu, upstream.running() as api_base:  # emulator: metrics only
        backend = {"api_base": api_base, "metrics_url": f"{emu.base_url}/metrics"}
        app = build_proxy_app(fair_config(emu, backend=backend))
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            for _ in range(3):
                response = await client.post("/v1/chat/completions", json=chat_body())
                assert response.status_code == 200 and response.json() == {"ok": True}
            await assert_idle(service_of(app))
    # Requests 2 and 3 each met the closing connection first, then got a fresh one.
    assert (upstream.answered, upstream.dropped, upstream.connections) == (3, 2, 3)


async def test_client_authorization_is_not_forwarded() -> None:
    seen: list[httpx.Headers] = []

    def backend(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        # An unread stream, like a real transport's (a `json=` response is already consumed).
        return httpx.Response(
            200,
            headers={"content-type": "application/json"},
            stream=httpx.ByteStream(b'{"ok":true}'),
        )

    async with emulator() as emu:  # only for the metrics the gate reads
        app = build_proxy_app(fair_config(emu), transport=httpx.MockTransport(backend))
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            response = await client.post(
                "/v1/chat/completions", json=chat_body(), headers={"x-api-key": "sk-a"}
            )
            assert response.status_code == 200 and response.json() == {"ok": True}
            assert len(seen) == 1
            assert "authorization" not in seen[0] and "x-api-key" not in seen[0]
            assert seen[0]["content-type"] == "application/json"
            await assert_idle(service_of(app))


# ----------------------------------------------------------------------------- streaming


async def test_stream_passes_through_unbuffered_and_ends_with_done() -> None:
    """The first SSE chunk reaches the client while the engine is still generating."""
    async with emulator(base_step_ms=10.0) as emu:
        app = build_proxy_app(fair_config(emu))
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            finished_when_first_chunk_arrived = None
            chunks: list[bytes] = []
            body = chat_body(max_tokens=30, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                async for chunk in response.aiter_raw():
                    if finished_when_first_chunk_arrived is None:
                        stats = emu.engine.statistics()
                        finished_when_first_chunk_arrived = stats.requests_finished
                    chunks.append(chunk)
            assert finished_when_first_chunk_arrived == 0
            assert len(chunks) > 2  # many reads, not one buffered body
            events = sse_events(b"".join(chunks).decode())
            assert events[-1] == "[DONE]"
            assert sum('"content":" token' in event for event in events) == 30
            await assert_idle(service_of(app))


# ----------------------------------------------------------------------------- disconnects


async def test_disconnect_while_parked_never_reaches_the_engine() -> None:
    async with emulator(max_num_seqs=1) as emu:
        app = build_proxy_app(fair_config(emu, waiting_below=1))
        service = service_of(app)
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            await gate_sees_metrics(service)
            hogs = await park_behind_full_engine(emu, service, client)

            parked = asyncio.ensure_future(
                client.post("/v1/chat/completions", json=chat_body(user="parked"))
            )
            await wait_until(lambda: service.scheduler.statistics().queued == 1)
            parked.cancel()
            await asyncio.gather(parked, return_exceptions=True)
            await wait_until(lambda: service.scheduler.statistics().queued == 0)
            assert service.scheduler.statistics().cancelled_total == 1

            await cancel_all(hogs)
            await assert_idle(service)
            await wait_until(lambda: emu.engine.statistics()[:2] == (0, 0))
            assert [r.user for r in emu.engine.received] == ["hog-1", "hog-2"]


async def test_disconnect_mid_stream_releases_lease_and_engine_sequence() -> None:
    async with emulator(max_num_seqs=2) as emu:
        app = build_proxy_app(fair_config(emu))
        service = service_of(app)
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            body = chat_body(max_tokens=5000, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                tokens = 0
                async for chunk in response.aiter_raw():
                    tokens += chunk.count(b'"content":" token')
                    if tokens >= 3:
                        break
            assert emu.engine.statistics().requests_received == 1
            await assert_idle(service)
            # The proxy closed its upstream connection: the engine aborted the sequence.
            await wait_until(lambda: emu.engine.statistics().running == 0)
            stats = emu.engine.statistics()
            assert stats.requests_aborted == 1 and stats.requests_finished == 0
            assert service.scheduler.statistics().completed_total == 1


# ----------------------------------------------------------------------------- the flood


async def _flood(
    base_url: str, path: str, body: dict[str, Any], parked: Any
) -> tuple[list[str], dict[str, int]]:
    """User A sends FLOOD_SIZE streams at once; once `parked()` holds, B and C send one each.

    Returns the completion order (user per finished stream) and, for B and C, how many of A's
    streams finished before theirs.
    """
    order: list[str] = []

    async def stream(client: httpx.AsyncClient, user: str) -> None:
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200, await response.aread()
            text = (await response.aread()).decode()
        assert sse_events(text)[-1] == "[DONE]"
        order.append(user)

    async with contextlib.AsyncExitStack() as stack:
        clients = {
            user: await stack.enter_async_context(open_client(base_url, key=f"sk-{user.lower()}"))
            for user in "ABC"
        }
        flood = [asyncio.ensure_future(stream(clients["A"], "A")) for _ in range(FLOOD_SIZE)]
        try:
            await wait_until(parked, timeout_s=15)
            light = [asyncio.ensure_future(stream(clients[user], user)) for user in "BC"]
            await asyncio.wait_for(asyncio.gather(*flood, *light), timeout=40)
        finally:
            await cancel_all([*flood])
    ranks = {user: order[: order.index(user)].count("A") for user in "BC"}
    return order, ranks


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.timing
async def test_flood_light_users_overtake_heavy_user(path: str) -> None:
    """B and C finish before most of A's flood with the proxy, after nearly all of it without.

    The engine's waiting queue stays within `waiting_below` (+1: a released request counts as
    pending until its first byte or a scrape sent `arrival_grace_ms` after its release, so only
    a request slower than that to reach the engine, on a loaded machine, can be missed once).
    """

    def body(max_tokens: int) -> dict[str, Any]:
        make = completion_body if path == "/v1/completions" else chat_body
        return make(max_tokens=max_tokens, stream=True)

    # Without the scheduler: the engine's FIFO puts B and C behind all of A's requests.
    async with emulator(max_num_seqs=4) as emu:
        _, direct_ranks = await _flood(
            emu.base_url,
            path,
            body(16),
            lambda: emu.engine.statistics().requests_received == FLOOD_SIZE,
        )
        direct_max_waiting = emu.engine.statistics().max_waiting_seen

    async with emulator(max_num_seqs=4) as emu:
        app = build_proxy_app(fair_config(emu))
        service = service_of(app)
        async with serve(app) as url:
            await gate_sees_metrics(service)

            def parked() -> bool:
                stats = service.scheduler.statistics()
                return stats.queued + stats.released_total == FLOOD_SIZE and stats.queued > 0

            _, fair_ranks = await _flood(url, path, body(16), parked)
            fair_max_waiting = emu.engine.statistics().max_waiting_seen
            await assert_idle(service)

    print(
        f"\nflood {path}: A finished before B/C: direct {direct_ranks}, fair {fair_ranks}; "
        f"engine max waiting: direct {direct_max_waiting}, fair {fair_max_waiting}"
    )
    for user in "BC":
        assert direct_ranks[user] >= 0.7 * FLOOD_SIZE
        assert fair_ranks[user] <= 0.3 * FLOOD_SIZE
    waiting_below = 2
    assert fair_max_waiting <= waiting_below + 1
    assert fair_max_waiting < direct_max_waiting


# ----------------------------------------------------------------------------- command line


def test_proxy_subcommand_parses_and_rejects_a_config_without_backends(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="fair-sched")
    add_proxy_parser(parser.add_subparsers(dest="command", required=True))
    config = tmp_path / "fair.yaml"
    config.write_text("fair_sched:\n  metrics_poll_ms: 50\n")
    args = parser.parse_args(["proxy", "--config", str(config), "--port", "0"])
    assert (args.host, args.port) == ("127.0.0.1", 0)
    assert args.handler(args) == 2
    assert "api_base" in capsys.readouterr().err

    config.write_text("fair_sched:\n  metrics_poll_ms: 1\n")
    assert args.handler(args) == 2
    assert "fair_sched.metrics_poll_ms" in capsys.readouterr().err


def test_client_connections_outlive_the_clients_own_pools() -> None:
    """A client reusing a pooled connection the proxy is closing gets a read error and no
    response: the proxy keeps idle connections longer than httpx / the openai SDK (5 s) and
    aiohttp (15 s) keep theirs."""
    httpx_expiry = httpx.Limits().keepalive_expiry
    assert httpx_expiry is not None
    assert max(httpx_expiry, 15.0) < CLIENT_KEEP_ALIVE_S


def test_fair_sched_proxy_serves_with_the_long_keep_alive(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fair-sched proxy` hands uvicorn `timeout_keep_alive=CLIENT_KEEP_ALIVE_S` (the setting;
    the real idle wait past uvicorn's 5 s default runs with scripts/test --full)."""
    served: dict[str, Any] = {}
    monkeypatch.setattr(
        uvicorn.Server, "run", lambda server, sockets=None: served.update(vars(server.config))
    )
    parser = argparse.ArgumentParser(prog="fair-sched")
    add_proxy_parser(parser.add_subparsers(dest="command", required=True))
    config = tmp_path / "fair.yaml"
    config.write_text(
        f"fair_sched:\n  backends:\n    m:\n      api_base: http://127.0.0.1:{free_port()}/v1\n"
    )
    args = parser.parse_args(["proxy", "--config", str(config), "--port", "0"])
    assert args.handler(args) == 0
    assert served["timeout_keep_alive"] == CLIENT_KEEP_ALIVE_S


@pytest.mark.full
@pytest.mark.timeout(90)
async def test_fair_sched_proxy_keeps_an_idle_client_connection_past_uvicorns_default(
    tmp_path: pathlib.Path,
) -> None:
    """`fair-sched proxy` as a process: a connection idle for 6 s (past uvicorn's and the
    clients' 5 s) still answers, so a client reusing it does not race the proxy's close."""
    section = {"backends": {"m": {"api_base": f"http://127.0.0.1:{free_port()}/v1"}}}
    async with fair_proxy(section, tmp_path, "keep-alive") as proxy:
        host, port = proxy.base_url.removeprefix("http://").removesuffix("/v1").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            assert await get_on_connection(reader, writer, "/health") == b"HTTP/1.1 200 OK"
            await asyncio.sleep(6.0)
            assert not reader.at_eof()
            assert await get_on_connection(reader, writer, "/health") == b"HTTP/1.1 200 OK"
        finally:
            writer.close()
            await writer.wait_closed()
