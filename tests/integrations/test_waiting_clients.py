"""Waiting clients: keep-alive while parked, the wait-limit header, where-do-I-stand.

Real clients (the official `openai` SDK, `litellm.acompletion`, httpx) reach the middleware and
`fair-sched proxy` through an idle-timeout relay on 127.0.0.1 (`relay.py`): a parked stream that
hears nothing for `RELAY_IDLE_S` is cut there, as a load balancer would. The waits are real time
(the relay's timer is), but no test sleeps a fixed time: each waits for the event it needs (the
control connection cut by the relay proves the idle time has passed for the others too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Mapping
from typing import Any, NamedTuple

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Message

from fair_sched_plugin.asgi import FairSchedulerMiddleware
from fair_sched_plugin.core import Ticket
from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.runtime.service import SchedulingService

from .conftest import (
    MODEL,
    assert_idle,
    cancel_all,
    chat_body,
    emulator,
    fair_config,
    find_middleware,
    forwarding_handler,
    gate_sees_metrics,
    http_state,
    open_client,
    park_behind_full_engine,
    serve,
    wait_until,
)
from .relay import idle_timeout_relay

RELAY_IDLE_S = 5.0
# Comments well inside the relay's idle timeout; the first one soon after parking.
KEEPALIVE_ON = {"keepalive_after_s": 0.5, "keepalive_interval_s": 1.0}
KEEPALIVE_OFF = {"keepalive_after_s": 0}
MAX_TOKENS = 6
MESSAGES = [{"role": "user", "content": "Tell me about fair scheduling."}]


def middleware_app(emu: RunningEmulator, config: Mapping[str, Any]) -> Starlette:
    """What an app author writes: one forwarding route, the middleware around it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with http_state(app):
            yield

    app = Starlette(
        routes=[Route("/v1/chat/completions", forwarding_handler(emu.base_url), methods=["POST"])],
        lifespan=lifespan,
    )
    app.add_middleware(FairSchedulerMiddleware, config=config)
    return app


def service_of(app: Starlette) -> SchedulingService:
    service = getattr(app.state, "fair_sched", None)
    return service if isinstance(service, SchedulingService) else find_middleware(app).service


def queue_settings(**queue: Any) -> dict[str, Any]:
    return {"queue": {"max_wait_s": 120, **queue}}


class ParkedEngine(NamedTuple):
    emu: RunningEmulator
    url: str
    service: SchedulingService
    hogs: list[asyncio.Task[None]]


@pytest.fixture
async def parked() -> AsyncIterator[ParkedEngine]:
    """The middleware (keep-alive on) in front of a one-slot engine that two long streams fill:
    the next request parks. Cancel `hogs` (cancel_all) to free the engine; they end at teardown
    in any case."""
    async with emulator(max_num_seqs=1) as emu:
        app = middleware_app(
            emu, fair_config(emu, waiting_below=1, **queue_settings(**KEEPALIVE_ON))
        )
        async with serve(app) as url, open_client(url, key="sk-batch", timeout=60) as hog_client:
            service = service_of(app)
            await gate_sees_metrics(service)
            hogs = await park_behind_full_engine(emu, service, hog_client)
            try:
                yield ParkedEngine(emu, url, service, hogs)
            finally:
                await cancel_all(hogs)


async def openai_stream(base_url: str, key: str) -> str:
    """The official SDK's stream, joined; raises what the SDK raises."""
    async with (
        httpx.AsyncClient(trust_env=False) as http,
        openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key=key, max_retries=0, http_client=http
        ) as client,
    ):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            stream=True,  # type: ignore[arg-type]
        )
        parts = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)


# `litellm.acompletion` runs in a process of its own: in the test process it hung when other
# tests had imported the plugin's LiteLLM module there first (state the SDK picks up).
_LITELLM_CLIENT = """
import asyncio, json, sys
import litellm

async def main(base_url, key, model, messages, max_tokens):
    response = await litellm.acompletion(
        model=f"openai/{model}", api_base=f"{base_url}/v1", api_key=key,
        messages=json.loads(messages), max_tokens=int(max_tokens), stream=True, max_retries=0,
    )
    parts = []
    async for chunk in response:
        content = chunk.choices[0].delta.content
        if content:
            parts.append(content)
    sys.stdout.write("".join(parts))

asyncio.run(main(*sys.argv[1:]))
"""


