"""The emulator keeps idle keep-alive connections longer than the clients in front of it pool
them (a real socket on 127.0.0.1; one idle wait of 6 s, past uvicorn's 5 s default)."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn

from fair_sched_plugin.lab.emulator import run_emulator
from fair_sched_plugin.lab.emulator.server import KEEP_ALIVE_S

from ...integrations.conftest import get_on_connection
from .conftest import fast_config

# LiteLLM's aiohttp pool keeps an idle connection this long (litellm AIOHTTP_KEEPALIVE_TIMEOUT).
LITELLM_POOL_KEEPALIVE_S = 15


def test_keep_alive_outlasts_litellms_connection_pool() -> None:
    assert KEEP_ALIVE_S > LITELLM_POOL_KEEPALIVE_S


async def test_the_emulator_serves_with_the_long_keep_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The running emulator's uvicorn has `timeout_keep_alive=KEEP_ALIVE_S` (the setting; the
    real idle wait past uvicorn's 5 s default runs with scripts/test --full)."""
    configs: list[uvicorn.Config] = []
    original = uvicorn.Server.__init__

    def recording_init(self: uvicorn.Server, config: uvicorn.Config) -> None:
        configs.append(config)
        original(self, config)

    monkeypatch.setattr(uvicorn.Server, "__init__", recording_init)
    async with run_emulator(fast_config()) as emu:
        assert emu.port
    assert [config.timeout_keep_alive for config in configs] == [KEEP_ALIVE_S]


@pytest.mark.full
@pytest.mark.timeout(60)
async def test_an_idle_connection_is_still_open_after_uvicorns_default_keep_alive() -> None:
    """Race fixed: LiteLLM reused a pooled connection idle for 5-15 s just as the emulator
    closed it (uvicorn's 5 s keep-alive) and answered 500 "Cannot write to closing transport"."""
    async with run_emulator(fast_config()) as emu:
        reader, writer = await asyncio.open_connection("127.0.0.1", emu.port)
        try:
            assert await get_on_connection(reader, writer, "/metrics") == b"HTTP/1.1 200 OK"
            await asyncio.sleep(6.0)  # idle past uvicorn's default 5 s
            assert not reader.at_eof()
            assert await get_on_connection(reader, writer, "/metrics") == b"HTTP/1.1 200 OK"
        finally:
            writer.close()
            await writer.wait_closed()
