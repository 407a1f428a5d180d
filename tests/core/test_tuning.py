"""`waiting_below: auto`: the queue tuner alone, and in the gate against a scripted
engine (fair_sched_plugin/lab/harness/engine_sim.py) with the fake clock: a step change of speed, lagging scrapes,
noisy TPOT, and the oscillation bound stated in core/tuning.py."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from fair_sched_plugin.core import BackendGroup, Deployment, MetricsGate, TierLimits
from fair_sched_plugin.core.tuning import QueueTuner
from fair_sched_plugin.lab.harness.engine_sim import URL, EngineSim, Sample, mean
from fair_sched_plugin.testing import FakeClock

TARGET_S = 1.0
AUTO = TierLimits(
    "interactive", waiting_below=1, auto_waiting_below=(1, 32), ttft_target_s=TARGET_S
)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.95 * (len(ordered) - 1))]


def _run(
    seconds: float, gate_options: dict[str, object] | None = None, **engine: object
) -> tuple[EngineSim, list[Sample]]:
    clock = FakeClock(0.0)
    group = BackendGroup("m", (Deployment(URL, URL),), **(gate_options or {}))  # type: ignore[arg-type]
    gate = MetricsGate([group], stale_after_s=5.0, clock=clock)
    sim = EngineSim(gate, clock, **engine)  # type: ignore[arg-type]

    def allowed() -> float | None:
        return dict(gate.status()[0].allowed_queue).get(AUTO.name)

    return sim, sim.run(seconds, {AUTO: 100_000}, allowed=allowed)


def _ttfb_p95(sim: EngineSim, start: float, end: float) -> float:
    return _p95([s for at, s in sim.ttfb[AUTO.name] if start <= at < end])


def test_a_step_change_of_speed_shrinks_the_queue_and_it_grows_back() -> None:
    """8 slots, 1 s per request; 3x slower from 20 s to 40 s. Outside the transitions the
    measured time to first byte keeps its target, and the engine stays full throughout."""
    sim, samples = _run(60.0, slowdown=lambda at: 3.0 if 20 <= at < 40 else 1.0)
    allowed = {round(s.at, 2): s.allowed for s in samples}
    fast_allowed = allowed[18.0]
    assert fast_allowed is not None and fast_allowed >= 2  # it grew from 1 to use the queue
    slow_allowed = allowed[38.0]
    assert slow_allowed is not None and slow_allowed <= fast_allowed / 2
    recovered = allowed[59.0]
    assert recovered is not None and recovered >= 2
    assert _ttfb_p95(sim, 8.0, 18.0) <= TARGET_S
    assert _ttfb_p95(sim, 50.0, 60.0) <= TARGET_S * 1.05
    parked = [s.running for s in samples if s.at >= 3.0 and s.parked]
    assert mean(parked) >= 0.95 * 8


def test_lagging_scrapes_do_not_break_the_target_or_the_fill() -> None:
    """The engine's /metrics 2 s behind (with `metrics_lag_s`): the tuner feeds on our own first
    bytes, which do not lag, so the target and the fill hold as without lag."""
    sim, samples = _run(40.0, {"metrics_lag_s": 2.0}, lag_s=2.0)
    assert _ttfb_p95(sim, 10.0, 40.0) <= TARGET_S
    assert mean([s.running for s in samples if s.at >= 5.0]) >= 0.95 * 8
    assert max(s.allowed or 0 for s in samples) < 12  # no run-away growth on stale data


def test_noisy_tpot_under_its_target_does_not_collapse_the_queue() -> None:
    """TPOT noisy around 60% of its target with a spike to 2x in one scrape out of ten: the
    interval mean stays under the target, the queue keeps growing while it is used."""
    rng = random.Random(17)
    tuner = QueueTuner(minimum=1, maximum=16, ttft_target_s=None, tpot_target_s=0.15)
    now = 0.0
    for _ in range(300):  # 30 s of scrapes every 100 ms
        now += 0.1
        tpot = 0.30 if rng.random() < 0.1 else rng.uniform(0.05, 0.11)
        tuner.observe_engine(now, None, tpot)
        tuner.note_held_back()
        tuner.tick(now)
    assert tuner.allowed == 16
    assert tuner.statistics().decreases == 0


def test_tpot_over_its_target_shrinks_the_queue_in_proportion() -> None:
    tuner = QueueTuner(minimum=1, maximum=16, ttft_target_s=None, tpot_target_s=0.1, initial=16)
    tuner.observe_engine(0.5, None, 0.3)  # 3x over: halved (never more at once)
    tuner.tick(1.0)
    assert tuner.allowed == 8
    tuner.observe_engine(2.5, None, 0.11)  # 10% over: x0.7
    tuner.tick(3.0)
    assert tuner.allowed == pytest.approx(5.6)


def test_first_bytes_from_before_a_decrease_are_not_acted_on_twice() -> None:
    """Requests released before a decrease report the old, longer queue; only requests released
    after it say whether the decrease was enough."""
    tuner = QueueTuner(minimum=1, maximum=16, ttft_target_s=1.0, initial=10)
    tuner.observe_released(1, 0.0)
    tuner.observe_first_byte(1, 0.0, 2.0)
    tuner.tick(1.0)
    assert tuner.allowed == 5
    tuner.observe_first_byte(2, 0.5, 2.0)  # released before the decrease at 1.0
    tuner.tick(2.0)
    assert tuner.allowed == 5


def test_requests_outstanding_past_the_target_count_before_their_first_byte() -> None:
    tuner = QueueTuner(minimum=1, maximum=16, ttft_target_s=1.0, initial=10)
    tuner.observe_released(1, 0.0)
    tuner.tick(1.0)
    assert tuner.allowed == 10  # 1 s old: not over the target yet
    tuner.tick(2.5)  # 2.5 s without a first byte: the smoothed latency is 1.75x the target
    assert tuner.allowed == pytest.approx(10 / 1.75)


def _allowed_after_30_s(tuner: QueueTuner, ttfb_at: Callable[[float], float]) -> list[float]:
    """300 s in 100 ms steps against an engine whose time to first byte is `ttfb_at(allowed)`
    for a request released under that allowed queue, known only when the first byte comes, with
    requests always held back; the allowed queue at every step after the first 30 s."""
    seen: list[float] = []
    in_flight: list[tuple[int, float, float]] = []
    for step in range(1, 3001):
        now = step * 0.1
        ttfb = ttfb_at(tuner.allowed)
        tuner.observe_released(step, now)
        in_flight.append((step, now, ttfb))
        for item in [item for item in in_flight if item[1] + item[2] <= now]:
            in_flight.remove(item)
            tuner.observe_first_byte(item[0], item[1], item[2])
        tuner.note_held_back()
        tuner.tick(now)
        if now >= 30:
            seen.append(tuner.allowed)
    return seen


def test_the_queue_grows_only_while_the_gate_holds_requests_back() -> None:
    tuner = QueueTuner(minimum=1, maximum=16, ttft_target_s=1.0)
    for second in range(1, 6):
        tuner.observe_first_byte(second, second - 0.5, 0.1)
        tuner.tick(float(second))
    assert tuner.allowed == 1  # well within the target, but the limit never bound
    tuner.observe_first_byte(9, 5.5, 0.1)
    tuner.note_held_back()
    tuner.tick(6.0)
    assert tuner.allowed == 2


def test_oscillation_stays_within_the_stated_bound() -> None:
    """The bound in core/tuning.py: an engine whose time to first byte is 0.1 s per request
    queued ahead (plus 0.1 s), +-10% noise, known only when the first byte comes. L = 9 is the largest
    queue within the 1 s target; after the first 30 s the allowed queue stays within
    [decrease * L - 1, L + 2] = [5.3, 11]."""
    rng = random.Random(17)
    tuner = QueueTuner(minimum=1, maximum=32, ttft_target_s=1.0)
    seen = _allowed_after_30_s(
        tuner, lambda allowed: 0.1 * (int(allowed) + 1) * rng.uniform(0.9, 1.1)
    )
    assert min(seen) >= 0.7 * 9 - 1
    assert max(seen) <= 9 + 2


def test_a_slower_drain_lowers_the_ceiling_before_any_first_byte_is_late() -> None:
    """Little's law: at 10 completions/s a 1 s target (80% headroom) allows 7 queued (the 8th
    would wait 0.8 s); when the engine slows to 2/s the queue shrinks to the minimum at the next
    interval, with no first byte observed at all."""
    tuner = QueueTuner(minimum=1, maximum=32, ttft_target_s=1.0, initial=20, smoothing=1.0)
    for _ in range(10):
        tuner.observe_completion()
    tuner.observe_first_byte(1, 0.5, 0.2)
    tuner.tick(1.0)
    assert tuner.allowed == pytest.approx(7.0)
    for _ in range(2):
        tuner.observe_completion()
    tuner.tick(2.0)
    assert tuner.allowed == 1


def test_where_newcomers_wait_for_a_slot_only_the_drain_rate_does_not_cap_the_queue() -> None:
    """With the engine's queue in user order (`fair_engine_queue`) a newcomer goes first there
    and waits for a slot, not behind the queue: the same slow drain as above leaves the queue
    where the newcomers' first bytes put it."""
    tuner = QueueTuner(
        minimum=1, maximum=32, ttft_target_s=1.0, initial=20, smoothing=1.0, newcomers_only=True
    )
    for second in (1.0, 2.0):
        for _ in range(2):
            tuner.observe_completion()
        tuner.observe_first_byte(int(second), second - 0.5, 0.2)
        tuner.tick(second)
    assert tuner.allowed == 20


