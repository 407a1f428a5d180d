"""The LiteLLM callback's routing hooks as pure logic: given the running request's lease,
which of LiteLLM's deployments may it go to. The real proxy is in test_litellm_placement.py;
these cover what it cannot make LiteLLM do on demand (a router that picks a deployment the
filter did not leave it)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
from typing import Any

import pytest

from fair_sched_plugin.core import Lease, Ticket, TierLimits
from fair_sched_plugin.request.watch import ensure_current_request
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.testing import FakeClock, ManualGate

from .litellm_harness import NEEDS_LITELLM

pytestmark = [
    pytest.mark.litellm_range,
    NEEDS_LITELLM,
]

A = "http://10.0.0.1:8000/v1"
B = "http://10.0.0.2:8000/v1"


def deployment(api_base: str) -> dict[str, Any]:
    return {"model_name": "tiny", "litellm_params": {"model": "openai/tiny", "api_base": api_base}}


def leased(bound_to: str | None) -> Lease:
    scheduler = FairScheduler(
        [TierLimits("interactive", waiting_below=3)],
        ManualGate(is_open=True, binds_to=bound_to),
        clock=FakeClock(),
    )
    lease = scheduler.try_acquire(Ticket(model="tiny", user="alice", tier="interactive"))
    assert lease is not None and lease.deployment == bound_to
    return lease


def callback() -> Any:
    from fair_sched_plugin.litellm._callback import FairSchedCallback

    def no_service() -> Any:
        raise AssertionError("the routing hooks need no service")

    return FairSchedCallback(no_service)


async def in_request(lease: Lease | None, hook: Any) -> Any:
    """Run `hook()` as a hook of a request that holds `lease` (its own context)."""

    async def run() -> Any:
        watch = ensure_current_request()
        if lease is not None:
            watch.hold(lease)
        return await hook()

    # A task made in a fresh context: the watch it binds is this request's alone.
    return await contextvars.copy_context().run(asyncio.ensure_future, run())


async def test_the_filter_leaves_only_the_bound_deployment() -> None:
    lease = leased(A)
    candidates = [deployment(B), deployment(A + "/")]
    kept = await in_request(
        lease, lambda: callback().async_filter_deployments("tiny", candidates, None)
    )
    assert kept == [deployment(A + "/")]


async def test_a_bound_deployment_in_cooldown_is_refused_not_replaced() -> None:
    from litellm.exceptions import ServiceUnavailableError

    lease = leased(A)
    with pytest.raises(ServiceUnavailableError, match=re.escape(f"no healthy deployment at {A}")):
        await in_request(
            lease, lambda: callback().async_filter_deployments("tiny", [deployment(B)], None)
        )


async def test_a_fallback_to_another_model_group_is_refused() -> None:
    from litellm.exceptions import ServiceUnavailableError

    lease = leased(A)
    with pytest.raises(ServiceUnavailableError, match="not falling back to model group `spare`"):
        await in_request(
            lease, lambda: callback().async_filter_deployments("spare", [deployment(A)], None)
        )


async def test_the_pre_call_check_refuses_a_deployment_the_router_picked_anyway() -> None:
    from litellm.exceptions import ServiceUnavailableError

    lease = leased(A)
    hooks = callback()
    assert await in_request(lease, lambda: hooks.async_pre_call_check(deployment(A), None)) is None
    with pytest.raises(ServiceUnavailableError, match=re.escape(f"picked {B} instead")):
        await in_request(lease, lambda: hooks.async_pre_call_check(deployment(B), None))


async def test_the_binding_outlives_the_lease() -> None:
    """An attempt after the lease ended (a late retry) must not go elsewhere either."""
    from litellm.exceptions import ServiceUnavailableError

    lease = leased(A)
    lease.abandon()
    with pytest.raises(ServiceUnavailableError):
        await in_request(lease, lambda: callback().async_pre_call_check(deployment(B), None))


@pytest.mark.parametrize("bound_to", [None, "no lease"])
async def test_an_unbound_request_keeps_litellms_choice(bound_to: str | None) -> None:
    lease = None if bound_to == "no lease" else leased(None)
    candidates = [deployment(A), deployment(B)]
    hooks = callback()
    assert (
        await in_request(lease, lambda: hooks.async_filter_deployments("spare", candidates, None))
        == candidates
    )
    assert await in_request(lease, lambda: hooks.async_pre_call_check(deployment(B), None)) is None


async def test_a_leases_refusal_is_a_warning_once_and_its_repeats_are_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """LiteLLM retries a refused attempt and tries each fallback: one lease, one warning."""
    from litellm.exceptions import ServiceUnavailableError

    first, second = leased(A), leased(A)
    hooks = callback()

    async def refused_attempts() -> None:
        watch = ensure_current_request()
        for lease in (first, second):
            watch.hold(lease)
            for model in ("tiny", "spare", "tiny"):
                with pytest.raises(ServiceUnavailableError):
                    await hooks.async_filter_deployments(model, [deployment(B)], None)

    with caplog.at_level(logging.DEBUG, logger="fair_sched"):
        await contextvars.copy_context().run(asyncio.ensure_future, refused_attempts())
    refusals = [r for r in caplog.records if "is not available" in r.getMessage()]
    assert [r.levelno for r in refusals] == [logging.WARNING, logging.DEBUG, logging.DEBUG] * 2
