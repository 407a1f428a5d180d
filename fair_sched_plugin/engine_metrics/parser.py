"""Prometheus text -> the engine-neutral numbers the gate needs.

A scrape that cannot be read, or lacks a required signal, raises `MetricsParseError`: the caller
treats the engine's load as *unknown*, never as zero.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from ..errors import FairSchedError
from .profiles import MetricProfile

__all__ = [
    "MetricsParseError",
    "ParsedMetrics",
    "parse_metrics",
    "recent_mean",
    "recent_prefix_cache_hit_rate",
    "recent_tpot",
]

# Long enough to recognise the junk in an error message, short enough for a log line.
_EXCERPT_CHARS = 80


class MetricsParseError(FairSchedError):
    """The text is not Prometheus exposition format, or lacks a required signal."""


class ParsedMetrics(NamedTuple):
    """One scrape's signals. `tpot_sum`/`tpot_count` (and the TTFT and queue-time pairs) are
    the histograms' lifetime totals, the prefix-cache counters lifetime token counts,
    `requests_finished` the lifetime count of finished requests summed over every reason."""

    waiting: float
    running: float
    kv_usage: float | None
    tpot_sum: float | None
    tpot_count: float | None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    queue_time_sum: float | None = None
    queue_time_count: float | None = None
    requests_finished: float | None = None


def parse_metrics(text: str, profile: MetricProfile, model_name: str | None) -> ParsedMetrics:
    """Read `profile`'s signals from `text`, summed over every label set (e.g. `engine`).

    With `model_name`, series whose `model_name` label differs are ignored; series without that
    label are kept. Raise `MetricsParseError` for text the Prometheus parser rejects, a missing
    `waiting` or `running`, or a NaN, infinite or negative value in a signal we use.
    """
    wanted = _names_of_interest(profile)
    totals = _collect(_sample_lines(text, wanted), wanted, model_name)
    where = f" for model_name={model_name!r}" if model_name is not None else ""
    waiting = _first_present(totals, profile.waiting)
    running = _first_present(totals, profile.running)
    if waiting is None:
        raise MetricsParseError(f"no {' or '.join(profile.waiting)} sample{where}")
    if running is None:
        raise MetricsParseError(f"no {' or '.join(profile.running)} sample{where}")
    tpot_sum, tpot_count = _histogram_totals(totals, profile.tpot)
    ttft_sum, ttft_count = _histogram_totals(totals, profile.ttft)
    queue_time_sum, queue_time_count = _histogram_totals(totals, profile.queue_time)
    queries = _first_present(totals, profile.prefix_cache_queries)
    hits = _first_present(totals, profile.prefix_cache_hits)
    finished = _first_present(totals, profile.requests_finished)
    return ParsedMetrics(
        waiting=waiting.total,
        running=running.total,
        kv_usage=_kv_usage(totals, profile.kv_usage),
        tpot_sum=tpot_sum,
        tpot_count=tpot_count,
        prefix_cache_queries=None if queries is None else queries.total,
        prefix_cache_hits=None if hits is None else hits.total,
        ttft_sum=ttft_sum,
        ttft_count=ttft_count,
        queue_time_sum=queue_time_sum,
        queue_time_count=queue_time_count,
        requests_finished=None if finished is None else finished.total,
    )


def recent_tpot(previous: ParsedMetrics | None, current: ParsedMetrics) -> float | None:
    """Mean time per output token *between* two scrapes: Δsum / Δcount.

    None when there is no earlier scrape, the histogram is absent, no token was produced in the
    interval, or the counters went backwards (the engine restarted). The lifetime mean is never
    returned: after hours of idle it would hide a slowdown happening now.
    """
    if previous is None:
        return None
    return recent_mean(
        (previous.tpot_sum, previous.tpot_count), (current.tpot_sum, current.tpot_count)
    )


def recent_mean(
    previous: tuple[float | None, float | None], current: tuple[float | None, float | None]
) -> float | None:
    """A histogram's mean *between* two scrapes from its (sum, count) then and now: Δsum / Δcount.

    None when either is absent, nothing was observed in the interval, or the counters went
    backwards (the engine restarted).
    """
    (old_sum, old_count), (new_sum, new_count) = previous, current
    if old_sum is None or old_count is None or new_sum is None or new_count is None:
        return None
    delta_count = new_count - old_count
    delta_sum = new_sum - old_sum
    if delta_count <= 0 or delta_sum < 0:
        return None
    return delta_sum / delta_count


def recent_prefix_cache_hit_rate(
    previous: ParsedMetrics | None, current: ParsedMetrics
) -> float | None:
    """Share of prompt tokens found in the prefix cache *between* two scrapes: Δhits / Δqueries.

    None without an earlier scrape or the counters, when no prompt token was looked up in the
    interval, or when the counters went backwards (the engine restarted).
    """
    if previous is None:
        return None
    old_queries, old_hits = previous.prefix_cache_queries, previous.prefix_cache_hits
    new_queries, new_hits = current.prefix_cache_queries, current.prefix_cache_hits
    if old_queries is None or old_hits is None or new_queries is None or new_hits is None:
        return None
    delta_queries = new_queries - old_queries
    delta_hits = new_hits - old_hits
    if delta_queries <= 0 or delta_hits < 0:
        return None
    return min(1.0, delta_hits / delta_queries)


class _Total:
    """The sum and the largest value of one sample name's series."""

    __slots__ = ("largest", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self.largest = -math.inf

    def add(self, value: float) -> None:
        self.total += value
        self.largest = max(self.largest, value)


def _names_of_interest(profile: MetricProfile) -> frozenset[str]:
    histograms = (*profile.tpot, *profile.ttft, *profile.queue_time)
    histogram_parts = {f"{name}{suffix}" for name in histograms for suffix in ("_sum", "_count")}
    return frozenset(
        (
            *profile.waiting,
            *profile.running,
            *profile.kv_usage,
            *histogram_parts,
            *profile.prefix_cache_queries,
            *profile.prefix_cache_hits,
            *profile.requests_finished,
        )
    )


def _sample_lines(text: str, wanted: frozenset[str]) -> list[str]:
    """The lines that can hold one of our samples (`_collect` reads them).

    A vLLM page has about 600 lines (histogram buckets mostly) and we read about ten of them;
    prometheus_client parses the whole page in about 8 ms, every poll, on the proxy's event loop.
    Comments go too: without `# TYPE` a histogram's `_sum` and `_count` are read as untyped
    samples of the same names. Junk in lines we do not read no longer matters, but a page that
    ends mid-line (the format requires a final line feed) is still not trusted.
    """
    if text and not text.endswith("\n"):
        raise MetricsParseError("not Prometheus text: the page ends mid-line (truncated?)")
    prefixes = tuple(wanted)
    return [line for line in text.split("\n") if line.startswith(prefixes)]


# A sample line in the plain form engines write: a name, labels whose values hold no escape, one
# space, a number, maybe a timestamp. Read here with two regular expressions; prometheus_client's
# parser walks every label character by character in Python (about 0.1 ms a line, ten lines a
# scrape, ten scrapes a second, on the proxy's event loop). Any other line (escapes, tabs, two
# spaces, junk) goes to prometheus_client, which also words every error.
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*"'
_PLAIN_SAMPLE = re.compile(
    rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})?"
    r" ([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)(?: -?[0-9]+)?"
)
_PLAIN_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')


