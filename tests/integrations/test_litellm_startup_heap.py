"""`freeze_startup_heap`: LiteLLM's first request freezes the start-up heap once (a full
collection of LiteLLM's ~720,000 start-up objects stopped its event loop for ~0.45 s)."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest

from fair_sched_plugin.runtime.service import SchedulingService
from fair_sched_plugin.runtime.startup_heap import freeze_startup_heap

from .litellm_harness import NEEDS_LITELLM


def test_freezing_moves_every_live_object_out_of_the_collections_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kept = [[n] for n in range(1000)]  # live, tracked objects
    caplog.set_level(logging.INFO, logger="fair_sched")
    assert gc.get_freeze_count() == 0
    freeze_startup_heap()
    assert gc.get_freeze_count() >= len(kept)
    assert not any(kept is obj for obj in gc.get_objects())  # no generation holds it now
    assert "froze the start-up heap" in caplog.text


async def first_hooks(
    monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any], requests: int, *, in_proxy: bool
) -> int:
    """How many of `requests` requests through the LiteLLM callback's pre-call hook froze the
    heap, in a running proxy or (`in_proxy=False`) in a program using LiteLLM's SDK. (The
    suite's conftest thaws the heap after every test, so each starts with nothing frozen.)"""
    from fair_sched_plugin.litellm import _callback
    from fair_sched_plugin.litellm._callback import FairSchedCallback

    proxy = object() if in_proxy else None
    monkeypatch.setattr(_callback, "running_proxy", lambda: proxy)
    service = SchedulingService(settings)
    callback = FairSchedCallback(lambda: service)
    counts = []
    for _ in range(requests):
        # No model: the hook returns before admission, after the one-time freeze.
        await callback.async_pre_call_hook(None, None, {"messages": []}, "completion")
        counts.append(gc.get_freeze_count())
        gc.unfreeze()  # a second freeze would show as a count again
    await service.aclose()
    return sum(1 for count in counts if count)


@NEEDS_LITELLM
async def test_the_first_request_through_litellm_freezes_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert await first_hooks(monkeypatch, {}, 3, in_proxy=True) == 1


@NEEDS_LITELLM
async def test_freeze_startup_heap_false_leaves_the_collector_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert await first_hooks(monkeypatch, {"freeze_startup_heap": False}, 2, in_proxy=True) == 0


@NEEDS_LITELLM
async def test_outside_a_proxy_the_heap_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert await first_hooks(monkeypatch, {}, 2, in_proxy=False) == 0
