"""`ParkedBytes`: the bodies waiting requests hold, capped per user and in total."""

from __future__ import annotations

import pytest

from fair_sched_plugin.core.parked_bytes import ParkedBytes
from fair_sched_plugin.errors import QueueFull


def test_a_user_past_its_byte_cap_is_refused_and_others_are_not() -> None:
    parked = ParkedBytes(max_per_user=100, max_total=1_000)
    parked.reserve("a", 60)
    with pytest.raises(QueueFull) as raised:
        parked.reserve("a", 41)
    assert raised.value.scope == "user"
    parked.reserve("b", 100)
    assert (parked.held_by("a"), parked.held_by("b"), parked.total) == (60, 100, 160)


def test_the_total_byte_cap_refuses_whoever_would_pass_it() -> None:
    parked = ParkedBytes(max_per_user=100, max_total=150)
    parked.reserve("a", 100)
    with pytest.raises(QueueFull) as raised:
        parked.reserve("b", 51)
    assert raised.value.scope == "total"


def test_released_bytes_are_given_back_and_the_user_forgotten() -> None:
    parked = ParkedBytes(max_per_user=100, max_total=1_000)
    parked.reserve("a", 100)
    parked.release("a", 100)
    parked.reserve("a", 100)
    parked.release("a", 100)
    assert parked.total == 0 and parked.held_by("a") == 0
    assert not parked._by_user  # tests may look inside: nothing kept for an idle user
