from __future__ import annotations

from collections.abc import Iterable

import pytest

from fair_sched_plugin.core import TierLimits
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.testing import FakeClock, ManualGate, drain, make_ticket, settle

# The helpers live in `fair_sched_plugin.testing`; these names stay for tests that import them
# from here.
ticket = make_ticket
__all__ = ["TIERS", "drain", "make_scheduler", "settle", "ticket"]

TIERS = (TierLimits("interactive", waiting_below=3), TierLimits("batch", waiting_below=1))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def gate() -> ManualGate:
    return ManualGate()


def make_scheduler(
    gate: ManualGate, clock: FakeClock, tiers: Iterable[TierLimits] = TIERS, **options: object
) -> FairScheduler:
    return FairScheduler(tiers, gate, clock=clock, **options)  # type: ignore[arg-type]
