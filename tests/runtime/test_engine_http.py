"""`sse_lines`: an event stream's lines end at CRLF, LF or CR, never inside a JSON string."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from fair_sched_plugin.lab.loadtest.client import Caller, stream_one
from fair_sched_plugin.runtime.engine_http import sse_lines

from ..integrations.conftest import serve

# Characters `str.splitlines` (and so httpx's `aiter_lines`) ends a line at that JSON does not
# escape inside a string.
UNESCAPED_BREAKS = "\x85\u2028\u2029"


async def pieces(*texts: str) -> AsyncIterator[str]:
    for text in texts:
        yield text


async def lines_of(*texts: str) -> list[str]:
    return [line async for line in sse_lines(pieces(*texts))]


def data_line(content: str) -> str:
    return "data: " + json.dumps({"choices": [{"delta": {"content": content}}]}, ensure_ascii=False)


async def test_a_json_string_with_splitlines_breaks_stays_one_line() -> None:
    line = data_line(f"a{UNESCAPED_BREAKS}b")
    assert await lines_of(line + "\n\n") == [line, ""]
    # What the reader replaces: it cut the same line in four.
    assert len((line + "\n").splitlines()) == 4


async def test_every_line_end_the_format_allows_and_pieces_cut_anywhere() -> None:
    text = "data: 1\r\n\r\ndata: 2\n\ndata: 3\r\rdata: 4"
    expected = ["data: 1", "", "data: 2", "", "data: 3", "", "data: 4"]
    assert await lines_of(text) == expected
    for cut in range(1, len(text)):  # a CRLF split between two pieces is still one line end
        assert await lines_of(text[:cut], text[cut:]) == expected, cut
    assert await lines_of(*text) == expected  # one character a piece


async def test_a_final_line_without_its_end_is_read_and_nothing_is_made_up() -> None:
    assert await lines_of("data: x") == ["data: x"]
    assert await lines_of("data: x\r") == ["data: x"]
    assert await lines_of() == []
    assert await lines_of("", "") == []


def token_stream_app(tokens: Iterable[str]) -> Starlette:
    """A chat endpoint that streams `tokens` as an OpenAI-style event stream, unescaped."""
    chosen = list(tokens)

    async def chat(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            for token in chosen:
                yield data_line(token) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def test_the_bench_client_counts_tokens_holding_line_breaks_of_other_kinds() -> None:
    tokens = ["plain", f"x{UNESCAPED_BREAKS[0]}y", UNESCAPED_BREAKS[1], f"{UNESCAPED_BREAKS[2]}z"]
    async with serve(token_stream_app(tokens)) as url, httpx.AsyncClient(trust_env=False) as client:
        record = await stream_one(client, f"{url}/v1", Caller("u", "g"), 4, 0.0)
    assert record.error is None
    assert record.tokens == len(tokens)
