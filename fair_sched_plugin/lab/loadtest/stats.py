"""Small statistics: percentiles, per-group summaries, Jain's fairness index."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from .client import RequestRecord


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def jain_index(values: Sequence[float]) -> float:
    """(Σx)² / (n·Σx²): 1.0 when everybody got the same, 1/n when one got everything."""
    squares = sum(value * value for value in values)
    if not values or squares == 0:
        return 0.0
    return sum(values) ** 2 / (len(values) * squares)


def _ttfts(records: Iterable[RequestRecord]) -> list[float]:
    return [r.ttft for r in records if r.ttft is not None and not r.error]


def ttft_p50(records: Iterable[RequestRecord]) -> float | None:
    """The median time to first token of the requests that got one."""
    return percentile(_ttfts(records), 50)


def _e2es(records: Iterable[RequestRecord]) -> list[float]:
    return [r.e2e for r in records if r.e2e is not None]


def summarize_flood(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Per-group latencies, throughput and makespan of one flood run."""
    light = [r for r in records if r.group == "light"]
    power = [r for r in records if r.group == "power"]
    ends = [r.ended for r in records if not r.error and r.ended is not None]
    starts = [r.started for r in records if not r.error and r.ended is not None]
    makespan = (max(ends) - min(starts)) if ends else 0.0
    tokens = sum(r.tokens for r in records)
    light_p50 = percentile(_ttfts(light), 50)
    power_ttfts = _ttfts(power)
    return {
        "requests": len(records),
        "errors": sum(1 for r in records if r.error),
        "light_ttft_p50": light_p50,
        "light_ttft_p95": percentile(_ttfts(light), 95),
        "power_ttft_p50": percentile(power_ttfts, 50),
        "power_ttft_p95": percentile(power_ttfts, 95),
        "light_e2e_p50": percentile(_e2es(light), 50),
        "power_e2e_p50": percentile(_e2es(power), 50),
        # How many of the power user's requests got their first token before the light users'
        # median did: near 1 means the light users waited behind (almost) the whole flood.
        "power_served_before_light": (
            sum(1 for t in power_ttfts if t < light_p50) / len(power_ttfts)
            if light_p50 is not None and power_ttfts
            else None
        ),
        "generated_tokens": tokens,
        "makespan_s": makespan,
        "throughput_tps": tokens / makespan if makespan else 0.0,
    }
