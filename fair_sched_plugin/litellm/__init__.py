"""LiteLLM proxy integration (needs the `litellm` extra).

In the proxy's config file::

    litellm_settings:
      callbacks: ["fair_sched_plugin.litellm.scheduler"]
    general_settings:
      custom_auth: fair_sched_plugin.litellm.authenticate   # only where keys come from principals
    fair_sched: {...}

Imported by a running proxy, this module reads and validates the `fair_sched:` section at once
(an invalid one stops the proxy at start-up), wraps the proxy app so a client leaving (queued or
running) is noticed and `max_lease_s` holds, and starts the metrics watchers on the proxy's event
loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import HTTPException, Request
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import LitellmUserRoles, UserAPIKeyAuth
from starlette.routing import Router

from ..observability import keys_match
from ._callback import PRINCIPAL_KEY, FairSchedCallback, VouchedPrincipal
from ._compat import auth_module_source, check_litellm, installed_litellm_version
from ._proxy import build_proxy_service, install_request_watch, running_proxy
from ._routes import add_routes_to_litellm_app, litellm_admin_routes

__all__ = [
    "FairSchedCallback",
    "authenticate",
    "scheduler",
]


def _attach() -> FairSchedCallback:
    proxy_server = running_proxy()
    # Before anything attaches: a LiteLLM with other internals would run requests unscheduled.
    check_litellm(
        CustomLogger,
        FairSchedCallback,
        proxy_server,
        auth_module_source() if proxy_server is not None else None,
        installed_litellm_version(),
    )
    callback = FairSchedCallback(build_proxy_service)
    if proxy_server is not None:
        # Inside the proxy: validate now (start-up fails on a bad section) and start watching.
        service = callback.service
        admin_routes = litellm_admin_routes(proxy_server, service)
        if not install_request_watch(proxy_server, service, admin=Router(routes=admin_routes)):
            add_routes_to_litellm_app(proxy_server, admin_routes)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # started lazily on the first request
        else:
            service.start()
    return callback


scheduler = _attach()


async def authenticate(request: Request, api_key: str | None) -> UserAPIKeyAuth:
    """`general_settings.custom_auth`: accept the master key and the keys of `principals`.

    LiteLLM runs custom auth before its own master-key check, so the master key is accepted here.
    Unknown keys get 401; the key itself is never logged or echoed. Only `HTTPException` may
    leave this function: LiteLLM turns anything else into an opaque 500.
    """
    if not isinstance(api_key, str) or not api_key:
        # LiteLLM passes None when the request has no Authorization header at all.
        raise HTTPException(status_code=401, detail="fair_sched: missing API key")
    proxy_server = running_proxy()
    master_key = getattr(proxy_server, "master_key", None) if proxy_server else None
    # On SHA-256 digests (`keys_match`): a comparison of the raw keys returns early on
    # unequal lengths, so its timing would tell the master key's length.
    if master_key and keys_match(api_key, str(master_key)):
        return UserAPIKeyAuth(
            api_key=api_key, user_role=LitellmUserRoles.PROXY_ADMIN, user_id="admin"
        )
    principal = scheduler.service.directory.principal_for_key(api_key)
    if principal is None:
        raise HTTPException(status_code=401, detail="fair_sched: unknown API key")
    metadata: dict[str, Any] = {PRINCIPAL_KEY: VouchedPrincipal(principal.name)}
    return UserAPIKeyAuth(
        api_key=api_key,
        user_id=principal.name,
        key_alias=principal.name,
        metadata=metadata,
        user_role=LitellmUserRoles.INTERNAL_USER,
    )
