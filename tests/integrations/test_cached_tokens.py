"""Cost that knows the cache: through the ASGI middleware to the emulator with its
prefix cache on, a user who reuses a prompt prefix is charged less than one who does not."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from fair_sched_plugin.asgi import FairSchedulerMiddleware
from fair_sched_plugin.core import Lease

from .conftest import (
    MODEL,
    emulator,
    fair_config,
    forwarding_handler,
    http_state,
    open_client,
    serve,
)

# 40 whole cache blocks of 16 tokens (4 characters a token, as the emulator counts).
PREFIX_CHARS = 40 * 16 * 4
OUTPUT_TOKENS = 4


def body(system: str, question: str, stream: bool) -> dict[str, Any]:
    extra: dict[str, Any] = (
        {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    )
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": OUTPUT_TOKENS,
        **extra,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_user_who_reuses_a_prefix_is_charged_less(stream: bool) -> None:
    """alice repeats one system prompt, bob sends a new one each time (same sizes): the engine
    reports alice's repeats as cached, and the `tokens` policy charges her only uncached prompt
    plus output tokens, so she is charged less than a third of what bob is."""
    async with emulator(prefix_cache_blocks=1000) as emu:
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", forwarding_handler(emu.base_url), methods=["POST"])
            ],
            lifespan=http_state,
        )
        served = FairSchedulerMiddleware(app, config=fair_config(emu, fairness="tokens"))
        charged: dict[str, list[int | None]] = {"alice": [], "bob": []}

        def record(lease: Lease, abandoned: bool) -> None:
            charged[lease.ticket.user].append(lease.tokens_used)

        async with serve(served) as url:
            served.service.scheduler.add_end_listener(record)
            shared = ("alice's team prompt. " * 200)[:PREFIX_CHARS]
            for n in range(5):
                own = (f"bob's prompt number {n}. " * 200)[:PREFIX_CHARS]
                for key, system in (("sk-a", shared), ("sk-b", own)):
                    async with open_client(url, key=key) as client:
                        response = await client.post(
                            "/v1/chat/completions", json=body(system, f"Question {n}?", stream)
                        )
                        assert response.status_code == 200
    prompt_tokens = (PREFIX_CHARS + len("Question 0?")) // 4
    assert charged["bob"] == [prompt_tokens + OUTPUT_TOKENS] * 5
    # alice's first request missed; the repeats were charged the uncached tail (the prompt's
    # last, partial block) and the output only.
    assert (
        charged["alice"]
        == [prompt_tokens + OUTPUT_TOKENS] + [prompt_tokens - 40 * 16 + OUTPUT_TOKENS] * 4
    )
    alice, bob = sum(filter(None, charged["alice"])), sum(filter(None, charged["bob"]))
    assert alice * 3 < bob


async def test_each_deployments_prefix_cache_hit_rate_is_on_the_status_page_and_a_gauge() -> None:
    """The watcher reads the emulator's vLLM prefix-cache counters; the rate between its last
    two scrapes shows in the status JSON and as `fair_sched_engine_prefix_cache_hit_ratio`."""
    async with emulator(prefix_cache_blocks=1000) as emu:
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", forwarding_handler(emu.base_url), methods=["POST"])
            ],
            lifespan=http_state,
        )
        served = FairSchedulerMiddleware(app, config=fair_config(emu))
        async with serve(served) as url, open_client(url, key="sk-a") as client:
            service = served.service
            (watcher,) = service.watchers()[MODEL]
            shared = ("a long shared system prompt. " * 200)[:PREFIX_CHARS]
            for n in range(200):  # bounded: the watcher scrapes every 50 ms
                response = await client.post(
                    "/v1/chat/completions", json=body(shared, f"Question {n}?", stream=False)
                )
                assert response.status_code == 200
                rate = watcher.prefix_cache_hit_rate
                # An interval with the first request (a miss) reads about 0.5; later ones ~0.98.
                if rate is not None and rate > 0.9:
                    break
            # Read in the same step as the rate (no await between): both see the same scrape.
            text = service.observability.render().decode()
            status = service.observability.status()
    assert rate is not None and rate > 0.9  # each repeat hits 640 of its 651 prompt tokens
    (deployment,) = status["models"][MODEL]["deployments"]
    assert deployment["last_snapshot"]["prefix_cache_hit_rate"] == round(rate, 4)
    gauges = [
        line
        for line in text.splitlines()
        if line.startswith("fair_sched_engine_prefix_cache_hit_ratio{")
    ]
    assert len(gauges) == 1 and f'url="{deployment["url"]}"' in gauges[0]
    assert float(gauges[0].rsplit(" ", 1)[1]) == pytest.approx(rate)
