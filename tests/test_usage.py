"""The one mapping from an engine's `usage` to what a request is charged (`_usage.read_usage`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fair_sched_plugin._usage import Usage, read_usage


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
