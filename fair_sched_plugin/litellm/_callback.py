"""The LiteLLM callback: a thin adapter from LiteLLM's hooks to `SchedulingService`.

LiteLLM calls `async_pre_call_hook` and `async_post_call_streaming_iterator_hook` only when the
registered class itself defines them (inherited ones are skipped), so both are defined here.

Deny by default: every call that names a model is scheduled, whatever its route (OpenAI,
Anthropic `/v1/messages`, Gemini `:generateContent`, responses, embeddings, ...), and so is every
pass-through call (its body goes to an engine as is, model or not). LiteLLM's pass-through routes
(`/vllm/...` and the like) do not all run this hook, so the one `FairSchedulerMiddleware` in front
of the proxy app schedules those (see `_proxy.install_request_watch`); the hook then finds the
request's lease and leaves it. Calls that name no model (files, batches, vector stores, ...)
cannot reach a model deployment and pass. On every call the client's own `priority` is removed,
also from the client objects LiteLLM forwards as written (the realtime session routes,
`NESTED_CLIENT_BODY`).

A granted lease belongs to the HTTP request, not to anything the client sends: it is held by the
request's `RequestWatch` (found through a context variable in every hook of that request), which
alone marks its first byte and ends it: when the request ends, when the client leaves, or after
`max_lease_s`. The hooks only report to it what they saw (the engine's first chunk, its usage, a
failure before any answer, LiteLLM's timeout). Nothing in the request body or metadata names the
lease, so no other request can end it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import AsyncGenerator, Callable, Mapping, MutableMapping
from typing import Any, NamedTuple

from fastapi import HTTPException
from litellm.exceptions import RateLimitError, ServiceUnavailableError, Timeout
from litellm.integrations.custom_logger import CustomLogger

from ..config import PriceSettings, deployment_key, safe_url
from ..core import Lease
from ..errors import ClientDisconnected, DeadlineUnreachable, InvalidRequest, Rejected
from ..request.body import OUTPUT_TOKEN_FIELDS, rewrite_priority
from ..request.identity import Credentials, Principal
from ..request.responses import error_response
from ..request.usage import read_usage
from ..request.watch import RequestWatch, current_request, ensure_current_request
from ..runtime.service import UNKNOWN_MODELS, SchedulingService
from ..runtime.startup_heap import freeze_startup_heap
from ._proxy import running_proxy

logger = logging.getLogger("fair_sched")

# Principal name our own `authenticate` vouched for (set on UserAPIKeyAuth.metadata), as a
# `VouchedPrincipal`: a virtual key's stored metadata is JSON (plain strings), which anyone who
# may create a key can fill in, so a plain string under this key is never believed.
PRINCIPAL_KEY = "fair_sched_principal"


class VouchedPrincipal(str):
    """A principal name set by this process's `authenticate`, never read from stored data.

    A `str` so that LiteLLM, which copies and logs the key's metadata, handles it as the name."""

    __slots__ = ()


# LiteLLM's pass-through routes (`/vllm/...`, ...) forward the body to the engine verbatim.
PASS_THROUGH_CALL_TYPE = "pass_through_endpoint"
# Call types whose upstream body is an object the client wrote, nested in `data` under this key:
# LiteLLM forwards it with unknown fields intact (a client `priority` included). Found by the
# route walk in tests/hardening/test_litellm_routes.py, which fails on any new one.
NESTED_CLIENT_BODY = {
    "acreate_realtime_client_secret": "session",
    "acreate_realtime_transcription_session": "transcription_session",
}
# Call types whose upstream request LiteLLM builds without `extra_body`, so an engine cannot be
# told the tier's priority: Gemini's `:generateContent` to an OpenAI-compatible engine goes
# through LiteLLM's translation to a chat completion, which keeps only the fields it knows. Where
# the engine schedules by priority such a request would run as the most urgent tier (an absent
# priority is vLLM's 0), so it is refused instead. Found by the route walk.
DROPS_ENGINE_PRIORITY = frozenset(
    {"agenerate_content", "agenerate_content_stream", "generate_content", "generate_content_stream"}
)


# The fields that size a request's output, which LiteLLM sends from `extra_body` over the
# top-level ones (as it sends `extra_body.priority`).
_SIZE_FIELDS = frozenset((*OUTPUT_TOKEN_FIELDS, "n", "best_of"))


def _as_sent(data: dict[str, Any]) -> Mapping[str, Any]:
    """`data` as the engine will read it: `extra_body`'s output sizes replace the top-level
    ones, so a request with `max_tokens: 1` and 4000 in `extra_body` is estimated (and bounded)
    at 4000."""
    extra_body = data.get("extra_body")
    if not isinstance(extra_body, Mapping):
        return data
    sizes = {field: value for field, value in extra_body.items() if field in _SIZE_FIELDS}
    return {**data, **sizes} if sizes else data


