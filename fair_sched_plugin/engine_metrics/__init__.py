"""Engine metrics: which series to read, how to parse them, and the watcher that scrapes them."""

from __future__ import annotations

from .parser import (
    MetricsParseError,
    ParsedMetrics,
    parse_metrics,
    recent_prefix_cache_hit_rate,
    recent_tpot,
)
from .profiles import (
    SGLANG_PROFILE,
    TGI_PROFILE,
    VLLM_PROFILE,
    MetricProfile,
    engine_profile,
    profile_for,
)
from .watcher import DEFAULT_MAX_BODY_BYTES, MetricsWatcher

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "SGLANG_PROFILE",
    "TGI_PROFILE",
    "VLLM_PROFILE",
    "MetricProfile",
    "MetricsParseError",
    "MetricsWatcher",
    "ParsedMetrics",
    "engine_profile",
    "parse_metrics",
    "profile_for",
    "recent_prefix_cache_hit_rate",
    "recent_tpot",
]
