"""The one mapping from an engine's `usage` to what a request is charged (`_usage.read_usage`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.request.usage import JsonUsageFinder, Usage, read_usage
from fair_sched_plugin.runtime.service import SchedulingService
from fair_sched_plugin.testing import FakeClock

BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 10}
PRICE = {"input_per_mtok": 1.0, "cached_input_per_mtok": 0.1, "output_per_mtok": 3.0}


def test_cached_prompt_tokens_are_not_charged() -> None:
    usage = read_usage(
        {
            "prompt_tokens": 700,
            "completion_tokens": 20,
            "total_tokens": 720,
            "prompt_tokens_details": {"cached_tokens": 640},
        }
    )
    assert usage == Usage(700, 20, 720, 640)
    assert usage is not None and usage.tokens_used == 60 + 20


def test_objects_with_attributes_read_like_json() -> None:
    """LiteLLM hands its hooks `Usage` objects, the ASGI middleware parses JSON: one reading."""
    details = SimpleNamespace(cached_tokens=32, audio_tokens=None)
    usage = SimpleNamespace(
        prompt_tokens=50, completion_tokens=5, total_tokens=55, prompt_tokens_details=details
    )
    found = read_usage(usage)
    assert found == Usage(50, 5, 55, 32)
    assert found is not None and found.tokens_used == 18 + 5


@pytest.mark.parametrize(
    ("usage", "tokens_used"),
    [
        ({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}, 13),
        ({"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": None}, 13),
        # vLLM without --enable-prompt-tokens-details, or an engine without a prefix cache.
        ({"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {}}, 13),
        # Only a total: the cached tokens still come off it.
        ({"total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 8}}, 5),
        # An engine reporting more cached than prompt tokens is not trusted below the output.
        (
            {
                "prompt_tokens": 10,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 99},
            },
            3,
        ),
        ({"prompt_tokens": 10, "completion_tokens": True, "total_tokens": 13}, 13),
    ],
)
def test_tokens_used_falls_back_sensibly(usage: dict[str, object], tokens_used: int) -> None:
    found = read_usage(usage)
    assert found is not None and found.tokens_used == tokens_used


@pytest.mark.parametrize("usage", [None, {}, {"completion_tokens": 3}, {"total_tokens": "13"}])
def test_no_token_count_is_no_usage(usage: object) -> None:
    assert read_usage(usage) is None


async def test_finishing_with_usage_charges_tokens_and_money_without_the_cached_prompt() -> None:
    """`Charges.charge_of`, what every adapter's request end charges: `tokens_used`
    leaves out cached prompt tokens; money prices them at `cached_input_per_mtok`; token budgets
    count the same tokens."""
    svc = SchedulingService(
        {
            "fairness": "tokens",
            "unknown_model_max_inflight": 4,
            "backends": {"m": {"price": PRICE}},
            "principals": [
                {"name": "alice", "keys": ["sk-a"], "budget": {"tokens": 10_000, "per": "hour"}}
            ],
        },
        clock=FakeClock(),
    )
    alice = svc.identify(Credentials(api_key="sk-a"))
    lease = (await svc.admit(alice, "m", BODY)).lease
    tokens_used, cost_used = svc.charges.charge_of("m", Usage(1000, 10, 1010, 896))
    assert lease.release(tokens_used, cost_used=cost_used)
    assert lease.tokens_used == 104 + 10
    # 104 input at 1.0, 896 cached at 0.1, 10 output at 3.0, per million.
    assert lease.cost_used == pytest.approx((104 * 1.0 + 896 * 0.1 + 10 * 3.0) / 1e6)
    tokens_used, cost_used = svc.charges.charge_of("m", Usage(1000, 10, 1010, 0))
    assert not lease.release(tokens_used, cost_used=cost_used)  # ends once
    (standing,) = svc.observability.view.budget_standings()
    assert standing.spent == 104 + 10
    await svc.aclose()


# ----------------------------------------------------------------- bounds and large answers


def test_a_count_beyond_the_cores_range_is_not_reported() -> None:
    """A misbehaving engine's 400-digit count must not reach the charge (it overflowed there)."""
    huge = 10**400
    assert read_usage({"prompt_tokens": huge, "completion_tokens": 5}) is None
    usage = read_usage({"prompt_tokens": 5, "completion_tokens": huge, "total_tokens": 9})
    assert usage is not None and usage.tokens_used == 9
    assert read_usage({"prompt_tokens": "5", "total_tokens": -1}) is None


def _answer(text_tokens: int, usage: dict[str, int]) -> bytes:
    content = " ".join(f"w{index}" for index in range(text_tokens))
    return json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
            "usage": usage,
            # vLLM puts fields after `usage`; a token text "usage" appears as a value there.
            "prompt_logprobs": [
                {"1": {"decoded_token": "usage"}},
                {"2": {"decoded_token": '"usage":'}},
            ],
        }
    ).encode()


def test_usage_is_found_at_the_end_of_a_large_answer_fed_in_pieces() -> None:
    """Before: only the first 256 KiB of a non-streamed answer were kept, so a 46,000-token
    answer's `usage` was lost and the request charged its estimate."""
    usage = {"prompt_tokens": 12, "completion_tokens": 46_000, "total_tokens": 46_012}
    body = _answer(46_000, usage)
    assert len(body) > 256 * 1024
    for piece_size in (1, 7, 4096, 65_536, len(body)):
        if piece_size == 1:
            # Byte by byte around the key only (the whole body byte by byte is slow to build).
            head, tail = body[:-400], body[-400:]
            pieces = [head, *[tail[i : i + 1] for i in range(len(tail))]]
        else:
            pieces = [body[i : i + piece_size] for i in range(0, len(body), piece_size)]
        finder = JsonUsageFinder()
        for piece in pieces:
            finder.feed(piece)
        assert finder.usage == Usage(12, 46_000, 46_012, 0), piece_size


@given(
    text=st.text(max_size=200),
    prompt=st.integers(0, 10**7),
    output=st.integers(0, 10**7),
    cut=st.integers(0, 10_000),
)
def test_usage_finder_agrees_with_parsing_the_whole_body(
    text: str, prompt: int, output: int, cut: int
) -> None:
    """Whatever the text says (quotes, the word usage, escapes) and wherever a piece ends."""
    document = {
        "choices": [{"message": {"content": text}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": output},
    }
    body = json.dumps(document, ensure_ascii=bool(cut % 2)).encode()
    finder = JsonUsageFinder()
    cut %= len(body) + 1
    finder.feed(body[:cut])
    finder.feed(body[cut:])
    assert finder.usage == read_usage(document["usage"])


def test_a_body_without_usage_reports_none() -> None:
    finder = JsonUsageFinder()
    finder.feed(b'{"error": {"message": "\\"usage\\": {\\"prompt_tokens\\": 5}"}}')
    assert finder.usage is None
