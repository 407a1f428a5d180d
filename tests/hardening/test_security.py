"""Security: identity comes from authentication, priority from configuration, secrets stay secret.

Everything that speaks HTTP runs through the standalone proxy (uvicorn on 127.0.0.1) in front of
the in-process emulator; what is pure (key comparison) is tested at unit level.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import inspect
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fair_sched_plugin import observability
from fair_sched_plugin.asgi import FairSchedulerMiddleware
from fair_sched_plugin.config import parse_settings
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.request import identity
from fair_sched_plugin.request.identity import Credentials, PrincipalDirectory
from fair_sched_plugin.runtime.service import SchedulingService

from ..integrations.conftest import (
    MODEL,
    assert_idle,
    cancel_all,
    chat_body,
    emulator,
    fair_config,
    open_client,
    received_priorities,
    serve,
    wait_until,
)
from ..support import service_of

INTERACTIVE_PRIORITY, BATCH_PRIORITY = 0, 10

# Attempts to jump the queue: every field a client could think of.
PRIORITY_SPOOFS: list[tuple[dict[str, Any], dict[str, str]]] = [
    ({"priority": -100}, {}),
    ({"extra_body": {"priority": -100}}, {}),
    ({"priority": -100, "extra_body": {"priority": -100, "top_k": 5}}, {}),
    ({}, {"x-priority": "-100", "priority": "-100"}),
    ({"metadata": {"priority": -100, "tier": "interactive"}}, {"x-fair-sched-tier": "interactive"}),
]


# ----------------------------------------------------------------------------- priority


async def test_client_cannot_raise_its_priority() -> None:
    """Whatever a client puts in its body or headers, the engine receives its tier's priority."""
    async with emulator(policy="priority") as emu:
        app = build_proxy_app(fair_config(emu, backend={"priority_scheduling": True}))
        async with (
            serve(app) as url,
            open_client(url, key="sk-batch") as bot,
            open_client(url, key="sk-a") as alice,
        ):
            for extra, headers in PRIORITY_SPOOFS:
                response = await bot.post(
                    "/v1/chat/completions", json=chat_body(**extra), headers=headers
                )
                assert response.status_code == 200, response.text
            # A client cannot lower itself below its tier either (it is ours to set).
            response = await alice.post("/v1/chat/completions", json=chat_body(priority=99))
            assert response.status_code == 200
            assert received_priorities(emu) == [BATCH_PRIORITY] * len(PRIORITY_SPOOFS) + [
                INTERACTIVE_PRIORITY
            ]
            await assert_idle(service_of(app))


async def test_forwarded_body_carries_only_our_priority() -> None:
    """The exact body the engine gets: our `priority` (or none), never the client's, in any place."""
    bodies: list[dict[str, Any]] = []

    def backend(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(
            200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(b"{}")
        )

    async with emulator() as emu:  # the gate reads its metrics; the bodies go to `backend`
        for priority_scheduling, expected in ((True, BATCH_PRIORITY), (False, None)):
            bodies.clear()
            config = fair_config(emu, backend={"priority_scheduling": priority_scheduling})
            app = build_proxy_app(config, transport=httpx.MockTransport(backend))
            async with serve(app) as url, open_client(url, key="sk-batch") as bot:
                for extra, headers in PRIORITY_SPOOFS:
                    response = await bot.post(
                        "/v1/chat/completions", json=chat_body(**extra), headers=headers
                    )
                    assert response.status_code == 200
            assert len(bodies) == len(PRIORITY_SPOOFS)
            for body in bodies:
                assert body.get("priority") == expected
                assert "priority" not in body.get("extra_body", {})
            # Unrelated extra_body fields pass through untouched.
            assert bodies[2]["extra_body"] == {"top_k": 5}


# ----------------------------------------------------------------------------- whose queue


@contextlib.asynccontextmanager
async def blocked_proxy(**overrides: Any) -> AsyncIterator[tuple[SchedulingService, str, Any]]:
    """A proxy whose engine has room for exactly one request, held by carol's long stream:
    everything else parks. (The engine's metrics fail, so the in-flight cap of 1 applies.)"""
    async with emulator() as emu:
        emu.engine.faults.metrics_mode = "error"
        config = fair_config(
            emu,
            on_metrics_unavailable={"max_inflight": 1},
            queue={"max_per_user": 1},
            **overrides,
        )
        app = build_proxy_app(config)
        service = service_of(app)
        async with serve(app) as url, open_client(url, key="sk-c") as carol:

            async def hog() -> None:
                body = chat_body(max_tokens=100_000, stream=True)
                async with carol.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for _ in response.aiter_raw():
                        pass

            holding = asyncio.ensure_future(hog())
            try:
                await wait_until(lambda: service.scheduler.statistics().in_flight == 1)
                yield service, url, emu
            finally:
                await cancel_all([holding])


async def park(client: httpx.AsyncClient, service: SchedulingService, **body: Any) -> Any:
    """Send a request that parks; return its task once the scheduler holds it."""
    before = service.scheduler.statistics().queued
    task = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat_body(**body)))
    await wait_until(lambda: service.scheduler.statistics().queued == before + 1 or task.done())
    assert not task.done(), task.result().text
    return task


