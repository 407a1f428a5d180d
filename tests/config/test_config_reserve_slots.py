"""`tiers[].reserve_slots`: parsed, checked against the backends' slots, named by key path."""

from __future__ import annotations

from typing import Any

import pytest

from fair_sched_plugin.config import parse_settings
from fair_sched_plugin.errors import ConfigError

SLOTS = {"m": {"api_base": "http://127.0.0.1:8000/v1", "max_num_seqs": 8}}


def test_no_slot_is_reserved_by_default() -> None:
    assert parse_settings({}).tiers[0].reserve_slots == 0


def test_reserve_slots_is_read_per_tier() -> None:
    section = {
        "tiers": [{"name": "interactive", "reserve_slots": 2}, {"name": "batch"}],
        "backends": SLOTS,
    }
    tiers = parse_settings(section).tiers
    assert [tier.reserve_slots for tier in tiers] == [2, 0]


BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "negative",
        {"tiers": [{"name": "a", "reserve_slots": -1}]},
        "fair_sched.tiers[0].reserve_slots: Input should be greater than or equal to 0",
    ),
    (
        "without the engine's slots",
        {
            "tiers": [{"name": "a", "reserve_slots": 1}],
            "backends": {"m": {"api_base": "http://127.0.0.1:8000/v1"}},
        },
        "fair_sched.tiers[0].reserve_slots: needs backends.m.max_num_seqs",
    ),
    (
        "every slot",
        {"tiers": [{"name": "a"}, {"name": "b", "reserve_slots": 8}], "backends": SLOTS},
        "fair_sched.tiers[1].reserve_slots: must be below backends.m.max_num_seqs (8) (got 8)",
    ),
    (
        "with shares",
        {
            "tiers": [{"name": "a", "reserve_slots": 1, "share": 0.8}, {"name": "b", "share": 0.2}],
            "backends": SLOTS,
        },
        "fair_sched.tiers[0].reserve_slots: not with tier shares",
    ),
]


@pytest.mark.parametrize(("case", "section", "expected"), BAD, ids=[c[0] for c in BAD])
def test_a_bad_reservation_names_its_key_path(
    case: str, section: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings(section)
    assert expected in str(caught.value)
