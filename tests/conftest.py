"""Suite-wide settings."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

# Property tests check behaviour, not speed: on a shared 2-core machine running two pytest
# workers a hypothesis example can take seconds, and its per-example deadline would fail a
# correct test (a wall-clock assertion in all but name).
settings.register_profile("fair-sched", deadline=None)
settings.load_profile("fair-sched")

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
    config.addinivalue_line(
        "markers",
        "timing: asserts a ratio or bound that depends on how fast the machine runs (light "
        "users' waits against a flood, the engine's queue under load, CPU shares): scripts/test "
        "runs these alone, after the parallel phase, so no other test shares the CPU with them",
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: a `full` test is also a `timing` one
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(pytest.mark.timing)  # full-size floods measure waits too
    if config.getoption("--full") or os.environ.get("FAIR_SCHED_FULL") == "1":
        return
    skip = pytest.mark.skip(reason="on demand only: scripts/test --full")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _heap_thawed_after_each_test() -> Iterator[None]:
    """A test that runs the LiteLLM callback's first pre-call hook in this process freezes its
    heap (`freeze_startup_heap`): thawed after it, so later tests' objects stay collectable."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