def backlog_depths(service: SchedulingService) -> dict[str, int]:
    return {entry.user: entry.depth for entry in service.scheduler.backlog()}


async def test_body_user_metadata_and_headers_do_not_change_the_queue() -> None:
    """With identity from authentication (the default), alice stays alice: claiming bob's name
    (or a fresh one) in the body, metadata or headers lands in her own queue, which is full."""
    async with contextlib.AsyncExitStack() as stack:
        service, url, emu = await stack.enter_async_context(blocked_proxy())
        alice = await stack.enter_async_context(open_client(url, key="sk-a"))
        bob = await stack.enter_async_context(open_client(url, key="sk-b"))
        parked = [await park(alice, service)]
        spoofs: list[tuple[dict[str, Any], dict[str, str]]] = [
            ({"user": "bob"}, {}),
            ({"user": "fresh-1"}, {}),
            ({"metadata": {"user_id": "bob", "team_id": "t", "user_api_key_alias": "bob"}}, {}),
            ({}, {"x-fair-sched-user": "bob", "x-user": "fresh-2", "x-user-id": "bob"}),
            ({}, {"x-api-key": "sk-b"}),  # the bearer key wins over a second key header
        ]
        for extra, headers in spoofs:
            response = await alice.post(
                "/v1/chat/completions", json=chat_body(**extra), headers=headers
            )
            assert response.status_code == 429, (extra, headers, response.text)
            assert response.json()["error"]["code"] == "queue_full"
        parked.append(await park(bob, service))
        assert backlog_depths(service) == {"alice": 1, "bob": 1}
        await cancel_all(parked)
        await wait_until(lambda: service.scheduler.statistics().queued == 0)
        # Parked requests that left never reached the engine.
        assert emu.engine.statistics().requests_received == 1


@pytest.mark.parametrize(
    ("source", "claim"),
    [
        ("header", lambda name: ({}, {"x-fair-sched-user": name})),
        ("body_user", lambda name: ({"user": name}, {})),
    ],
)
async def test_client_named_identity_works_when_configured(source: str, claim: Any) -> None:
    """Where identity is configured to come from a header or the body's `user` (behind a
    gateway that sets it), that value names the queue: a new name is a new queue, and naming
    a configured principal puts the request in its queue."""
    async with contextlib.AsyncExitStack() as stack:
        service, url, _ = await stack.enter_async_context(
            blocked_proxy(identity={"source": source})
        )
        client = await stack.enter_async_context(open_client(url, key="sk-a"))
        parked = []
        for name in ("u1", "u2", "bob"):
            extra, headers = claim(name)
            task = asyncio.ensure_future(
                client.post("/v1/chat/completions", json=chat_body(**extra), headers=headers)
            )
            waiting = f"{'' if name == 'bob' else 'user:'}{name}"
            await wait_until(
                functools.partial(lambda user: user in backlog_depths(service), waiting)
            )
            parked.append(task)
        assert backlog_depths(service) == {"user:u1": 1, "user:u2": 1, "bob": 1}
        extra, headers = claim("u1")
        again = await client.post("/v1/chat/completions", json=chat_body(**extra), headers=headers)
        assert again.status_code == 429
        await cancel_all(parked)
        await wait_until(lambda: service.scheduler.statistics().queued == 0)


