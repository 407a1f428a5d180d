"""Fairness from the client's side: who was backlogged when, who was served, and how unequally.

Definitions (VTC, Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):

- a user is **backlogged** from the moment it sends a request until that request's first token
  (or its end, for one that failed), as long as any of its requests is in that state: it has
  work the system has not started;
- a request's **service** is its output tokens, charged when it starts (its first token), as VTC
  charges a counter when it dispatches;
- the **service gap** between two users is, over any interval in which both are continuously
  backlogged, the difference of the service they received in it. VTC bounds it by
  ``2 x (the largest request's tokens)``; FIFO has no bound (a light user waits behind a
  whole flood);
- **Jain's index** ``(Σx)² / (n·Σx²)`` of the service of the users that are backlogged for a
  whole interval (fixed-width intervals; those with at least two such users), averaged over the
  intervals weighted by their service. 1.0: everybody backlogged got the same.

Pure functions over records; no I/O. A record is anything with ``user``, ``started``,
``first_token``, ``ended``, ``tokens`` and ``error`` (seconds since the run started).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

from .stats import jain_index, percentile


class Outcome(Protocol):
    @property
    def user(self) -> str: ...
    @property
    def started(self) -> float: ...
    @property
    def first_token(self) -> float | None: ...
    @property
    def ended(self) -> float | None: ...
    @property
    def tokens(self) -> int: ...
    @property
    def error(self) -> str | None: ...


Interval = tuple[float, float]


class ServiceGap(NamedTuple):
    tokens: float
    users: tuple[str, str] | None
    interval: Interval | None


def _dispatched_at(record: Outcome) -> float | None:
    """When a request stopped waiting: its first token, or its end if it never had one."""
    return record.first_token if record.first_token is not None else record.ended


def backlog_intervals(records: Iterable[Outcome]) -> dict[str, list[Interval]]:
    """Per user, the merged [sent, dispatched] intervals (closed: the dispatch belongs in it)."""
    spans: dict[str, list[Interval]] = defaultdict(list)
    for record in records:
        until = _dispatched_at(record)
        if until is not None:
            spans[record.user].append((record.started, max(until, record.started)))
    merged: dict[str, list[Interval]] = {}
    for user, intervals in spans.items():
        intervals.sort()
        out: list[Interval] = []
        for start, end in intervals:
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], end))
            else:
                out.append((start, end))
        merged[user] = out
    return merged


def dispatches(records: Iterable[Outcome]) -> dict[str, list[tuple[float, int]]]:
    """Per user, (first token time, tokens) of each request that got one, in time order."""
    out: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for record in records:
        if record.first_token is not None:
            out[record.user].append((record.first_token, record.tokens))
    for events in out.values():
        events.sort()
    return dict(out)


def _intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start <= end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _pair_gap(
    both: Sequence[Interval],
    first: Sequence[tuple[float, int]],
    second: Sequence[tuple[float, int]],
) -> tuple[float, Interval | None]:
    """max over the joint intervals of (max - min) of the running service difference, which is
    the largest |ΔW₁ - ΔW₂| over any sub-interval."""
    events = sorted([(t, n) for t, n in first] + [(t, -n) for t, n in second])
    best, where, k = 0.0, None, 0
    for start, end in both:
        while k < len(events) and events[k][0] < start:
            k += 1
        difference = low = high = 0.0
        m = k
        while m < len(events) and events[m][0] <= end:
            difference += events[m][1]
            low, high = min(low, difference), max(high, difference)
            m += 1
        if high - low > best:
            best, where = high - low, (start, end)
    return best, where


def max_service_gap(
    records: Sequence[Outcome], classes: Mapping[str, str] | None = None
) -> ServiceGap:
    """The largest service gap between two users while both were backlogged; with `classes`
    (user → tier), only users of the same class are compared (tiers are meant to differ)."""
    backlog = backlog_intervals(records)
    served = dispatches(records)
    best = ServiceGap(0.0, None, None)
    for one, two in itertools.combinations(sorted(backlog), 2):
        if classes is not None and classes.get(one) != classes.get(two):
            continue
        both = _intersect(backlog[one], backlog[two])
        if not both:
            continue
        gap, where = _pair_gap(both, served.get(one, ()), served.get(two, ()))
        if gap > best.tokens:
            best = ServiceGap(gap, (one, two), where)
    return best


def jain_while_backlogged(
    records: Sequence[Outcome], interval_s: float, classes: Mapping[str, str] | None = None
) -> tuple[float | None, int]:
    """Jain's index of the service of the users backlogged throughout each interval, averaged
    over intervals with at least two of them (weighted by the service in the interval); with
    `classes`, per class. Returns (index or None, intervals counted)."""
    if interval_s <= 0:
        raise ValueError("interval_s must be > 0")
    backlog = backlog_intervals(records)
    served = dispatches(records)
    ends = [end for spans in backlog.values() for _, end in spans]
    if not ends:
        return None, 0
    total_weight = weighted = 0.0
    counted = 0
    for k in range(int(max(ends) / interval_s) + 1):
        lo, hi = k * interval_s, (k + 1) * interval_s
        inside = [u for u, spans in backlog.items() if any(s <= lo and hi <= e for s, e in spans)]
        groups: dict[str | None, list[str]] = defaultdict(list)
        for user in inside:
            groups[classes.get(user) if classes else None].append(user)
        for users in groups.values():
            if len(users) < 2:
                continue
            service = [float(sum(n for t, n in served.get(u, ()) if lo <= t < hi)) for u in users]
            weight = sum(service)
            if weight <= 0:
                continue
            counted += 1
            total_weight += weight
            weighted += weight * jain_index(service)
    return (weighted / total_weight if total_weight else None), counted


def service_over_time(
    records: Sequence[Outcome], step_s: float
) -> tuple[list[float], dict[str, list[int]]]:
    """Cumulative tokens streamed per user at each multiple of `step_s` (each token counted
    at an even share of its request's streaming time)."""
    ends = [r.ended for r in records if r.ended is not None]
    horizon = max(ends) if ends else 0.0
    times = [k * step_s for k in range(int(horizon / step_s) + 2)]
    curves: dict[str, list[int]] = {}
    for user in sorted({r.user for r in records}):
        curve = []
        mine = [r for r in records if r.user == user and r.first_token is not None]
        for t in times:
            total = 0.0
            for r in mine:
                first, end = r.first_token or 0.0, r.ended if r.ended is not None else t
                if t >= end:
                    total += r.tokens
                elif t > first:
                    total += r.tokens * (t - first) / (end - first)
            curve.append(round(total))
        curves[user] = curve
    return times, curves


def _ttfts(records: Iterable[Outcome], users: set[str]) -> list[float]:
    return [
        r.first_token - r.started
        for r in records
        if r.user in users and r.first_token is not None and not r.error
    ]


def fairness_summary(
    records: Sequence[Outcome],
    *,
    heavy_users: set[str],
    largest_request_tokens: int,
    interval_s: float,
    classes: Mapping[str, str] | None = None,
) -> dict[str, object]:
    """The report's fairness numbers for one target and scenario."""
    everyone = {r.user for r in records}
    light = everyone - heavy_users
    light_p50 = percentile(_ttfts(records, light), 50)
    heavy_p50 = percentile(_ttfts(records, heavy_users), 50)
    gap = max_service_gap(records, classes)
    jain, intervals = jain_while_backlogged(records, interval_s, classes)
    bound = 2 * largest_request_tokens
    return {
        "light_ttft_p50_s": light_p50,
        "light_ttft_p95_s": percentile(_ttfts(records, light), 95),
        "heavy_ttft_p50_s": heavy_p50,
        "heavy_ttft_p95_s": percentile(_ttfts(records, heavy_users), 95),
        "light_heavy_ttft_ratio": (
            light_p50 / heavy_p50 if light_p50 is not None and heavy_p50 else None
        ),
        "jain_index": jain,
        "jain_intervals": intervals,
        "jain_interval_s": interval_s,
        "max_service_gap_tokens": gap.tokens,
        "max_service_gap_users": list(gap.users) if gap.users else None,
        "vtc_bound_tokens": bound,
        "gap_within_bound": gap.tokens <= bound,
    }


__all__ = [
    "Outcome",
    "ServiceGap",
    "backlog_intervals",
    "dispatches",
    "fairness_summary",
    "jain_while_backlogged",
    "max_service_gap",
    "service_over_time",
]