def test_where_only_newcomers_are_measured_an_interval_without_one_keeps_the_last_latency() -> None:
    """A flood of one user's requests brings few newcomers: on the real vLLM `auto` with the
    engine's queue in user order stayed at the queue it had when the engine's first queue
    showed. Between newcomers the last one's latency decides: a fast one lets the
    queue grow while requests are held back, a slow one shrinks it, and after the decrease,
    with no newcomer since, it grows again once a slow one could have shown. Measuring every
    request, an interval without a first byte is still no reason to move."""

    def tuner(newcomers_only: bool) -> QueueTuner:
        return QueueTuner(
            minimum=1, maximum=32, ttft_target_s=2.0, initial=4, newcomers_only=newcomers_only
        )

    sparse, everyone = tuner(True), tuner(False)
    for each in (sparse, everyone):
        each.observe_released(1, 0.2)
        each.observe_first_byte(1, 0.2, 0.3)  # one fast newcomer, then none
    for second in range(1, 6):
        for each in (sparse, everyone):
            each.observe_engine(second - 0.5, None, None, waiting=4)
            each.note_held_back()
            each.tick(float(second))
    assert everyone.allowed == 5  # grown on the interval that measured, then held
    assert sparse.allowed == 9  # one more per interval, as if fast newcomers kept coming

    sparse.observe_released(2, 5.2)
    sparse.observe_first_byte(2, 5.2, 4.0)  # a slow one: over the target
    sparse.observe_engine(5.5, None, None, waiting=9)
    sparse.note_held_back()
    sparse.tick(6.0)
    assert sparse.allowed == pytest.approx(6.3)  # x0.7: smoothed, 2.15 s against 2 s
    grown = []
    for second in range(7, 12):
        sparse.observe_engine(second - 0.5, None, None, waiting=4)
        sparse.note_held_back()
        sparse.tick(float(second))
        grown.append(sparse.allowed)
    # Settled 3 s (interval + target) after the decrease: from then one more per interval.
    assert grown == pytest.approx([6.3, 6.3, 7.3, 8.3, 9.3])


