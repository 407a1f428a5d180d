"""Which Prometheus series carry our four signals, per engine.

Each signal has a tuple of candidate sample names, preferred first: engines rename metrics between
releases (vLLM's `gpu_cache_usage_perc` became `kv_cache_usage_perc`), and the first candidate
present in a scrape wins. Names are matched against `sample.name` exactly as the engine prints it
(counters keep their `_total`); `tpot` names a histogram, whose `_sum` and `_count` are read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Literal
from urllib.parse import urlencode, urlsplit, urlunsplit

from ..config import BackendSettings

__all__ = [
    "SGLANG_PROFILE",
    "TGI_PROFILE",
    "VLLM_PROFILE",
    "EngineName",
    "MetricProfile",
    "engine_profile",
    "filtered_metrics_url",
    "profile_for",
]

EngineName = Literal["vllm", "sglang", "tgi"]


@dataclass(frozen=True)
class MetricProfile:
    """Candidate sample names for each signal; an empty tuple means the engine has no such signal.

    `waiting` and `running` are required in every scrape; `kv_usage` (0..1) and `tpot` (a
    time-per-output-token histogram in seconds) are optional. `prefix_cache_queries` and
    `prefix_cache_hits` (token counters) only inform the status page, never the gate.
    """

    engine: str
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()
    tpot: tuple[str, ...] = ()
    # Histograms (seconds) that feed `waiting_below: auto`; optional.
    ttft: tuple[str, ...] = ()
    queue_time: tuple[str, ...] = ()
    prefix_cache_queries: tuple[str, ...] = ()
    prefix_cache_hits: tuple[str, ...] = ()
    # A counter of the requests the engine finished, summed over its label sets (vLLM labels it
    # by `finished_reason`): the gate counts arrivals between scrapes by it. Only a counter
    # updated in step with `waiting` and `running` belongs here, one that never counts a request
    # they did not hold (that would release one too many; one left uncounted, as vLLM leaves
    # aborted requests, only keeps a lease pending longer).
    requests_finished: tuple[str, ...] = ()
    # The engine serves `<metrics path>/?name[]=...` with only the named series (prometheus_client's
    # own exposition app, which vLLM 0.32 mounts under /metrics/; its /metrics itself is another
    # handler that ignores the query and always renders the whole page).
    name_filter: bool = False

    def __post_init__(self) -> None:
        if not self.waiting or not self.running:
            raise ValueError(f"{self.engine} profile needs `waiting` and `running` metric names")

    def series_names(self) -> tuple[str, ...]:
        """Every sample name the parser may read, in the profile's order: the candidates of each
        signal, and `_sum` and `_count` of each histogram (never its buckets)."""
        histograms = (*self.tpot, *self.ttft, *self.queue_time)
        names = (
            *self.waiting,
            *self.running,
            *self.kv_usage,
            *(f"{name}{suffix}" for name in histograms for suffix in ("_sum", "_count")),
            *self.prefix_cache_queries,
            *self.prefix_cache_hits,
            *self.requests_finished,
        )
        return tuple(dict.fromkeys(names))


VLLM_PROFILE = MetricProfile(
    engine="vllm",
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    tpot=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    ttft=("vllm:time_to_first_token_seconds",),
    queue_time=("vllm:request_queue_time_seconds",),
    prefix_cache_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    prefix_cache_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    requests_finished=("vllm:request_success_total",),
    name_filter=True,
)

SGLANG_PROFILE = MetricProfile(
    engine="sglang",
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_usage=("sglang:token_usage",),
    tpot=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    ttft=("sglang:time_to_first_token_seconds",),
    # No `requests_finished`: `sglang:num_requests_total` is counted by the tokenizer manager,
    # not the scheduler whose queue gauges we read, and aborts go to a counter of their own;
    # not verified against a capture, so arrivals are counted from our own ends.
)

TGI_PROFILE = MetricProfile(
    engine="tgi",
    waiting=("tgi_queue_size",),
    running=("tgi_batch_current_size",),
    kv_usage=(),  # TGI exports no KV-cache usage.
    tpot=("tgi_request_mean_time_per_token_duration",),
    # No `requests_finished`: `tgi_request_success` leaves out failed requests that did leave
    # the queue or batch, and `tgi_request_count` counts requests that never enter them.
)

_PROFILES = MappingProxyType({p.engine: p for p in (VLLM_PROFILE, SGLANG_PROFILE, TGI_PROFILE)})


def engine_profile(engine: str) -> MetricProfile:
    """The built-in profile of `engine` ("vllm", "sglang" or "tgi")."""
    try:
        return _PROFILES[engine]
    except KeyError:
        known = sorted(_PROFILES)
        raise ValueError(f"unknown engine {engine!r}; expected one of {known}") from None


def filtered_metrics_url(url: str, profile: MetricProfile) -> str | None:
    """`http://host:8000/metrics` -> `http://host:8000/metrics/?name[]=...` with the profile's
    series: 2.3 kB instead of vLLM 0.32's 47.5 kB, which its API server renders on the CPU that
    also feeds the engine (at ten scrapes a second its processes spent 26 ms of CPU a second
    instead of 72, 14 of them idle: benchmarks/vllm_scrape_cost.py). None where the engine
    serves no such filter, or the URL is not a plain path ending in /metrics (a query or another
    path is the operator's own, and is left as given)."""
    if not profile.name_filter:
        return None
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if parts.query or parts.fragment or not path.endswith("/metrics"):
        return None
    query = urlencode([("name[]", name) for name in profile.series_names()])
    return urlunsplit((parts.scheme, parts.netloc, path + "/", query, ""))


def profile_for(backend: BackendSettings) -> MetricProfile:
    """The backend's engine profile with its `metric_names` overrides applied.

    An override replaces every candidate for that signal: a user who names a metric means that
    one, so falling back to the engine's default name would hide a typo.
    """
    base = engine_profile(backend.engine)
    names = backend.metric_names

    def chosen(signal: str, default: tuple[str, ...]) -> tuple[str, ...]:
        return (names[signal],) if signal in names else default

    # The finished counter is only right in step with the engine's own queue gauges: with
    # either renamed they may be another exporter's, and our ends count the arrivals instead.
    gauges_renamed = "waiting" in names or "running" in names
    return replace(
        base,
        requests_finished=() if gauges_renamed else base.requests_finished,
        waiting=chosen("waiting", base.waiting),
        running=chosen("running", base.running),
        kv_usage=chosen("kv_usage", base.kv_usage),
        tpot=chosen("tpot", base.tpot),
    )
