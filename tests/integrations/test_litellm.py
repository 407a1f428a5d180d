"""The LiteLLM plugin end to end: clients -> a real `litellm` proxy process -> emulators.

Two proxies are shared by the whole module (starting one costs ~7-11 s):

- `main`: model `tiny` on a priority-policy emulator (4 slots) gated on its metrics;
- `strict`: model `tiny-fcfs` on an fcfs emulator without priority scheduling, and `tiny-capped`
  on the same emulator with a metrics URL nobody serves, so its gate runs on the fallback
  in-flight cap of 1: a lease that is never released blocks every later request there.
  `queue.max_per_user` is 2.

The emulators run in this test's event loop, so the tests read the engine's state directly. The
plugin's own state lives in the proxy process; it is inferred from what reaches the engine and
from whether a request on `tiny-capped` still gets through.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from fair_sched_plugin.lab.emulator.engine import EmulatedEngine, EmulatorConfig
from fair_sched_plugin.lab.emulator.server import RunningEmulator, run_emulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    CHAT,
    MASTER_KEY,
    ProxyProcess,
    StreamResult,
    free_port,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
    run_proxy_to_exit,
    stream_chat,
)

from ..support import cancel_all, eventually
from .conftest import wait_until
from .litellm_harness import shared_proxy_marks

pytestmark = shared_proxy_marks(pytest.mark.litellm_range)

WAITING_BELOW = 2  # the interactive tier's threshold on `main`
MAX_NUM_SEQS = 4
INTERACTIVE_PRIORITY = 1  # non-zero, so "sent" and "not sent" differ at the engine
BATCH_PRIORITY = 10
FLOOD_SIZE = 40
FLOOD_TOKENS = 24
# Long enough to hold a slot for the whole test (15 ms a step: over a minute).
HOG_TOKENS = 5000
# A step slow enough that a proxy on two cores keeps up with every running stream.
ENGINE_STEPS: dict[str, Any] = {
    "base_step_ms": 15.0,
    "step_ms_per_running_seq": 0.0,
    "prefill_ms_per_token": 0.0,
}
# That a request is parked in the plugin is read from the proxy's `/fair-sched/status` document
# (`wait_queued`), never waited for with a fixed sleep.


def fair_sched_section(**overrides: Any) -> dict[str, Any]:
    section: dict[str, Any] = {
        "tiers": [
            {
                "name": "interactive",
                "waiting_below": WAITING_BELOW,
                "vllm_priority": INTERACTIVE_PRIORITY,
            },
            {"name": "batch", "waiting_below": 1, "vllm_priority": BATCH_PRIORITY},
        ],
        "default_tier": "interactive",
        "principals": [
            {"name": "alice", "keys": ["sk-a"]},
            {"name": "bob", "keys": ["sk-b"]},
            {"name": "carol", "keys": ["sk-c"]},
            {"name": "bot", "keys": ["sk-batch"], "tier": "batch"},
        ],
        "metrics_poll_ms": 50,
    }
    section.update(overrides)
    return section


class WaitingPeak:
    """The engine's largest waiting queue since `reset()` (it only grows when a request arrives)."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.value = 0
        original = engine.submit

        def submit(*args: Any, **kwargs: Any) -> Any:
            seq = original(*args, **kwargs)
            self.value = max(self.value, engine.statistics().waiting)
            return seq

        engine.submit = submit  # type: ignore[method-assign]

    def reset(self) -> None:
        self.value = 0


