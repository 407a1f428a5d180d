"""The public surface is pinned: adding or removing a name is a deliberate change."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fair_sched_plugin
import fair_sched_plugin.testing

PUBLIC = {
    "__version__",
    "ClientDisconnected",
    "ConfigError",
    "DeadlineUnreachable",
    "FairSchedError",
    "FairSchedSettings",
    "FairScheduler",
    "FairSchedulerMiddleware",
    "Lease",
    "QueueFull",
    "QueueTimeout",
    "Rejected",
    "SchedulerClosed",
    "SchedulingService",
    "StateStoreError",
    "Ticket",
    "build_proxy_app",
    "load_settings",
}


def test_all_is_pinned_and_every_name_resolves() -> None:
    assert set(fair_sched_plugin.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(fair_sched_plugin, name) is not None


def test_the_testing_module_is_pinned() -> None:
    assert set(fair_sched_plugin.testing.__all__) == {
        "FakeClock",
        "GateLeaseOwner",
        "ManualGate",
        "drain",
        "make_ticket",
        "released_users",
        "settle",
        "snapshot",
        "submit",
    }


@pytest.mark.parametrize("module", ["fair_sched_plugin.core", "fair_sched_plugin.testing"])
def test_the_core_and_its_doubles_import_without_the_http_stack(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "heavy = [m for m in ('httpx', 'starlette', 'litellm', 'redis', 'prometheus_client') "
        "if m in sys.modules]; print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
