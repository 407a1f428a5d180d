"""The OpenAI-compatible surface: streaming format, usage, models, errors."""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import pytest

from fair_sched_plugin.lab.emulator import RunningEmulator, run_emulator
from fair_sched_plugin.lab.emulator.app import (
    CompletionKind,
    CompletionRenderer,
    CompletionRequest,
    token_text,
)

from .conftest import chat_body, fast_config, open_client


async def stream_events(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines()]
    assert all(line.startswith("data: ") for line in lines if line)
    return [line.removeprefix("data: ") for line in lines if line]


async def test_chat_stream_is_json_chunks_then_done(client: httpx.AsyncClient) -> None:
    events = await stream_events(client, "/v1/chat/completions", chat_body(5, stream=True))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [chunk["choices"][0]["delta"]["content"] for chunk in chunks[1:]]
    assert len(content) == 5 and all(content)
    finish_reasons = [chunk["choices"][0]["finish_reason"] for chunk in chunks[1:]]
    assert finish_reasons == [None] * 4 + ["length"]
    assert not any("usage" in chunk for chunk in chunks)


async def test_include_usage_adds_a_usage_chunk_before_done(client: httpx.AsyncClient) -> None:
    body = chat_body(7, stream=True, stream_options={"include_usage": True})
    events = await stream_events(client, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    usage_chunk = json.loads(events[-2])
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7


async def test_text_completion_stream(client: httpx.AsyncClient) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 3, "stream": True}
    events = await stream_events(client, "/v1/completions", body)
    chunks = [json.loads(event) for event in events[:-1]]
    assert [chunk["object"] for chunk in chunks] == ["text_completion"] * 3
    assert all(chunk["choices"][0]["text"] for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_non_streaming_usage_and_content(client: httpx.AsyncClient) -> None:
    prompt = "x" * 400  # about 100 tokens at 4 characters per token
    body = chat_body(max_tokens=12, messages=[{"role": "user", "content": prompt}])
    reply = (await client.post("/v1/chat/completions", json=body)).json()
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": 100, "completion_tokens": 12, "total_tokens": 112}
    assert len(reply["choices"][0]["message"]["content"].split()) == 12


async def test_max_completion_tokens_and_the_default(client: httpx.AsyncClient) -> None:
    explicit = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4},
    )
    default = await client.post("/v1/completions", json={"prompt": "hi"})
    assert explicit.json()["usage"]["completion_tokens"] == 4
    assert default.json()["usage"]["completion_tokens"] == 16
    assert default.json()["usage"]["prompt_tokens"] == 1  # never below one


async def test_max_new_tokens_caps_every_answer() -> None:
    """Like vLLM's `max_new_tokens`: a longer request ends early and reports what it generated."""
    async with run_emulator(fast_config(max_new_tokens=3)) as emu, open_client(emu) as http:
        capped = await http.post("/v1/chat/completions", json=chat_body(max_tokens=10))
        shorter = await http.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert capped.json()["usage"]["completion_tokens"] == 3
    assert capped.json()["choices"][0]["finish_reason"] == "length"
    assert shorter.json()["usage"]["completion_tokens"] == 2


async def test_models_and_health(client: httpx.AsyncClient, emu: RunningEmulator) -> None:
    models = (await client.get("/v1/models")).json()
    assert [model["id"] for model in models["data"]] == list(emu.engine.config.models)
    assert (await client.get("/health")).status_code == 200


async def test_unknown_model_is_404_and_bad_bodies_are_400(client: httpx.AsyncClient) -> None:
    unknown = await client.post("/v1/chat/completions", json=chat_body(model="nope"))
    not_json = await client.post("/v1/chat/completions", content=b"{nope")
    bad_tokens = await client.post("/v1/chat/completions", json=chat_body(max_tokens=0))
    no_messages = await client.post("/v1/chat/completions", json={"max_tokens": 3})
    assert unknown.status_code == 404
    assert "nope" in unknown.json()["error"]["message"]
    assert [r.status_code for r in (not_json, bad_tokens, no_messages)] == [400, 400, 400]


async def test_server_binds_loopback_only(emu: RunningEmulator) -> None:
    assert emu.base_url == f"http://127.0.0.1:{emu.port}"


async def test_no_two_neighbouring_stream_chunks_repeat(client: httpx.AsyncClient) -> None:
    """LiteLLM fails a stream after 100 identical chunks in a row ("The model is repeating the
    same chunk"): the emulator's tokens vary, the same way in every response."""
    events = await stream_events(client, "/v1/chat/completions", chat_body(250, stream=True))
    chunks = [json.loads(event) for event in events[1:-1]]
    content = [chunk["choices"][0]["delta"]["content"] for chunk in chunks]
    assert content == [token_text(" token", i) for i in range(250)]
    assert all(a != b for a, b in itertools.pairwise(content))
    whole = await client.post("/v1/chat/completions", json=chat_body(250))
    assert whole.json()["choices"][0]["message"]["content"] == "".join(content)


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_token_events_read_the_same_however_the_steps_cut_them(kind: CompletionKind) -> None:
    request = CompletionRequest(kind, "m", 1, 37, 0, True, False, None, ())
    renderer = CompletionRenderer(request, "id-1", " word")
    cuts = [1, 9, 10, 11, 3, 2, 1]  # 37 tokens in steps of several sizes
    body = b"".join(
        renderer.token_events(count, ends_stream=i == len(cuts) - 1) for i, count in enumerate(cuts)
    )
    chunks = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line]
    texts = [
        chunk["choices"][0]["delta"]["content"] if kind == "chat" else chunk["choices"][0]["text"]
        for chunk in chunks
    ]
    assert texts == [token_text(" word", i) for i in range(37)]
    finish = [chunk["choices"][0]["finish_reason"] for chunk in chunks]
    assert finish == [None] * 36 + ["length"]
