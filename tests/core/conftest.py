from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest

from fair_sched_plugin.core import FairScheduler, Ticket, TierLimits
from fair_sched_plugin.testing import FakeClock, ManualGate

TIERS = (TierLimits("interactive", waiting_below=3), TierLimits("batch", waiting_below=1))


async def settle(rounds: int = 5) -> None:
    """Let woken tasks run (yields to the loop; never waits for time to pass)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def drain(scheduler: FairScheduler) -> None:
    """Close the scheduler and collect every other task's outcome (no unretrieved exceptions)."""
    scheduler.close()
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    await asyncio.gather(*others, return_exceptions=True)


def ticket(
    user: str, *, model: str = "m", tier: str = "interactive", weight: float = 1.0, cost: int = 1
) -> Ticket:
    return Ticket(model=model, user=user, tier=tier, weight=weight, cost=cost)


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
