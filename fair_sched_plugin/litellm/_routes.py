"""The admin routes on a running LiteLLM proxy: metrics, status and the UI page.

LiteLLM has its own admin credential, the master key, so the routes check that (read at request
time from the proxy module) instead of ``observability.admin_key``.

They are answered in front of LiteLLM's app, by the middleware the integration puts around it
(`_proxy.install_request_watch`), not as routes of LiteLLM's app: on the real vLLM stage, a
client asking for /fair-sched/status (or being refused it) every half second through LiteLLM's
own middleware and router while a power user's 100 requests came in held the light users' first
token at 3.9-12 s where it was 0.8-1.8 s without, or with LiteLLM's own /health/liveliness or
/v1/models asked as often (docs/operations.md). The status page polls every 0.4 s.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..observability import METRICS_PATH, STATUS_PATH, UI_PATH, register_in_default_registry
from ..observability._endpoints import (
    Renderer,
    keys_match,
    metrics_response,
    presented_key,
    status_response,
    unauthorized,
)
from ..observability._ui import LITELLM_KEY_HINT, ui_response
from ..runtime.service import SchedulingService

logger = logging.getLogger("fair_sched")


def litellm_admin_routes(proxy_server: Any, service: SchedulingService) -> list[Route]:
    """/fair-sched/metrics, /fair-sched/status and /fair-sched/ui for a LiteLLM proxy.

    Metrics and status need the proxy's master key (``Authorization: Bearer`` or
    ``x-litellm-api-key``), compared in constant time with ``proxy_server.master_key`` at request
    time; anything else gets 401. The page holds no data and asks for that key itself. The
    collector also joins prometheus_client's default registry, so the families appear in
    LiteLLM's own /metrics when its Prometheus callback is on.
    """
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
        return ui_response(LITELLM_KEY_HINT)

    return [
        Route(METRICS_PATH, guarded(metrics_response), methods=["GET"]),
        Route(STATUS_PATH, guarded(status_response), methods=["GET"]),
        Route(UI_PATH, page, methods=["GET"]),
    ]


def add_routes_to_litellm_app(proxy_server: Any, routes: list[Route]) -> None:
    """Where no middleware could go in front of LiteLLM's app (`install_request_watch` said so):
    the same routes as routes of LiteLLM's app, behind its own middleware."""
    app = getattr(proxy_server, "app", None)
    if app is None or not hasattr(app, "router"):
        logger.warning("fair_sched: cannot add /fair-sched/* routes (no proxy app found)")
        return
    existing = {getattr(route, "path", None) for route in app.router.routes}
    # Imported twice (a plugin file next to the config): the first import's stay.
    app.router.routes.extend(route for route in routes if route.path not in existing)