def test_the_engines_finished_counter_is_the_drain_rate_where_it_has_one() -> None:
    """Behind a starved LiteLLM our ends came back in bursts seconds late while the engine
    finished 7 requests a second by its own counter; a drain ceiling from the ends cut a flood's
    queue from 29 to 2.8. With the counter, the ceiling follows the engine: 3.2 s of
    a 4 s target at 7/s holds 21 queued, at 2/s 5.4. Without it, the ends decide as before."""

    def tuner() -> QueueTuner:
        return QueueTuner(minimum=1, maximum=32, ttft_target_s=4.0, initial=20, smoothing=1.0)

    counted, by_ends = tuner(), tuner()
    for second in range(1, 7):
        for each in (counted, by_ends):
            each.observe_completion()  # one end a second reaches us
            # A scrape every other second (they took 2-3 s), with the engine's own count.
            if second % 2:
                count = (14.0, 2.0) if each is counted else None
                each.observe_engine(second - 0.1, None, None, waiting=6, finished=count)
            each.tick(float(second))
        assert counted.allowed == 20
    assert by_ends.allowed <= 2.2
    counted.observe_engine(6.9, None, None, waiting=6, finished=(4.0, 2.0))  # slowed to 2/s
    counted.tick(7.0)
    assert counted.allowed == pytest.approx(3.2 * 2 - 1)


