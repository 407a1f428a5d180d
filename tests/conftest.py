"""Suite-wide settings."""

from __future__ import annotations

import os

import pytest

# Importing LiteLLM (the plugin's tests do, in-process and in subprocesses) must never fetch its
# price list from the internet: tests talk to 127.0.0.1 only.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="also run the tests marked `full`: full-size floods, baselines whose numbers are "
        "printed but never asserted, and real idle waits (scripts/test --full)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full") or os.environ.get("FAIR_SCHED_FULL") == "1":
        return
    skip = pytest.mark.skip(reason="on demand only: scripts/test --full")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)
