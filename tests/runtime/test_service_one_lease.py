"""One request lifecycle: with memory:// the service hands out the core's own lease,
a parked request waits on one future, and an admission runs little code."""

from __future__ import annotations

import asyncio

import pytest

from fair_sched_plugin.lab.harness.admission_calls import measure
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.driver import DisconnectSignal
from fair_sched_plugin.runtime.service import ClientDisconnected, SchedulingService
from fair_sched_plugin.state import LocalScheduler
from fair_sched_plugin.testing import settle

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}


def service() -> SchedulingService:
    return SchedulingService({"unknown_model_max_inflight": 1})


async def test_memory_hands_out_the_cores_lease_carrying_its_usage() -> None:
    svc = service()
    principal = svc.identify(Credentials(api_key="sk-a"))
    scheduler = svc.scheduler
    assert isinstance(scheduler, LocalScheduler)
    admission = await svc.admit(principal, "m", BODY)
    lease = admission.lease
    assert lease._owner is scheduler.core  # no replica lease over it
    assert scheduler.core.statistics().in_flight == 1
    assert lease.release(tokens_used=7, cost_used=0.5)
    assert (lease.tokens_used, lease.cost_used) == (7, 0.5)
    stats = scheduler.core.statistics()
    assert (stats.in_flight, stats.completed_total) == (0, 1)
    assert not scheduler._held and not scheduler._parked  # the replica kept nothing
    await svc.aclose()


async def test_a_parked_request_waits_without_a_task_and_leaves_when_its_client_does() -> None:
    svc = service()
    principal = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(principal, "m", BODY)
    before = asyncio.all_tasks()
    gone = DisconnectSignal()
    parked = asyncio.create_task(svc.admit(principal, "m", BODY, disconnected=gone))
    await settle()
    assert asyncio.all_tasks() - before == {parked}  # no watch task, no wait task
    assert svc.scheduler.statistics().queued == 1
    gone.set()
    assert svc.scheduler.statistics().queued == 0  # out of the queue before any task runs
    with pytest.raises(ClientDisconnected):
        await parked
    holder.lease.release()
    stats = svc.scheduler.statistics()
    assert (stats.in_flight, stats.released_total, stats.cancelled_total) == (0, 1, 1)
    await svc.aclose()


def test_disconnect_signal_calls_back_once_and_at_once_when_already_set() -> None:
    calls: list[str] = []
    signal = DisconnectSignal()
    signal.add_callback(lambda: calls.append("first"))
    removed = lambda: calls.append("removed")  # noqa: E731
    signal.add_callback(removed)
    signal.remove_callback(removed)
    signal.set()
    signal.set()
    assert calls == ["first"] and signal.is_set() and signal.fired
    signal.add_callback(lambda: calls.append("late"))
    assert calls == ["first", "late"]
    signal.clear()
    assert not signal.fired and not signal.is_set()


def test_an_admission_runs_within_its_call_bounds() -> None:
    """The admission paths' Python calls and module switches (what the admission benchmark
    prints) stay within bounds: about half of what an admission ran when every layer kept its
    own waiter and lease (no wait 107 calls / 52 switches, park then grant 312 / 161). A rule
    that adds a frame costs a few switches; a second waiter, a task or a timer per request
    costs dozens, and that is what the bounds catch."""
    results = asyncio.run(measure(with_litellm=False))
    no_wait, parked = results["no wait"], results["park, then grant"]
    assert no_wait.calls <= 53 and no_wait.switches <= 26
    assert parked.calls <= 156 and parked.switches <= 90


def test_a_disconnect_callback_that_raises_does_not_skip_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("boom")

    signal = DisconnectSignal()
    signal.add_callback(broken)
    signal.add_callback(lambda: calls.append("second"))
    signal.set()  # does not raise into the receive loop that set it
    assert calls == ["second"]
    signal.add_callback(broken)  # already set: called at once, and contained too
    assert [record.levelname for record in caplog.records] == ["ERROR", "ERROR"]
    assert "disconnect callback raised" in caplog.records[0].getMessage()
