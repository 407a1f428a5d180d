"""Hostile clients and failing parts against this round's bounds and lease ends (one behaviour
per test; plain ASGI callables or real loopback servers)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fair_sched_plugin.asgi import _usage_from_sse
from fair_sched_plugin.core import Lease
from fair_sched_plugin.lab.loadtest.trace import TraceError, parse_line
from fair_sched_plugin.request.body import requested_max_tokens
from fair_sched_plugin.request.usage import JsonUsageFinder
from fair_sched_plugin.request.watch import RequestWatch, _error_payload
from fair_sched_plugin.state.wire import read_published
from fair_sched_plugin.testing import make_ticket


class _RecordingOwner:
    """A lease owner that records how each lease ended."""

    def __init__(self) -> None:
        self.ends: list[tuple[int | None, bool]] = []

    def lease_started(self, lease: Lease) -> None:
        pass

    def lease_ended(self, lease: Lease, tokens_used: int | None, *, abandoned: bool) -> None:
        self.ends.append((tokens_used, abandoned))


async def _receive_forever() -> dict[str, Any]:
    await asyncio.Event().wait()  # the client never leaves
    raise AssertionError("unreachable")


async def _discard(message: dict[str, Any]) -> None:
    pass


async def test_a_forwarded_request_that_outlives_max_lease_s_is_charged_not_abandoned() -> None:
    """Race: max_lease_s ends a non-streamed request the engine has been generating for
    (forwarded, no answer yet). Abandoning it passes the turn on uncharged, so a user whose
    requests always outlive max_lease_s would use the engine for free."""
    owner = _RecordingOwner()
    lease = Lease(owner, make_ticket("heavy", cost=500), 1, 0.0, 0.0, 0.0)
    holder: list[RequestWatch] = []

    async def engine_still_working(scope: Any, receive: Any, send: Any) -> None:
        holder[0].hold(lease)
        holder[0].forwarded()  # the app read the body: the engine has it
        await asyncio.Event().wait()

    watch = RequestWatch(_receive_forever, _discard, max_lease_s=0.05)
    holder.append(watch)
    await asyncio.wait_for(watch.run(engine_still_working, {"type": "http", "headers": []}), 10)
    assert not lease.active
    assert owner.ends == [(500, False)]  # no speed known: its whole estimate


@pytest.mark.parametrize(
    "text",
    [
        '{"t": 0, "user": "a", "prompt_tokens": 1, "max_tokens": 1' + "0" * 5000 + "}",
        "[" * 100_000 + "]" * 100_000,
    ],
    ids=["integer-past-the-digit-limit", "deeply-nested"],
)
def test_a_trace_line_python_cannot_decode_is_a_trace_error_naming_its_line(text: str) -> None:
    """json.loads raises plain ValueError (an integer past 4300 digits) or RecursionError (deep
    nesting) for these, not JSONDecodeError: `fair-sched bench --trace` printed no line number
    for the first and crashed with a traceback for the second."""
    with pytest.raises(TraceError, match=r"^f\.jsonl:7: "):
        parse_line(text, "f.jsonl:7")


DEEP = b"[" * 3000 + b"]" * 3000
REAL_USAGE = b'{"prompt_tokens": 3, "completion_tokens": 4}'


def test_a_deeply_nested_usage_in_a_json_answer_is_skipped_not_raised() -> None:
    """A failing engine's answer with `"usage"` nested past the recursion limit: json raised
    RecursionError out of `feed()`, inside the middleware's `send`, cutting the answer off."""
    finder = JsonUsageFinder()
    finder.feed(b'{"usage": ' + DEEP + b', "usage": ' + REAL_USAGE + b"}")
    assert finder.usage is not None and finder.usage.tokens_used == 7


def test_a_deeply_nested_usage_in_an_event_stream_is_skipped_not_raised() -> None:
    lines = b'data: {"usage": ' + DEEP + b'}\n\ndata: {"usage": ' + REAL_USAGE + b"}\n\n"
    usage = _usage_from_sse(lines)
    assert usage is not None and usage.tokens_used == 7


TOO_DEEP = "[" * 100_000 + "]" * 100_000


def test_a_too_deep_statistics_document_in_redis_is_a_value_error() -> None:
    """The other readers of Redis values turn RecursionError into ValueError; the leader's
    statistics document did not, so a corrupt `stats` key raised out of `_after_beat`."""
    with pytest.raises(ValueError, match="nested too deeply"):
        read_published(TOO_DEEP)


def test_a_too_deep_error_body_after_keep_alive_becomes_our_error_event() -> None:
    """An app's error answer, after the client already holds our keep-alive 200, is turned into
    an error event; a body nested past the recursion limit raised RecursionError instead."""
    payload = _error_payload(502, TOO_DEEP.encode())
    assert payload["error"]["code"] == "502"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "max_completion_tokens": 1, "max_tokens": 4000},  # /v1/completions
        {"input": "hi", "max_tokens": 1, "max_output_tokens": 4000},  # /v1/responses
    ],
    ids=["completions", "responses"],
)
def test_the_estimate_covers_the_output_field_the_engine_reads(body: dict[str, Any]) -> None:
    """A client that adds a field its route's engine ignores, set to 1, was estimated at 1
    output token while vLLM generates 4000 (charged only that if it leaves mid-stream)."""
    assert requested_max_tokens(body) >= 4000