async def litellm_stream(base_url: str, key: str) -> str:
    """`litellm.acompletion` as a client (an OpenAI-compatible server behind `api_base`)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _LITELLM_CLIENT,
        base_url,
        key,
        MODEL,
        json.dumps(MESSAGES),
        str(MAX_TOKENS),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    try:
        out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    if process.returncode != 0:
        raise openai.APIConnectionError(
            message=err.decode(errors="replace")[-2000:], request=httpx.Request("POST", base_url)
        )
    return out.decode()


def import_litellm() -> Any:
    """LiteLLM, imported before any server starts: the import blocks the loop for seconds."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


async def expected_text(emu: RunningEmulator) -> str:
    """The same request straight to the engine: what a complete answer reads."""
    return await openai_stream(emu.base_url, "none")


async def wait_queued(service: SchedulingService, count: int) -> None:
    # Generous: in a fresh virtualenv litellm.acompletion's first call compiles the modules it
    # imports lazily, which took over 20 s on a 2-core CI machine before its request was sent.
    await wait_until(lambda: service.scheduler.statistics().queued >= count, timeout_s=120)


@contextlib.asynccontextmanager
async def parked_pair(
    emu: RunningEmulator, kind: str
) -> AsyncIterator[tuple[SchedulingService, str, SchedulingService, str, list[Any]]]:
    """Two servers of `kind` on one full engine (keep-alive on, keep-alive off), each behind an
    idle-timeout relay; the engine is full, so what is sent through them parks."""

    def build(queue: Mapping[str, Any]) -> Starlette:
        config = fair_config(emu, waiting_below=1, **queue_settings(**queue))
        return middleware_app(emu, config) if kind == "middleware" else build_proxy_app(config)

    on_app, off_app = build(KEEPALIVE_ON), build(KEEPALIVE_OFF)
    async with (
        serve(on_app) as on_url,
        serve(off_app) as off_url,
        idle_timeout_relay(on_url, RELAY_IDLE_S) as on_relay,
        idle_timeout_relay(off_url, RELAY_IDLE_S) as off_relay,
        open_client(on_url, key="sk-batch", timeout=60) as hog_client,
    ):
        on, off = service_of(on_app), service_of(off_app)
        await gate_sees_metrics(on)
        await gate_sees_metrics(off)
        hogs = await park_behind_full_engine(emu, on, hog_client)
        await wait_until(lambda: all((s.waiting or 0) >= 1 for s in off.gate.status()))
        try:
            yield on, on_relay.url, off, off_relay.url, hogs
            assert on_relay.dropped == 0
            assert off_relay.dropped >= 1
        finally:
            await cancel_all(hogs)


# ----------------------------------------------------------------------------- keep-alive


@pytest.mark.parametrize("kind", ["middleware", "proxy"])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_parked_stream_survives_an_idle_timeout_relay_with_keepalive(kind: str) -> None:
    """openai SDK and litellm.acompletion streams parked longer than the relay's idle timeout
    complete with the right content; the same stream without keep-alive is cut (the control)."""
    import_litellm()
    async with emulator(max_num_seqs=1) as emu:
        expected = await expected_text(emu)
        assert expected
        async with parked_pair(emu, kind) as (on, on_url, off, off_url, hogs):
            sdk = asyncio.ensure_future(openai_stream(on_url, "sk-a"))
            via_litellm = asyncio.ensure_future(litellm_stream(on_url, "sk-b"))
            await wait_queued(on, 2)
            control = asyncio.ensure_future(openai_stream(off_url, "sk-c"))
            await wait_queued(off, 1)
            # The control is cut once it was silent for the relay's idle time; the others were
            # parked at least as long (they parked first).
            with pytest.raises(openai.APIConnectionError):
                await asyncio.wait_for(control, RELAY_IDLE_S * 4)
            assert not sdk.done() and not via_litellm.done()
            assert on.scheduler.statistics().queued == 2
            await cancel_all(hogs)  # the engine frees up: the parked streams are released
            assert await asyncio.wait_for(sdk, 30) == expected
            assert await asyncio.wait_for(via_litellm, 30) == expected
            await assert_idle(on)
            await assert_idle(off)