@dataclass
class Stack:
    emu: RunningEmulator  # priority policy, behind `main`'s `tiny`
    fcfs: RunningEmulator  # fcfs policy, behind `strict`'s `tiny-fcfs` and `tiny-capped`
    main: ProxyProcess
    strict: ProxyProcess
    peak: WaitingPeak
    # A proxy started with an invalid `fair_sched:` section: its exit code and output. Started
    # with the others, so its ~15 s of importing LiteLLM overlap theirs.
    invalid_start: asyncio.Task[tuple[int | None, str]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    workdir = tmp_path_factory.mktemp("litellm")
    async with contextlib.AsyncExitStack() as exits:
        emu = await exits.enter_async_context(
            run_emulator(
                EmulatorConfig(
                    models=("tiny",), max_num_seqs=MAX_NUM_SEQS, policy="priority", **ENGINE_STEPS
                )
            )
        )
        fcfs = await exits.enter_async_context(
            run_emulator(
                EmulatorConfig(models=("tiny",), max_num_seqs=4, policy="fcfs", **ENGINE_STEPS)
            )
        )
        main_config = proxy_config(
            [model_entry("tiny", f"{emu.base_url}/v1")],
            fair_sched_section(backends={"tiny": {"priority_scheduling": True}}),
        )
        dead_metrics = f"http://127.0.0.1:{free_port()}/metrics"
        strict_config = proxy_config(
            [
                model_entry("tiny-fcfs", f"{fcfs.base_url}/v1"),
                model_entry("tiny-capped", f"{fcfs.base_url}/v1"),
            ],
            fair_sched_section(
                backends={
                    "tiny-fcfs": {"priority_scheduling": False},
                    "tiny-capped": {
                        "metrics_url": dead_metrics,
                        "on_metrics_unavailable": {"max_inflight": 1},
                    },
                },
                queue={"max_per_user": 2},
            ),
        )
        invalid_config = proxy_config(
            [model_entry("tiny", f"{emu.base_url}/v1")],
            fair_sched_section(tiers=[{"name": "interactive", "waiting_below": -1}]),
        )
        invalid_start = asyncio.create_task(
            run_proxy_to_exit(invalid_config, workdir, "invalid", timeout_s=120)
        )
        exits.push_async_callback(cancel_all, [invalid_start])
        # All import LiteLLM at once: faster than one after the other.
        started = await asyncio.gather(
            exits.enter_async_context(litellm_proxy(main_config, workdir, "main")),
            exits.enter_async_context(litellm_proxy(strict_config, workdir, "strict")),
            return_exceptions=True,
        )
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        main, strict = started
        assert isinstance(main, ProxyProcess) and isinstance(strict, ProxyProcess)
        yield Stack(emu, fcfs, main, strict, WaitingPeak(emu.engine), invalid_start)


# ----------------------------------------------------------------------------- helpers


def body(max_tokens: int = 5, model: str = "tiny", **extra: Any) -> dict[str, Any]:
    """A chat request; `max_tokens` doubles as a tag to find the request at the engine."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
        "max_tokens": max_tokens,
        **extra,
    }


def received_with(emu: RunningEmulator, max_tokens: int) -> list[Any]:
    return [request for request in emu.engine.received if request.max_tokens == max_tokens]


def hogs_arrived_since_now(emu: RunningEmulator) -> Callable[[], int]:
    """How many HOG_TOKENS requests reached `emu` since this call. The engine remembers earlier
    tests' hogs, so a wait on the total alone can pass before this test's hog holds its slot."""
    before = len(received_with(emu, HOG_TOKENS))
    return lambda: len(received_with(emu, HOG_TOKENS)) - before


async def engine_idle(emu: RunningEmulator, timeout_s: float = 10.0) -> None:
    def idle() -> bool:
        stats = emu.engine.statistics()
        return stats.running == 0 and stats.waiting == 0

    await wait_until(idle, timeout_s)


async def drain(client: httpx.AsyncClient, request_body: Mapping[str, Any]) -> None:
    """Stream a request to the end (or until cancelled: the connection is then closed)."""
    async with client.stream("POST", CHAT, json=dict(request_body)) as response:
        async for _ in response.aiter_raw():
            pass


def share_started_before(flood: list[StreamResult], moment: float) -> float:
    started = [r.first_token_at for r in flood if r.first_token_at is not None]
    assert len(started) == len(flood), "every flood request must stream"
    return sum(1 for at in started if at < moment) / len(flood)


# ----------------------------------------------------------------------------- basics


async def test_streaming_and_non_streaming_with_usage(stack: Stack) -> None:
    async with open_client(stack.main.base_url, "sk-a") as client:
        whole = await client.post(CHAT, json=body(max_tokens=5))
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"]["completion_tokens"] == 5

        streamed = await stream_chat(
            client, CHAT, body(max_tokens=6, stream=True, stream_options={"include_usage": True})
        )
        assert streamed.status == 200, streamed.error
        assert streamed.content_chunks == 6
        assert streamed.usage is not None and streamed.usage["completion_tokens"] == 6

        text = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "Fair is", "max_tokens": 3}
        )
        assert text.status_code == 200, text.text
        assert text.json()["usage"]["completion_tokens"] == 3
    await engine_idle(stack.emu)


async def test_engine_gets_the_tier_priority_never_the_clients(stack: Stack) -> None:
    # (key, tag, extra body fields, the priority the engine must see)
    cases: list[tuple[str, int, dict[str, Any], int]] = [
        ("sk-a", 31, {}, INTERACTIVE_PRIORITY),
        ("sk-a", 32, {"priority": 7}, INTERACTIVE_PRIORITY),
        ("sk-a", 33, {"extra_body": {"priority": -3}}, INTERACTIVE_PRIORITY),
        ("sk-a", 34, {"priority": 7, "extra_body": {"priority": -3}}, INTERACTIVE_PRIORITY),
        ("sk-batch", 35, {}, BATCH_PRIORITY),
        ("sk-batch", 36, {"extra_body": {"priority": 0}}, BATCH_PRIORITY),
        (MASTER_KEY, 37, {"extra_body": {"priority": -3}}, INTERACTIVE_PRIORITY),
    ]
    for key, tag, extra, expected in cases:
        async with open_client(stack.main.base_url, key) as client:
            response = await client.post(CHAT, json=body(max_tokens=tag, **extra))
            assert response.status_code == 200, (tag, response.text)
        assert [r.priority for r in received_with(stack.emu, tag)] == [expected], tag


async def test_fcfs_backend_gets_no_priority_and_nothing_errors(stack: Stack) -> None:
    cases: list[tuple[str, int, dict[str, Any]]] = [
        ("sk-a", 41, {"priority": 7, "extra_body": {"priority": 9}}),
        ("sk-batch", 42, {}),
        ("sk-batch", 43, {"extra_body": {"priority": 5}, "stream": True}),
    ]
    for key, tag, extra in cases:
        async with open_client(stack.strict.base_url, key) as client:
            if extra.get("stream"):
                result = await stream_chat(client, CHAT, body(tag, "tiny-fcfs", **extra))
                assert result.status == 200 and result.content_chunks == tag, result.error
            else:
                response = await client.post(CHAT, json=body(tag, "tiny-fcfs", **extra))
                assert response.status_code == 200, response.text
        # The fcfs emulator answers 400 to any non-zero priority, as vLLM does.
        assert [r.priority for r in received_with(stack.fcfs, tag)] == [0]


# ----------------------------------------------------------------------------- identity


async def test_unknown_or_missing_key_is_401_and_the_master_key_works(stack: Stack) -> None:
    received_before = stack.emu.engine.statistics().requests_received
    for key in ("sk-nobody", None):
        async with open_client(stack.main.base_url, key) as client:
            response = await client.post(CHAT, json=body())
            assert response.status_code == 401, response.text
            assert "sk-nobody" not in response.text
    assert stack.emu.engine.statistics().requests_received == received_before

    async with open_client(stack.main.base_url, MASTER_KEY) as client:
        response = await client.post(CHAT, json=body())
        assert response.status_code == 200, response.text


async def test_body_user_and_headers_do_not_change_the_callers_queue(stack: Stack) -> None:
    """With `tiny-capped`'s only slot taken, alice's queue holds its cap of 2; a third request
    claiming another user in the body and in headers is still alice's: 429. Carol's is not."""
    async with (
        open_client(stack.strict.base_url, "sk-b") as hog_client,
        open_client(stack.strict.base_url, "sk-a") as alice,
        open_client(stack.strict.base_url, "sk-c") as carol,
    ):
        hogs_arrived = hogs_arrived_since_now(stack.fcfs)
        hog = asyncio.create_task(drain(hog_client, body(HOG_TOKENS, "tiny-capped", stream=True)))
        await wait_until(lambda: hogs_arrived() >= 1)
        parked = []
        for tag in (51, 52):
            parked.append(asyncio.create_task(alice.post(CHAT, json=body(tag, "tiny-capped"))))
            await wait_queued(stack.strict, "tiny-capped", len(parked))
        try:
            disguised = await alice.post(
                CHAT,
                json=body(53, "tiny-capped", user="carol"),
                headers={
                    "x-fair-sched-user": "carol",
                    "x-litellm-call-id": "carol-call",
                    "x-forwarded-for": "10.9.9.9",
                },
            )
            assert disguised.status_code == 429, disguised.text
            other = asyncio.create_task(carol.post(CHAT, json=body(54, "tiny-capped")))
            await wait_queued(stack.strict, "tiny-capped", 3)
            assert not other.done(), "carol's request must park in her own queue"
            parked.append(other)
        finally:
            await cancel_all([hog, *parked])
        for tag in (51, 52, 53, 54):
            assert not received_with(stack.fcfs, tag)
    await engine_idle(stack.fcfs)


async def test_queue_cap_is_429_with_retry_after(stack: Stack) -> None:
    async with (
        open_client(stack.strict.base_url, "sk-b") as hog_client,
        open_client(stack.strict.base_url, "sk-c") as carol,
    ):
        hogs_arrived = hogs_arrived_since_now(stack.fcfs)
        hog = asyncio.create_task(drain(hog_client, body(HOG_TOKENS, "tiny-capped", stream=True)))
        await wait_until(lambda: hogs_arrived() >= 1)
        parked = []
        for tag in (55, 56):
            parked.append(asyncio.create_task(carol.post(CHAT, json=body(tag, "tiny-capped"))))
            # Both must be queued before the third, else the third is queued in their place and
            # waits for ever.
            await wait_queued(stack.strict, "tiny-capped", len(parked))
        try:
            for extra in ({}, {"stream": True}):
                rejected = await carol.post(CHAT, json=body(57, "tiny-capped", **extra))
                assert rejected.status_code == 429, rejected.text
                assert int(rejected.headers["retry-after"]) >= 1
                assert "queue" in rejected.json()["error"]["message"]
        finally:
            await cancel_all([hog, *parked])
    await engine_idle(stack.fcfs)


# ----------------------------------------------------------------------------- the flood


async def flood(
    base_url: str,
    keys: tuple[str, str, str],
    engine: EmulatedEngine,
    proxy: ProxyProcess | None = None,
) -> tuple[list[StreamResult], list[StreamResult]]:
    """`keys[0]` sends FLOOD_SIZE streams at once; once the engine is full and the whole flood
    has arrived (at the engine, or parked in `proxy`'s plugin), `keys[1]` and `keys[2]` send one
    each, as in DESIGN.md (there: 1 s later). Returns (flood, light users)."""
    heavy_key, *light_keys = keys
    request = body(FLOOD_TOKENS, stream=True)
    received_before = engine.statistics().requests_received
    async with (
        open_client(base_url, heavy_key, timeout=60) as heavy,
        open_client(base_url, light_keys[0], timeout=60) as light_b,
        open_client(base_url, light_keys[1], timeout=60) as light_c,
    ):
        heavy_tasks = [
            asyncio.create_task(stream_chat(heavy, CHAT, request)) for _ in range(FLOOD_SIZE)
        ]
        try:
            await wait_until(lambda: engine.statistics().running == MAX_NUM_SEQS)

            async def whole_flood_arrived() -> bool:
                """At the engine, or parked in the plugin (`proxy`): the light users come last."""
                arrived = engine.statistics().requests_received - received_before
                if proxy is not None and arrived < FLOOD_SIZE:
                    arrived += await queued_count(proxy, "tiny")
                return arrived >= FLOOD_SIZE

            await eventually(whole_flood_arrived, 60)
            light = await asyncio.gather(
                stream_chat(light_b, CHAT, request), stream_chat(light_c, CHAT, request)
            )
            flood_results = await asyncio.wait_for(asyncio.gather(*heavy_tasks), 60)
        finally:
            await cancel_all(heavy_tasks)
    for result in (*flood_results, *light):
        assert result.status == 200 and result.content_chunks == FLOOD_TOKENS, result.error
    return list(flood_results), list(light)


# The claim (light users first through LiteLLM with the plugin, the engine's queue held) is the
# demo's guard in CI (test_demo.py, stricter: the queue <= its threshold); this flood runs with
# scripts/test --full.
@pytest.mark.full
async def test_flood_light_users_overtake_the_power_user(stack: Stack) -> None:
    await engine_idle(stack.emu)
    stack.peak.reset()
    heavy, light = await flood(
        stack.main.base_url, ("sk-a", "sk-b", "sk-c"), stack.emu.engine, stack.main
    )
    plugin_peak = stack.peak.value
    with_plugin = [share_started_before(heavy, r.first_token_at or 0.0) for r in light]

    await engine_idle(stack.emu)
    stack.peak.reset()
    direct_heavy, direct_light = await flood(stack.emu.base_url, ("a", "b", "c"), stack.emu.engine)
    direct_peak = stack.peak.value
    direct = [share_started_before(direct_heavy, r.first_token_at or 0.0) for r in direct_light]

    print(
        f"\nflood of {FLOOD_SIZE}: share of the power user's requests started before each light "
        f"user's first token: with plugin {with_plugin}, direct {direct}; light TTFT p50 "
        f"{statistics.median(r.ttft or 0 for r in light):.3f} s with plugin, "
        f"{statistics.median(r.ttft or 0 for r in direct_light):.3f} s direct; engine max "
        f"waiting {plugin_peak} with plugin (waiting_below {WAITING_BELOW}), {direct_peak} direct"
    )
    assert all(share < 0.8 for share in with_plugin), with_plugin
    assert all(share >= 0.8 for share in direct), direct
    # The gate's credits keep the engine's queue below `waiting_below`; a released request that
    # takes longer than `arrival_grace_ms` to reach the engine (a starved proxy) can overshoot by
    # one or two, never by the flood.
    assert plugin_peak <= WAITING_BELOW + 2
    assert direct_peak >= FLOOD_SIZE - MAX_NUM_SEQS
    await engine_idle(stack.emu)


# ----------------------------------------------------------------------------- disconnects


async def test_disconnect_while_parked_never_reaches_the_engine(stack: Stack) -> None:
    """Bob's long streams fill the engine (4 running, 2 waiting: the gate is closed). Carol's
    first request parks and its client leaves; her second stays. When bob's streams end, only
    the second reaches the engine, and the proxy logged the first as 499."""
    hog_count = MAX_NUM_SEQS + WAITING_BELOW
    async with (
        open_client(stack.main.base_url, "sk-b") as bob,
        open_client(stack.main.base_url, "sk-c") as carol,
        open_client(stack.main.base_url, "sk-c") as carol_again,
    ):
        hogs_arrived = hogs_arrived_since_now(stack.emu)
        hogs = [
            asyncio.create_task(drain(bob, body(HOG_TOKENS, stream=True))) for _ in range(hog_count)
        ]
        try:
            await wait_until(lambda: hogs_arrived() >= hog_count)
            leaving = asyncio.create_task(drain(carol, body(61, stream=True)))
            await wait_queued(stack.main, "tiny", 1)
            staying = asyncio.create_task(carol_again.post(CHAT, json=body(62)))
            await wait_queued(stack.main, "tiny", 2)
            assert not leaving.done() and not staying.done()
            await cancel_all([leaving])
            # The gate stays closed until the plugin has dropped the one that left.
            await eventually(lambda: queued_on(stack.main, "tiny", equals=1), 30)
        finally:
            await cancel_all(hogs)
        response = await asyncio.wait_for(staying, 30)
        assert response.status_code == 200, response.text
    assert not received_with(stack.emu, 61)
    assert len(received_with(stack.emu, 62)) == 1
    async with open_client(stack.main.base_url) as anonymous:
        assert (await anonymous.get("/health/liveliness")).status_code == 200
    # The plugin answered the departed client 499 (LiteLLM logs it; nobody was there to read it).
    await wait_until(lambda: "client_disconnected" in stack.main.log_text(), 5)
    await engine_idle(stack.emu)


async def test_disconnect_mid_stream_releases_the_lease(stack: Stack) -> None:
    """On `tiny-capped` (one request in flight at most) a stream whose client leaves must end
    its lease: the next request gets through, and the engine's sequence is aborted."""
    aborted_before = stack.fcfs.engine.statistics().requests_aborted
    async with open_client(stack.strict.base_url, "sk-c") as client:
        request = body(HOG_TOKENS - 1, "tiny-capped", stream=True)
        async with client.stream("POST", CHAT, json=request) as response:
            assert response.status_code == 200
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    break  # leaving the block closes the connection mid-stream
        await wait_until(lambda: stack.fcfs.engine.statistics().requests_aborted > aborted_before)
        await engine_idle(stack.fcfs)
        after = await asyncio.wait_for(client.post(CHAT, json=body(63, "tiny-capped")), 15)
        assert after.status_code == 200, after.text


async def test_backend_500_is_an_error_and_ends_the_lease(stack: Stack) -> None:
    faults = stack.fcfs.engine.faults
    async with open_client(stack.strict.base_url, "sk-a") as client:
        faults.fail_every_nth_completion = 1
        try:
            failed = await client.post(CHAT, json=body(64, "tiny-capped"))
            assert failed.status_code >= 500, failed.text
            failed_stream = await stream_chat(client, CHAT, body(65, "tiny-capped", stream=True))
            assert failed_stream.status >= 500, failed_stream.error
        finally:
            faults.fail_every_nth_completion = 0
        # With a fallback cap of 1 in flight, one leaked lease would block all of these.
        for tag in (66, 67, 68):
            response = await asyncio.wait_for(client.post(CHAT, json=body(tag, "tiny-capped")), 15)
            assert response.status_code == 200, response.text


# ----------------------------------------------------------------------------- start-up


async def test_invalid_section_stops_the_proxy_with_the_key_path(stack: Stack) -> None:
    """`tiers[0].waiting_below: -1` (started by the fixture): the proxy exits non-zero and its
    output names the key path and the bad value."""
    code, output = await asyncio.wait_for(asyncio.shield(stack.invalid_start), 120)
    assert code is not None and code != 0, output[-2000:]
    assert "fair_sched.tiers[0].waiting_below" in output, output[-2000:]
    assert "(got -1)" in output, output[-2000:]
    assert "Application startup complete" not in output


# ----------------------------------------------------------------------------- the end


async def test_nothing_in_flight_or_queued_at_the_end(stack: Stack) -> None:
    """Every request the engines saw finished or was aborted, and on each model a probe goes
    straight through (on `tiny-capped` one leaked lease would block it)."""
    for emu in (stack.emu, stack.fcfs):
        await engine_idle(emu)
        stats = emu.engine.statistics()
        assert stats.requests_received == stats.requests_finished + stats.requests_aborted
    for proxy, model in ((stack.main, "tiny"), (stack.strict, "tiny-capped")):
        async with open_client(proxy.base_url, "sk-a") as client:
            # A leaked lease would park the probe for ever; the bound only ends that wait.
            response = await asyncio.wait_for(client.post(CHAT, json=body(3, model)), 15)
            assert response.status_code == 200, response.text
        async with open_client(proxy.base_url, MASTER_KEY) as admin:
            status = await admin.get("/fair-sched/status")
        if status.status_code == 200:  # the plugin's status document, where it is installed
            counts = dict(counters(status.json(), ("in_flight", "queued")))
            assert all(value == 0 for value in counts.values()), counts


async def queued_count(proxy: ProxyProcess, model: str) -> int:
    """Requests the plugin holds queued on `model`, from its status document."""
    async with open_client(proxy.base_url, MASTER_KEY) as admin:
        response = await admin.get("/fair-sched/status")
    assert response.status_code == 200, response.text
    queued = response.json()["models"].get(model, {}).get("queued", {})
    return sum(queued.values())


async def queued_on(proxy: ProxyProcess, model: str, *, equals: int) -> bool:
    return await queued_count(proxy, model) == equals


async def wait_queued(proxy: ProxyProcess, model: str, count: int, timeout_s: float = 30) -> None:
    """Until the plugin's status document shows at least `count` requests queued on `model`."""

    async def enough() -> bool:
        return await queued_count(proxy, model) >= count

    await eventually(enough, timeout_s, interval_s=0.05, what=f"{count} queued on {model}")


def counters(document: Any, names: tuple[str, ...], path: str = "") -> list[tuple[str, int]]:
    """Every integer field called one of `names`, anywhere in a JSON document, with its path."""
    found: list[tuple[str, int]] = []
    if isinstance(document, Mapping):
        for key, value in document.items():
            where = f"{path}.{key}"
            if key in names and isinstance(value, int) and not isinstance(value, bool):
                found.append((where, value))
            else:
                found.extend(counters(value, names, where))
    elif isinstance(document, list):
        for index, item in enumerate(document):
            found.extend(counters(item, names, f"{path}[{index}]"))
    return found
