"""`waiting_below: auto`: a controller that finds the largest engine queue meeting the targets.

One `QueueTuner` per (deployment, tier) with `auto`, owned by the gate (each deployment has its
own queue and its own targets to meet). It is AIMD, as TCP and the concurrency-limits libraries
use it, on the queue the gate lets form in the engine:

- every `interval_s` it compares the interval's latency with the tier's targets: our own
  release-to-first-byte time of this tier's requests (its 95th percentile, so that the target
  holds for the slow requests too, counting requests still without a first byte at their age;
  plus one completion interval, a newcomer's wait in our own queue for the next release; at
  an allowed queue of 0 that wait is the whole TTFT and counts at its 95th percentile, ln 20
  intervals)
  and the engine's own recent TTFT where it exports it, against `ttft_target_s`; the engine's
  recent TPOT against `tpot_target_s`;
- over a target: the allowed queue shrinks at once, in proportion to the overshoot (x0.7 for a
  small one, at most halved: a gradient step in the style of Vegas / concurrency-limits);
- under `headroom` (80%) of every target, and the gate held requests back because of the queue
  during the interval (the limit binds: more queue could be used): it grows by one; until the
  first decrease (slow start, as in TCP) it doubles instead, once per round trip (the path's
  latency, below), in intervals whose scrapes showed no engine queue (below);
- in between it stays (a dead band: no hunting while the targets hold). Always within
  [minimum, maximum]. A minimum of 0 lets it keep no engine queue at all, where even a queue of
  one misses the target (a newcomer behind one queued request waits for two completions): a
  decrease that ends below 1 ends at 0, since the gate treats any allowed queue below 1 as none
  (it then releases only into a running slot left free), and growth from 0 is to 1;
- and never above what the engine drains within `headroom` of the TTFT target at its recent
  completion rate (Little's law: queue = rate x wait), plus the requests on their way to it
  (rate x the path's latency, below). Completions slow down the moment the engine does, long
  before the first bytes of the requests queued behind them come back, so a slower engine
  shrinks the queue within an interval or two instead of a round trip each step. The rate is
  the engine's own count of finished requests between scrapes where it exports one (vLLM's
  `request_success_total`), else the ends the gate sees: behind a starved proxy those come
  back late and in bursts, and a rate from them cut the queue to a fraction of what the engine
  drained.

The engine's queue, not the way to it. The gate counts requests on their way to the
engine against the allowed queue, and behind a CPU-starved proxy (LiteLLM in a CPU scheduling
group of its own) they take a second or more to arrive and their first bytes come back as late:
our latency missed a 2 s target with the engine's queue empty and most of its slots free, the
tuner shrank to its minimum, and the engine ran 2.4 of 8 slots. So the scrapes' waiting counts
say whose latency it is:

- an interval whose scrapes showed the engine without a queue (under half a request on
  average: one scrape catching a request between its arrival and its slot is not one) is the
  path's: only the engine's own TTFT and TPOT can shrink the queue then, no drain ceiling
  applies (the completion rate is what we let through, not what the engine can drain), and the
  queue grows while the gate holds requests back; its latency feeds the path's latency (an
  EWMA, like Vegas's base RTT: never from an interval with an engine queue, so queueing delay
  cannot inflate it; any faster interval lowers it);
- where the path alone misses the TTFT target, the target the queue is held to is the path's
  latency with `headroom` to spare (path / headroom): no queue meets the target then, and only
  queueing delay beyond the path shrinks the queue.
Without scrapes (the tuner alone, or no `waiting` exported) everything is as before.

Newcomers only (`fair_engine_queue`): the engine serves a user's first request before anyone's
next, so the gate measures only requests whose user had none waiting there (they wait for a
slot, not behind the queue). No drain ceiling then, and since a flood of one user's requests
brings few of them, an interval without one is not "nothing measured": the last newcomer's
smoothed latency decides (none since a decrease: growth once settled), as if one had come.

Signals arrive late: a request released before a decrease still reports the old queue's latency.
After a decrease only requests released after it count (one decrease per round trip), and the
queue grows again only once a request released after it could have shown a miss; otherwise the
controller would shrink to the minimum on latency it has already acted on, or grow on the first
bytes that came back soonest. The latency is smoothed across intervals (`smoothing`, an EWMA
weight of the newest interval) and the engine's means are averaged over the interval, so one
noisy interval or scrape does not halve the queue.

Oscillation bound (tests/core/test_tuning.py holds it): against an engine whose time to first
byte grows with its queue, with L the largest queue meeting the target, the allowed queue ends
in the dead band or, after a noisy miss, in the sawtooth below it: within
[decrease * L - 1, L + 2], after an initial ramp of about L intervals. Where no queue meets
the target (L = 0, minimum 0) that is [0, 2]: it tries a queue again once the last miss has had
time to show, and is back at 0 within a round trip.

How fast it reacts: a step to a 3x slower engine lowers the drain ceiling to about a third
within two intervals (the completion rate is smoothed); latency over target shrinks the queue by
up to half per round trip; recovery is one request more per interval once the targets hold. From
the start, slow start reaches a queue of 16 in four round trips where one more per interval took
sixteen intervals.

Overshoot of slow start (tests/core/test_tuning.py holds it): a doubling's requests show in the
engine's queue within one round trip, before the next doubling, and the first decrease ends it;
so the engine's queue exceeds the largest queue that met the targets by at most that queue once
(the last doubling), and only while slow start lasts.
Pure: the gate feeds it; time comes from the caller.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["QueueTuner", "TunerStatus"]

# Enough first bytes per interval for a percentile (bounded memory under any load).
_MAX_SAMPLES = 4096
# An interval whose scrapes showed the engine's queue this short on average had none to speak
# of: its latency was the path's (one scrape catching a request between arrival and its slot
# does not make it the queue's; read so, it ended slow start 2-4 s into a real flood).
_NO_QUEUE_BELOW = 0.5
# The 95th percentile of the wait from a random moment to the next completion, in mean
# completion intervals: ln 20 for completions spread as a Poisson stream (2.5 for the slot
# turnover of the speed-change scenario, benchmarks/slot_turnover.py).
_NEXT_RELEASE_P95_INTERVALS = math.log(20)


class TunerStatus(NamedTuple):
    """What one tuner decided (for metrics and the status page)."""

    allowed: float
    latency_s: float | None  # the latest interval's latency (TTFT side)
    tpot_s: float | None
    decreases: int
    increases: int


class QueueTuner:
    """AIMD on one tier's allowed engine queue; see the module docstring."""

    def __init__(
        self,
        *,
        minimum: int,
        maximum: int,
        ttft_target_s: float | None,
        tpot_target_s: float | None = None,
        initial: float | None = None,
        interval_s: float = 1.0,
        decrease: float = 0.7,
        smoothing: float = 0.5,
        headroom: float = 0.8,
        started_at: float = 0.0,
        newcomers_only: bool = False,
    ) -> None:
        if not 0 <= minimum <= maximum or maximum < 1:
            raise ValueError(
                f"need 0 <= minimum <= maximum and maximum >= 1 (got {minimum}, {maximum})"
            )
        if ttft_target_s is None and tpot_target_s is None:
            raise ValueError("auto needs a TTFT or a TPOT target")
        if not 0 < decrease < 1 or not 0 < smoothing <= 1 or interval_s <= 0:
            raise ValueError("need 0 < decrease < 1, 0 < smoothing <= 1 and interval_s > 0")
        self._minimum = float(minimum)
        self._maximum = float(maximum)
        self._ttft_target = ttft_target_s
        self._tpot_target = tpot_target_s
        start = minimum if initial is None else initial
        self._allowed = min(self._maximum, max(self._minimum, float(start)))
        self._interval_s = interval_s
        self._decrease = decrease
        self._smoothing = smoothing
        self._headroom = headroom
        # Whether the gate measures newcomers only (`fair_engine_queue`: the engine serves a
        # user's first request before anyone's next, so a newcomer waits for a slot, not behind
        # the queue). Then no drain ceiling (Little's law on the whole queue is no newcomer's
        # wait), and an interval without a newcomer is no evidence: the last latency stands.
        self._newcomers_only = newcomers_only
        self._interval_started = started_at
        self._decreased_at = -math.inf
        self._doubled_at = -math.inf
        self._first_bytes: list[float] = []
        # Released requests without a first byte yet, oldest first: key -> release time.
        self._outstanding: dict[int, float] = {}
        self._engine_ttft: list[float] = []
        self._engine_tpot: list[float] = []
        # The engine queues the interval's scrapes showed: their sum and how many said.
        self._waiting_sum = 0.0
        self._waiting_scrapes = 0
        self._held_back = False
        self._completions = 0
        # Completions by the engine's own counter (vLLM's request_success_total) since the last
        # decision, and the seconds between the scrapes that counted them; where the interval's
        # scrapes counted, their count is the drain rate (our ends come back late and in bursts).
        # Scrapes without the counter since the last decision: an engine that stopped exporting
        # it (or was replaced by one without) is measured by our ends again.
        self._counted = 0.0
        self._counted_s = 0.0
        self._uncounted_scrapes = 0
        self._engine_counts = False
        self._drain_rate: float | None = None
        self._latency: float | None = None
        self._last_latency: float | None = None
        # The latency of the way to the engine and back without an engine queue (Vegas's base
        # RTT): learned only in intervals whose scrapes showed no queue, so the queue's own
        # delay never inflates it; lowered by any interval that was faster.
        self._path: float | None = None
        self._tpot: float | None = None
        self._decreases = 0
        self._increases = 0

    @property
    def allowed(self) -> float:
        """The engine queue the gate may let form now (the tier's `waiting_below`)."""
        return self._allowed

    def observe_released(self, key: int, released_at: float) -> None:
        """A request of this tier went to the engine; until its first byte its age is a lower
        bound of its time to first byte (see `tick`)."""
        self._outstanding[key] = released_at

    def observe_first_byte(self, key: int, released_at: float, seconds: float) -> None:
        """One request of this tier: its time from release to first byte."""
        self._outstanding.pop(key, None)
        if released_at < self._decreased_at:
            return  # it saw the queue from before the last decrease: already acted on
        if len(self._first_bytes) < _MAX_SAMPLES:
            self._first_bytes.append(seconds)

    def observe_ended(self, key: int) -> None:
        """The request ended (without a first byte, if it was still outstanding)."""
        self._outstanding.pop(key, None)

    def observe_completion(self) -> None:
        """A request of any tier left the engine: the rate at which its queue drains."""
        self._completions += 1

    def observe_engine(
        self,
        now: float,
        ttft_s: float | None,
        tpot_s: float | None,
        waiting: float | None = None,
        finished: tuple[float, float] | None = None,
    ) -> None:
        """One scrape's recent engine TTFT and TPOT (None where not exported), its waiting
        queue, and where the engine counts its finished requests, how many it finished since
        the previous scrape and over how many seconds; the interval's means count, so one slow
        scrape among many does not shrink the queue. TTFT and TPOT are skipped for an interval
        after a decrease: the engine's means still hold the requests queued before."""
        if waiting is not None:
            self._waiting_sum += waiting
            self._waiting_scrapes += 1
        if finished is None:
            self._uncounted_scrapes += 1
        else:
            count, seconds = finished
            if count >= 0 and seconds > 0:  # a counter that went down: a restarted engine
                self._counted += count
                self._counted_s += seconds
                self._engine_counts = True
        if now - self._decreased_at < self._interval_s:
            return
        if ttft_s is not None:
            self._engine_ttft.append(ttft_s)
        if tpot_s is not None:
            self._engine_tpot.append(tpot_s)

    def note_held_back(self) -> None:
        """The gate held a request of this tier back because of the engine's queue."""
        self._held_back = True

    def tick(self, now: float) -> bool:
        """Decide once the interval is over; True if the allowed queue changed."""
        elapsed = now - self._interval_started
        if elapsed < self._interval_s:
            return False
        self._interval_started = now
        self._update_drain_rate(elapsed)
        latency = self._interval_latency(now)
        engine_ttft = _mean(self._engine_ttft)
        tpot = _mean(self._engine_tpot)
        held_back = self._held_back
        # The interval's scrapes showed the engine without a queue: whatever kept our
        # latency long was on the way to the engine (a CPU-starved proxy, the network), which no
        # engine queue shortens, and the queue the gate allowed was spent on requests in transit.
        # Not at an allowed queue of 0: the gate keeps the engine's queue empty then, and the
        # latency is the wait in ours for a slot, which growing the queue would lengthen.
        no_engine_queue = self._allowed >= 1 and self._engine_had_no_queue()
        self._first_bytes = []
        self._engine_ttft = []
        self._engine_tpot = []
        self._waiting_sum = 0.0
        self._waiting_scrapes = 0
        self._held_back = False
        if latency is not None:
            self._last_latency = latency
            self._latency = _smooth(self._latency, latency, self._smoothing)
            if no_engine_queue:
                self._path = _smooth(self._path, latency, self._smoothing)
            elif self._path is not None:
                self._path = min(self._path, latency)
        if tpot is not None:
            self._tpot = _smooth(self._tpot, tpot, self._smoothing)
        before = self._allowed
        # Little's law is about the engine's queue: without one the completion rate is what we
        # sent, not what the engine can drain, and a ceiling from it would keep it under-filled.
        ceiling = self._maximum if no_engine_queue else self._drain_ceiling()
        if ceiling < before:
            # The queue cannot drain within the target at the engine's present pace (Little's
            # law): shrink now rather than after its first bytes come back late.
            self._allowed = self._whole_queue(ceiling)
            self._decreased_at = now
            self._latency = self._tpot = None
            self._decreases += 1
            return True
        if latency is None and tpot is None and not no_engine_queue and not self._newcomers_only:
            # Nothing measured: no reason to move. Where only newcomers are measured, few
            # arrive in a flood of one user's requests, and holding until one did kept the
            # queue wherever it stood when the engine's first queue showed (1.7-4.9 waiting on
            # the real vLLM while the power user's requests waited in ours): the
            # last newcomer's latency (none since a decrease: growth) decides, as it would if
            # one had come.
            return False
        # Without an engine queue only what the engine itself reports counts: shrinking a queue
        # it does not have would hold work back from free slots and shorten nobody's wait.
        overshoot = self._engine_overshoot(engine_ttft) if no_engine_queue else self._overshoot()
        if overshoot > 1.0:
            # Proportional to how far over the target (a gradient step, as in Vegas-style
            # limiters), never less than `decrease` nor more than half at once.
            self._allowed = self._whole_queue(before * max(0.5, min(self._decrease, 1 / overshoot)))
            self._decreased_at = now
            # The next decision rests on what follows the decrease only: smoothing it with the
            # latency already acted on would shrink the queue again for the same cause.
            self._latency = self._tpot = None
            self._decreases += self._allowed < before
        elif held_back and overshoot <= self._headroom and self._settled(now):
            # Slow start: the scrapes showed no engine queue although we held requests back, so
            # whatever the queue we allowed was spent on (requests on their way, first bytes
            # relayed late), the engine has room; one more a second left it idle for most of a
            # 20 s flood behind a starved LiteLLM (1 -> 11 by the flood's end). So
            # double, once per round trip (the path's latency: the requests of the last
            # doubling have reached the engine by then), one more per interval in between,
            # until the first decrease; from then on one more per interval only.
            ramp = (
                no_engine_queue
                and not self._decreases
                and now - self._doubled_at >= (self._path or 0.0)
            )
            step = max(1.0, before) if ramp else 1.0
            self._allowed = min(self._maximum, ceiling, before + step)
            self._increases += self._allowed > before
            if ramp:
                self._doubled_at = now
        return self._allowed != before

    def statistics(self) -> TunerStatus:
        return TunerStatus(
            allowed=self._allowed,
            latency_s=self._last_latency,
            tpot_s=self._tpot,
            decreases=self._decreases,
            increases=self._increases,
        )

    def _interval_latency(self, now: float) -> float | None:
        samples = self._first_bytes
        target = self._ttft_target
        if target is not None:
            # Requests still waiting for their first byte past the target have missed it
            # already: counting their age now reacts a whole first-byte time sooner to a
            # slower engine than waiting for those first bytes would. Those near it count too,
            # or the first bytes that came back soonest (the lucky ones that found a free slot)
            # would read as room to grow.
            for released_at in self._outstanding.values():
                if now - released_at <= target * self._headroom:
                    break  # oldest first: the rest are younger
                if released_at >= self._decreased_at and len(samples) < _MAX_SAMPLES:
                    samples.append(now - released_at)
        own = _percentile(samples, 0.95) if samples else None
        engine = _mean(self._engine_ttft)
        latency = engine if own is None else own if engine is None else max(own, engine)
        if latency is None:
            return None
        # A client's TTFT through us also holds its wait in our queue for the next release, for
        # a user without a backlog (the light users the target is for) the wait for the next
        # completion: the part of the target the engine queue may not spend. About one mean
        # interval beside first bytes that span several completions themselves; with no engine
        # queue they are only the way and one step, and that wait is the TTFT: at its 95th
        # percentile, or a queue of 0 reads as room to grow where the wait for a slot alone
        # takes most of the target (an engine's slow phase: it grew to 3 and missed it).
        if not self._drain_rate:
            return latency
        intervals = _NEXT_RELEASE_P95_INTERVALS if self._allowed < 1 else 1.0
        return latency + intervals / self._drain_rate

    def _engine_had_no_queue(self) -> bool:
        """Whether the interval's scrapes showed the engine without a queue to speak of: under
        half a request waiting on average."""
        if not self._waiting_scrapes:
            return False
        return self._waiting_sum / self._waiting_scrapes < _NO_QUEUE_BELOW

    def _update_drain_rate(self, elapsed: float) -> None:
        """The engine's completion rate over the interval: by its own finished counter where it
        has one, else by the ends we saw. Behind a starved LiteLLM the ends came back in bursts
        seconds late; a rate from them fell to a fraction of the engine's and its drain ceiling
        cut a flood's queue from 29 to 2.8 with the engine completing 7 requests a second (issue
        #17). An interval without a scrape keeps the last rate (scrapes took 2-3 s there); one
        whose scrapes had no counter, after an engine that counted, goes back to the ends."""
        completions, self._completions = self._completions, 0
        counted, counted_s, uncounted = self._counted, self._counted_s, self._uncounted_scrapes
        self._counted = self._counted_s = 0.0
        self._uncounted_scrapes = 0
        if counted_s > 0:
            rate = counted / counted_s
        elif self._engine_counts and not uncounted:
            return  # no scrape counted or failed to count: nothing new about the engine
        else:
            rate = completions / elapsed
        self._drain_rate = _smooth(self._drain_rate, rate, self._smoothing)

    def _whole_queue(self, shrunk: float) -> float:
        """A decrease's result within the bounds. Below 1 the gate lets no queue form at all
        (`gate_rules.blocked_reason`), so a queue shrunk from 1 is 0 (where the minimum allows):
        growth by one then comes back to 1, not to 1.7, which would let a queue of two form."""
        return max(self._minimum, shrunk if shrunk >= 1 else 0.0)

    def _drain_ceiling(self) -> float:
        """The largest queue the engine drains within `headroom` of the TTFT target at its
        recent completion rate, plus the requests on their way to it (the rate times the path's
        latency: those replace completions rather than queue); no ceiling before a rate is known
        or without a TTFT target."""
        if self._newcomers_only or self._ttft_target is None or not self._drain_rate:
            return self._maximum
        # (queue + 1) / rate: the wait of a request released behind the whole queue.
        budget = self._ttft_target * self._headroom + (self._path or 0.0)
        return max(self._minimum, budget * self._drain_rate - 1)

    def _effective_ttft_target(self) -> float | None:
        """The TTFT target, or where the way to the engine alone misses it, the path's latency
        with `headroom` of it to spare: no engine queue can meet the target then, and shrinking
        the queue would only leave its slots idle (as behind a CPU-starved proxy)."""
        target = self._ttft_target
        if target is None or self._path is None:
            return target
        return max(target, self._path / self._headroom)

    def _settled(self, now: float) -> bool:
        """Long enough since the last decrease that a slow request released after it would
        have shown: first bytes that came back sooner are the lucky ones only."""
        return now - self._decreased_at >= self._interval_s + (self._ttft_target or 0.0)

    def _engine_overshoot(self, engine_ttft: float | None) -> float:
        """The worst of the engine's own TTFT / TTFT target and TPOT / TPOT target."""
        ratios = [0.0]
        if self._ttft_target is not None and engine_ttft is not None:
            ratios.append(engine_ttft / self._ttft_target)
        if self._tpot_target is not None and self._tpot is not None:
            ratios.append(self._tpot / self._tpot_target)
        return max(ratios)

    def _overshoot(self) -> float:
        """The worst of latency / TTFT target and TPOT / TPOT target (0 when unmeasured)."""
        ratios = [0.0]
        target = self._effective_ttft_target()
        if target is not None and self._latency is not None:
            ratios.append(self._latency / target)
        if self._tpot_target is not None and self._tpot is not None:
            ratios.append(self._tpot / self._tpot_target)
        return max(ratios)


def _smooth(previous: float | None, value: float, weight: float) -> float:
    return value if previous is None else previous + weight * (value - previous)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)]
