"""Prometheus metrics of the emulated engine, named like vLLM, SGLang or TGI print them.

Each emulator owns a private ``CollectorRegistry``: several emulators run in one test process and
must never share (or pollute) the global registry. Gauges are set from the engine's state right
before rendering; histograms and counters are fed by engine events through ``EngineObserver``.
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .engine import EmulatedEngine, EngineObserver, MetricsProfile, Sequence

# Bucket bounds copied from vLLM 0.32 so histogram_quantile behaves the same on both.
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on

VLLM_ENGINE_INDEX = "0"
# vLLM 0.32 creates `request_success_total` for every finish reason up front (see the fixtures).
VLLM_FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)


def _child(metric: _Metric | None, label_values: tuple[str, ...]) -> _Metric | None:
    if metric is None or not label_values:
        return metric
    return metric.labels(*label_values)


class _ModelSeries:
    """The labelled children of one model, resolved once: ``.labels()`` per token is too slow."""

    def __init__(self, metrics: EngineMetrics, model: str) -> None:
        values = metrics.label_values(model)
        self.waiting = _child(metrics.waiting, values)
        self.running = _child(metrics.running, values)
        self.kv_usage = _child(metrics.kv_usage, values)
        self.prompt_tokens = _child(metrics.prompt_tokens, values)
        self.generation_tokens = _child(metrics.generation_tokens, values)
        self.preemptions = _child(metrics.preemptions, values)
        self.prefix_queries = _child(metrics.prefix_queries, values)
        self.prefix_hits = _child(metrics.prefix_hits, values)
        self.ttft = _child(metrics.ttft, values)
        self.itl = _child(metrics.itl, values)
        self.request_tpot = _child(metrics.request_tpot, values)
        self.queue_time = _child(metrics.queue_time, values)
        self.e2e = _child(metrics.e2e, values)
        # The emulator finishes a request only at its max_tokens: vLLM's "length".
        self.finished_by_length = (
            None
            if metrics.request_success is None
            else metrics.request_success.labels(*values, "length")
        )


class EngineMetrics(EngineObserver):
    """Feeds one private registry from engine events, with the names of ``profile``.

    A profile declares only the metrics that engine really has; the others stay ``None``.
    """

    def __init__(
        self,
        profile: MetricsProfile,
        models: tuple[str, ...],
        kv_capacity: int,
        *,
        prefix_caching: bool = False,
        success_counter: bool = True,
    ) -> None:
        self.profile = profile
        # Off: vLLM's page without `request_success_total` (the gate's other settling rule).
        self._success_counter = success_counter
        # vLLM counts prefix-cache queries only while caching is on; off, both stay at 0.
        self._prefix_caching = prefix_caching
        self.registry = CollectorRegistry(auto_describe=True)
        self._kv_capacity = kv_capacity
        self._labels = {"vllm": ("model_name", "engine"), "sglang": ("model_name",), "tgi": ()}[
            profile
        ]
        self.waiting: Gauge | None = None
        self.running: Gauge | None = None
        self.kv_usage: Gauge | None = None
        self.prompt_tokens: Counter | None = None
        self.generation_tokens: Counter | None = None
        self.preemptions: Counter | None = None
        self.prefix_queries: Counter | None = None
        self.prefix_hits: Counter | None = None
        self.ttft: Histogram | None = None
        self.itl: Histogram | None = None
        self.request_tpot: Histogram | None = None
        self.queue_time: Histogram | None = None
        self.e2e: Histogram | None = None
        self.request_success: Counter | None = None
        declare = {"vllm": self._declare_vllm, "sglang": self._declare_sglang}
        declare.get(profile, self._declare_tgi)()
        if self.request_success is not None:
            for model in models:
                for reason in VLLM_FINISHED_REASONS:
                    self.request_success.labels(*self.label_values(model), reason)
        self._series = {model: _ModelSeries(self, model) for model in models}

    def label_values(self, model: str) -> tuple[str, ...]:
        if self.profile == "vllm":
            return (model, VLLM_ENGINE_INDEX)
        if self.profile == "sglang":
            return (model,)
        return ()  # TGI serves one model and labels nothing

    # ------------------------------------------------------------ declarations per profile

    def _gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(name, documentation, self._labels, registry=self.registry)

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(name, documentation, self._labels, registry=self.registry)

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, documentation, self._labels, registry=self.registry, buckets=buckets)

    def _declare_vllm(self) -> None:
        # Names and help texts as vLLM 0.32 prints them (see the fixtures).
        self.running = self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.preemptions = self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        if self._success_counter:
            # Like vLLM's, aborted requests are not counted (vllm-project/vllm#31503): the
            # "abort" series exists and stays at 0.
            self.request_success = Counter(
                "vllm:request_success",
                "Count of successfully processed requests.",
                (*self._labels, "finished_reason"),
                registry=self.registry,
            )
        self.prefix_queries = self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.request_tpot = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

    def _declare_sglang(self) -> None:
        self.running = self._gauge("sglang:num_running_reqs", "The number of running requests.")
        self.waiting = self._gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue."
        )
        self.kv_usage = self._gauge("sglang:token_usage", "The token usage.")
        self.prompt_tokens = self._counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = self._counter(
            "sglang:generation_tokens", "Number of generation tokens processed."
        )
        self.ttft = self._histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = self._histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            REQUEST_LATENCY_BUCKETS,
        )

    def _declare_tgi(self) -> None:
        self.waiting = self._gauge("tgi_queue_size", "Number of requests waiting in the queue.")
        self.running = self._gauge("tgi_batch_current_size", "Current batch size.")
        self.request_tpot = self._histogram(
            "tgi_request_mean_time_per_token_duration",
            "Mean time per generated token of a request, in seconds.",
            ITL_BUCKETS,
        )
        self.generation_tokens = self._counter(
            "tgi_request_generated_tokens", "Number of generated tokens."
        )

    # ------------------------------------------------------------ engine events

    def on_prefill(self, seq: Sequence, queue_time_s: float) -> None:
        series = self._series[seq.model]
        if series.prompt_tokens is not None:
            series.prompt_tokens.inc(seq.prompt_tokens)
        if self._prefix_caching:
            if series.prefix_queries is not None:
                series.prefix_queries.inc(seq.prompt_tokens)
            if series.prefix_hits is not None:
                series.prefix_hits.inc(seq.cached_tokens)
        if series.queue_time is not None:
            series.queue_time.observe(queue_time_s)

    def on_tokens(self, batch: list[Sequence], interval_s: float, now: float) -> None:
        for seq in batch:
            series = self._series[seq.model]
            if series.generation_tokens is not None:
                series.generation_tokens.inc()
            if seq.generated == 1:
                if series.ttft is not None:
                    series.ttft.observe(now - seq.arrived_at)
            elif series.itl is not None:
                series.itl.observe(interval_s)

    def on_finish(self, seq: Sequence, now: float) -> None:
        series = self._series[seq.model]
        if series.finished_by_length is not None:
            series.finished_by_length.inc()
        if series.e2e is not None:
            series.e2e.observe(now - seq.arrived_at)
        if series.request_tpot is not None and seq.first_token_at is not None:
            decode_tokens = max(seq.generated - 1, 1)
            series.request_tpot.observe((now - seq.first_token_at) / decode_tokens)

    # ------------------------------------------------------------ rendering

    def render(self, engine: EmulatedEngine, names: list[str] | None = None) -> bytes:
        """Prometheus text exposition, with gauges read from the engine right now; with `names`,
        only those samples (prometheus_client's `name[]` filter, as vLLM serves it)."""
        waiting = engine.waiting_by_model()
        running = engine.running_by_model()
        kv_tokens = engine.kv_tokens_by_model()
        for model, series in self._series.items():
            if series.waiting is not None:
                series.waiting.set(waiting[model])
            if series.running is not None:
                series.running.set(running[model])
            if series.kv_usage is not None:
                usage = min(kv_tokens[model] / self._kv_capacity, 1.0)
                series.kv_usage.set(usage)
        if names:
            return generate_latest(self.registry.restricted_registry(names))
        return generate_latest(self.registry)
