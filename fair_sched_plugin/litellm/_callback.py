"""The LiteLLM callback: a thin adapter from LiteLLM's hooks to `SchedulingService`.

LiteLLM calls `async_pre_call_hook` and `async_post_call_streaming_iterator_hook` only when the
registered class itself defines them (inherited ones are skipped), so both are defined here.
Leases are keyed by an id we put into the request's metadata: `litellm_call_id` can be chosen by
the client (`x-litellm-call-id`), so it could collide with another request's.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger

from ..core import Lease
from ..errors import Rejected
from ..identity import Credentials, Principal
from ..service import ClientDisconnected, SchedulingService
from ._disconnect import current_disconnect_event

logger = logging.getLogger("fair_sched")

LEASE_KEY = "fair_sched_lease"
# Principal name our own `authenticate` vouched for (set on UserAPIKeyAuth.metadata).
PRINCIPAL_KEY = "fair_sched_principal"
# Generation calls that reach the engine; embeddings, moderation and the rest pass through.
SCHEDULED_CALL_TYPES = frozenset(
    {"completion", "acompletion", "text_completion", "atext_completion", "responses", "aresponses"}
)


class FairSchedCallback(CustomLogger):
    """Parks each generation request until its fair turn; ends its lease exactly once."""

    def __init__(self, service_factory: Callable[[], SchedulingService]) -> None:
        super().__init__()
        self._service_factory = service_factory
        self._service: SchedulingService | None = None
        self._leases: dict[str, Lease] = {}

    @property
    def service(self) -> SchedulingService:
        if self._service is None:
            self._service = self._service_factory()
        return self._service

    def in_flight_leases(self) -> int:
        return len(self._leases)

    # ------------------------------------------------------------------ admission

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        if call_type not in SCHEDULED_CALL_TYPES or not isinstance(data.get("model"), str):
            return data
        service = self.service
        principal = self._principal(service, user_api_key_dict, data)
        try:
            admission = await service.admit(
                principal, data["model"], data, disconnected=current_disconnect_event()
            )
        except Rejected as exc:
            raise HTTPException(
                status_code=exc.status_code,
                detail={
                    "error": {"message": str(exc), "type": "rate_limit_error", "code": exc.reason}
                },
                headers={"Retry-After": exc.retry_after_header},
            ) from None
        except ClientDisconnected:
            # Nobody is listening; 499 is what proxies log for a client that closed the request.
            raise HTTPException(
                status_code=499, detail="client disconnected while queued"
            ) from None
        lease_id = uuid.uuid4().hex
        metadata = data.get("metadata")
        if not isinstance(metadata, dict):
            metadata = data["metadata"] = {}
        metadata[LEASE_KEY] = lease_id
        self._leases[lease_id] = admission.lease
        service.rewrite_priority(data, admission.engine_priority, via_extra_body=True)
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
        lease = self._leases.get(_lease_id(request_data.get("metadata")) or "")
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
            self._finish(_lease_id(request_data.get("metadata")), tokens)

    async def async_post_call_success_hook(
        self, data: dict[str, Any], user_api_key_dict: Any, response: Any
    ) -> Any:
        self._finish(_lease_id(data.get("metadata")), _total_tokens(response))
        return response

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: str | None = None,
    ) -> None:
        self._finish(_lease_id(request_data.get("metadata")), None)

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._finish(_lease_id(_logged_metadata(kwargs)), _total_tokens(response_obj))

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._finish(_lease_id(_logged_metadata(kwargs)), None)

    def _finish(self, lease_id: str | None, tokens: int | None) -> None:
        if lease_id is None:
            return
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            lease.release(tokens_used=tokens)


def _lease_id(metadata: Any) -> str | None:
    if isinstance(metadata, Mapping):
        value = metadata.get(LEASE_KEY)
        if isinstance(value, str):
            return value
    return None


def _logged_metadata(kwargs: Mapping[str, Any]) -> Any:
    params = kwargs.get("litellm_params")
    return params.get("metadata") if isinstance(params, Mapping) else None


def _total_tokens(response: Any) -> int | None:
    usage = getattr(response, "usage", None)
    total = getattr(usage, "total_tokens", None)
    return total if isinstance(total, int) and total > 0 else None
