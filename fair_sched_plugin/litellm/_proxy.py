"""Attaching to a running LiteLLM proxy: its config file, its deployments, its ASGI app.

LiteLLM imports our callback module while it loads its config, inside the app's lifespan (so an
event loop is running). That is where the `fair_sched:` section is read and validated: an invalid
section raises `ConfigError` (a `ValueError`), which stops the proxy at start-up with our message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from starlette.types import ASGIApp

from ..asgi import FairSchedulerMiddleware, RouteMode
from ..config import FairSchedSettings, load_settings
from ..errors import ConfigError
from ..runtime.service import SchedulingService
from ..runtime.shutdown import install_sigterm_drain

logger = logging.getLogger("fair_sched")

PROXY_MODULE = "litellm.proxy.proxy_server"
# LiteLLM pass-through prefixes whose target is a self-hosted engine (vLLM's own API).
SELF_HOSTED_PASS_THROUGH = frozenset({"/vllm"})


def running_proxy() -> Any | None:
    """LiteLLM's proxy_server module when we are imported inside a running proxy, else None."""
    return sys.modules.get(PROXY_MODULE)


def proxy_config_path(proxy_server: Any | None) -> Path | None:
    """The config file the proxy was started with (`--config`), if any."""
    candidates = [
        getattr(proxy_server, "user_config_file_path", None) if proxy_server else None,
        os.environ.get("CONFIG_FILE_PATH"),
    ]
    worker_config = os.environ.get("WORKER_CONFIG")
    if worker_config:
        with contextlib.suppress(ValueError, AttributeError):
            candidates.append(json.loads(worker_config).get("config"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate).resolve()
    return None


def _read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read LiteLLM config {str(path)!r}: {exc}") from None
    return document if isinstance(document, Mapping) else {}


def _resolve_env(value: Any) -> Any:
    # LiteLLM's own convention for secrets and addresses in the config file.
    if isinstance(value, str) and value.startswith("os.environ/"):
        return os.environ.get(value.removeprefix("os.environ/"))
    return value


def deployments_from_model_list(model_list: Any) -> dict[str, list[str]]:
    """model_name -> the api_base of each deployment (for default metrics URLs)."""
    deployments: dict[str, list[str]] = {}
    if not isinstance(model_list, list):
        return deployments
    for entry in model_list:
        if not isinstance(entry, Mapping):
            continue
        name = entry.get("model_name")
        params = entry.get("litellm_params")
        api_base = _resolve_env(params.get("api_base")) if isinstance(params, Mapping) else None
        if isinstance(name, str) and isinstance(api_base, str) and api_base:
            deployments.setdefault(name, []).append(api_base)
    return deployments


def model_names(model_list: Any) -> set[str]:
    """Every `model_name` of the proxy's `model_list` (scheduled under its own name)."""
    if not isinstance(model_list, list):
        return set()
    return {
        entry["model_name"]
        for entry in model_list
        if isinstance(entry, Mapping) and isinstance(entry.get("model_name"), str)
    }


def load_proxy_settings(proxy_server: Any | None) -> tuple[FairSchedSettings, dict[str, list[str]]]:
    """Settings from FAIR_SCHED_CONFIG or the proxy's config file, and its deployments.

    Every model name of the `model_list` is a key of the deployments (with no api_base where
    the entry has none), so it is scheduled under its own name.
    """
    config_path = proxy_config_path(proxy_server)
    document = _read_yaml(config_path) if config_path else {}
    deployments = deployments_from_model_list(document.get("model_list"))
    for name in model_names(document.get("model_list")):
        deployments.setdefault(name, [])
    if os.environ.get("FAIR_SCHED_CONFIG"):
        return load_settings(os.environ["FAIR_SCHED_CONFIG"], prices_from_adapter=True), deployments
    if config_path is None:
        logger.warning("fair_sched: no LiteLLM config file found; using default settings")
        return load_settings({}, prices_from_adapter=True), deployments
    section = document.get("fair_sched")
    try:
        # LiteLLM has prices of its own (`FairSchedCallback` asks them where none is set).
        settings = load_settings({"fair_sched": section or {}}, prices_from_adapter=True)
        return settings, deployments
    except ConfigError as exc:
        raise ConfigError(f"{exc}\n  (in {config_path})") from None


def pass_through_routes() -> list[tuple[str, RouteMode]]:
    """The middleware's table for LiteLLM's pass-through routes, generated from LiteLLM's own
    route list: a pattern and a mode for the routes to self-hosted engines (`/vllm/...`), and
    one for the routes to hosted providers (`/openai/...`, ...).

    Their bodies reach the target without LiteLLM's pre-call hook (the router pass-through
    never calls it), so the middleware in front of the proxy schedules them: whatever goes to
    a self-hosted engine, model or not (400 if not JSON); a body for a hosted provider only
    where it names a model (a router model: scheduled), since one that names none (a file
    upload, ...) cannot reach our engines.
    """
    from litellm.proxy._types import LiteLLMRoutes

    prefixes = sorted(LiteLLMRoutes.mapped_pass_through_routes.value, key=len, reverse=True)
    self_hosted = [prefix for prefix in prefixes if prefix in SELF_HOSTED_PASS_THROUGH]
    hosted = [prefix for prefix in prefixes if prefix not in SELF_HOSTED_PASS_THROUGH]

    def pattern(group: list[str]) -> str:
        return r"^(" + "|".join(re.escape(prefix) for prefix in group) + r")(/|$)"

    table: list[tuple[str, RouteMode]] = []
    if self_hosted:
        table.append((pattern(self_hosted), "schedule"))
    if hosted:
        table.append((pattern(hosted), "schedule_if_model"))
    return table


def install_request_watch(
    proxy_server: Any, service: SchedulingService, *, admin: ASGIApp | None = None
) -> bool:
    """Put one `FairSchedulerMiddleware` in front of the proxy app: it schedules LiteLLM's
    pass-through routes itself (`pass_through_routes`), runs every other request under a
    `RequestWatch` (client gone, max_lease_s; the pre-call hook schedules those and hands the
    watch its lease), and answers the admin paths with `admin` (before LiteLLM's own
    middleware and router: `_routes`). One layer, one path lookup and one walk over the
    headers per request.

    Wraps the built middleware stack (add_middleware is refused once the app has started).
    Inside the running proxy (its start-up, after uvicorn installed its signal handlers) a
    SIGTERM is made to drain the queue first (`_shutdown.install_sigterm_drain`).
    """
    app = getattr(proxy_server, "app", None)
    stack = getattr(app, "middleware_stack", None)
    if app is None or stack is None:
        logger.warning(
            "fair_sched: cannot watch requests (the proxy app is not built yet); a client "
            "leaving while queued will still be sent to the engine, max_lease_s is not "
            "enforced, pass-through routes are not scheduled and /fair-sched/* is answered "
            "behind LiteLLM's own middleware"
        )
        return False
    if not isinstance(stack, FairSchedulerMiddleware):
        # The OpenAI paths (/v1/chat/completions, ...) are LiteLLM's own: its pre-call hook
        # schedules them, under the watch this layer gives every request.
        app.middleware_stack = FairSchedulerMiddleware(
            stack,
            service=service,
            paths=(),
            routes=pass_through_routes(),
            others="watch",
            admin=admin,
        )
        with contextlib.suppress(RuntimeError):  # no running loop: not inside a server
            asyncio.get_running_loop()
            install_sigterm_drain(service)
    return True


def build_proxy_service() -> SchedulingService:
    proxy_server = running_proxy()
    settings, deployments = load_proxy_settings(proxy_server)
    return SchedulingService(settings, deployments=deployments)
