"""The admin routes on a running LiteLLM proxy: metrics, status and the UI page.

LiteLLM has its own admin credential, the master key, so the routes check that (read at request
time from the proxy module) instead of ``observability.admin_key``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..observability import METRICS_PATH, STATUS_PATH, UI_PATH, register_in_default_registry
from ..observability._endpoints import (
    Renderer,
    keys_match,
    metrics_response,
    presented_key,
    status_response,
    unauthorized,
)
from ..observability._ui import ui_response
from ..service import SchedulingService

logger = logging.getLogger("fair_sched")


def install_litellm_routes(proxy_server: Any, service: SchedulingService) -> None:
    """Add /fair-sched/metrics, /fair-sched/status and /fair-sched/ui to a LiteLLM proxy.

    Metrics and status need the proxy's master key (``Authorization: Bearer`` or
    ``x-litellm-api-key``), compared in constant time with ``proxy_server.master_key`` at request
    time; anything else gets 401. The page holds no data and asks for that key itself. The
    collector also joins prometheus_client's default registry, so the families appear in
    LiteLLM's own /metrics when its Prometheus callback is on.
    """
    app = getattr(proxy_server, "app", None)
    if app is None or not hasattr(app, "add_api_route"):
        logger.warning("fair_sched: cannot add /fair-sched/* routes (no proxy app found)")
        return
    metrics = service.observability
    metrics.remember_loop()
    register_in_default_registry(metrics)

    def guarded(render: Renderer) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            master_key = getattr(proxy_server, "master_key", None)
            presented = presented_key(request, extra_headers=("x-litellm-api-key",))
            if not keys_match(presented, str(master_key) if master_key else None):
                return unauthorized()
            return render(metrics)

        return endpoint

    async def page(request: Request) -> Response:
        return ui_response()

    existing = {getattr(route, "path", None) for route in getattr(app, "routes", ())}
    for path, endpoint in (
        (METRICS_PATH, guarded(metrics_response)),
        (STATUS_PATH, guarded(status_response)),
        (UI_PATH, page),
    ):
        if path in existing:
            continue  # imported twice (a plugin file next to the config): keep the first
        app.add_api_route(
            path, endpoint, methods=["GET"], include_in_schema=False, response_model=None
        )