def test_an_engine_that_stops_counting_is_measured_by_our_ends_again() -> None:
    """The counter's rate holds only while scrapes bring it: an engine replaced behind the same
    URL by one without `request_success_total` (SGLang, TGI) is measured by the ends we see
    from the next interval on, not by the last count for ever. An interval without any scrape
    still keeps the last rate."""
    tuner = QueueTuner(minimum=1, maximum=32, ttft_target_s=4.0, initial=20, smoothing=1.0)
    for second in (1, 2):
        tuner.observe_engine(second - 0.1, None, None, waiting=6, finished=(7.0, 1.0))
        tuner.tick(float(second))
    assert tuner.allowed == 20  # 7/s: 3.2 s of the target holds 21 queued
    tuner.tick(3.0)  # no scrape in this interval: the last rate stands
    assert tuner.allowed == 20
    tuner.observe_engine(3.9, None, None, waiting=6, finished=None)  # the counter is gone
    tuner.observe_completion()  # one end a second reaches us
    tuner.tick(4.0)
    assert tuner.allowed == pytest.approx(3.2 * 1 - 1)


# ---------------------------------------------------------------- the path, not the engine
# The real-vLLM result behind a CPU-starved LiteLLM: requests spend about a second on the
# way to the engine and their first bytes and ends come back a second late, so our own time to
# first byte misses a 2 s target with the engine's queue empty and half its slots free.

STARVED_PROXY = {"transit_s": 1.0, "proxy_delay_s": 1.0, "service_s": 1.0}


def test_a_miss_without_an_engine_queue_does_not_shrink_the_queue() -> None:
    """Every scrape of the interval shows the engine without a queue: a first byte over the
    target was slow on the way, which no engine queue shortens. The queue is not shrunk, and it
    grows while the gate holds requests back (doubles: nothing shrank it yet, slow start). That latency becomes the path's: later, with a
    queue in the engine, only latency beyond it (with `headroom` to spare) shrinks the queue."""
    tuner = QueueTuner(minimum=1, maximum=16, ttft_target_s=1.0, initial=4)
    tuner.observe_first_byte(1, 0.0, 1.8)
    tuner.observe_engine(0.5, 0.05, None, waiting=0)
    tuner.observe_engine(0.9, 0.05, None, waiting=0)
    tuner.note_held_back()
    tuner.tick(1.0)
    assert tuner.allowed == 8  # slow start: doubled
    assert tuner.statistics().decreases == 0
    tuner.observe_first_byte(2, 1.0, 1.9)  # as slow as the path alone: no queueing delay
    tuner.observe_engine(1.9, 0.05, None, waiting=2)
    tuner.tick(2.0)
    assert tuner.allowed == 8
    tuner.observe_first_byte(3, 2.0, 3.5)  # the engine's queue adds to it: now it counts
    tuner.observe_engine(2.9, 0.05, None, waiting=4)
    tuner.tick(3.0)
    assert tuner.allowed < 8


