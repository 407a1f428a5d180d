"""Refusing to attach to a LiteLLM whose internals are not the ones this adapter relies on.

The adapter reaches into LiteLLM's proxy: the names and parameters of `CustomLogger`'s hooks (the
proxy passes them by keyword, and skips a hook the registered class defines under another name),
`custom_auth`'s call, attributes of `litellm.proxy.proxy_server`, and the ASGI app it wraps. A
LiteLLM that changed any of them would not fail loudly: requests would reach the engine without
ever being queued. So the callback refuses to attach instead, naming the installed LiteLLM.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterable
from importlib import metadata
from types import ModuleType
from typing import Any

from ..errors import UnsupportedLiteLLM

logger = logging.getLogger("fair_sched")

# The ends of the range CI tests; the same as the `litellm` extra in pyproject.toml.
OLDEST_SUPPORTED = "1.94.0"
NEWEST_SUPPORTED = "1.108.7"

# Every hook FairSchedCallback overrides: LiteLLM's base must define each with the same parameters.
HOOKS = (
    "async_pre_call_hook",
    "async_post_call_streaming_iterator_hook",
    "async_post_call_success_hook",
    "async_post_call_failure_hook",
    "async_log_success_event",
    "async_filter_deployments",
    "async_pre_call_check",
)
PROXY_ATTRIBUTES = ("app", "master_key", "user_config_file_path")
# What install_request_watch (the middleware in front) and add_routes_to_litellm_app use on the
# proxy's FastAPI app.
APP_ATTRIBUTES = ("middleware_stack", "router", "routes")
AUTH_MODULE = "litellm.proxy.auth.user_api_key_auth"
# How the proxy calls `general_settings.custom_auth` (our `authenticate(request, api_key)`).
CUSTOM_AUTH_CALL = "user_custom_auth(request=request, api_key=api_key)"


def installed_litellm_version() -> str:
    try:
        return metadata.version("litellm")
    except metadata.PackageNotFoundError:
        return "unknown"


def check_litellm(
    base: type,
    ours: type,
    proxy_server: ModuleType | None,
    auth_source: str | None,
    version: str,
) -> None:
    """Raise `UnsupportedLiteLLM` naming `version` and every internal that differs.

    `base` is LiteLLM's `CustomLogger`, `ours` the callback class; `proxy_server` is None outside
    a running proxy (then only the hooks are checked); `auth_source` is the text of LiteLLM's
    auth module, None where it cannot be read.
    """
    problems = list(_hook_problems(base, ours))
    if proxy_server is not None:
        problems += _missing(proxy_server, PROXY_ATTRIBUTES, "litellm.proxy.proxy_server")
        app = getattr(proxy_server, "app", None)
        if app is not None:
            problems += _missing(app, APP_ATTRIBUTES, "the proxy app")
        if auth_source is None:
            # Installed without sources (.pyc only): nothing to compare; the hooks were checked.
            logger.warning("fair_sched: cannot read %s to check custom_auth's call", AUTH_MODULE)
        elif CUSTOM_AUTH_CALL not in auth_source:
            problems.append(f"{AUTH_MODULE} does not call custom_auth as `{CUSTOM_AUTH_CALL}`")
    if problems:
        raise UnsupportedLiteLLM(
            f"fair_sched: cannot attach to LiteLLM {version} (supported: {OLDEST_SUPPORTED} to "
            f"{NEWEST_SUPPORTED}): its internals differ from what the plugin hooks into, and "
            "requests would run unscheduled:\n  - " + "\n  - ".join(problems)
        )
    if not _within_tested_range(version):
        logger.warning(
            "fair_sched: LiteLLM %s is outside the tested range %s to %s; its hooks match",
            version,
            OLDEST_SUPPORTED,
            NEWEST_SUPPORTED,
        )


def _hook_problems(base: type, ours: type) -> Iterable[str]:
    for name in HOOKS:
        theirs = getattr(base, name, None)
        if theirs is None:
            yield f"CustomLogger.{name} does not exist"
            continue
        expected = _parameter_names(getattr(ours, name))
        found = _parameter_names(theirs)
        if found != expected:
            yield (
                f"CustomLogger.{name}({', '.join(found)}) where the plugin defines "
                f"{name}({', '.join(expected)})"
            )


def _parameter_names(function: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)[1:]  # without `self`


def _missing(owner: object, names: Iterable[str], where: str) -> list[str]:
    return [f"{where} has no `{name}`" for name in names if not hasattr(owner, name)]


def auth_module_source() -> str | None:
    """The text of LiteLLM's auth module as loaded by the running proxy, if readable."""
    module = sys.modules.get(AUTH_MODULE)
    if module is None:
        return ""  # the proxy no longer loads it there: nothing matches, so the check fails
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return None


def _within_tested_range(version: str) -> bool:
    release = _release(version)
    return bool(release) and _release(OLDEST_SUPPORTED) <= release <= _release(NEWEST_SUPPORTED)


def _release(version: str) -> tuple[int, ...]:
    # "1.74.15.post2" -> (1, 74, 15): a post-release belongs to its release.
    parts: list[int] = []
    for part in version.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)
