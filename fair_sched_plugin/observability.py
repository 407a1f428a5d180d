"""Operator visibility: Prometheus metrics, the status document, their endpoints."""

from __future__ import annotations

from typing import Any


def install_litellm_routes(proxy_server: Any, callback: Any) -> None:
    """Add /fair-sched/metrics and /fair-sched/status to a running LiteLLM proxy (admin only)."""
