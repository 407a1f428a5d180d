"""A client that goes away frees its place: in the batch and in the waiting queue."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from fair_sched_plugin.lab.emulator import run_emulator

from .conftest import WaitUntil, chat_body, fast_config, open_client

ENDLESS = 100_000  # max_tokens that would take minutes: only a disconnect ends it in time


async def test_streaming_client_that_closes_early_frees_its_slot(wait_until: WaitUntil) -> None:
    async with run_emulator(fast_config(max_num_seqs=2)) as emu, open_client(emu) as http:
        body = chat_body(max_tokens=ENDLESS, stream=True)
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            await wait_until(lambda: emu.engine.statistics().running == 1)
        # Leaving the block closes the half-read response, hence the connection.
        await wait_until(lambda: emu.engine.statistics().running == 0)
        stats = emu.engine.statistics()
    assert stats.requests_aborted == 1
    assert stats.requests_finished == 0


async def test_non_streaming_client_cancelled_while_queued_leaves_the_queue(
    wait_until: WaitUntil,
) -> None:
    async with run_emulator(fast_config(max_num_seqs=1)) as emu, open_client(emu) as http:
        blocker = asyncio.create_task(
            http.post("/v1/chat/completions", json=chat_body(max_tokens=ENDLESS))
        )
        await wait_until(lambda: emu.engine.statistics().running == 1)
        queued = asyncio.create_task(http.post("/v1/chat/completions", json=chat_body()))
        await wait_until(lambda: emu.engine.statistics().waiting == 1)

        queued.cancel()
        await wait_until(lambda: emu.engine.statistics().waiting == 0)
        assert emu.engine.statistics().requests_aborted == 1

        blocker.cancel()
        await wait_until(lambda: emu.engine.statistics().running == 0)
        for task in (queued, blocker):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        stats = emu.engine.statistics()
    assert stats.requests_aborted == 2
    assert stats.requests_finished == 0


async def test_a_freed_slot_goes_to_the_next_waiting_request(wait_until: WaitUntil) -> None:
    async with run_emulator(fast_config(max_num_seqs=1)) as emu, open_client(emu) as http:
        blocker = asyncio.create_task(
            http.post("/v1/chat/completions", json=chat_body(max_tokens=ENDLESS))
        )
        await wait_until(lambda: emu.engine.statistics().running == 1)
        waiting = asyncio.create_task(http.post("/v1/chat/completions", json=chat_body()))
        await wait_until(lambda: emu.engine.statistics().waiting == 1)
        blocker.cancel()
        response = await asyncio.wait_for(waiting, timeout=10)
        with contextlib.suppress(asyncio.CancelledError):
            await blocker
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 16


async def test_shutdown_ends_open_streams() -> None:
    async with contextlib.AsyncExitStack() as emulator_scope:
        emu = await emulator_scope.enter_async_context(run_emulator(fast_config()))
        body = chat_body(max_tokens=ENDLESS, stream=True)
        async with (
            open_client(emu) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            lines = response.aiter_lines()
            await anext(lines)
            await asyncio.wait_for(emulator_scope.aclose(), timeout=10)  # shut down mid-stream
            # The rest of the stream ends (without [DONE]) instead of hanging.
            rest: list[str] = []
            with contextlib.suppress(httpx.HTTPError):  # a cut connection is acceptable, too
                rest = await asyncio.wait_for(_collect(lines), timeout=10)
    assert "data: [DONE]" not in rest
    assert emu.engine.statistics().requests_aborted == 1


async def _collect(lines: AsyncIterator[str]) -> list[str]:
    return [line async for line in lines]