def _request_headers(data: Mapping[str, Any]) -> object:
    """The headers the proxy received: `proxy_server_request.headers`, which LiteLLM writes
    itself on every route. Not the body's `metadata.headers` first: on the routes where LiteLLM
    keeps its own in `litellm_metadata` (/v1/responses, /v1/messages, ...), `metadata` is the
    client's, so a client could name any user there. Outside the proxy: `metadata.headers`."""
    request = data.get("proxy_server_request")
    if isinstance(request, Mapping) and isinstance(request.get("headers"), Mapping):
        return request["headers"]
    metadata = data.get("metadata")
    return metadata.get("headers") if isinstance(metadata, Mapping) else None


class FairSchedCallback(CustomLogger):
    """Parks each call that reaches an engine until its fair turn; ends its lease exactly once."""

    def __init__(self, service_factory: Callable[[], SchedulingService]) -> None:
        super().__init__()
        self._service_factory = service_factory
        self._service: SchedulingService | None = None
        # LiteLLM's start-up is over by its first request (uvicorn serves after start-up).
        self._startup_heap_frozen = False

    @property
    def service(self) -> SchedulingService:
        if self._service is None:
            self._service = self._service_factory()
            self._service.charges.use_price_lookup(LiteLLMPrices())
        return self._service

    # ------------------------------------------------------------------ admission

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        service = self.service
        if not self._startup_heap_frozen:
            self._startup_heap_frozen = True
            # A proxy's heap only: LiteLLM's SDK inside someone's program leaves theirs alone.
            if service.settings.freeze_startup_heap and running_proxy() is not None:
                freeze_startup_heap()
        pass_through = call_type == PASS_THROUGH_CALL_TYPE
        # A pass-through body reaches the engine as is, so its priority is a top-level field.
        via_extra_body = not pass_through
        rewrite_priority(data, None, via_extra_body=via_extra_body)
        nested = data.get(NESTED_CLIENT_BODY.get(call_type, ""))
        if isinstance(nested, MutableMapping):
            # Stripped, not rewritten: a session's settings are not a generation request.
            rewrite_priority(nested, None, via_extra_body=False)
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
            if not pass_through:
                model = router_model_group(model, service.known_models)
            if (
                call_type in DROPS_ENGINE_PRIORITY
                and isinstance(model, str)
                and service.engine_priority(model, principal.tier) is not None
            ):
                raise InvalidRequest(
                    f"model `{model}` runs on an engine that schedules by priority, and this "
                    "route cannot carry the request's priority to it (LiteLLM translates it to "
                    "a chat completion without it); send it to /v1/chat/completions instead",
                    param="model",
                )
            admission = await service.admit(
                principal,
                model,
                _as_sent(data) if via_extra_body else data,
                disconnected=request.watch(),
                waiting=request,
                max_wait_s=request.max_wait_s(service.settings.queue.max_wait_s),
            )
        except DeadlineUnreachable as exc:
            if not _has_fallbacks(model, data):
                request.refuse(exc)
                error = error_response(exc)
                raise HTTPException(
                    status_code=error.status, detail=error.body, headers=error.headers
                ) from None
            # LiteLLM's fallbacks run in its router, after this hook: the refusal is raised
            # there (`async_filter_deployments`), and the fallback group schedules it anew.
            _SPILLS[request] = _Spill(
                str(model),
                principal,
                _as_sent(data) if via_extra_body else data,
                request.max_wait_s(service.settings.queue.max_wait_s),
                exc,
            )
            return data
        except (Rejected, ClientDisconnected) as exc:
            # LiteLLM re-renders the HTTPException's body; the request's watch sends ours.
            request.refuse(exc)
            error = error_response(exc)
            raise HTTPException(
                status_code=error.status, detail=error.body, headers=error.headers
            ) from None
        request.hold(admission.lease)
        request.admitted(admission, name_principal=service.names_principals)
        # LiteLLM sends it on when this hook returns: a client that leaves from now on is
        # charged what the engine can have generated.
        request.forwarded()
        request.interrupted_tokens = service.charges.interrupted_tokens
        rewrite_priority(data, admission.engine_priority, via_extra_body=via_extra_body)
        return data

    def _principal(
        self, service: SchedulingService, auth: Any, data: Mapping[str, Any]
    ) -> Principal:
        auth_metadata = getattr(auth, "metadata", None) or {}
        vouched = auth_metadata.get(PRINCIPAL_KEY) if isinstance(auth_metadata, Mapping) else None
        # Only our own `authenticate` names a principal this way; a key's stored metadata (which
        # a non-admin may write on a key it creates) holds plain strings and is ignored.
        if isinstance(vouched, VouchedPrincipal):
            principal = service.directory.principal_named(vouched)
            if principal is not None:
                return principal
        claimed = None
        identity = service.settings.identity
        if identity.source == "body_user" and isinstance(data.get("user"), str):
            claimed = data["user"]
        elif identity.source == "header":
            headers = _request_headers(data)
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

    # ------------------------------------------------------------------ routing

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list[Any],
        messages: Any,
        request_kwargs: dict[str, Any] | None = None,
        parent_otel_span: Any = None,
    ) -> list[dict[str, Any]]:
        request = current_request()
        spill = _SPILLS.get(request) if request is not None else None
        if spill is not None and request is not None and request.lease is None:
            await self._spill_over(request, spill, model, request_kwargs)
        lease = _bound_lease(self._service)
        if lease is None:
            return healthy_deployments
        _check_same_model(lease, model, self._service)
        bound = [entry for entry in healthy_deployments if _key_of(entry) == lease.deployment]
        if not bound:
            # LiteLLM took it out of rotation (cooldown after failures, health checks).
            shown = _public_name(self._service, lease.deployment)
            raise _unavailable(
                lease, f"LiteLLM has no healthy deployment at {shown} (cooldown?)", self._service
            )
        return bound

    async def _spill_over(
        self,
        request: RequestWatch,
        spill: _Spill,
        model: str,
        request_kwargs: dict[str, Any] | None,
    ) -> None:
        """A request refused for its deadline in its own model group, now in LiteLLM's router:
        in that group the refusal is raised as LiteLLM's rate-limit error (which its fallbacks
        act on, at once: no retries); in a fallback group it is scheduled as that group's
        request, or refused the same way for the next fallback."""
        service = self.service
        if model == spill.refused_in:
            raise _fallback_trigger(spill.refusal, model)
        try:
            admission = await service.admit(
                spill.principal,
                model,
                spill.body,
                disconnected=request.watch(),
                waiting=request,
                max_wait_s=spill.max_wait_s,
            )
        except (Rejected, ClientDisconnected) as exc:
            raise _fallback_trigger(exc, model) from None
        del _SPILLS[request]
        request.hold(admission.lease)
        request.admitted(admission, name_principal=service.names_principals)
        request.forwarded()
        request.interrupted_tokens = service.charges.interrupted_tokens
        if request_kwargs is not None:
            rewrite_priority(request_kwargs, admission.engine_priority, via_extra_body=True)

    async def async_pre_call_check(
        self, deployment: dict[str, Any], parent_otel_span: Any
    ) -> dict[str, Any] | None:
        lease = _bound_lease(self._service)
        picked = _key_of(deployment)
        if lease is not None and picked != lease.deployment:
            shown = _public_name(self._service, picked)
            raise _unavailable(lease, f"LiteLLM's router picked {shown} instead", self._service)
        return None

    # ------------------------------------------------------------------ the end of a request

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: Any, request_data: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        request = current_request()
        lease = request.lease if request is not None else None
        if request is None or lease is None:
            # No lease held (nothing to schedule, or it ended): chunks pass as they come.
            async for chunk in response:
                yield chunk
            return
        usage: Any = None
        answered = False
        try:
            # Per chunk only what the end needs (this loop runs for every token LiteLLM relays).
            async for chunk in response:
                if not answered:
                    answered = True
                    request.engine_answered(lease)
                usage = chunk_usage(chunk) or usage
                yield chunk
        finally:
            # Also on a mid-stream disconnect (the generator is closed or cancelled).
            if lease.started:
                _report_usage(lease, self._service, usage)
            else:
                request.engine_never_answered(lease)  # the engine failed before its answer

    async def async_post_call_success_hook(
        self, data: dict[str, Any], user_api_key_dict: Any, response: Any
    ) -> Any:
        lease = _request_lease()
        if lease is not None:
            _report_usage(lease, self._service, getattr(response, "usage", None))
        return response

    # No `async_log_failure_event`: it fires for each failed attempt, and LiteLLM's router may
    # retry on the same deployment within the lease, which ends when the proxy answers (here, or
    # at the request's end).
    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: str | None = None,
    ) -> None:
        request = current_request()
        lease = request.lease if request is not None else None
        if request is not None and lease is not None:
            # What LiteLLM saw; the lease's life decides what it means (an answered request
            # ends with its response, not here).
            if isinstance(original_exception, Timeout):
                # LiteLLM gave up on a request the engine had (a `timeout` the client may set
                # itself).
                request.engine_timed_out(lease)
            else:
                # Refused on the way (another hook, the router) or failed before any answer.
                request.engine_never_answered(lease)

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        # Runs in a task LiteLLM creates from the request's context, so it sees its lease.
        lease = _request_lease()
        if lease is not None:
            _report_usage(lease, self._service, getattr(response_obj, "usage", None))


