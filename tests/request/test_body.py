"""The request body at the HTTP boundary: its numbers bounded where they are read, its priority."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fair_sched_plugin.errors import BodyTooLarge, InvalidRequest
from fair_sched_plugin.request.body import (
    MAX_BODY_CONTAINERS,
    MAX_BODY_DEPTH,
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TOOLS,
    estimate_prompt_tokens,
    parse_request_body,
    request_size,
    requested_choices,
    requested_max_tokens,
    rewrite_priority,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}


@pytest.mark.parametrize("via_extra_body", [True, False])
def test_client_priority_is_always_removed(via_extra_body: bool) -> None:
    body: dict[str, Any] = {
        "model": "m",
        "priority": -100,
        "extra_body": {"priority": -100, "top_k": 3},
    }
    rewrite_priority(body, None, via_extra_body=via_extra_body)
    assert "priority" not in body and body["extra_body"] == {"top_k": 3}
    rewrite_priority(body, 10, via_extra_body=via_extra_body)
    if via_extra_body:
        assert body["extra_body"] == {"top_k": 3, "priority": 10} and "priority" not in body
    else:
        assert body["priority"] == 10 and body["extra_body"] == {"top_k": 3}


def test_non_mapping_extra_body_is_dropped() -> None:
    body: dict[str, Any] = {"model": "m", "extra_body": "priority=-1"}
    rewrite_priority(body, None, via_extra_body=True)
    assert "extra_body" not in body


def test_cost_estimates() -> None:
    assert estimate_prompt_tokens(BODY) == 100
    assert requested_max_tokens(BODY) == 50
    # The largest field present: which one the engine reads depends on the route.
    assert requested_max_tokens({"max_completion_tokens": 7, "max_tokens": 50}) == 50
    assert requested_max_tokens({}) == 256
    assert estimate_prompt_tokens({"prompt": ["abcd" * 10, 5]}) == 10


ODD_COUNTS = [10**400, float("inf"), float("nan"), -1, 0, "256", [256], {"n": 1}, True, 2.5]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "max_output_tokens"])
@pytest.mark.parametrize("value", ODD_COUNTS, ids=repr)
def test_an_output_bound_out_of_range_is_a_400_naming_the_field(field: str, value: Any) -> None:
    """Before: any positive int was taken as the request's cost, and a 400-digit one made the
    charge raise OverflowError after the lease was marked ended (a slot leaked for good)."""
    with pytest.raises(InvalidRequest) as refused:
        requested_max_tokens({field: value})
    assert refused.value.param == field
    assert field in str(refused.value)


@pytest.mark.parametrize("field", ["n", "best_of"])
@pytest.mark.parametrize("value", [*ODD_COUNTS, 129], ids=repr)
def test_a_choice_count_out_of_range_is_a_400_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as refused:
        requested_choices({field: value})
    assert refused.value.param == field


def nested(levels: int, inner: str = "1") -> bytes:
    return ('{"model":"m","x":' + "[" * (levels - 1) + inner + "]" * (levels - 1) + "}").encode()


def test_a_body_nested_to_the_limit_is_read() -> None:
    assert parse_request_body(nested(MAX_BODY_DEPTH))["model"] == "m"


def test_a_body_nested_past_the_limit_is_a_400_naming_it() -> None:
    with pytest.raises(InvalidRequest, match=f"deeper than {MAX_BODY_DEPTH} levels"):
        parse_request_body(nested(MAX_BODY_DEPTH + 1))


def test_brackets_and_escapes_inside_strings_are_not_structure() -> None:
    """A string full of brackets, escaped quotes and backslashes neither nests nor counts."""
    text = '[{\\"\\\\' * (MAX_BODY_CONTAINERS + 1) + '\\\\"[[['
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    body = parse_request_body(raw.encode())
    assert body["messages"][0]["content"] == text


def test_more_objects_and_arrays_than_the_limit_is_a_400_naming_it() -> None:
    raw = b'{"model":"m","messages":[%s]}' % b",".join([b"{}"] * MAX_BODY_CONTAINERS)
    with pytest.raises(InvalidRequest, match=str(MAX_BODY_CONTAINERS)):
        parse_request_body(raw)


def test_a_body_over_the_size_limit_is_a_413_before_it_is_parsed() -> None:
    with pytest.raises(BodyTooLarge) as raised:
        parse_request_body(b"{" * 11, max_bytes=10)
    assert raised.value.status_code == 413


@pytest.mark.parametrize(
    ("field", "items"),
    [("messages", MAX_MESSAGES + 1), ("input", MAX_MESSAGES + 1), ("tools", MAX_TOOLS + 1)],
)
def test_a_list_longer_than_its_limit_is_a_400_naming_the_field(field: str, items: int) -> None:
    body = {"model": "m", field: ["x"] * items}
    with pytest.raises(InvalidRequest) as raised:
        parse_request_body(json.dumps(body).encode())
    assert raised.value.param == field


def test_content_parts_past_the_limit_are_a_400_naming_messages() -> None:
    parts = [{"type": "text", "text": "x"}] * (MAX_CONTENT_PARTS + 1)
    body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    with pytest.raises(InvalidRequest) as raised:
        parse_request_body(json.dumps(body).encode())
    assert raised.value.param == "messages"


def test_an_adapters_own_body_has_its_list_lengths_bounded_without_a_walk() -> None:
    """LiteLLM parsed the body itself: `request_size` bounds what it iterates, nothing more."""
    deep: Any = "x"
    for _ in range(MAX_BODY_DEPTH * 2):
        deep = [deep]
    assert request_size({"model": "m", "metadata": deep, "messages": []})[0] >= 1
    with pytest.raises(InvalidRequest) as raised:
        request_size({"model": "m", "messages": [{}] * (MAX_MESSAGES + 1)})
    assert raised.value.param == "messages"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_body_not_in_utf8_is_a_400(encoding: str) -> None:
    """Forwarded bytes are extended in place (the engine priority), which only UTF-8 allows."""
    raw = json.dumps({"model": "m", "messages": []}).encode(encoding)
    assert json.loads(raw)["model"] == "m"  # what the decoder alone would take
    with pytest.raises(InvalidRequest, match="UTF-8"):
        parse_request_body(raw)
