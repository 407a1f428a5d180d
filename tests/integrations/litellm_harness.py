"""The LiteLLM tests' marks; their proxy, configs and clients are the harness's
(`fair_sched_plugin.lab.harness.litellm_proxy`), which the benchmarks share."""

from __future__ import annotations

import importlib.util

import pytest

NEEDS_LITELLM = pytest.mark.skipif(
    importlib.util.find_spec("litellm") is None, reason="needs the litellm extra"
)


def shared_proxy_marks(*marks: pytest.MarkDecorator) -> list[pytest.MarkDecorator]:
    """`pytestmark` of a module whose tests share proxies started by a module fixture: marked
    `litellm`, one event loop for the module (the fixture's), skipped without the extra."""
    return [pytest.mark.litellm, *marks, pytest.mark.asyncio(loop_scope="module"), NEEDS_LITELLM]
