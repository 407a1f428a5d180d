"""Hostile numbers in request bodies and headers, through every integration: each is refused
with a 400 naming the field (or served within its bounds), never a 500; afterwards another
principal is served and nothing is left queued or in flight.

Before: a 400-digit `max_tokens` became the ticket's cost; turning it into a float raised
OverflowError in the end's charge after the lease was marked ended (slots leaked for good), and
with `fairness: tokens` inside the release step, after which every request of every tier got a
500 until a restart. Sent to a follower replica, it wedged the leader.

The fair-sched proxy (the ASGI middleware in front of a relay) runs in this process under every
fairness policy, with hypothesis-generated bodies and headers; a real LiteLLM proxy runs the
issue's worst case (`fairness: tokens`); two fair-sched proxy replicas share a real
redis-server, the odd values entering at the follower.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_sched_plugin.lab.harness.litellm_proxy import (
    MASTER_KEY,
    litellm_proxy,
    model_entry,
    proxy_config,
)
from fair_sched_plugin.lab.harness.litellm_proxy import open_client as open_litellm_client
from fair_sched_plugin.proxy import build_proxy_app
from fair_sched_plugin.runtime.service import SchedulingService

from ..integrations.conftest import (
    MODEL,
    assert_idle,
    chat_body,
    emulator,
    fair_config,
    open_client,
    serve,
    wait_until,
)
from ..integrations.litellm_harness import NEEDS_LITELLM
from ..state.conftest import RedisServer, require_redis_server, unique_prefix
from .test_litellm_leases import wait_in_flight_zero

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
# As JSON text: Python's json reads `NaN`, `Infinity` and a 400-digit integer as numbers.
ODD_VALUES = [
    "1" + "0" * 400,
    "1e400",
    "NaN",
    "-Infinity",
    "-5",
    "0",
    '"256"',
    "[256]",
    "2.5",
    "true",
    "{}",
]
ODD_FIELDS = ["max_tokens", "max_completion_tokens", "n"]
PRICE = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}


def odd_body(field: str, value: str) -> bytes:
    start = json.dumps({"model": MODEL, "messages": MESSAGES})[:-1]
    return f'{start}, "{field}": {value}}}'.encode()


def fairness_config(emu: Any, fairness: str, **overrides: Any) -> dict[str, Any]:
    backend = {"price": PRICE} if fairness == "cost" else {}
    return fair_config(emu, fairness=fairness, backend=backend, **overrides)


async def send_odd_values(client: httpx.AsyncClient) -> list[tuple[str, str, int, str]]:
    """Every odd value in every field; (field, value, status, error param)."""
    answers = []
    for field in ODD_FIELDS:
        for value in ODD_VALUES:
            response = await client.post(
                CHAT, content=odd_body(field, value), headers={"content-type": "application/json"}
            )
            error = response.json().get("error", {}) if response.status_code >= 400 else {}
            answers.append((field, value[:12], response.status_code, str(error.get("param"))))
    return answers


async def served_three_times(client: httpx.AsyncClient) -> int:
    served = 0
    for _ in range(3):
        response = await client.post(CHAT, json=chat_body(max_tokens=4))
        served += response.status_code == 200
    return served


@pytest.mark.parametrize("fairness", ["round_robin", "weighted", "tokens", "cost"])
async def test_odd_numbers_through_the_fair_sched_proxy(fairness: str) -> None:
    async with emulator() as emu:
        app = build_proxy_app(fairness_config(emu, fairness))
        async with (
            serve(app) as url,
            open_client(url, key="sk-a") as alice,
            open_client(url, key="sk-b") as bob,
        ):
            answers = await send_odd_values(alice)
            assert [status for _, _, status, _ in answers] == [400] * len(answers), answers
            assert all(param == field for field, _, _, param in answers), answers
            assert await served_three_times(bob) == 3
            await assert_idle(_service(app))


def _service(app: Any) -> SchedulingService:
    service = app.state.fair_sched
    assert isinstance(service, SchedulingService)
    return service


# ------------------------------------------------------------ hypothesis: bodies and headers

HOSTILE_NUMBER = st.one_of(
    st.integers(min_value=-(10**30), max_value=0),
    st.integers(min_value=10**8 + 1, max_value=10**500),
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not 1 <= x <= 16),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.booleans(),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
# Values the engine serves quickly: a test never asks for a long generation.
FAIR_NUMBER = st.integers(min_value=1, max_value=8)
FIELD_VALUE = st.one_of(HOSTILE_NUMBER, FAIR_NUMBER, st.none())
BODIES = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.just(MESSAGES)},
    optional={
        "max_tokens": FIELD_VALUE,
        "max_completion_tokens": FIELD_VALUE,
        "n": st.one_of(HOSTILE_NUMBER, st.just(1), st.none()),
        "best_of": st.one_of(HOSTILE_NUMBER, st.just(1), st.none()),
        "stream": st.one_of(st.booleans(), st.text(max_size=3), st.none()),
        "priority": st.one_of(st.integers(), st.floats(), st.text(max_size=5)),
        "user": st.one_of(st.text(max_size=30), st.integers()),
        "extra_body": st.one_of(
            st.dictionaries(st.sampled_from(["priority", "x"]), st.integers()), st.text()
        ),
    },
)
HEADER_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40
).map(str.strip)
HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "x-fair-sched-max-wait-s": st.one_of(
            HEADER_TEXT, st.sampled_from(["1e400", "nan", "-1", "0", "inf", "1" + "0" * 400])
        ),
        "x-fair-sched-deployment": HEADER_TEXT,
        "x-api-key": HEADER_TEXT,
    },
)


class ThreadedStack:
    """The emulator and a fair-sched proxy served by a loop in a thread of their own, so a
    synchronous hypothesis test can drive them over real HTTP."""

    def __init__(self, fairness: str) -> None:
        self.fairness = fairness
        self.url = ""
        self.service: SchedulingService | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with emulator() as emu:
            app = build_proxy_app(fairness_config(emu, self.fairness, queue={"max_wait_s": 5}))
            async with serve(app) as url:
                self.url = url
                self.service = _service(app)
                self._ready.set()
                await self._stop.wait()

    def call(self, check: Any) -> Any:
        """Run `check()` (a coroutine function) on the stack's loop and return its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(check(), self._loop).result(60)

    def __enter__(self) -> ThreadedStack:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the emulator and proxy did not start")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture(scope="module", params=["tokens", "cost"])
