"""Through a real LiteLLM proxy: `max_lease_s` and `send_timeout_s` end a lease.

One `litellm` process (the plugin as callback, our custom auth) in front of two emulators: `tiny`
generates a short word per token, `firehose` a 32 KB word per token, so a client that reads
nothing fills the socket buffers within a few tokens. Every check counts (leases in flight, the
engine's running and aborted requests, log lines); none measures a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio

from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    CHAT,
    MASTER_KEY,
    ProxyProcess,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
)

from ..integrations.conftest import chat_body, emulator, wait_until
from ..integrations.litellm_harness import shared_proxy_marks
from ..support import find_int
from .test_bypasses import raw_request

pytestmark = shared_proxy_marks()

# Long enough that a stalled stream always meets send_timeout_s first (the buffers fill within
# a few firehose tokens); short enough to wait for.
MAX_LEASE_S = 5.0
SEND_TIMEOUT_S = 0.5
MAX_LEASE_LOG = "(max_lease_s)"
SEND_TIMEOUT_LOG = "(send_timeout_s)"


@dataclass
class Stack:
    emu: RunningEmulator
    firehose: RunningEmulator
    proxy: ProxyProcess


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    workdir = tmp_path_factory.mktemp("litellm-leases")
    async with (
        emulator() as emu,
        emulator(filler_word=" " + "x" * 32_768) as firehose,
    ):
        fair_sched = {
            "principals": [{"name": "alice", "keys": ["sk-a"]}],
            "backends": {
                "tiny": {"metrics_url": f"{emu.base_url}/metrics"},
                "firehose": {"metrics_url": f"{firehose.base_url}/metrics"},
            },
            "metrics_poll_ms": 50,
            "max_lease_s": MAX_LEASE_S,
            "send_timeout_s": SEND_TIMEOUT_S,
        }
        config = proxy_config(
            [
                model_entry("tiny", f"{emu.base_url}/v1"),
                model_entry("firehose", f"{firehose.base_url}/v1"),
            ],
            fair_sched,
        )
        async with litellm_proxy(config, workdir, "leases") as proxy:
            yield Stack(emu, firehose, proxy)


async def in_flight(proxy: ProxyProcess) -> int:
    async with open_client(proxy.base_url, MASTER_KEY) as admin:
        status = (await admin.get("/fair-sched/status")).json()
    return find_int(status, "in_flight")


async def wait_in_flight_zero(proxy: ProxyProcess) -> None:
    for _ in range(200):  # bounded: a lease ends once its request's task is cancelled
        if await in_flight(proxy) == 0:
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"a lease is still in flight\n{proxy.log_tail()}")


async def test_max_lease_ends_a_long_non_streamed_request_with_a_504(stack: Stack) -> None:
    """Before: a request could hold its lease (and the engine slot) for as long as it ran."""
    engine = stack.emu.engine
    aborted = engine.statistics().requests_aborted
    expired = stack.proxy.log_text().count(MAX_LEASE_LOG)
    body = chat_body(max_tokens=100_000)
    async with open_client(stack.proxy.base_url, "sk-a", timeout=60) as alice:
        response = await alice.post(CHAT, json=body)
    assert response.status_code == 504, response.text[:500]
    assert response.json()["error"]["code"] == "lease_expired"
    await wait_until(lambda: engine.statistics().requests_aborted == aborted + 1, 15)
    await wait_until(lambda: engine.statistics().running == 0, 15)
    await wait_in_flight_zero(stack.proxy)
    assert stack.proxy.log_text().count(MAX_LEASE_LOG) == expired + 1


async def test_max_lease_closes_a_stream_the_client_keeps_reading(stack: Stack) -> None:
    """A stream past `max_lease_s` is cut (no `[DONE]`), the engine's request is aborted."""
    engine = stack.emu.engine
    aborted = engine.statistics().requests_aborted
    body = chat_body(max_tokens=100_000, stream=True)
    received = bytearray()
    async with (
        open_client(stack.proxy.base_url, "sk-a", timeout=60) as alice,
        alice.stream("POST", CHAT, json=body) as response,
    ):
        assert response.status_code == 200
        with contextlib.suppress(httpx.RemoteProtocolError):  # cut mid-body
            async for chunk in response.aiter_raw():
                received.extend(chunk)
    assert received.count(b"data: ") > 1  # it did stream before the cut
    assert b"data: [DONE]" not in received
    await wait_until(lambda: engine.statistics().requests_aborted == aborted + 1, 15)
    await wait_until(lambda: engine.statistics().running == 0, 15)
    await wait_in_flight_zero(stack.proxy)


async def test_send_timeout_ends_the_lease_of_a_client_that_stops_reading(stack: Stack) -> None:
    """Before: a client that stopped reading held its lease while it kept the socket open. Now
    the proxy's send blocks on the full buffers, and after `send_timeout_s` the request ends,
    the engine's request is aborted and the lease is free: `send_timeout_s` ended it, not
    `max_lease_s` (counted in the proxy's log)."""
    engine = stack.firehose.engine
    aborted = engine.statistics().requests_aborted
    log = stack.proxy.log_text()
    expired, stalled_before = log.count(MAX_LEASE_LOG), log.count(SEND_TIMEOUT_LOG)
    body = chat_body(max_tokens=100_000, stream=True) | {"model": "firehose"}
    with raw_request(stack.proxy.base_url, CHAT, body, "sk-a"):
        # The stalled socket stays open meanwhile: the proxy's close waits for its buffered
        # bytes to be read (uvicorn closes gracefully), but the lease and the engine's work
        # end without the client.
        await wait_until(lambda: engine.statistics().requests_aborted == aborted + 1, 30)
        await wait_until(lambda: engine.statistics().running == 0, 15)
        await wait_in_flight_zero(stack.proxy)
    log = stack.proxy.log_text()
    assert log.count(SEND_TIMEOUT_LOG) == stalled_before + 1, stack.proxy.log_tail()
    assert log.count(MAX_LEASE_LOG) == expired