async def test_keepalive_comments_then_the_engine_stream_on_one_response(
    parked: ParkedEngine,
) -> None:
    """The raw bytes: 200 and SSE headers, `: queued position=… wait_s=…` comments, then the
    engine's events and `[DONE]` on the same response; the lease was not started by comments."""
    emu, url, service, hogs = parked
    async with (
        open_client(url, key="sk-a", timeout=60) as client,
        client.stream(
            "POST",
            "/v1/chat/completions",
            json=chat_body(max_tokens=MAX_TOKENS, stream=True),
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-fair-sched-tier"] == "interactive"
        lines = response.aiter_lines()
        comments = []
        async for line in lines:
            if line.startswith(": queued"):
                comments.append(line)
            if len(comments) == 2:
                break
        assert all("position=1" in c and "wait_s=" in c for c in comments)
        await cancel_all(hogs)
        rest = [line async for line in lines]
    events = [line[6:] for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(
        choice["delta"].get("content") or ""
        for event in events[:-1]
        for choice in json.loads(event)["choices"]
    )
    assert text == await expected_text(emu)
    await assert_idle(service)


async def read_events(
    response: httpx.Response, lines: AsyncIterator[str] | None = None
) -> tuple[list[str], list[Any]]:
    """(comment lines, decoded `data:` events) of the rest of an SSE response."""
    comments, events = [], []
    async for line in lines or response.aiter_lines():
        if line.startswith(":"):
            comments.append(line)
        elif line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return comments, events


async def test_errors_after_keepalive_arrive_as_an_error_event_and_a_clean_end(
    parked: ParkedEngine,
) -> None:
    """Once the client holds the keep-alive's 200, a refusal (its own wait limit passing) and
    an engine 400 each end the stream with an OpenAI-style error event, which the SDK raises."""
    _, url, service, hogs = parked
    async with open_client(url, key="sk-a", timeout=60) as client:
        # Timed out in the queue after the keep-alive began.
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json=chat_body(stream=True),
            headers={"x-fair-sched-max-wait-s": "2"},
        ) as response:
            assert response.status_code == 200
            comments, events = await read_events(response)
        assert comments and events[-1]["error"]["code"] == "timeout"
        assert "x-fair-sched-max-wait-s" in events[-1]["error"]["message"]

        # The SDK raises the error event as an APIError.
        sdk = openai.AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key="sk-a",
            max_retries=0,
            http_client=httpx.AsyncClient(trust_env=False),
        )
        async with sdk:
            stream = await sdk.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,  # type: ignore[arg-type]
                stream=True,
                extra_headers={"x-fair-sched-max-wait-s": "2"},
            )
            with pytest.raises(openai.APIError, match="x-fair-sched-max-wait-s"):
                async for _ in stream:
                    pass

        # The engine refuses the request (no messages: within every bound of ours) after it
        # was released.
        async with client.stream(
            "POST", "/v1/chat/completions", json={**chat_body(stream=True), "messages": []}
        ) as response:
            await wait_until(lambda: service.scheduler.statistics().queued == 1)
            await cancel_all(hogs)
            comments, events = await read_events(response)
        assert response.status_code == 200
        assert len(events) == 1 and events[0]["error"]["message"]
    await assert_idle(service)


async def test_an_app_exception_after_keepalive_ends_with_an_error_event() -> None:
    """The app raises once the request was released: the client, which holds our 200, gets a
    server error event and a clean end; the exception still reaches the server (not hidden)."""
    async with emulator(max_num_seqs=1) as emu:
        forward = forwarding_handler(emu.base_url)
        calls = 0

        async def flaky(request: Any) -> Any:
            nonlocal calls
            calls += 1
            body = await request.body()
            if json.loads(body).get("user") == "boom":
                raise RuntimeError("the app broke")
            return await forward(request)

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with http_state(app):
                yield

        app = Starlette(
            routes=[Route("/v1/chat/completions", flaky, methods=["POST"])], lifespan=lifespan
        )
        config = fair_config(emu, waiting_below=1, **queue_settings(**KEEPALIVE_ON))
        app.add_middleware(FairSchedulerMiddleware, config=config)
        async with serve(app) as url, open_client(url, key="sk-batch", timeout=60) as hog_client:
            service = service_of(app)
            await gate_sees_metrics(service)
            hogs = await park_behind_full_engine(emu, service, hog_client)
            async with (
                open_client(url, key="sk-a", timeout=60) as client,
                client.stream(
                    "POST", "/v1/chat/completions", json=chat_body(stream=True, user="boom")
                ) as response,
            ):
                comments: list[str] = []
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith(": queued"):
                        comments.append(line)
                        break
                await cancel_all(hogs)
                _, events = await read_events(response, lines)
            assert comments and response.status_code == 200
            assert events == [
                {
                    "error": {
                        "message": "the request failed on the server",
                        "type": "server_error",
                        "param": None,
                        "code": "internal_error",
                    }
                }
            ]
            await assert_idle(service)


