"""The speed-change scenario's summary, from scripted records and samples."""

from __future__ import annotations

import pytest

from fair_sched_plugin.config import load_settings
from fair_sched_plugin.lab.loadtest.client import RequestRecord
from fair_sched_plugin.lab.loadtest.flood import Variant, fair_sched_section
from fair_sched_plugin.lab.loadtest.speed_change import (
    Sample,
    SpeedChangeResult,
    SpeedChangeSize,
    speed_change_variants,
    summarize_speed_change,
)

SIZE = SpeedChangeSize(before_s=10, slow_s=10, after_s=10, transition_s=2)


def light(started: float, ttft: float) -> RequestRecord:
    return RequestRecord("light-1", "light", started, first_token=started + ttft, ended=started + 5)


def test_ttft_outside_transitions_per_phase_and_running_while_parked() -> None:
    records = [
        light(5.0, 0.5),  # fast
        light(10.5, 9.0),  # in the first transition: left out of the steady p95
        light(15.0, 1.5),  # slow
        light(20.5, 7.0),  # in the second transition
        light(25.0, 0.7),  # fast again
        RequestRecord("power", "power", 1.0, first_token=30.0, ended=31.0),  # not a light user
    ]
    samples = [
        Sample(at=1.0, running=8, waiting=3, parked=10, generated_tokens=0, allowed=3.0),
        Sample(at=16.0, running=6, waiting=0, parked=2, generated_tokens=500, allowed=1.0),
        Sample(at=29.0, running=2, waiting=0, parked=0, generated_tokens=900, allowed=4.0),
    ]
    result = SpeedChangeResult(Variant("auto", "auto", "fair_proxy"), records, samples)
    summary = summarize_speed_change(result, SIZE, max_num_seqs=8)
    assert summary["light_ttft_p95_steady_s"] == 1.5
    assert summary["light_ttft_p95_fast_s"] == pytest.approx(0.7)
    assert summary["light_ttft_p95_slow_s"] == 1.5
    assert summary["mean_running_while_parked"] == 7.0  # the sample without parked requests out
    assert summary["mean_allowed_fast"] == 3.5
    assert summary["mean_allowed_slow"] == 1.0


def test_the_variants_are_fixed_0_1_3_8_and_auto_with_the_target() -> None:
    variants = speed_change_variants(SIZE)
    assert [v.waiting_below for v in variants] == [0, 1, 3, 8, "auto", "auto"]
    assert [v.auto_min for v in variants[-2:]] == [None, 0]
    assert all(v.ttft_target_ms == SIZE.ttft_target_ms for v in variants[-2:])


def test_each_variants_settings_are_valid_and_auto_min_0_reaches_the_tier() -> None:
    tiers = {
        v.name: load_settings(fair_sched_section(v, "http://127.0.0.1:9")).tiers[0]
        for v in speed_change_variants(SIZE)
    }
    assert tiers["fixed_0"].initial_waiting_below() == 0
    assert tiers["auto"].auto_bounds() == (1, 32)
    assert tiers["auto_min_0"].auto_bounds() == (0, 32)
    settings = load_settings(fair_sched_section(speed_change_variants(SIZE)[0], "http://x:9"))
    assert settings.backends["tiny"].max_num_seqs == 8  # a queue of 0 needs the slots told