def chunk_usage(chunk: Any) -> Any:
    """A streamed chunk's `usage`, None where it has none (most chunks).

    LiteLLM's chunks are pydantic models that carry `usage` as an extra field, only on the
    chunk that reports it; `getattr(chunk, "usage", None)` on the others goes through pydantic's
    `__getattr__` and an AttributeError, ~7 us for every token relayed. The extras (and the
    fields, in `__dict__`) are read directly instead; anything else by attribute."""
    extra = getattr(chunk, "__pydantic_extra__", None)
    if not isinstance(extra, dict):
        return getattr(chunk, "usage", None)
    fields = getattr(chunk, "__dict__", None)
    return extra.get("usage") or (fields.get("usage") if isinstance(fields, dict) else None)


def _alias_target(aliases: Any, model: str) -> str | None:
    """The group a `router_settings.model_group_alias` entry names (a string, or a mapping with
    `model`, as LiteLLM accepts both). Read from the router's attribute, which every supported
    release has (`Router.get_model_from_alias` is newer than the oldest one)."""
    item = aliases.get(model) if isinstance(aliases, Mapping) else None
    if isinstance(item, Mapping):
        item = item.get("model")
    return item if isinstance(item, str) else None


class _Spill(NamedTuple):
    """A request refused for its deadline in `refused_in`, whose fallbacks LiteLLM's router
    will try: what scheduling it in a fallback group needs."""

    refused_in: str
    principal: Principal
    body: Mapping[str, Any]
    max_wait_s: float | None
    refusal: DeadlineUnreachable