async def test_unknown_keys_are_strangers_in_the_default_tier_never_a_principal() -> None:
    """An unknown key is not anybody's principal: it gets the default tier and its own queue,
    named by a short hash of the key (the proxy does not authenticate: see the docs)."""
    directory = PrincipalDirectory(parse_settings({"principals": [{"name": "a", "keys": ["k1"]}]}))
    stranger = directory.resolve(Credentials(api_key="k2", claimed_user="a"))
    assert (stranger.name, stranger.known) == (identity.key_fingerprint("k2"), False)
    assert "k2" not in stranger.name and hashlib.sha256(b"k2").hexdigest() not in stranger.name


# ----------------------------------------------------------------------------- status, metrics


ADMIN_KEY = "adm-0d5c1f2e9b7a4c3d"


async def test_status_and_metrics_require_the_admin_key() -> None:
    async with emulator() as emu:
        app = build_proxy_app(fair_config(emu, observability={"admin_key": ADMIN_KEY}))
        async with serve(app) as url, open_client(url) as client:
            for path in (observability.STATUS_PATH, observability.METRICS_PATH):
                for headers in (
                    {},
                    {"authorization": "Bearer sk-a"},  # a user's key is not the admin key
                    {"authorization": f"Bearer {ADMIN_KEY}x"},
                    {"authorization": f"Bearer {ADMIN_KEY[:-1]}"},
                    {"x-api-key": ADMIN_KEY},
                ):
                    response = await client.get(path, headers=headers)
                    assert response.status_code == 401, (path, headers)
                    assert ADMIN_KEY not in response.text and "sk-a" not in response.text
                response = await client.get(path, headers={"authorization": f"Bearer {ADMIN_KEY}"})
                assert response.status_code == 200


def test_status_without_an_admin_key_is_open_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Without `observability.admin_key` the endpoints are open (by design, for trusted
    networks); the proxy says so at start-up."""
    caplog.set_level(logging.WARNING, logger="fair_sched")
    build_proxy_app({"backends": {MODEL: {"api_base": "http://127.0.0.1:9/v1"}}})
    assert any("without authentication" in record.getMessage() for record in caplog.records)


# ----------------------------------------------------------------------------- keys


def test_sha256_keys_resolve_like_plain_ones() -> None:
    secret = "sk-hashed-4c1b9e"
    hashed = "sha256:" + hashlib.sha256(secret.encode()).hexdigest()
    directory = PrincipalDirectory(
        parse_settings({"principals": [{"name": "bot", "keys": [hashed], "tier": "batch"}]})
    )
    assert directory.resolve(Credentials(api_key=secret)).name == "bot"
    # The digest itself is not a key: presenting it does not authenticate.
    assert not directory.resolve(Credentials(api_key=hashed)).known
    assert not directory.resolve(Credentials(api_key=hashed.removeprefix("sha256:"))).known


async def test_sha256_keys_work_end_to_end() -> None:
    secret = "sk-hashed-bot-91d0"
    config_key = "sha256:" + hashlib.sha256(secret.encode()).hexdigest()
    async with emulator(policy="priority") as emu:
        config = fair_config(emu, backend={"priority_scheduling": True})
        config["principals"] = [{"name": "ci-bot", "keys": [config_key], "tier": "batch"}]
        app = build_proxy_app(config)
        async with serve(app) as url:
            async with open_client(url, key=secret) as bot:
                assert (await bot.post("/v1/chat/completions", json=chat_body())).status_code == 200
            async with open_client(url, key="sk-someone-else") as other:
                refused = await other.post("/v1/chat/completions", json=chat_body())
                # The standalone proxy authenticates with the principals' keys.
                assert refused.status_code == 401
                assert "sk-someone-else" not in refused.text
            # ci-bot was recognised (batch tier); the stranger never reached the engine.
            assert received_priorities(emu) == [BATCH_PRIORITY]
            await assert_idle(service_of(app))


def test_key_comparison_is_constant_time_on_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Principal keys and the admin key are compared with `hmac.compare_digest`, on SHA-256
    digests of equal length, never on the raw keys (so timing says nothing about a stored key,
    not even its length)."""
    calls: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    secret = "sk-compare-31f9"
    directory = PrincipalDirectory(
        parse_settings({"principals": [{"name": "a", "keys": [secret]}]})
    )
    assert directory.principal_for_key(secret) is not None
    assert observability.keys_match(secret, secret)
    assert not observability.keys_match(secret + "x", secret)
    assert len(calls) == 3
    for a, b in calls:
        assert len(a) == len(b) and secret not in str(a) and secret not in str(b)
    assert calls[0][0] == hashlib.sha256(secret.encode()).hexdigest()
    # The code paths themselves, so a refactor cannot quietly drop them.
    assert "hmac.compare_digest" in inspect.getsource(PrincipalDirectory.principal_for_key)
    assert "hmac.compare_digest" in inspect.getsource(PrincipalDirectory.principal_for_digest)
    assert "hmac.compare_digest" in inspect.getsource(observability.keys_match)


