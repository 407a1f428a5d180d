"""End to end: small `unequal-replicas` and `shared-prefixes` runs through real LiteLLM
proxies in front of two real emulators, the plugin against LiteLLM's default router.

Each scenario is run once per module (two LiteLLM proxies, ~10 s of CPU each to start), and the
tests read its summaries. The assertions are orderings and ratios whose margins come from the
workload's structure, not from one lucky run (each test says why its margin holds on a loaded
2-core machine); timings themselves vary ±40% there.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fair_sched_plugin.lab.loadtest.processes import kill_leftover_groups, litellm_executable
from fair_sched_plugin.lab.loadtest.replicas import (
    ReplicaResult,
    SharedPrefixSize,
    UnequalSize,
    run_shared,
    run_unequal,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.litellm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(litellm_executable() is None, reason="needs the litellm extra"),
    pytest.mark.timing,
]

UNEQUAL = UnequalSize(power_requests=64, max_tokens=24, light_at_s=(1.0, 2.0))
# More users than both engines run and queue at once (2 x (4 + 2)): a user's next request is
# released only after its first one was prefilled, as the best possible hit rate assumes.
# The e2e size keeps the queue (3) and prefill (0.1 ms a token) these checks were written for.
SHARED = SharedPrefixSize(
    users=16,
    # Six rounds, not three: see test_shared_plugin_keeps_users_service_even.
    requests_per_user=6,
    system_prompt_tokens=600,
    max_num_seqs=4,
    waiting_below=3,
    prefill_ms_per_token=0.1,
)


def _by_name(results: list[ReplicaResult]) -> dict[str, dict[str, Any]]:
    return {result.variant.name: result.summary for result in results}


def _quiet(message: str) -> None:
    print(message, flush=True)


@pytest.fixture(scope="module")
def unequal(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    workdir: Path = tmp_path_factory.mktemp("unequal")
    try:
        return _by_name(asyncio.run(run_unequal(UNEQUAL, workdir, _quiet, with_direct=False)))
    finally:
        kill_leftover_groups()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    workdir: Path = tmp_path_factory.mktemp("shared")
    try:
        return _by_name(asyncio.run(run_shared(SHARED, workdir, _quiet)))
    finally:
        kill_leftover_groups()


def test_unequal_every_run_completes_without_errors(unequal: dict[str, dict[str, Any]]) -> None:
    assert set(unequal) == {"litellm", "plugin"}
    requests = UNEQUAL.power_requests + 2 * len(UNEQUAL.light_at_s)
    for summary in unequal.values():
        assert summary["errors"] == 0
        assert summary["requests"] == requests
        assert summary["generated_tokens"] == requests * UNEQUAL.max_tokens


def test_unequal_each_engines_queue_stays_at_its_threshold(
    unequal: dict[str, dict[str, Any]],
) -> None:
    """The engine's own maximum (after each step's scheduling, exact, not sampled): with a gate
    per deployment neither engine queues past `waiting_below`; LiteLLM's router, blind to load,
    sends the slow engine half the flood, so its queue grows far past it (the control: the same
    measurement can fail). Behind a loaded LiteLLM this held only once the gate counted arrivals
    by the engine's finished counter: our ends, seen late, read as arrivals (peaks of 4-7)."""
    threshold = UNEQUAL.waiting_below
    for engine in unequal["plugin"]["engines"]:
        assert engine["max_waiting_seen"] <= threshold, engine
    slow = unequal["litellm"]["engines"][1]
    assert slow["max_waiting_seen"] > 2 * threshold, slow


def test_unequal_the_slow_engine_gets_less_work_with_the_plugin(
    unequal: dict[str, dict[str, Any]],
) -> None:
    """Work in proportion to what each takes: the slow engine decodes a third as fast, so it
    takes a quarter of the work, plus the ten requests it holds at the end (8 running, 2 queued)
    that a 10 s run cannot amortise: ~30% of 68 (measured 30-34%). LiteLLM's shuffle gives it
    half; 40% separates the two with room for noise on either side."""
    fast, slow = (e["requests_received"] for e in unequal["plugin"]["engines"])
    assert slow < fast
    assert slow <= 0.4 * (fast + slow)