async def test_non_streaming_requests_get_no_keepalive_and_headers_say_where_they_stood(
    parked: ParkedEngine,
) -> None:
    """A parked non-streaming request waits silently (its answer is one JSON document, which
    cannot be started early); the response says how long it queued and in which tier."""
    _, url, service, hogs = parked
    async with open_client(url, key="sk-a", timeout=60) as client:
        pending = asyncio.ensure_future(
            client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
        )
        await wait_until(lambda: service.scheduler.statistics().queued == 1)
        parked_at = asyncio.get_running_loop().time()
        # Parked past keepalive_after_s: a streaming request would have its 200 now.
        await wait_until(lambda: asyncio.get_running_loop().time() - parked_at > 3 * 0.5)
        assert not pending.done()
        await cancel_all(hogs)
        response = await pending
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
    assert float(response.headers["x-fair-sched-queued-s"]) > 0
    assert response.headers["x-fair-sched-tier"] == "interactive"
    assert "x-fair-sched-principal" not in response.headers
    await assert_idle(service)


@pytest.mark.parametrize(
    "value", ["abc", "0", "-3", "inf", "nan", "", "1_0", "1e3", "+5", "0x10", "1" * 40, "0.0"]
)
async def test_a_bad_max_wait_header_is_400_naming_it(value: str) -> None:
    async with emulator() as emu:
        app = middleware_app(emu, fair_config(emu))
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            response = await client.post(
                "/v1/chat/completions",
                json=chat_body(),
                headers={"x-fair-sched-max-wait-s": value},
            )
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == "x-fair-sched-max-wait-s"
            assert "x-fair-sched-max-wait-s" in error["message"]
            assert len(emu.engine.received) == 0


async def test_max_wait_header_lowers_the_wait_never_raises_it() -> None:
    """Parked behind a full engine: a 1 s header gives up after about 1 s (504 timeout); a
    header above `queue.max_wait_s` (2 s) still gives up at the configured 2 s. Principal names
    are in the headers only with `observability.user_labels: principals`."""
    async with emulator(max_num_seqs=1) as emu:
        config = fair_config(
            emu,
            waiting_below=1,
            queue={"max_wait_s": 2, **KEEPALIVE_OFF},
            observability={"user_labels": "principals"},
        )
        app = middleware_app(emu, config)
        async with serve(app) as url, open_client(url, key="sk-batch", timeout=60) as hog_client:
            service = service_of(app)
            await gate_sees_metrics(service)
            served = await hog_client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
            assert served.headers["x-fair-sched-principal"] == "bot"
            assert served.headers["x-fair-sched-tier"] == "batch"
            hogs = await park_behind_full_engine(emu, service, hog_client)
            async with open_client(url, key="sk-a", timeout=60) as client:
                loop = asyncio.get_running_loop()

                async def timed(header: str) -> tuple[httpx.Response, float]:
                    started = loop.time()
                    response = await client.post(
                        "/v1/chat/completions",
                        json=chat_body(),
                        headers={"x-fair-sched-max-wait-s": header},
                    )
                    return response, loop.time() - started

                (short, short_s), (long, long_s) = await asyncio.gather(timed("1"), timed("3600"))
            await cancel_all(hogs)
            for response in (short, long):
                assert response.status_code == 504
                assert response.json()["error"]["code"] == "timeout"
                assert response.json()["error"]["type"] == "timeout_error"
                assert int(response.headers["retry-after"]) >= 1
            assert short_s < long_s  # an ordering, not a time: the machine is shared
            await assert_idle(service)


class _Parked:
    """What the watch reads from a parked request (`service.ParkedRequest`)."""

    def __init__(self) -> None:
        from fair_sched_plugin.config import QueueSettings

        self.queue = QueueSettings(keepalive_after_s=0.001, keepalive_interval_s=0.001)
        self.ticket = Ticket(model=MODEL, user="alice", tier="interactive")

    def position(self) -> int:
        return 1

    def wait_s(self) -> float:
        return 0.0

    def eta_s(self) -> float | None:
        return None

    def standing(self) -> tuple[int, float | None, float]:
        return self.position(), self.eta_s(), self.wait_s()


