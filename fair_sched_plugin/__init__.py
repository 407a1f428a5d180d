"""fair-sched-plugin: fair, backpressure-aware request scheduling for self-hosted LLM engines.

The public surface is what `__all__` lists; everything else is private. Names are imported on
first use, so `import fair_sched_plugin.core` stays free of the HTTP and metrics stacks.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "FairSchedSettings": "fair_sched_plugin.config",
    "load_settings": "fair_sched_plugin.config",
    "ConfigError": "fair_sched_plugin.errors",
    "DeadlineUnreachable": "fair_sched_plugin.errors",
    "FairSchedError": "fair_sched_plugin.errors",
    "QueueFull": "fair_sched_plugin.errors",
    "QueueTimeout": "fair_sched_plugin.errors",
    "Rejected": "fair_sched_plugin.errors",
    "SchedulerClosed": "fair_sched_plugin.errors",
    "StateStoreError": "fair_sched_plugin.errors",
    "FairScheduler": "fair_sched_plugin.runtime.driver",
    "Lease": "fair_sched_plugin.core",
    "Ticket": "fair_sched_plugin.core",
    "FairSchedulerMiddleware": "fair_sched_plugin.asgi",
    "SchedulingService": "fair_sched_plugin.runtime.service",
    "ClientDisconnected": "fair_sched_plugin.errors",
    "build_proxy_app": "fair_sched_plugin.proxy",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fair_sched_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
