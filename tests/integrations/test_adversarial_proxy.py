"""Hostile clients against `fair-sched proxy`, on real loopback servers."""

from __future__ import annotations

import httpx

from fair_sched_plugin.proxy import build_proxy_app

from ..support import service_of
from .conftest import assert_idle, chat_body, emulator, fair_config, open_client, serve

CHAT = "/v1/chat/completions"


async def test_a_request_the_proxy_times_out_at_the_engine_is_charged_not_abandoned() -> None:
    """A non-streamed request longer than the proxy's read timeout: the engine generated for
    all of it, then httpx's ReadTimeout abandoned the lease (uncharged, the turn passed on), so
    a client sending such requests used the engine for free."""
    async with emulator() as emu:
        app = build_proxy_app(
            fair_config(emu), timeout=httpx.Timeout(10.0, read=0.3, write=10.0, pool=10.0)
        )
        async with serve(app) as url, open_client(url, "sk-a") as client:
            service = service_of(app)
            ends: list[bool] = []
            service.scheduler.add_end_listener(lambda lease, abandoned: ends.append(abandoned))
            response = await client.post(CHAT, json=chat_body(max_tokens=100_000))
            assert response.status_code == 502, response.text
            assert emu.engine.statistics().requests_received == 1
            assert ends == [False]
            await assert_idle(service)