# Per running request (its watch), while its fallbacks are tried; gone with the request.
_SPILLS: weakref.WeakKeyDictionary[RequestWatch, _Spill] = weakref.WeakKeyDictionary()


def _has_fallbacks(model: object, data: Mapping[str, Any]) -> bool:
    """Whether LiteLLM's router has fallbacks for the model group `model` (its own `fallbacks`,
    a `*` default, or the request's own `fallbacks`)."""
    if data.get("fallbacks"):
        return True
    router = getattr(running_proxy(), "llm_router", None)
    fallbacks = getattr(router, "fallbacks", None)
    if not isinstance(model, str) or not isinstance(fallbacks, list):
        return False
    return any(
        isinstance(entry, Mapping) and bool(entry.get(model) or entry.get("*"))
        for entry in fallbacks
    )


def _fallback_trigger(refusal: Rejected | ClientDisconnected, model: str) -> Exception:
    """LiteLLM's rate-limit error for a refusal in `model`'s group: its router then tries the
    group's fallbacks, and with `num_retries=0` it does so without retrying here first."""
    return RateLimitError(
        f"fair_sched: {refusal}", llm_provider="fair_sched", model=model, num_retries=0
    )


def router_model_group(model: Any, groups: frozenset[str]) -> Any:
    """The name a call is scheduled under: the model group LiteLLM's router sends `model` to.

    Names other than a group's own reach a group's deployments too: a `model_group_alias` is
    scheduled as its group. A deployment's id (which LiteLLM names in every response's
    `x-litellm-model-id`) or its `litellm_params.model` make the router call that one deployment
    directly; scheduled as an unknown name, they ran on the shared in-flight cap, past every gate
    of the group. Those are refused (400): the scheduler chooses the deployment, not the client.
    """
    router = getattr(running_proxy(), "llm_router", None)
    if router is None or not isinstance(model, str) or model in groups:
        return model
    alias = _alias_target(getattr(router, "model_group_alias", None), model)
    if alias is not None and alias in groups:
        return alias
    pinned = [
        entry.get("model_name")
        for entry in router.model_list
        if isinstance(entry, Mapping)
        and (
            (entry.get("model_info") or {}).get("id") == model
            or (entry.get("litellm_params") or {}).get("model") == model
        )
    ]
    if any(group in groups for group in pinned):
        raise InvalidRequest(
            "the model names one deployment of a scheduled model group; send the group's "
            "name, the scheduler chooses the deployment",
            param="model",
        )
    return model