async def test_litellm_master_key_is_compared_on_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `authenticate` compared the raw master key with `hmac.compare_digest`, which
    returns early on unequal lengths (its timing told the key's length). Now both sides are
    SHA-256 digests of equal length."""
    import sys
    import types

    from fair_sched_plugin.litellm import authenticate
    from fair_sched_plugin.litellm._proxy import PROXY_MODULE

    master = "sk-master-LEAKCHECK-77a1"
    calls: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    monkeypatch.setitem(sys.modules, PROXY_MODULE, types.SimpleNamespace(master_key=master))
    admin = await authenticate(None, master)  # type: ignore[arg-type]
    assert admin.user_id == "admin"
    assert calls == [(hashlib.sha256(master.encode()).digest(),) * 2]


def test_a_virtual_keys_metadata_cannot_claim_a_principal() -> None:
    """Before: `fair_sched_principal` in a LiteLLM virtual key's metadata (which a non-admin may
    set on a key it creates) made the caller that principal: its tier, weight, caps, budget.
    Now only a name our own `authenticate` vouched for counts; stored metadata is ignored."""
    import types

    from fair_sched_plugin.litellm._callback import (
        PRINCIPAL_KEY,
        FairSchedCallback,
        VouchedPrincipal,
    )

    service = SchedulingService(
        {"principals": [{"name": "vip", "keys": ["sk-vip-9d1c"], "weight": 10}]}
    )
    callback = FairSchedCallback(lambda: service)

    def caller(vouched: str) -> Any:
        return types.SimpleNamespace(
            metadata={PRINCIPAL_KEY: vouched},
            user_id="mallory",
            team_id=None,
            key_alias=None,
            token=hashlib.sha256(b"sk-mallory").hexdigest(),
        )

    forged = callback._principal(service, caller("vip"), {})
    assert (forged.name, forged.known) == ("user:mallory", False)
    vouched = callback._principal(service, caller(VouchedPrincipal("vip")), {})
    assert (vouched.name, vouched.known, vouched.weight) == ("vip", True, 10)


# ----------------------------------------------------------------------------- no key leaks


SECRETS = {
    "alice": "sk-alice-LEAKCHECK-6b21e0",
    "bob": "sk-bob-LEAKCHECK-f09a7d",
    "stranger": "sk-stranger-LEAKCHECK-33c8aa",
    "admin": "adm-LEAKCHECK-92e1b4",
    "wrong_admin": "adm-wrong-LEAKCHECK-5d7710",
}


def leak_config(emu: Any) -> dict[str, Any]:
    config = fair_config(
        emu,
        waiting_below=1,
        on_metrics_unavailable={"max_inflight": 1},
        queue={"max_per_user": 1},
        observability={"admin_key": SECRETS["admin"], "user_labels": "principals"},
    )
    config["principals"] = [
        {"name": "alice", "keys": [SECRETS["alice"]]},
        {"name": "bob", "keys": ["sha256:" + hashlib.sha256(SECRETS["bob"].encode()).hexdigest()]},
    ]
    return config


def assert_no_secret(text: str, where: str) -> None:
    for name, secret in SECRETS.items():
        assert secret not in text, f"{name}'s key appears in {where}"
        full_digest = hashlib.sha256(secret.encode()).hexdigest()
        if name != "bob":  # bob's digest is in the config on purpose
            assert full_digest not in text, f"{name}'s key digest appears in {where}"


async def test_keys_never_appear_in_logs_errors_status_or_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A scripted run at DEBUG: successes, an unknown key, a 429, a 401, a disconnect while
    parked and one mid-stream, a backend error. No key (nor its full digest) is in any log
    record (message, arguments or extras), error response, status document or metric."""
    caplog.set_level(logging.DEBUG)
    responses: list[str] = []
    async with emulator() as emu:
        emu.engine.faults.metrics_mode = "error"  # fallback: one request in flight at a time
        app = build_proxy_app(leak_config(emu))
        service = service_of(app)
        async with contextlib.AsyncExitStack() as stack:
            url = await stack.enter_async_context(serve(app))
            clients = {
                name: await stack.enter_async_context(open_client(url, key=SECRETS[name]))
                for name in ("alice", "bob", "stranger")
            }
            for name in ("alice", "bob", "stranger"):
                response = await clients[name].post("/v1/chat/completions", json=chat_body())
                # The proxy authenticates with the principals' keys: the stranger's is refused.
                assert response.status_code == (401 if name == "stranger" else 200)
                responses.append(response.text)

            # A backend error passes through.
            emu.engine.faults.fail_every_nth_completion = 1
            failed = await clients["alice"].post("/v1/chat/completions", json=chat_body())
            assert failed.status_code == 500
            responses.append(failed.text)
            emu.engine.faults.fail_every_nth_completion = 0

            # Alice holds the only slot with a stream she will leave mid-way.
            stream_body = chat_body(max_tokens=100_000, stream=True)
            async with clients["alice"].stream(
                "POST", "/v1/chat/completions", json=stream_body
            ) as streaming:
                # Keep the iterator referenced: a dropped one is finalised, closing the stream.
                chunks = streaming.aiter_raw()
                await chunks.__anext__()
                # Bob parks, then leaves; a second request of bob's is over his cap (429).
                bob_parked = asyncio.ensure_future(
                    clients["bob"].post("/v1/chat/completions", json=chat_body())
                )
                await wait_until(lambda: service.scheduler.statistics().queued == 1)
                rejected = await clients["bob"].post("/v1/chat/completions", json=chat_body())
                assert rejected.status_code == 429
                responses.append(rejected.text + json.dumps(dict(rejected.headers)))
                for path in (observability.STATUS_PATH, observability.METRICS_PATH):
                    for key in (SECRETS["wrong_admin"], SECRETS["alice"]):
                        denied = await clients["alice"].get(
                            path, headers={"authorization": f"Bearer {key}"}
                        )
                        assert denied.status_code == 401
                        responses.append(denied.text)
                    admin = await clients["alice"].get(
                        path, headers={"authorization": f"Bearer {SECRETS['admin']}"}
                    )
                    assert admin.status_code == 200
                    responses.append(admin.text)
                await cancel_all([bob_parked])
            await assert_idle(service)
            status = service.observability.status()
            metrics = service.observability.render().decode()
            assert status["totals"]["cancelled"] == 1

    assert_no_secret("\n".join(responses), "a response")
    assert_no_secret(json.dumps(status), "the status document")
    assert_no_secret(metrics, "the metrics")
    assert caplog.records, "the run should have logged something"
    for record in caplog.records:
        assert_no_secret(record.getMessage(), f"log record {record.name}")
        assert_no_secret(repr(record.__dict__), f"log record {record.name} (args/extras)")
    # The rejection was logged, naming the principal, not the key.
    assert any(
        getattr(record, "fair_sched_event", None) == "rejected"
        and getattr(record, "principal", None) == "bob"
        for record in caplog.records
    )