async def test_release_while_a_comment_is_being_sent_waits_for_it() -> None:
    """Race: the request is released (the app sends its response start) while a keep-alive
    comment is blocked in the server's send. The app's messages go out after the comment, its
    response start is absorbed, and no comment follows the engine's bytes."""
    from fair_sched_plugin.request.watch import RequestWatch

    sent: list[Message] = []
    unblock = asyncio.Event()
    first_comment = asyncio.Event()

    async def send(message: Message) -> None:
        if message.get("body", b"").startswith(b": queued") and not first_comment.is_set():
            first_comment.set()
            await unblock.wait()  # the client reads slowly
        sent.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    watch = RequestWatch(receive, send)
    watch.streaming = True

    async def app(scope: Any, receive: Any, send: Any) -> None:
        watch.parked(_Parked())  # type: ignore[arg-type]
        await first_comment.wait()
        watch.unparked()  # released now, mid-comment
        sending = asyncio.ensure_future(
            send({"type": "http.response.start", "status": 200, "headers": []})
        )
        await asyncio.sleep(0)
        assert not sending.done()  # waits for the comment in flight
        unblock.set()
        await sending
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": False})

    await watch.run(app, {"type": "http", "headers": []})
    kinds = [(m["type"], m.get("status"), m.get("body", b"")[:8]) for m in sent]
    assert kinds[0][:2] == ("http.response.start", 200)
    assert [k for k in kinds if k[0] == "http.response.start"] == [kinds[0]]
    assert kinds[-1] == ("http.response.body", None, b"data: x\n")
    assert all(k[2].startswith(b": queued") for k in kinds[1:-1])
    assert watch.response_complete


async def test_client_leaving_during_keepalive_takes_the_request_out_of_the_queue(
    parked: ParkedEngine,
) -> None:
    """Race: the client's connection fails while a keep-alive comment is sent; the request is
    treated as gone (ClientDisconnected while parked), never released to the engine."""
    emu, url, service, hogs = parked
    async with (
        open_client(url, key="sk-a", timeout=60) as client,
        client.stream(
            "POST", "/v1/chat/completions", json=chat_body(stream=True, user="gone")
        ) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith(": queued"):
                break
    # The client closed its connection after the first comment.
    await wait_until(lambda: service.scheduler.statistics().queued == 0)
    assert service.scheduler.statistics().cancelled_total == 1
    await cancel_all(hogs)
    await assert_idle(service)
    assert not any(request.user == "gone" for request in emu.engine.received)


# ----------------------------------------------------------------------------- where do I stand


@pytest.mark.parametrize("kind", ["middleware", "proxy"])
async def test_a_caller_sees_its_own_parked_requests_in_order_and_nobody_elses(kind: str) -> None:
    """30 parked requests of alice: her query lists 30 positions in order (with ETAs once a
    drain rate is measured); bob's query, with his own key, shows none of them; no key: 401."""
    async with emulator(max_num_seqs=1) as emu:
        config = fair_config(emu, waiting_below=1, **queue_settings(**KEEPALIVE_OFF))
        app = middleware_app(emu, config) if kind == "middleware" else build_proxy_app(config)
        async with serve(app) as url, open_client(url, key="sk-batch", timeout=60) as hog_client:
            service = service_of(app)
            await gate_sees_metrics(service)
            hogs = await park_behind_full_engine(emu, service, hog_client)
            async with (
                open_client(url, key="sk-a", timeout=60) as alice,
                open_client(url, key="sk-b", timeout=60) as bob,
                open_client(url, timeout=60) as nobody,
            ):
                parked = [
                    asyncio.ensure_future(
                        alice.post("/v1/chat/completions", json=chat_body(max_tokens=1))
                    )
                    for _ in range(30)
                ]
                await wait_until(lambda: service.scheduler.statistics().queued == 30)
                mine = (await alice.get("/fair-sched/queue")).json()
                assert list(mine["models"]) == [MODEL]
                entries = mine["models"][MODEL]["parked"]
                assert [entry["position"] for entry in entries] == list(range(1, 31))
                assert all(entry["tier"] == "interactive" for entry in entries)
                waits = [entry["wait_s"] for entry in entries]
                assert waits == sorted(waits, reverse=True)  # oldest first
                assert "principal" not in mine  # not named unless configured

                theirs = await bob.get("/fair-sched/queue")
                assert theirs.status_code == 200 and theirs.json() == {"models": {}}
                anonymous = await nobody.get("/fair-sched/queue")
                assert anonymous.status_code == 401
                assert "sk-a" not in anonymous.text

                await cancel_all(hogs)
                responses = await asyncio.gather(*parked)
                assert all(response.status_code == 200 for response in responses)
                assert (await alice.get("/fair-sched/queue")).json() == {"models": {}}
            await assert_idle(service)
