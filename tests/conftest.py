"""Suite-wide settings."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests check behaviour, not speed: on a shared 2-core machine running two pytest
# workers a hypothesis example can take seconds, and its per-example deadline would fail a
# correct test (a wall-clock assertion in all but name).
settings.register_profile("fair-sched", deadline=None)
settings.load_profile("fair-sched")

TESTS = Path(__file__).resolve().parent

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


# The parallel phase's longest modules, longest first (seconds on one worker of a loaded 2-core
# machine). Each pytest-xdist worker takes the next module when it is done with its last, in
# collection order (scripts/test passes --no-loadscope-reorder): long modules that came last kept
# one worker busy for minutes after the others were done, so they come first. A module missing
# here only starts later; after these come the other modules with LiteLLM proxies or slow tests.
LONGEST_MODULES = (
    "integrations/test_litellm_oldest.py",  # ~150: the adapter's tests again, one after another
    "lab/test_demo.py",  # ~110: `fair-sched bench --quick` (its demo tests are `timing`)
    "integrations/test_litellm_budgets_shares.py",  # ~110: a LiteLLM proxy per test
    "integrations/test_litellm_budgets_redis.py",  # two LiteLLM proxies sharing one Redis
    "integrations/test_proxy_replicas_cost.py",  # ~45
    "integrations/test_bench_targets_litellm.py",  # ~40
    "integrations/test_ui_browser.py",  # ~40: a proxy and Chromium
    "hardening/test_litellm_credentials.py",  # ~35
    "integrations/test_litellm_deadlines.py",  # ~35
    "integrations/test_waiting_clients_litellm.py",  # ~25
    "integrations/test_litellm.py",  # ~25
    "integrations/test_litellm_cached_tokens.py",  # ~25
    "hardening/test_litellm_routes.py",  # ~25
    "integrations/test_graceful_drain.py",  # ~25
)


def _module_rank(item: pytest.Item) -> tuple[int, int]:
    path = item.path.relative_to(TESTS).as_posix() if TESTS in item.path.parents else ""
    if path in LONGEST_MODULES:
        return (LONGEST_MODULES.index(path), 0)
    heavy = any(item.get_closest_marker(name) is not None for name in ("litellm", "slow"))
    return (len(LONGEST_MODULES), 0 if heavy else 1)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: a `full` test is also a `timing` one
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(pytest.mark.timing)  # full-size floods measure waits too
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Every worker collects, and all must agree: a stable sort by module keeps each module's
        # tests together and in their order.
        rank: dict[str, tuple[int, int]] = {}
        for item in items:
            module = str(item.path)
            rank[module] = min(rank.get(module, (len(LONGEST_MODULES), 1)), _module_rank(item))
        items.sort(key=lambda item: rank[str(item.path)])
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