# ----------------------------------------------------------------------------- engine credentials

ENGINE_PASSWORD = "pw-LEAKCHECK-0c4e91"
ENGINE_TOKEN = "tok-LEAKCHECK-a7d253"


def credentialed(base_url: str) -> str:
    """`base_url`'s api_base with a password and a `?token=` in it, as some gateways want."""
    host = base_url.removeprefix("http://")
    return f"http://engine:{ENGINE_PASSWORD}@{host}/v1?token={ENGINE_TOKEN}"


def assert_no_engine_credential(text: str, where: str) -> None:
    for secret in (ENGINE_PASSWORD, ENGINE_TOKEN):
        assert secret not in text, f"the engine's credential appears in {where}: {text[:800]}"


async def test_engine_credentials_never_reach_clients_status_metrics_or_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: the deployment key was the raw api_base, so a password or a `?token=` in it came
    back in every response's `x-fair-sched-deployment`, and in the proxy's "cannot reach" line,
    the gate's transition lines and the metrics watcher's. Now every response header, status
    field, metric label and log record names the deployment without them."""
    caplog.set_level(logging.DEBUG)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    seen: list[str] = []
    async with emulator() as emu:
        config = fair_config(
            emu,
            backend={"api_base": credentialed(emu.base_url)},
            observability={"admin_key": SECRETS["admin"], "user_labels": "principals"},
            stale_after_ms=300,
        )
        config["backends"]["gone"] = {"api_base": credentialed(dead)}
        app = build_proxy_app(config)
        service = service_of(app)
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            ok = await client.post("/v1/chat/completions", json=chat_body())
            assert ok.status_code == 200, ok.text
            assert ok.headers["x-fair-sched-deployment"] == f"{emu.base_url}/v1"
            unreachable = await client.post("/v1/chat/completions", json=chat_body(model="gone"))
            assert unreachable.status_code in (502, 503), unreachable.text
            # The engine's metrics go and come back: the gate says so, naming the deployment.
            emu.engine.faults.metrics_mode = "error"
            await wait_until(
                lambda: any(
                    t.new == "fallback"
                    for t in service.observability.view.recent_transitions()
                    if t.model == MODEL
                ),
                20,
            )
            emu.engine.faults.metrics_mode = "ok"
            await wait_until(
                lambda: service.observability.view.recent_transitions()[-1].new == "metrics", 20
            )
            for response in (ok, unreachable):
                seen.append(response.text + json.dumps(list(response.headers.items())))
            admin = {"authorization": f"Bearer {SECRETS['admin']}"}
            for path in (observability.STATUS_PATH, observability.METRICS_PATH):
                answer = await client.get(path, headers=admin)
                assert answer.status_code == 200
                seen.append(answer.text)
            await assert_idle(service)
    assert "fair_sched_gate_mode" in seen[-1] and f"{emu.base_url}/v1" in seen[-1]
    assert_no_engine_credential("\n".join(seen), "a response, the status or the metrics")
    messages = [record.getMessage() for record in caplog.records]
    assert any("cannot reach" in message for message in messages), messages
    assert any("mode=fallback" in message for message in messages), messages
    for record in caplog.records:
        assert_no_engine_credential(record.getMessage(), f"log record {record.name}")
        assert_no_engine_credential(repr(record.__dict__), f"log record {record.name} (args)")


async def test_the_app_gets_the_key_in_request_state_and_only_the_name_in_its_header() -> None:
    """Behind the middleware the app must reach the bound engine (credentials and all), from
    `request.state`; the request header it might echo or forward carries the public name."""
    async with emulator() as emu:
        api_base = credentialed(emu.base_url)

        async def endpoint(request: Request) -> Response:
            return JSONResponse(
                {
                    "state": request.state.fair_sched_deployment,
                    "header": request.headers.get("x-fair-sched-deployment"),
                }
            )

        inner = Starlette(routes=[Route("/v1/chat/completions", endpoint, methods=["POST"])])
        app = FairSchedulerMiddleware(inner, fair_config(emu, backend={"api_base": api_base}))
        async with serve(app) as url, open_client(url, key="sk-a") as client:
            response = await client.post("/v1/chat/completions", json=chat_body())
            assert response.status_code == 200, response.text
            assert response.json() == {
                "state": api_base,
                "header": f"{emu.base_url}/v1",
            }
            assert response.headers["x-fair-sched-deployment"] == f"{emu.base_url}/v1"