def threaded_stack(request: pytest.FixtureRequest) -> Iterator[ThreadedStack]:
    with ThreadedStack(request.param) as stack:
        yield stack


def test_generated_bodies_and_headers_never_get_a_500(threaded_stack: ThreadedStack) -> None:
    statuses: list[int] = []
    with httpx.Client(base_url=threaded_stack.url, timeout=30, trust_env=False) as client:

        @settings(
            max_examples=120,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )
        @given(body=BODIES, headers=HEADERS)
        def one_request(body: dict[str, Any], headers: dict[str, str]) -> None:
            content = json.dumps(body).encode()
            response = client.post(
                CHAT,
                content=content,
                headers={
                    "authorization": "Bearer sk-a",
                    "content-type": "application/json",
                    **headers,
                },
            )
            statuses.append(response.status_code)
            assert response.status_code < 500, (body, headers, response.text[:300])

        one_request()
        # Afterwards another principal is served, and nothing stays queued or in flight.
        served = sum(
            client.post(
                CHAT, json=chat_body(max_tokens=4), headers={"authorization": "Bearer sk-b"}
            ).status_code
            == 200
            for _ in range(3)
        )
    assert served == 3
    assert 400 in statuses  # the strategies did reach the bounds

    async def idle() -> None:
        assert threaded_stack.service is not None
        await assert_idle(threaded_stack.service)

    threaded_stack.call(idle)


# ------------------------------------------------------------ a real LiteLLM proxy


@NEEDS_LITELLM
@pytest.mark.litellm
async def test_odd_numbers_through_litellm_with_token_fairness(tmp_path: Path) -> None:
    """The issue's measurement: all 16 odd answers were 500, then another principal was served
    0 times out of 3. Only `fairness: tokens` here (each policy is a proxy start of its own;
    the same request path runs every policy in `test_odd_numbers_through_the_fair_sched_proxy`)."""
    async with emulator() as emu:
        fair_sched = fairness_config(emu, "tokens")
        fair_sched["backends"] = {MODEL: {"metrics_url": f"{emu.base_url}/metrics"}}
        config = proxy_config([model_entry(MODEL, f"{emu.base_url}/v1")], fair_sched)
        async with litellm_proxy(config, tmp_path, "hostile") as proxy:
            async with open_litellm_client(proxy.base_url, "sk-a") as alice:
                answers = await send_odd_values(alice)
            assert all(400 <= status < 500 for _, _, status, _ in answers), answers
            # Our own refusal, naming the field (LiteLLM's own validation would not).
            assert all(param == field for field, _, _, param in answers), answers
            async with open_litellm_client(proxy.base_url, "sk-b") as bob:
                assert await served_three_times(bob) == 3
            await wait_in_flight_zero(proxy)
            async with open_litellm_client(proxy.base_url, MASTER_KEY) as admin:
                status = (await admin.get("/fair-sched/status")).json()
            assert sum(status["models"][MODEL]["queued"].values()) == 0


# ------------------------------------------------------------ replicas on a real redis-server


@contextlib.asynccontextmanager
async def two_replicas(emu: Any, redis_url: str) -> AsyncIterator[tuple[Any, Any]]:
    shared = {"state": redis_url, "state_prefix": unique_prefix()}
    leader_app = build_proxy_app(fairness_config(emu, "tokens", **shared))
    follower_app = build_proxy_app(fairness_config(emu, "tokens", **shared))
    async with serve(leader_app) as leader_url:
        await wait_until(lambda: _service(leader_app).scheduler.leading, 15)
        async with serve(follower_app) as follower_url:
            await wait_until(
                lambda: (
                    _service(follower_app).scheduler.coordinated
                    and not _service(follower_app).scheduler.leading
                ),
                15,
            )
            yield (leader_app, leader_url), (follower_app, follower_url)


@pytest.mark.redis
async def test_odd_numbers_at_a_follower_leave_the_leader_serving(tmp_path: Path) -> None:
    require_redis_server()
    redis = RedisServer(tmp_path)
    redis.start()
    try:
        async with emulator() as emu, two_replicas(emu, redis.url) as (leader, follower):
            (leader_app, leader_url), (follower_app, follower_url) = leader, follower
            async with open_client(follower_url, key="sk-a") as alice:
                answers = await send_odd_values(alice)
            assert [status for _, _, status, _ in answers] == [400] * len(answers), answers
            for url in (leader_url, follower_url):
                async with open_client(url, key="sk-b") as bob:
                    assert await served_three_times(bob) == 3
            assert _service(leader_app).scheduler.leading
            await assert_idle(_service(leader_app))
            await assert_idle(_service(follower_app))
    finally:
        redis.stop()