def _collect(lines: list[str], wanted: frozenset[str], model_name: str | None) -> dict[str, _Total]:
    totals: dict[str, _Total] = {}
    others: list[str] = []
    for line in lines:
        match = _PLAIN_SAMPLE.fullmatch(line)
        if match is None:
            others.append(line)
            continue
        name, label_text, value_text = match.groups()
        pairs = _PLAIN_LABEL.findall(label_text) if label_text else []
        labels = dict(pairs)
        if len(labels) != len(pairs):
            others.append(line)  # a label named twice: prometheus_client's to judge
            continue
        _add(totals, wanted, model_name, name, labels, float(value_text))
    if not others:
        return totals
    rest = "\n".join(others)
    try:
        # The parser is lazy: errors surface while iterating, so the whole loop is guarded.
        for family in text_string_to_metric_families(rest + "\n"):
            for sample in family.samples:
                _add(totals, wanted, model_name, sample.name, sample.labels, sample.value)
    # ValueError is what prometheus_client raises for malformed text (fuzzing 0.26 with mutated
    # captures found nothing else); IndexError guards its unchecked string indexing in releases
    # we support but did not fuzz.
    except (ValueError, IndexError) as exc:
        raise MetricsParseError(f"not Prometheus text: {_excerpt(str(exc))}") from exc
    return totals


def _add(
    totals: dict[str, _Total],
    wanted: frozenset[str],
    model_name: str | None,
    name: str,
    labels: dict[str, str],
    value: float,
) -> None:
    if name not in wanted or not _is_for_model(labels, model_name):
        return
    _check_value(name, value)
    totals.setdefault(name, _Total()).add(float(value))


def _is_for_model(labels: dict[str, str], model_name: str | None) -> bool:
    # A series without a `model_name` label is the engine's own and counts for every model.
    return model_name is None or labels.get("model_name", model_name) == model_name


def _check_value(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise MetricsParseError(f"{name} is {value}")
    if value < 0:
        raise MetricsParseError(f"{name} is negative ({value})")


def _first_present(totals: dict[str, _Total], candidates: Iterable[str]) -> _Total | None:
    for name in candidates:
        if name in totals:
            return totals[name]
    return None


def _kv_usage(totals: dict[str, _Total], candidates: tuple[str, ...]) -> float | None:
    usage = _first_present(totals, candidates)
    # A fraction does not add up across engines (two at 0.6 are not 1.2 full); the fullest
    # engine is the one that preempts first, so it speaks for the deployment.
    return None if usage is None else usage.largest


def _histogram_totals(
    totals: dict[str, _Total], candidates: tuple[str, ...]
) -> tuple[float | None, float | None]:
    for name in candidates:
        histogram_sum, histogram_count = totals.get(f"{name}_sum"), totals.get(f"{name}_count")
        if histogram_sum is not None and histogram_count is not None:
            return histogram_sum.total, histogram_count.total
    return None, None


def _excerpt(message: str) -> str:
    if len(message) <= _EXCERPT_CHARS:
        return repr(message)
    return repr(message[:_EXCERPT_CHARS]) + "..."