def test_the_engines_own_ttft_over_target_still_shrinks_a_queue_it_does_not_show() -> None:
    """No queue in any scrape, but the engine itself reports a TTFT 2x over the target (a long
    prefill): that is the engine's, and it still halves the queue."""
    tuner = QueueTuner(minimum=1, maximum=16, ttft_target_s=1.0, initial=8)
    tuner.observe_engine(0.5, 2.0, None, waiting=0)
    tuner.tick(1.0)
    assert tuner.allowed == 4


def test_without_an_engine_queue_the_drain_ceiling_does_not_cap_growth() -> None:
    """Little's law bounds the engine's queue by its drain rate; with no queue the completion
    rate is only what we sent (1 per second here: a ceiling of 0.6 at a 2 s target), and
    capping growth by it kept an engine with free slots at the minimum."""
    tuner = QueueTuner(minimum=1, maximum=16, ttft_target_s=2.0)
    now = 0.0
    for _ in range(5):
        now += 1.0
        tuner.observe_completion()
        tuner.observe_engine(now - 0.5, 0.05, None, waiting=0)
        tuner.note_held_back()
        tuner.tick(now)
    assert tuner.allowed >= 3


def test_a_starved_proxy_in_front_of_the_engine_does_not_leave_its_slots_idle() -> None:
    """8 slots, 1 s per request, 1 s on the way to the engine and 1 s late first bytes and
    ends: the allowed queue is spent on requests in transit, never in the engine's queue. Before
    this rule the tuner sat at its minimum (the misses were the path's, the drain ceiling came
    from the trickle it let through) and the engine ran 2.4 of 8 slots (a fixed 3: 3.0).
    The engine counts its finished requests, as a real vLLM does; the next test
    is the same without that counter."""
    _, samples = _run(40.0, **STARVED_PROXY, finished_counter=True)
    parked = [s for s in samples if s.at >= 5.0 and s.parked]
    assert mean([s.running for s in parked]) >= 0.9 * 8
    # The queue it lets form once the engine is full stays bounded.
    assert max(s.waiting for s in parked) <= 8


def test_a_starved_proxy_without_the_finished_counter_does_not_leave_its_slots_idle() -> None:
    """The same as above for an engine without vLLM's success counter (SGLang, TGI). The arrival
    grace without it is the quickest round trip less the way back that scrapes measured
    (DeploymentLedger.grace_s): with the whole round trip it ran 6.2 of 8 slots, with a queue of
    11 (7.8 and 5 before the grace stretched; 7.8 and 5 again now)."""
    _, samples = _run(40.0, **STARVED_PROXY)
    parked = [s for s in samples if s.at >= 5.0 and s.parked]
    assert mean([s.running for s in parked]) >= 0.9 * 8
    assert max(s.waiting for s in parked) <= 8


# ---------------------------------------------------------------- slow start
# The sessions layout, as the trace of a real run showed it: the starved LiteLLM's
# scrapes of vLLM took about a second and showed the engine half a second late, first bytes and
# ends came back a second late, requests reached the engine in 0.1-0.2 s, and a request took
# 0.4 s of engine time. One more a second grew the queue from 1 to 11 over a 20 s flood.

SLOW_SCRAPES = {
    "transit_s": 0.15,
    "proxy_delay_s": 1.0,
    "poll_s": 1.0,
    "lag_s": 0.5,
    "service_s": 0.4,
    "finished_counter": True,
}


