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


def pytest_configure(config: pytest.Config) -> None:
    # Registered here, not in pyproject.toml: a change there makes scripts/bootstrap.sh
    # reinstall the virtualenv.
    config.addinivalue_line(
        "markers",
        "full: runs only with scripts/test --full (pytest --full): full-size floods, "
        "baselines that are printed but never asserted, real idle waits",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full") or os.environ.get("FAIR_SCHED_FULL") == "1":
        return
    skip = pytest.mark.skip(reason="on demand only: scripts/test --full")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)
