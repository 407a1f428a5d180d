"""A LiteLLM callback beside the plugin that raises in its hooks for the requests that ask it to
(`metadata` flag `lifecycle.OBSERVERS_RAISE`): another team's logger failing inside the proxy.

Loaded by the LiteLLM proxy from the directory of its config file (the test copies this file
there), as `lifecycle_observer.raising`; it imports nothing from the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

OBSERVERS_RAISE = "fair_sched_test_observers_raise"


def _asks(metadata: object) -> bool:
    return isinstance(metadata, Mapping) and metadata.get(OBSERVERS_RAISE) is True


def _call_metadata(kwargs: Mapping[str, Any]) -> object:
    params = kwargs.get("litellm_params")
    return params.get("metadata") if isinstance(params, Mapping) else None


class RaisingObserver(CustomLogger):
    async def async_post_call_success_hook(
        self, data: dict[str, Any], user_api_key_dict: Any, response: Any
    ) -> Any:
        if _asks(data.get("metadata")):
            raise RuntimeError("an observer failed after the answer (injected)")
        return response

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        if _asks(_call_metadata(kwargs)):
            raise RuntimeError("a success logger failed (injected)")

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        if _asks(_call_metadata(kwargs)):
            raise RuntimeError("a failure logger failed (injected)")


raising = RaisingObserver()
