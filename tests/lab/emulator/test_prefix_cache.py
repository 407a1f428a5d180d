"""Prefix caching and per-instance speed, against the real emulator on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fair_sched_plugin.lab.emulator import EmulatorConfig, run_emulator
from fair_sched_plugin.lab.emulator.app import CHARS_PER_TOKEN, prompt_blocks
from fair_sched_plugin.lab.emulator.engine import PrefixCache

from .conftest import fast_config, open_client

BLOCK_CHARS = 16 * CHARS_PER_TOKEN
# Ten whole blocks (160 tokens) that every request of a "team" starts with.
SYSTEM_PROMPT = ("You are the support assistant of team A. " * 20)[: 10 * BLOCK_CHARS]
MODEL = "emulated-model"


def chat(system: str, question: str, **extra: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
        **extra,
    }


async def usage_of(http: httpx.AsyncClient, body: dict[str, object]) -> dict[str, object]:
    """The usage of one request, streamed (final usage chunk) or not."""
    if not body.get("stream"):
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        usage: dict[str, object] = response.json()["usage"]
        return usage
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = [
            json.loads(line.removeprefix("data: "))
            async for line in response.aiter_lines()
            if line.startswith("data: {")
        ]
    usage = chunks[-1]["usage"]
    return usage


def cached(usage: dict[str, object]) -> int:
    details = usage["prompt_tokens_details"]
    assert isinstance(details, dict)
    value = details["cached_tokens"]
    assert isinstance(value, int)
    return value


def prefix_counters(text: str) -> dict[str, tuple[dict[str, str], float]]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:prefix_cache_") and sample.name.endswith("_total"):
                found[sample.name] = (sample.labels, sample.value)
    return found


@pytest.mark.parametrize("stream", [False, True])
async def test_a_repeated_system_prompt_hits_after_the_first_request(stream: bool) -> None:
    extra: dict[str, object] = (
        {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    )
    async with (
        run_emulator(fast_config(prefix_cache_blocks=64)) as emu,
        open_client(emu) as http,
    ):
        first = await usage_of(http, chat(SYSTEM_PROMPT, "How do I reset my password?", **extra))
        second = await usage_of(http, chat(SYSTEM_PROMPT, "Where is my invoice?", **extra))
        other = await usage_of(http, chat(SYSTEM_PROMPT.upper(), "Where is my invoice?", **extra))
    assert cached(first) == 0
    # The ten system-prompt blocks are reused; the differing question is not.
    assert cached(second) == 160
    assert second["prompt_tokens"] == (len(SYSTEM_PROMPT) + len("Where is my invoice?")) // 4
    assert cached(other) == 0  # another prompt, even of the same length, starts cold


async def test_the_last_prompt_token_is_never_served_from_the_cache() -> None:
    """vLLM computes at least one prompt token to produce the first output token, so a prompt of
    exactly two whole blocks seen before hits on one block, not two."""
    exact = SYSTEM_PROMPT[: 2 * BLOCK_CHARS]
    body = {"model": MODEL, "prompt": exact, "max_tokens": 1}
    async with (
        run_emulator(fast_config(prefix_cache_blocks=8)) as emu,
        open_client(emu) as http,
    ):
        for _ in range(2):
            response = await http.post("/v1/completions", json=body)
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


async def test_the_counters_match_usage_with_vllms_names_and_labels() -> None:
    async with (
        run_emulator(fast_config(prefix_cache_blocks=64)) as emu,
        open_client(emu) as http,
    ):
        usages = [await usage_of(http, chat(SYSTEM_PROMPT, f"Question {n}?")) for n in range(5)]
        usages += [await usage_of(http, chat(SYSTEM_PROMPT[:300], f"Other {n}?")) for n in range(3)]
        counters = prefix_counters((await http.get("/metrics")).text)
        stats = emu.engine.statistics()
    labels = {"engine": "0", "model_name": MODEL}
    queries = sum(int(str(usage["prompt_tokens"])) for usage in usages)
    hits = sum(cached(usage) for usage in usages)
    assert counters["vllm:prefix_cache_queries_total"] == (labels, float(queries))
    assert counters["vllm:prefix_cache_hits_total"] == (labels, float(hits))
    assert (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (queries, hits)
    # Only the very first request missed: the shorter prompt starts like the long one, whose
    # first four blocks were cached already.
    assert hits == 4 * 160 + 3 * 64


async def test_without_a_prefix_cache_nothing_is_cached_or_counted() -> None:
    async with run_emulator(fast_config()) as emu, open_client(emu) as http:
        for _ in range(2):
            usage = await usage_of(http, chat(SYSTEM_PROMPT, "Again?"))
        counters = prefix_counters((await http.get("/metrics")).text)
    assert "prompt_tokens_details" not in usage  # as vLLM without --enable-prompt-tokens-details
    assert counters["vllm:prefix_cache_queries_total"][1] == 0
    assert counters["vllm:prefix_cache_hits_total"][1] == 0


async def test_a_small_cache_evicts_the_least_recently_used_prompt() -> None:
    """Three prompts of five blocks each in a ten-block cache: the least recently used goes."""
    # Five whole blocks and one token more, so all five blocks can hit.
    prompts = {name: name * BLOCK_CHARS * 5 + "?" * CHARS_PER_TOKEN for name in "ABC"}
    async with (
        run_emulator(fast_config(prefix_cache_blocks=10)) as emu,
        open_client(emu) as http,
    ):

        async def cached_of(name: str) -> int:
            return cached(await usage_of(http, chat(prompts[name], "")))

        assert [await cached_of(name) for name in "ABA"] == [0, 0, 80]
        # A was used after B, so C's five blocks push B out, not A.
        assert await cached_of("C") == 0
        assert await cached_of("A") == 80
        assert await cached_of("B") == 0
        assert len(emu.engine.prefix_cache) == 10


@pytest.mark.timing
async def test_prefill_is_charged_only_for_uncached_tokens() -> None:
    """A prompt of 400 tokens at 2 ms each: its first request waits for the whole prefill, the
    repeat only for its last block. A ratio of TTFTs, not absolute times."""
    config = fast_config(prefix_cache_blocks=64, prefill_ms_per_token=2.0)
    long_prompt = (SYSTEM_PROMPT * 3)[: 25 * BLOCK_CHARS]
    body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 1}
    async with run_emulator(config) as emu, open_client(emu) as http:
        ttfts = []
        for _ in range(2):
            started = asyncio.get_running_loop().time()
            response = await http.post("/v1/completions", json=body)
            ttfts.append(asyncio.get_running_loop().time() - started)
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 384}
    assert ttfts[1] * 3 < ttfts[0]


async def test_a_slower_instance_finishes_the_same_work_later() -> None:
    """Two instances side by side, one at speed 0.25, given the same four requests at once:
    every request of the fast one finishes before any of the slow one (an ordering, not a
    measured duration; 4x apart in theory)."""
    finished: list[float] = []

    async def serve_four(speed: float) -> None:
        config = fast_config(base_step_ms=5.0, speed=speed, max_num_seqs=4)
        async with run_emulator(config) as emu, open_client(emu) as http:

            async def one(n: int) -> None:
                await usage_of(http, chat("Hello", f"q{n}", max_tokens=20))
                finished.append(speed)

            await asyncio.gather(*(one(n) for n in range(4)))
            assert emu.engine.statistics().steps >= 20

    await asyncio.gather(serve_four(1.0), serve_four(0.25))
    assert finished == [1.0] * 4 + [0.25] * 4


def test_speed_and_cache_sizes_are_validated() -> None:
    for bad, message in (
        ({"speed": 0}, "speed must be a number > 0"),
        ({"prefix_cache_blocks": -1}, "prefix_cache_blocks must be >= 0"),
        ({"block_tokens": 0}, "block_tokens must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            EmulatorConfig(**bad)  # type: ignore[arg-type]


def test_blocks_are_chained_to_everything_before_them() -> None:
    one = prompt_blocks("x" * BLOCK_CHARS + "y" * BLOCK_CHARS, 16)
    two = prompt_blocks("z" * BLOCK_CHARS + "y" * BLOCK_CHARS + "tail", 16)
    assert len(one) == len(two) == 2  # only whole blocks
    assert one[1] != two[1]  # the same second block after a different first one
    cache = PrefixCache(capacity=4, block_tokens=16)
    cache.insert(one)
    assert cache.lookup(two, prompt_tokens=40) == 0  # a miss on the first block ends the match
