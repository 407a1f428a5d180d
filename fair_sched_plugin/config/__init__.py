"""The `fair_sched:` settings, validated once at the edge.

Everything downstream receives frozen, typed objects. Errors name the key path and the bad value,
for example ``fair_sched.tiers[1].waiting_below: must be 0 or more (got -1)``.

The parts: the section's models (`_settings`, with `backends.<model>` in `_backends` and what
every model shares in `_base`), deployment URLs and their public names (`_urls`), the error
messages with their key paths and "did you mean" (`_messages`), and reading a mapping or a YAML
file (`_load`).
"""

from __future__ import annotations

from ._backends import (
    BackendSettings,
    DeploymentSettings,
    MetricsUnavailableSettings,
    PlacementSettings,
    PriceSettings,
)
from ._base import resolve_secret
from ._load import load_settings, parse_settings
from ._settings import (
    BUDGET_WINDOWS_S,
    DEFAULT_WAIT_BUCKETS_S,
    PRICES_FROM_ADAPTER,
    AutoBounds,
    AutoWaitingBelow,
    BudgetSettings,
    FairSchedSettings,
    IdentitySettings,
    ObservabilitySettings,
    PrincipalMatch,
    PrincipalSettings,
    QueueSettings,
    TierSettings,
)
from ._urls import default_metrics_url, deployment_key, deployment_names, safe_url

__all__ = [
    "BUDGET_WINDOWS_S",
    "DEFAULT_WAIT_BUCKETS_S",
    "PRICES_FROM_ADAPTER",
    "AutoBounds",
    "AutoWaitingBelow",
    "BackendSettings",
    "BudgetSettings",
    "DeploymentSettings",
    "FairSchedSettings",
    "IdentitySettings",
    "MetricsUnavailableSettings",
    "ObservabilitySettings",
    "PlacementSettings",
    "PriceSettings",
    "PrincipalMatch",
    "PrincipalSettings",
    "QueueSettings",
    "TierSettings",
    "default_metrics_url",
    "deployment_key",
    "deployment_names",
    "load_settings",
    "parse_settings",
    "resolve_secret",
    "safe_url",
]
