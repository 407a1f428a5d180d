"""The bench's shared helpers: a results table whose headings travel with their cells, and
starting several targets side by side (no processes: plain context managers)."""

from __future__ import annotations

import asyncio
import contextlib
from argparse import Namespace
from collections.abc import AsyncIterator

import pytest

from fair_sched_plugin.lab.loadtest.flood import standard_variants
from fair_sched_plugin.lab.loadtest.processes import enter_side_by_side
from fair_sched_plugin.lab.loadtest.report import results_table
from fair_sched_plugin.lab.loadtest.runner import _keep_runnable


def test_results_table_puts_each_heading_over_its_cells() -> None:
    table = results_table(
        [("a", 1), ("b", 2)],
        lambda r: r[0],
        [("double", lambda r: str(2 * r[1])), ("square", lambda r: str(r[1] ** 2))],
    )
    assert table.splitlines() == [
        "|  | double | square |",
        "|---|---|---|",
        "| a | 2 | 1 |",
        "| b | 4 | 4 |",
    ]


async def test_side_by_side_starts_all_then_stops_all() -> None:
    events: list[str] = []
    lines: list[str] = []

    @contextlib.asynccontextmanager
    async def target(name: str) -> AsyncIterator[str]:
        events.append(f"start {name}")
        await asyncio.sleep(0)
        try:
            yield name
        finally:
            events.append(f"stop {name}")

    async with contextlib.AsyncExitStack() as stack:
        started = await enter_side_by_side(
            stack, [target("a"), target("b")], lines.append, "starting 2 ..."
        )
        assert started == ["a", "b"]
    assert events == ["start a", "start b", "stop b", "stop a"]
    assert lines[0] == "starting 2 ..." and lines[1].startswith("all started in ")


async def test_a_failed_start_waits_for_the_others_and_leaves_nothing_running() -> None:
    stopped: list[str] = []

    @contextlib.asynccontextmanager
    async def slow() -> AsyncIterator[str]:
        for _ in range(3):
            await asyncio.sleep(0)
        try:
            yield "slow"
        finally:
            stopped.append("slow")

    @contextlib.asynccontextmanager
    async def broken() -> AsyncIterator[str]:
        raise RuntimeError("no engine")
        yield "never"  # pragma: no cover

    with pytest.raises(RuntimeError, match="no engine"):
        async with contextlib.AsyncExitStack() as stack:
            await enter_side_by_side(stack, [broken(), slow()], lambda _: None, "starting ...")
    assert stopped == ["slow"]


def test_a_real_engine_runs_no_variant_that_assumes_the_emulators_slots() -> None:
    variants = standard_variants(with_thresholds=True)
    emulator = {v.name for v in _keep_runnable(variants, Namespace(engine=None))}
    real = {
        v.name for v in _keep_runnable(variants, Namespace(engine="http://e", engine_priority=True))
    }
    assert "reserve_slots_1" in emulator
    assert real == emulator - {"reserve_slots_1"}