def test_unequal_throughput_at_least_litellms_default(unequal: dict[str, dict[str, Any]]) -> None:
    """LiteLLM's half-and-half split makes the slow engine's half decide the makespan: the
    plugin's split should finish ~2x sooner ((1 + 0.33) / (2 x 0.33)). Asserting only >= 1x
    leaves that factor of two for the proxies' CPU noise."""
    assert unequal["plugin"]["throughput_tps"] >= unequal["litellm"]["throughput_tps"]


def test_unequal_light_users_ttft_below_litellms_default(
    unequal: dict[str, dict[str, Any]],
) -> None:
    """Through LiteLLM, the plugin's light users wait less than behind LiteLLM's own router.
    (Light users against direct FIFO is the demo's claim, checked once, by
    `test_demo.py::test_demo_guard_light_users_throughput_and_the_engines_queue`.)"""
    assert unequal["plugin"]["light_ttft_p50"] < unequal["litellm"]["light_ttft_p50"]


def test_shared_every_run_completes_without_errors(shared: dict[str, dict[str, Any]]) -> None:
    assert set(shared) == {"litellm", "plugin"}
    for summary in shared.values():
        assert summary["errors"] == 0
        assert summary["requests"] == SHARED.users * SHARED.requests_per_user


def test_shared_plugin_hit_rate_near_the_best_and_above_litellms(
    shared: dict[str, dict[str, Any]],
) -> None:
    """Affinity keeps each user on one engine, whose cache holds its half of the prompts: every
    request after a user's first hits. LiteLLM's shuffle sends each user to both engines, each
    cycling through more prompts than it holds, so most of its repeats miss."""
    plugin, litellm = shared["plugin"], shared["litellm"]
    assert plugin["hit_rate"] >= plugin["best_hit_rate"] - 0.1
    assert plugin["hit_rate"] > litellm["hit_rate"] + 0.1


def test_shared_plugin_keeps_users_service_even(shared: dict[str, dict[str, Any]]) -> None:
    """Round-robin release keeps users' service even while all are backlogged, placement and
    look-ahead included (the look-ahead skips at most a few users, who go first next time, and
    passes over a held head at most MAX_PASSED_OVER times: without that cap one run of three
    measured 0.946, users homed on the more crowded engine falling behind; 3 of 3 passed with
    it).

    Six requests a user: the index counts service until the first user is done, and with three
    rounds that moment comes before homes even out. On a faster machine three rounds read
    0.932-0.948 in 6 of 12 runs, this code and the one before it alike (users homed 10 to 6 on
    the two engines, each served in its engine's turn until a user of the emptier one finished),
    and 0.973-0.977 in the others; six rounds read 0.980-0.994 in 6 of 6, with hit rates
    0.768-0.809 against a best of 0.809.

    Throughput is not asserted at this size: a run of a few seconds is decided by the gate's
    first scrapes and a loaded LiteLLM's forwarding delay more than by the cache (measured:
    0.8x-1.05x LiteLLM's, and 0.91x-1.53x in six runs at load average 8-11, where
    the engines ran about 1 of their slots on average: LiteLLM, not the engines, set the pace);
    `fair-sched bench --scenarios shared-prefixes` measures it at full size (docs/results.md)."""
    assert shared["plugin"]["jain_backlogged"] >= 0.95


def test_shared_each_engines_queue_stays_at_its_threshold(
    shared: dict[str, dict[str, Any]],
) -> None:
    """As in the unequal scenario: arrivals counted by the engine's finished counter, not by our
    late ends (peaks of 6 against 3 in 3 of 6 bench runs before)."""
    for engine in shared["plugin"]["engines"]:
        assert engine["max_waiting_seen"] <= SHARED.waiting_below, engine
