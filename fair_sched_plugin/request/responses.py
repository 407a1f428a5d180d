"""The one mapping from a refusal to an HTTP response, shared by every adapter.

The LiteLLM callback, the ASGI middleware and the standalone proxy all answer a `Rejected`
(or a client that left) with `error_response(exc)`: the status, an OpenAI-shaped body
``{"error": {"message", "type", "param", "code"}}`` and, where a retry makes sense, `Retry-After`.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from starlette.types import Send

from ..errors import ClientDisconnected, DeadlineUnreachable, InvalidRequest, Rejected

# How long a request refused for its deadline had waited (the header a granted one carries).
WAITED_HEADER = "x-fair-sched-queued-s"
# nginx's "client closed request": logged, never read by anyone.
CLIENT_CLOSED_STATUS = 499

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    CLIENT_CLOSED_STATUS: "client_closed_request",
    502: "engine_unavailable_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ErrorResponse(NamedTuple):
    status: int
    body: dict[str, Any]
    headers: dict[str, str]

    def content(self) -> bytes:
        return json.dumps(self.body).encode()

    async def send_asgi(self, send: Send) -> None:
        """Send this response on an ASGI connection whose response has not started."""
        content = self.content()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
            *((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in
              self.headers.items()),
        ]  # fmt: skip
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": content, "more_body": False})


def error(
    status: int,
    message: str,
    *,
    code: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> ErrorResponse:
    """An error in OpenAI's shape; the `type` follows from the status."""
    kind = _ERROR_TYPES.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return ErrorResponse(status, body, dict(headers or {}))


def error_response(exc: Rejected | ClientDisconnected) -> ErrorResponse:
    """The HTTP answer to a request fair-sched refused, or whose client left while queued."""
    if isinstance(exc, ClientDisconnected):
        return error(CLIENT_CLOSED_STATUS, str(exc), code="client_disconnected")
    param = exc.param if isinstance(exc, InvalidRequest) else None
    headers = {}
    if exc.retryable:
        # A full queue, a wait given up, an engine or a server away: say when to come back
        # (the service estimates it from the measured drain rate).
        headers["Retry-After"] = exc.retry_after_header
    if isinstance(exc, DeadlineUnreachable):
        # Whether it was refused on arrival or after waiting (the prediction changed).
        headers[WAITED_HEADER] = f"{exc.waited_s:.3f}"
    return error(exc.status_code, str(exc), code=exc.error_code, param=param, headers=headers)
