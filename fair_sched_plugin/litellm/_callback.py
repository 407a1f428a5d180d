"""The LiteLLM callback: a thin adapter from LiteLLM's hooks to `SchedulingService`.

LiteLLM calls `async_pre_call_hook` and `async_post_call_streaming_iterator_hook` only when the
registered class itself defines them (inherited ones are skipped), so both are defined here.

Deny by default: every call that names a model is scheduled, whatever its route (OpenAI,
Anthropic `/v1/messages`, Gemini `:generateContent`, responses, embeddings, ...), and so is every
pass-through call (its body goes to an engine as is, model or not). LiteLLM's pass-through routes
(`/vllm/...` and the like) do not all run this hook, so `FairSchedulerMiddleware` in front of the
proxy app schedules those (see `_proxy.install_request_watch`); the hook then finds the request's
lease and leaves it. Calls that name no model (files, batches, vector stores, ...) cannot reach a
model deployment and pass. On every call the client's own `priority` is removed.

A granted lease belongs to the HTTP request, not to anything the client sends: it is held by the
request's `RequestWatch` (found through a context variable in every hook of that request), which
also ends it when the request ends, when the client leaves, or after `max_lease_s`. Nothing in the
request body or metadata names it, so no other request can end it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger

from .._request import current_request, ensure_current_request
from .._responses import error_response
from ..core import Lease
from ..errors import ClientDisconnected, Rejected
from ..identity import Credentials, Principal
from ..service import UNKNOWN_MODELS, SchedulingService

logger = logging.getLogger("fair_sched")

# Principal name our own `authenticate` vouched for (set on UserAPIKeyAuth.metadata).
PRINCIPAL_KEY = "fair_sched_principal"
# LiteLLM's pass-through routes (`/vllm/...`, ...) forward the body to the engine verbatim.
PASS_THROUGH_CALL_TYPE = "pass_through_endpoint"


class FairSchedCallback(CustomLogger):
    """Parks each call that reaches an engine until its fair turn; ends its lease exactly once."""

    def __init__(self, service_factory: Callable[[], SchedulingService]) -> None:
        super().__init__()
        self._service_factory = service_factory
        self._service: SchedulingService | None = None

    @property
    def service(self) -> SchedulingService:
        if self._service is None:
            self._service = self._service_factory()
        return self._service

    # ------------------------------------------------------------------ admission

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        service = self.service
        pass_through = call_type == PASS_THROUGH_CALL_TYPE
        # A pass-through body reaches the engine as is, so its priority is a top-level field.
        via_extra_body = not pass_through
        service.rewrite_priority(data, None, via_extra_body=via_extra_body)
        if "model" not in data and not pass_through:
            return data  # names no model: cannot reach a model deployment
        model = data.get("model")
        if pass_through and model is None:
            model = UNKNOWN_MODELS  # its engine will pick a default model: still scheduled
        request = ensure_current_request()
        if request.lease is not None:
            return data  # scheduled already (a pass-through route, by the middleware in front)
        principal = self._principal(service, user_api_key_dict, data)
        request.streaming = data.get("stream") is True
        try:
            admission = await service.admit(
                principal,
                model,
                data,
                disconnected=request.watch(),
                waiting=request,
                max_wait_s=request.max_wait_s(service.settings.queue.max_wait_s),
            )
        except (Rejected, ClientDisconnected) as exc:
            # LiteLLM re-renders the HTTPException's body; the request's watch sends ours.
            request.refuse(exc)
            error = error_response(exc)
            raise HTTPException(
                status_code=error.status, detail=error.body, headers=error.headers
            ) from None
        request.hold(admission.lease)
        request.admitted(admission, name_principal=service.names_principals)
        service.rewrite_priority(data, admission.engine_priority, via_extra_body=via_extra_body)
        return data

    def _principal(
        self, service: SchedulingService, auth: Any, data: Mapping[str, Any]
    ) -> Principal:
        auth_metadata = getattr(auth, "metadata", None) or {}
        vouched = auth_metadata.get(PRINCIPAL_KEY) if isinstance(auth_metadata, Mapping) else None
        if isinstance(vouched, str):
            principal = service.directory.principal_named(vouched)
            if principal is not None:
                return principal
        claimed = None
        identity = service.settings.identity
        if identity.source == "body_user" and isinstance(data.get("user"), str):
            claimed = data["user"]
        elif identity.source == "header":
            headers = (data.get("metadata") or {}).get("headers") or {}
            if isinstance(headers, Mapping):
                wanted = identity.header.lower()
                claimed = next((v for k, v in headers.items() if str(k).lower() == wanted), None)
        return service.identify(
            Credentials(
                user_id=getattr(auth, "user_id", None),
                team_id=getattr(auth, "team_id", None),
                key_alias=getattr(auth, "key_alias", None),
                key_hash=getattr(auth, "token", None),
                claimed_user=claimed if isinstance(claimed, str) else None,
            )
        )

    # ------------------------------------------------------------------ the end of a request

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: Any, request_data: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        lease = _request_lease()
        tokens: int | None = None
        try:
            async for chunk in response:
                if lease is not None:
                    lease.mark_started()
                usage = getattr(chunk, "usage", None)
                if usage is not None:
                    tokens = getattr(usage, "total_tokens", None) or tokens
                yield chunk
        finally:
            # Also on a mid-stream disconnect (the generator is closed or cancelled).
            if lease is not None:
                _end(lease, tokens)

    async def async_post_call_success_hook(
        self, data: dict[str, Any], user_api_key_dict: Any, response: Any
    ) -> Any:
        lease = _request_lease()
        if lease is not None:
            lease.release(tokens_used=_total_tokens(response))
        return response

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: str | None = None,
    ) -> None:
        lease = _request_lease()
        if lease is not None:
            _end(lease, None)

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        # Runs in a task LiteLLM creates from the request's context, so it sees its lease.
        lease = _request_lease()
        if lease is not None:
            lease.release(tokens_used=_total_tokens(response_obj))

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        lease = _request_lease()
        if lease is not None:
            _end(lease, None)


def _request_lease() -> Lease | None:
    """The lease the running request holds (None: it holds none, or it ended)."""
    request = current_request()
    return request.lease if request is not None else None


def _end(lease: Lease, tokens: int | None) -> None:
    # Completed once the engine demonstrably took it (a byte came back); otherwise the request
    # never got to the engine (another hook refused it, the router failed): the turn passes on
    # uncharged.
    if lease.started:
        lease.release(tokens_used=tokens)
    else:
        lease.abandon()


def _total_tokens(response: Any) -> int | None:
    usage = getattr(response, "usage", None)
    total = getattr(usage, "total_tokens", None)
    return total if isinstance(total, int) and total > 0 else None