def test_slow_start_fills_the_engine_within_a_short_flood() -> None:
    """The vLLM stage's 2 s target. Doubling once per round trip while no scrape shows an
    engine queue, the queue reaches 16 within 8 s (one more per interval: 9), and the engine
    runs 6 or more of its 8 slots on average from 10 s to 20 s (one more per interval: 4.8)."""
    tier = AUTO._replace(ttft_target_s=2.0)
    clock = FakeClock(0.0)
    gate = MetricsGate([BackendGroup("m", (Deployment(URL, URL),))], stale_after_s=5.0, clock=clock)
    sim = EngineSim(gate, clock, **SLOW_SCRAPES)  # type: ignore[arg-type]

    def allowed() -> float | None:
        return dict(gate.status()[0].allowed_queue).get(tier.name)

    samples = sim.run(20.0, {tier: 100_000}, allowed=allowed)
    by_time = {round(s.at, 2): s.allowed for s in samples}
    assert (by_time[8.0] or 0) >= 16
    later = [s.running for s in samples if 10.0 <= s.at < 20.0]
    assert mean(later) >= 6.0


def test_slow_start_overshoots_at_most_once_and_ends_at_the_first_decrease() -> None:
    """Slow start doubles only until the first decrease: after it, however long the targets hold
    and the engine shows no queue, the queue grows by one per interval."""
    tuner = QueueTuner(minimum=1, maximum=64, ttft_target_s=1.0)
    now = 0.0
    for _ in range(4):  # no engine queue, targets held, requests held back: 1 -> 2 -> 4 -> 8
        now += 1.0
        tuner.observe_first_byte(int(now), now - 0.5, 0.2)
        tuner.observe_engine(now - 0.5, 0.05, None, waiting=0)
        tuner.note_held_back()
        tuner.tick(now)
    assert tuner.allowed == 16
    now += 1.0
    tuner.observe_first_byte(99, now - 0.5, 3.0)  # the engine's queue: a miss, 3x the target
    tuner.observe_engine(now - 0.5, 0.05, None, waiting=12)
    tuner.tick(now)
    shrunk = tuner.allowed
    assert shrunk < 16
    for _ in range(10):  # everything fine again, no engine queue: one more per interval
        now += 1.0
        tuner.observe_first_byte(int(now) + 100, now - 0.5, 0.2)
        tuner.observe_engine(now - 0.5, 0.05, None, waiting=0)
        tuner.note_held_back()
        before = tuner.allowed
        tuner.tick(now)
        assert tuner.allowed - before <= 1


# ---------------------------------------------------------------- down to no engine queue
# `{auto: {min: 0}}`: where even a queue of one misses the target (an engine's slow phase: a
# newcomer behind one queued request waits for two completions), the gate keeps no engine queue.


def test_a_minimum_of_zero_is_reached_on_a_miss_and_left_again() -> None:
    """From 1 a miss goes to 0, not to 0.5..0.7 (the gate treats any queue below 1 as none, and
    growth by one from 0.7 would allow a queue of two); once the targets hold it is 1 again."""
    tuner = QueueTuner(minimum=0, maximum=8, ttft_target_s=1.0, initial=1)
    tuner.observe_released(1, 0.0)
    tuner.observe_first_byte(1, 0.0, 2.0)
    tuner.tick(1.0)
    assert tuner.allowed == 0
    for second in (2, 3):  # settled 2 s after the decrease (an interval and the target)
        tuner.observe_first_byte(second, second - 0.5, 0.2)
        tuner.note_held_back()
        tuner.tick(float(second))
    assert tuner.allowed == 1
    assert tuner.statistics().decreases == 1 and tuner.statistics().increases == 1


def test_a_drain_ceiling_below_one_is_no_queue() -> None:
    """At 1 completion/s a 1 s target (80% headroom) drains no queued request in time: the
    ceiling (0.8 - 1) is no queue at all, with a minimum of 0."""
    tuner = QueueTuner(minimum=0, maximum=8, ttft_target_s=1.0, initial=4, smoothing=1.0)
    tuner.observe_completion()
    tuner.tick(1.0)
    assert tuner.allowed == 0