def _bound_lease(service: SchedulingService | None) -> Lease | None:
    """The last lease the running request was granted, if the scheduler bound it to one
    deployment LiteLLM knows by its api_base; also once it ended (an attempt after that must
    not go elsewhere either).

    A deployment the gate knows by its metrics URL only (a model_list entry without api_base,
    `backends.<model>.metrics_url` given) names no LiteLLM deployment: there is nothing to hold
    the router to (held to it, every request was refused with a 503). A key that is neither
    (a leader whose configuration differs) is held to, and fails: no deployment has it."""
    request = current_request()
    if request is None or not request.leases:
        return None
    lease = request.leases[-1]
    if lease.deployment is None:
        return None
    backend = service.backends.get(lease.ticket.model) if service is not None else None
    if (
        backend is not None
        and lease.deployment not in backend.all_api_bases()
        and lease.deployment in backend.all_metrics_urls()
    ):
        return None
    return lease


def _key_of(deployment: Any) -> str | None:
    """The deployment key of a LiteLLM router deployment (its `litellm_params.api_base`)."""
    params = deployment.get("litellm_params") if isinstance(deployment, Mapping) else None
    api_base = params.get("api_base") if isinstance(params, Mapping) else None
    return deployment_key(api_base) if isinstance(api_base, str) and api_base else None


def _check_same_model(lease: Lease, model: str, service: SchedulingService | None) -> None:
    if model != lease.ticket.model:
        # A fallback to another model group: its engines never counted this request.
        raise _unavailable(lease, f"not falling back to model group `{model}`", service)


def _public_name(service: SchedulingService | None, key: str | None) -> str | None:
    """A deployment's public name (its api_base may carry credentials)."""
    if key is None:
        return None
    return service.names.deployment_name(key) if service is not None else safe_url(key)


def _unavailable(lease: Lease, why: str, service: SchedulingService | None) -> Exception:
    shown = _public_name(service, lease.deployment)
    message = (
        f"fair_sched: the deployment this request was scheduled to ({shown}, model "
        f"`{lease.ticket.model}`) is not available: {why}; retry to be placed again"
    )
    # LiteLLM's router retries a refused attempt (and tries each fallback): one warning per
    # lease says it; the repeats are for debugging.
    request = current_request()
    repeat = request is not None and not request.first_refusal(lease)
    logger.log(logging.DEBUG if repeat else logging.WARNING, "%s", message)
    return ServiceUnavailableError(
        message=message, model=lease.ticket.model, llm_provider="fair_sched"
    )


def _request_lease() -> Lease | None:
    """The lease the running request holds (None: it holds none, or it ended)."""
    request = current_request()
    return request.lease if request is not None else None


def _report_usage(lease: Lease, service: SchedulingService | None, usage: Any) -> None:
    """Report what the engine said the request used (`SchedulingService.charge_of`: uncached
    prompt plus output tokens, and their money cost at the model's price —
    `backends.<model>.price`, else LiteLLM's own cost data) to the request's watch, which ends
    the lease once the answer went out, after recording its first byte."""
    found = read_usage(usage) if service is not None else None
    tokens_used, cost_used = (
        service.charges.charge_of(lease.ticket.model, found)
        if service is not None and found is not None
        else (None, None)
    )
    ensure_current_request().report(lease, tokens_used, cost_used)


class LiteLLMPrices:
    """LiteLLM's own price for a model group: the per-token costs LiteLLM holds for its
    deployments (their `model_info.input_cost_per_token` / `output_cost_per_token`, else LiteLLM's
    cost map for the deployment's model), the dearest deployment's, through the proxy router's
    `get_model_group_info`. Asked only for served models without `backends.<model>.price`;
    remembered per model once the router exists (the model list is bounded)."""

    def __init__(self) -> None:
        self._known: dict[str, PriceSettings | None] = {}

    def __call__(self, model: str) -> PriceSettings | None:
        if model in self._known:
            return self._known[model]
        router = getattr(running_proxy(), "llm_router", None)
        if router is None:
            return None  # not yet: asked again on the next request
        price = None
        try:
            info = router.get_model_group_info(model_group=model)
        except Exception:  # a LiteLLM lookup error means "no price", never a 500
            logger.warning("fair_sched: LiteLLM has no cost data for model %r", model)
            info = None
        input_cost = getattr(info, "input_cost_per_token", None)
        output_cost = getattr(info, "output_cost_per_token", None)
        if isinstance(input_cost, (int, float)) and isinstance(output_cost, (int, float)):
            price = PriceSettings(
                input_per_mtok=float(input_cost) * 1e6, output_per_mtok=float(output_cost) * 1e6
            )
        self._known[model] = price
        return price
