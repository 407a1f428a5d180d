"""Settings for tier shares, promotion, short-first order, cost fairness, prices and budgets."""

from __future__ import annotations

from typing import Any

import pytest

from fair_sched_plugin.config import load_settings
from fair_sched_plugin.errors import ConfigError

PRICED = {
    "m": {"api_base": "http://127.0.0.1:9/v1", "price": {"input_per_mtok": 1, "output_per_mtok": 2}}
}


def test_the_design_keys_parse() -> None:
    settings = load_settings(
        {
            "tiers": [
                {"name": "interactive", "share": 0.8},
                {"name": "batch", "share": 0.2, "promote_after_s": 120},
            ],
            "fairness": "cost",
            "queue": {"order": "shortest_first"},
            "backends": {
                "m": {
                    "price": {
                        "input_per_mtok": 0.5,
                        "cached_input_per_mtok": 0.1,
                        "output_per_mtok": 1.5,
                    }
                }
            },
            "principals": [
                {
                    "name": "ci-bot",
                    "keys": ["sk-ci"],
                    "budget": {"usd": 50, "per": "day", "action": "demote", "demote_to": "batch"},
                }
            ],
        }
    )
    assert [tier.share for tier in settings.tiers] == [0.8, 0.2]
    assert settings.tiers[1].promote_after_s == 120
    assert settings.queue.order == "shortest_first"
    price = settings.backends["m"].price
    assert price is not None
    # 500 uncached + 500 cached prompt tokens and 100 output tokens.
    assert price.cost(1000, 100, cached_tokens=500) == pytest.approx(
        (500 * 0.5 + 500 * 0.1 + 100 * 1.5) / 1e6
    )
    budget = settings.principals[0].budget
    assert budget is not None and (budget.usd, budget.per, budget.demote_to) == (50, "day", "batch")


BAD: list[tuple[Any, str]] = [
    ({"tiers": [{"name": "a", "share": 0}]}, "fair_sched.tiers[0].share"),
    ({"tiers": [{"name": "a", "promote_after_s": 5}]}, "fair_sched.tiers[0].promote_after_s"),
    ({"fairness": "cost"}, "backends.<model>.price"),
    ({"queue": {"order": "random"}}, "fair_sched.queue.order"),
    (
        {"principals": [{"name": "x", "keys": ["k"], "budget": {"per": "day"}}]},
        "fair_sched.principals[0].budget: needs exactly one of `usd` or `tokens`",
    ),
    (
        {"principals": [{"name": "x", "keys": ["k"], "budget": {"tokens": 5, "per": "week"}}]},
        "fair_sched.principals[0].budget.per",
    ),
    (
        {
            "principals": [
                {
                    "name": "x",
                    "keys": ["k"],
                    "budget": {"tokens": 5, "per": "day", "action": "demote"},
                }
            ]
        },
        "needs `demote_to`",
    ),
    (
        {
            "principals": [
                {
                    "name": "x",
                    "keys": ["k"],
                    "tier": "batch",
                    "budget": {
                        "tokens": 5,
                        "per": "day",
                        "action": "demote",
                        "demote_to": "interactive",
                    },
                }
            ]
        },
        "fair_sched.principals[0].budget.demote_to: 'interactive' is not below",
    ),
    (
        {"principals": [{"name": "x", "keys": ["k"], "budget": {"usd": 5, "per": "day"}}]},
        "fair_sched.principals[0].budget.usd: needs prices",
    ),
    (
        {"backends": {"m": {"price": {"input_per_mtok": -1, "output_per_mtok": 1}}}},
        "fair_sched.backends.m.price.input_per_mtok",
    ),
]


@pytest.mark.parametrize(("section", "expected"), BAD)
def test_bad_values_name_their_key_path(section: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(section)
    assert expected in str(raised.value)


def test_a_usd_budget_with_prices_is_accepted() -> None:
    settings = load_settings(
        {
            "backends": PRICED,
            "principals": [{"name": "x", "keys": ["k"], "budget": {"usd": 5, "per": "hour"}}],
        }
    )
    assert settings.principals[0].budget is not None


def test_inside_litellm_cost_fairness_and_usd_budgets_need_no_configured_price() -> None:
    section = {
        "fairness": "cost",
        "principals": [{"name": "p", "keys": ["sk-p"], "budget": {"usd": 5, "per": "day"}}],
    }
    with pytest.raises(ConfigError, match=r"backends\.<model>\.price"):
        load_settings(section)
    # LiteLLM's own cost data prices its deployments (the LiteLLM adapter loads like this).
    assert load_settings(section, prices_from_adapter=True).fairness == "cost"
