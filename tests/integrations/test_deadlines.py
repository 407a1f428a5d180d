"""Deadlines through the ASGI middleware and `fair-sched proxy`: a request whose place in the
queue and the measured drain rate say it cannot start within its `x-fair-sched-max-wait-s` is
answered 429 `deadline_unreachable` at once, with `Retry-After`, instead of 504 at its deadline.
Real servers on 127.0.0.1 (the emulator, uvicorn); the benchmark's scenario, smaller, through
the real `fair-sched proxy` process."""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import sys
from typing import Any

import httpx
import pytest

from fair_sched_plugin.proxy import build_proxy_app

from .conftest import (
    chat_body,
    emulator,
    fair_config,
    gate_sees_metrics,
    open_client,
    serve,
    wait_until,
)
from .test_waiting_clients import middleware_app, service_of

BENCHMARK = pathlib.Path(__file__).parents[2] / "benchmarks" / "deadlines.py"


async def _send(client: httpx.AsyncClient, max_tokens: int, limit_s: float | None = None) -> Any:
    headers = {} if limit_s is None else {"x-fair-sched-max-wait-s": f"{limit_s:g}"}
    return await client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=max_tokens), headers=headers
    )


@pytest.mark.parametrize("kind", ["middleware", "proxy"])
async def test_a_request_that_cannot_start_in_time_is_refused_at_once(kind: str) -> None:
    async with emulator(max_num_seqs=1) as emu:
        config = fair_config(emu, waiting_below=0, queue={"max_wait_s": 120})
        app = middleware_app(emu, config) if kind == "middleware" else build_proxy_app(config)
        async with (
            serve(app) as url,
            open_client(url, key="sk-a", timeout=60) as alice,
            open_client(url, key="sk-b", timeout=60) as bob,
        ):
            service = service_of(app)
            await gate_sees_metrics(service)
            # Alice's backlog drains through the one slot (4 ms a token): the rate is measured
            # (the first run of eight releases fills the engine and is not; one more is).
            backlog = [asyncio.ensure_future(_send(alice, 20)) for _ in range(40)]
            await wait_until(
                lambda: service.scheduler.statistics().released_total >= 20, timeout_s=60
            )
            # Bob sends six at once with 0.3 s each: turns alternate with alice's, so his k-th
            # is about the (2k-1)-th released, and his last ones cannot start in 0.3 s.
            answers = await asyncio.gather(*(_send(bob, 4, limit_s=0.3) for _ in range(6)))
            assert service.scheduler.statistics().queued > 0  # alice still queued throughout
            await asyncio.gather(*backlog)
    refused = [a for a in answers if a.status_code == 429]
    assert refused, [a.status_code for a in answers]
    error = refused[-1].json()["error"]
    assert error["code"] == "deadline_unreachable" and error["type"] == "rate_limit_error"
    assert int(refused[-1].headers["retry-after"]) >= 1
    # Refused on arrival, but for at most one: a request admitted with room to spare may be
    # refused later, before its deadline, where the drain slows down (measured over ~14 here).
    on_arrival = [a for a in refused if float(a.headers["x-fair-sched-queued-s"]) == 0.0]
    assert len(on_arrival) >= max(1, len(refused) - 1), [
        a.headers["x-fair-sched-queued-s"] for a in refused
    ]
    assert all(a.status_code in (200, 429) for a in answers)  # none waited its limit out


def _load_benchmark() -> Any:
    spec = importlib.util.spec_from_file_location("deadlines_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.timing
@pytest.mark.slow
async def test_the_deadline_scenario_through_fair_sched_proxy() -> None:
    """`benchmarks/deadlines.py`, smaller: the flood is served whole, a request with a limit is
    never started after it, and the batch user's burst is mostly refused on arrival."""
    bench = _load_benchmark()
    scenario = bench.Scenario(flood=40, batch=24, batch_at_s=2.0, light_users=2, light_requests=3)
    outcomes, counts = await bench.run(scenario)
    numbers = bench.summary(outcomes)
    assert numbers["flood_served"] == numbers["flood"] == 40
    assert numbers["started_late"] == 0
    assert numbers["refused_at_once"] > 0 and numbers["refused_after_limit"] == 0
    assert counts["interactive"]["refused"] == numbers["refused_at_once"]
    batch = [o for o in outcomes if o.group == "batch"]
    assert sum(o.started for o in batch) < len(batch)  # not all 24 can start in 2 s