def test_where_no_queue_meets_the_target_it_stays_between_zero_and_one() -> None:
    """The oscillation bound of core/tuning.py with L = 0: the time to first byte is 0.3 s with
    no engine queue and 1.5 s with any (the target is 1 s). The allowed queue stays within
    [0, L + 2]: it tries a queue again once the last miss has had time to show (growing for an
    interval or two on the first bytes of requests released at 0), and is back at 0 within a
    round trip. 0 is where it spends the most time (45% here: growth waits only for the last
    decrease to show, not for the queue it grew to)."""
    rng = random.Random(17)
    tuner = QueueTuner(minimum=0, maximum=32, ttft_target_s=1.0)
    seen = _allowed_after_30_s(
        tuner, lambda allowed: (0.3 if allowed < 1 else 1.5) * rng.uniform(0.9, 1.1)
    )
    assert min(seen) == 0 and max(seen) <= 0 + 2
    assert seen.count(0.0) >= 0.4 * len(seen)
    assert seen.count(0.0) == max(seen.count(value) for value in set(seen))


@pytest.mark.parametrize(("completions_per_s", "grows"), [(2, False), (5, True)])
def test_at_zero_the_wait_for_a_slot_counts_at_its_95th_percentile(
    completions_per_s: int, grows: bool
) -> None:
    """With no engine queue a newcomer's TTFT is its wait for the next completion (first bytes
    are only the way and one step, 0.2 s here). At 2 completions/s that wait's 95th percentile,
    ln 20 / 2 = 1.5 s, leaves no room under 80% of a 2 s target: it stays at 0 (counted as one
    mean interval, 0.5 s, it grew to 1 and then to 3 in an engine's slow phase). At 5/s it grows."""
    tuner = QueueTuner(minimum=0, maximum=8, ttft_target_s=2.0, initial=0, smoothing=1.0)
    for second in range(1, 6):
        for _ in range(completions_per_s):
            tuner.observe_completion()
        tuner.observe_first_byte(second, second - 0.5, 0.2)
        tuner.note_held_back()
        tuner.tick(float(second))
    assert (tuner.allowed > 0) is grows
    assert tuner.statistics().decreases == 0


def test_at_zero_an_engine_without_a_queue_is_not_the_paths_latency() -> None:
    """At 0 the gate keeps the engine's queue empty, so scrapes without a queue say nothing about
    the way to the engine: the latency is the wait for a slot in our queue. Taken for the path's
    (as at a queue of 1 or more), it grew the queue on every interval held back and inflated
    the path's latency, which relaxes the target for the queue it grew to."""
    tuner = QueueTuner(minimum=0, maximum=8, ttft_target_s=2.0, initial=0, smoothing=1.0)
    for second in range(1, 6):
        for _ in range(2):  # 2 completions/s: the wait for a slot is 1.5 s at its 95th percentile
            tuner.observe_completion()
        tuner.observe_first_byte(second, second - 0.5, 0.2)
        tuner.observe_engine(second - 0.5, 0.1, None, waiting=0)
        tuner.note_held_back()
        tuner.tick(float(second))
    assert tuner.allowed == 0


def test_one_scrape_catching_a_request_before_its_slot_is_not_an_engine_queue() -> None:
    """Real-vLLM traces: 2-4 s into a flood one scrape of an interval showed a request waiting
    (between its arrival and its slot) while the rest showed none; read as the engine's queue,
    the path's slow first bytes then shrank the queue and ended slow start at 1.2-1.4. An
    interval whose scrapes average under half a request is the path's; one that averages more
    is the queue's."""
    path_like = QueueTuner(minimum=1, maximum=16, ttft_target_s=1.0, initial=4)
    path_like.observe_first_byte(1, 0.0, 1.8)
    for at in range(10):
        path_like.observe_engine(at / 10, 0.05, None, waiting=1 if at == 5 else 0)
    path_like.note_held_back()
    path_like.tick(1.0)
    assert path_like.allowed == 8  # grew (slow start), nothing shrunk
    queued = QueueTuner(minimum=1, maximum=16, ttft_target_s=1.0, initial=4)
    queued.observe_first_byte(1, 0.0, 1.8)
    for at in range(10):
        queued.observe_engine(at / 10, 0.05, None, waiting=1 if at % 2 else 0)
    queued.note_held_back()
    queued.tick(1.0)
    assert queued.allowed < 4
