"""The admin HTTP endpoints: ``/fair-sched/metrics``, ``/fair-sched/status``, ``/fair-sched/ui``.

The metrics and the status need the admin key as a bearer token. The UI page carries no data
(it asks for the key and reads the status with it), so it is served to anyone who reaches the
path, like a login form.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from ._ui import ARGUMENT_KEY_HINT, SETTINGS_KEY_HINT, ui_response

if TYPE_CHECKING:
    from ..config import FairSchedSettings
    from ._metrics import ServiceMetrics

METRICS_PATH = "/fair-sched/metrics"
STATUS_PATH = "/fair-sched/status"
UI_PATH = "/fair-sched/ui"
ADMIN_PATHS = frozenset({METRICS_PATH, STATUS_PATH, UI_PATH})

Renderer = Callable[["ServiceMetrics"], Response]


class Observed(Protocol):
    """What the endpoints need of a service: its settings and its metrics."""

    @property
    def settings(self) -> FairSchedSettings: ...

    @property
    def observability(self) -> ServiceMetrics: ...


def presented_key(request: Request, *, extra_headers: Iterable[str] = ()) -> str | None:
    """The bearer token of a request (or the first of `extra_headers` that is set)."""
    authorization = request.headers.get("authorization", "")
    if authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    for header in extra_headers:
        value = request.headers.get(header)
        if value:
            return value.strip()
    return None


def keys_match(presented: str | None, expected: str | None) -> bool:
    """Constant-time comparison; digests first, so the time says nothing about the length."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(
        hashlib.sha256(presented.encode()).digest(), hashlib.sha256(expected.encode()).digest()
    )


def unauthorized() -> Response:
    body = {
        "error": {
            "message": "fair_sched: this endpoint needs the admin key (Authorization: Bearer ...)",
            "type": "authentication_error",
            "code": "unauthorized",
            "param": None,
        }
    }
    return JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})


def metrics_response(metrics: ServiceMetrics) -> Response:
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def status_response(metrics: ServiceMetrics) -> Response:
    return Response(
        json.dumps(metrics.status(), separators=(",", ":"), allow_nan=False).encode(),
        media_type="application/json",
        headers={"cache-control": "no-store"},
    )


def _admin_key_not_configured() -> Response:
    return JSONResponse(
        {
            "error": {
                "message": "the status page needs observability.admin_key",
                "type": "permission_error",
                "code": "admin_key_not_configured",
                "param": None,
            }
        },
        status_code=403,
    )


def endpoints(service: Observed, *, admin_key: str | None = None) -> list[Route]:
    """Starlette routes for ``GET /fair-sched/metrics``, ``/fair-sched/status`` and ``/ui``.

    With an admin key (`admin_key`, else ``observability.admin_key`` from the settings) the
    metrics and the status answer 401 unless the request carries ``Authorization: Bearer <admin
    key>``. Without one the metrics stay open (aggregates; user labels only when `user_labels`
    opts in) and the status, which names backlogged callers, answers 403: it is never public by
    accident. The UI page is static and reads the status with the key the operator types.
    """
    metrics = service.observability
    key = admin_key or service.settings.observability.resolved_admin_key()
    key_hint = ARGUMENT_KEY_HINT if admin_key else SETTINGS_KEY_HINT

    async def ui_endpoint(request: Request) -> Response:
        return ui_response(key_hint)

    def guarded(
        render: Renderer, *, open_without_key: bool
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if key is None:
                if not open_without_key:
                    return _admin_key_not_configured()
            elif not keys_match(presented_key(request), key):
                return unauthorized()
            return render(metrics)

        return endpoint

    return [
        Route(METRICS_PATH, guarded(metrics_response, open_without_key=True), methods=["GET"]),
        Route(STATUS_PATH, guarded(status_response, open_without_key=False), methods=["GET"]),
        Route(UI_PATH, ui_endpoint, methods=["GET"]),
    ]


def admin_app(service: Observed, *, admin_key: str | None = None) -> Router:
    """The admin endpoints as one ASGI app (a `Router`), for mounting or for the middleware."""
    return Router(routes=endpoints(service, admin_key=admin_key))
