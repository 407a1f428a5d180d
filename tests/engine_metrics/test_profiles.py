"""Which series a profile asks the engine for (`metrics_filter`), and the URL that asks."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from fair_sched_plugin.config import BackendSettings
from fair_sched_plugin.engine_metrics import (
    SGLANG_PROFILE,
    TGI_PROFILE,
    VLLM_PROFILE,
    parse_metrics,
    profile_for,
)
from fair_sched_plugin.engine_metrics.profiles import filtered_metrics_url


def _only(text: str, names: tuple[str, ...]) -> str:
    """A Prometheus page cut to the samples named, with the HELP and TYPE lines of their
    families (what prometheus_client's `name[]` filter serves)."""
    kept = []
    for line in text.splitlines():
        if line.startswith("# "):
            family = line.split(" ", 3)[2]
            if any(name == family or name.startswith(family + "_") for name in names):
                kept.append(line)
        elif line.split("{", 1)[0].split(" ", 1)[0] in names:
            kept.append(line)
    return "\n".join(kept) + "\n"


@pytest.mark.parametrize("capture", ["midburst_text", "kvfull_text"])
def test_the_filtered_page_parses_to_what_the_whole_page_does(
    capture: str, request: pytest.FixtureRequest
) -> None:
    """Differential: a real vLLM 0.32 page cut to the profile's series reads exactly as the
    whole page, so the filter leaves out nothing the parser uses."""
    whole = request.getfixturevalue(capture)
    names = VLLM_PROFILE.series_names()
    cut = _only(whole, names)
    assert len(cut) * 5 < len(whole)
    assert parse_metrics(cut, VLLM_PROFILE, "tiny") == parse_metrics(whole, VLLM_PROFILE, "tiny")


def test_series_names_hold_every_candidate_and_the_histograms_sums_and_counts() -> None:
    names = VLLM_PROFILE.series_names()
    assert "vllm:num_requests_waiting" in names and "vllm:gpu_cache_usage_perc" in names
    assert "vllm:time_to_first_token_seconds_sum" in names
    assert "vllm:time_to_first_token_seconds_count" in names
    assert "vllm:request_success_total" in names
    assert not any(name.endswith("_bucket") for name in names)
    assert len(set(names)) == len(names)


def test_the_filtered_url_asks_vllms_exposition_app_for_the_profiles_series() -> None:
    url = filtered_metrics_url("http://127.0.0.1:8000/metrics", VLLM_PROFILE)
    assert url is not None
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == ("http", "127.0.0.1:8000", "/metrics/")
    assert tuple(parse_qs(parts.query)["name[]"]) == VLLM_PROFILE.series_names()
    # A trailing slash already there, or a prefix before /metrics, are kept as the operator's.
    assert filtered_metrics_url("http://h/metrics/", VLLM_PROFILE) == url.replace(
        "127.0.0.1:8000", "h"
    )
    prefixed = filtered_metrics_url("https://h/engine-1/metrics", VLLM_PROFILE)
    assert prefixed is not None and urlsplit(prefixed).path == "/engine-1/metrics/"


@pytest.mark.parametrize(
    "url",
    [
        "http://h:8000/metrics?format=text",  # the operator's own query
        "http://h:8000/stats",  # not a /metrics path
        "http://h:8000/metrics#x",
        "http://h:8000/metricsx",
    ],
)
def test_a_url_that_is_not_a_plain_metrics_path_is_left_as_given(url: str) -> None:
    assert filtered_metrics_url(url, VLLM_PROFILE) is None


def test_engines_without_a_verified_filter_are_read_whole() -> None:
    assert filtered_metrics_url("http://h:30000/metrics", SGLANG_PROFILE) is None
    assert filtered_metrics_url("http://h:3000/metrics", TGI_PROFILE) is None


def test_renamed_metrics_are_the_ones_asked_for() -> None:
    backend = BackendSettings(metric_names={"waiting": "my:queue_len"})
    names = profile_for(backend).series_names()
    assert "my:queue_len" in names and "vllm:num_requests_waiting" not in names
