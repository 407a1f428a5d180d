"""The request body at the HTTP boundary: its numbers bounded where they are read, its priority."""

from __future__ import annotations

from typing import Any

import pytest

from fair_sched_plugin._body import (
    estimate_prompt_tokens,
    requested_choices,
    requested_max_tokens,
    rewrite_priority,
)
from fair_sched_plugin.errors import InvalidRequest

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
