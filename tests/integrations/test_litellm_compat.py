"""The start-up check against the installed LiteLLM's internals (fair_sched_plugin.litellm._compat).

The installed LiteLLM must pass; a LiteLLM with a hook, an attribute or the custom_auth call
changed is simulated by handing the check a class or module without it. These tests run under
every supported LiteLLM (scripts/test runs them again under the oldest).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from .litellm_harness import NEEDS_LITELLM

pytestmark = [
    pytest.mark.litellm_range,
    NEEDS_LITELLM,
]

VERSION = "1.94.0"


@pytest.fixture(scope="module")
def compat() -> Any:
    from fair_sched_plugin.litellm import _compat

    return _compat


@pytest.fixture(scope="module")
def base() -> type:
    from litellm.integrations.custom_logger import CustomLogger

    return CustomLogger


@pytest.fixture(scope="module")
def ours() -> type:
    from fair_sched_plugin.litellm import FairSchedCallback

    return FairSchedCallback


@pytest.fixture(scope="module")
def auth_source(compat: Any) -> str:
    # The installed file, read without importing LiteLLM's whole proxy into the test process.
    spec = importlib.util.find_spec(compat.AUTH_MODULE)
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).read_text(encoding="utf-8")


def proxy_module(**drop: bool) -> types.ModuleType:
    """A stand-in for `litellm.proxy.proxy_server` with the attributes the plugin reads."""
    app = types.SimpleNamespace(middleware_stack=None, router=None, routes=[])
    module = types.ModuleType("litellm.proxy.proxy_server")
    attributes = {"app": app, "master_key": "sk-x", "user_config_file_path": None}
    for name, value in attributes.items():
        if not drop.get(name):
            setattr(module, name, value)
    return module


def logger_without(base: type, hook: str) -> type:
    """LiteLLM's CustomLogger as a release that renamed or dropped `hook` would have it."""
    return type("CustomLogger", (), {k: v for k, v in vars(base).items() if k != hook})


def test_the_installed_litellm_passes(
    compat: Any, base: type, ours: type, auth_source: str
) -> None:
    version = compat.installed_litellm_version()
    compat.check_litellm(base, ours, proxy_module(), auth_source, version)
    compat.check_litellm(base, ours, None, None, version)


def test_a_missing_hook_stops_start_up_naming_the_version(
    compat: Any, base: type, ours: type
) -> None:
    from fair_sched_plugin.errors import UnsupportedLiteLLM

    with pytest.raises(UnsupportedLiteLLM) as caught:
        compat.check_litellm(logger_without(base, "async_pre_call_hook"), ours, None, None, "9.9.9")
    message = str(caught.value)
    assert "cannot attach to LiteLLM 9.9.9" in message
    assert "CustomLogger.async_pre_call_hook does not exist" in message
    assert "run unscheduled" in message


def test_a_hook_with_other_parameters_stops_start_up(compat: Any, base: type, ours: type) -> None:
    from fair_sched_plugin.errors import UnsupportedLiteLLM

    async def async_post_call_success_hook(self: Any, data: Any, user: Any, response: Any) -> Any:
        return response

    changed = type(
        "CustomLogger",
        (),
        {**vars(base), "async_post_call_success_hook": async_post_call_success_hook},
    )
    with pytest.raises(UnsupportedLiteLLM, match=r"async_post_call_success_hook\(data, user, "):
        compat.check_litellm(changed, ours, None, None, VERSION)


@pytest.mark.parametrize("attribute", ["app", "master_key", "user_config_file_path"])
def test_a_missing_proxy_attribute_stops_start_up(
    compat: Any, base: type, ours: type, auth_source: str, attribute: str
) -> None:
    from fair_sched_plugin.errors import UnsupportedLiteLLM

    with pytest.raises(UnsupportedLiteLLM, match=f"proxy_server has no `{attribute}`"):
        compat.check_litellm(base, ours, proxy_module(**{attribute: True}), auth_source, VERSION)


def test_an_app_the_disconnect_watch_cannot_wrap_stops_start_up(
    compat: Any, base: type, ours: type, auth_source: str
) -> None:
    from fair_sched_plugin.errors import UnsupportedLiteLLM

    proxy_server = proxy_module()
    proxy_server.app = types.SimpleNamespace(router=None, routes=[])
    with pytest.raises(UnsupportedLiteLLM, match="the proxy app has no `middleware_stack`"):
        compat.check_litellm(base, ours, proxy_server, auth_source, VERSION)


def test_another_custom_auth_call_stops_start_up(
    compat: Any, base: type, ours: type, auth_source: str
) -> None:
    from fair_sched_plugin.errors import UnsupportedLiteLLM

    changed = auth_source.replace(compat.CUSTOM_AUTH_CALL, "user_custom_auth(request, api_key)")
    with pytest.raises(UnsupportedLiteLLM, match="does not call custom_auth as"):
        compat.check_litellm(base, ours, proxy_module(), changed, VERSION)


def test_unreadable_auth_source_is_logged_not_fatal(
    compat: Any, base: type, ours: type, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="fair_sched"):
        compat.check_litellm(base, ours, proxy_module(), None, VERSION)
    assert "cannot read litellm.proxy.auth.user_api_key_auth" in caplog.text


@pytest.mark.parametrize(
    ("version", "warned"),
    [
        ("1.94.0", False),
        ("1.100.3", False),
        ("1.108.7", False),
        ("1.93.2", True),
        ("1.110.2", True),
    ],
)
def test_a_matching_litellm_outside_the_tested_range_is_only_a_warning(
    compat: Any,
    base: type,
    ours: type,
    caplog: pytest.LogCaptureFixture,
    version: str,
    warned: bool,
) -> None:
    with caplog.at_level(logging.WARNING, logger="fair_sched"):
        compat.check_litellm(base, ours, None, None, version)
    assert ("outside the tested range" in caplog.text) is warned


def test_the_tested_range_is_the_extra_declared_in_pyproject(compat: Any) -> None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    declared = re.search(r'"litellm\[proxy\]>=([\w.]+),<=([\w.]+)"', pyproject.read_text())
    assert declared is not None
    assert declared.groups() == (compat.OLDEST_SUPPORTED, compat.NEWEST_SUPPORTED)


def test_attaching_the_callback_runs_the_check() -> None:
    """The callback module itself refuses to load on a LiteLLM without a hook it overrides."""
    code = (
        "from litellm.integrations.custom_logger import CustomLogger\n"
        "del CustomLogger.async_post_call_streaming_iterator_hook\n"
        "import fair_sched_plugin.litellm\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert result.returncode != 0
    assert "UnsupportedLiteLLM: fair_sched: cannot attach to LiteLLM 1." in result.stderr
    assert "async_post_call_streaming_iterator_hook does not exist" in result.stderr
