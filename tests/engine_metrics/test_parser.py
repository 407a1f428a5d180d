from __future__ import annotations

import os

import pytest

from fair_sched_plugin.config import BackendSettings
from fair_sched_plugin.engine_metrics import (
    SGLANG_PROFILE,
    TGI_PROFILE,
    VLLM_PROFILE,
    MetricProfile,
    MetricsParseError,
    ParsedMetrics,
    engine_profile,
    parse_metrics,
    profile_for,
    recent_prefix_cache_hit_rate,
    recent_tpot,
)
from fair_sched_plugin.engine_metrics.parser import recent_mean

from .conftest import vllm_text

# -- the real vLLM 0.32 captures -----------------------------------------------------------------


def test_midburst_capture_gives_the_engines_own_numbers(midburst_text: str) -> None:
    parsed = parse_metrics(midburst_text, VLLM_PROFILE, "tiny")
    assert (parsed.waiting, parsed.running) == (22, 8)
    assert parsed.kv_usage is not None and 0 < parsed.kv_usage < 1
    assert parsed.tpot_sum == pytest.approx(94.886196174)
    assert parsed.tpot_count == 18501


def test_midburst_capture_has_the_prefix_cache_counters(midburst_text: str) -> None:
    parsed = parse_metrics(midburst_text, VLLM_PROFILE, "tiny")
    assert (parsed.prefix_cache_queries, parsed.prefix_cache_hits) == (612, 0)


def test_recent_prefix_cache_hit_rate_is_the_delta_of_the_counters() -> None:
    def scrape(queries: float | None, hits: float | None) -> ParsedMetrics:
        return ParsedMetrics(1, 1, None, None, None, queries, hits)

    assert recent_prefix_cache_hit_rate(scrape(1000, 100), scrape(1400, 400)) == 0.75
    assert recent_prefix_cache_hit_rate(None, scrape(1400, 400)) is None  # nothing to compare
    assert recent_prefix_cache_hit_rate(scrape(1000, 100), scrape(1000, 100)) is None  # idle
    assert recent_prefix_cache_hit_rate(scrape(1000, 100), scrape(10, 0)) is None  # restarted
    assert recent_prefix_cache_hit_rate(scrape(None, None), scrape(10, 0)) is None  # absent
    assert parse_metrics(vllm_text(), VLLM_PROFILE, "tiny").prefix_cache_queries is None


def test_kvfull_capture_counts_finished_requests_over_every_reason(kvfull_text: str) -> None:
    # vLLM 0.32 prints one `request_success_total` series per finished_reason (25 "length", the
    # others 0): the arrivals rule needs them all, whatever made a request leave the engine.
    assert parse_metrics(kvfull_text, VLLM_PROFILE, "tiny").requests_finished == 25


def test_finished_counter_sums_reasons_and_engines() -> None:
    text = vllm_text() + "".join(
        f'vllm:request_success_total{{engine="{engine}",finished_reason="{reason}",'
        f'model_name="tiny"}} {count}\n'
        for engine, reason, count in (("0", "stop", 4), ("0", "length", 3), ("1", "abort", 2))
    )
    assert parse_metrics(text, VLLM_PROFILE, "tiny").requests_finished == 9


def test_finished_counter_absent_is_none_not_zero() -> None:
    # An engine without the counter keeps the gate on the rule that counts our own ends.
    assert parse_metrics(vllm_text(), VLLM_PROFILE, "tiny").requests_finished is None
    assert SGLANG_PROFILE.requests_finished == TGI_PROFILE.requests_finished == ()


@pytest.mark.parametrize("value", ["NaN", "-1"])
def test_garbage_in_the_finished_counter_is_an_error(value: str) -> None:
    text = vllm_text() + f'vllm:request_success_total{{finished_reason="stop"}} {value}\n'
    with pytest.raises(MetricsParseError, match="request_success_total"):
        parse_metrics(text, VLLM_PROFILE, None)


def test_midburst_capture_without_model_filter_is_the_same(midburst_text: str) -> None:
    assert parse_metrics(midburst_text, VLLM_PROFILE, None) == parse_metrics(
        midburst_text, VLLM_PROFILE, "tiny"
    )


def test_kvfull_capture_shows_a_full_cache_and_preemptions(kvfull_text: str) -> None:
    parsed = parse_metrics(kvfull_text, VLLM_PROFILE, "tiny")
    assert parsed.kv_usage == pytest.approx(1.0)
    assert (parsed.waiting, parsed.running) == (24, 6)
    # Preemptions are a counter: the sample keeps its `_total` suffix.
    preemptions = MetricProfile(
        engine="probe",
        waiting=("vllm:num_preemptions_total",),
        running=("vllm:num_preemptions_total",),
    )
    assert parse_metrics(kvfull_text, preemptions, "tiny").waiting > 0


def test_captures_no_longer_have_the_old_names(midburst_text: str, kvfull_text: str) -> None:
    for text in (midburst_text, kvfull_text):
        assert "vllm:gpu_cache_usage_perc" not in text
        assert "vllm:time_per_output_token_seconds" not in text


def test_a_capture_for_another_model_is_stale_not_idle(midburst_text: str) -> None:
    with pytest.raises(MetricsParseError, match="model_name='other'"):
        parse_metrics(midburst_text, VLLM_PROFILE, "other")


# -- names, labels, fallbacks --------------------------------------------------------------------


def test_old_kv_cache_name_is_the_fallback() -> None:
    text = vllm_text(kv_usage=0.75).replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_metrics(text, VLLM_PROFILE, None).kv_usage == 0.75


def test_new_kv_cache_name_wins_over_the_old_one() -> None:
    text = vllm_text(kv_usage=0.25) + 'vllm:gpu_cache_usage_perc{engine="0"} 0.9\n'
    assert parse_metrics(text, VLLM_PROFILE, None).kv_usage == 0.25


def test_old_tpot_histogram_name_is_the_fallback() -> None:
    text = vllm_text(tpot_sum=3.0, tpot_count=60).replace(
        "inter_token_latency_seconds", "time_per_output_token_seconds"
    )
    parsed = parse_metrics(text, VLLM_PROFILE, None)
    assert (parsed.tpot_sum, parsed.tpot_count) == (3.0, 60)


def test_missing_optional_signals_are_none() -> None:
    text = 'vllm:num_requests_waiting{engine="0"} 1\nvllm:num_requests_running{engine="0"} 2\n'
    assert parse_metrics(text, VLLM_PROFILE, None) == ParsedMetrics(1, 2, None, None, None)


def test_gauges_are_summed_across_engines() -> None:
    text = vllm_text(waiting=3, running=4, tpot_sum=1.0, tpot_count=10) + vllm_text(
        waiting=5, running=2, tpot_sum=2.0, tpot_count=30
    ).replace('engine="0"', 'engine="1"').replace("# TYPE", "# HELP")
    parsed = parse_metrics(text, VLLM_PROFILE, "tiny")
    assert (parsed.waiting, parsed.running) == (8, 6)
    assert (parsed.tpot_sum, parsed.tpot_count) == (3.0, 40)


def test_kv_usage_across_engines_is_the_fullest_not_the_sum() -> None:
    text = vllm_text(kv_usage=0.6) + vllm_text(kv_usage=0.7).replace('engine="0"', 'engine="1"')
    assert parse_metrics(text, VLLM_PROFILE, None).kv_usage == 0.7


def test_model_name_filter_keeps_only_that_model() -> None:
    text = vllm_text(waiting=3, model_name="tiny") + vllm_text(waiting=40, model_name="big")
    assert parse_metrics(text, VLLM_PROFILE, "tiny").waiting == 3
    assert parse_metrics(text, VLLM_PROFILE, "big").waiting == 40
    assert parse_metrics(text, VLLM_PROFILE, None).waiting == 43


def test_series_without_a_model_name_label_count_for_any_model() -> None:
    text = "vllm:num_requests_waiting 4\nvllm:num_requests_running 1\n"
    assert parse_metrics(text, VLLM_PROFILE, "tiny").waiting == 4


def test_similar_names_are_not_mistaken_for_the_signal() -> None:
    text = vllm_text(waiting=1) + (
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99\n'
    )
    assert parse_metrics(text, VLLM_PROFILE, None).waiting == 1


# -- other engines and overrides -----------------------------------------------------------------


def test_sglang_profile() -> None:
    text = (
        '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m"} 7\n'
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m"} 3\n'
        '# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name="m"} 0.4\n'
        "# TYPE sglang:inter_token_latency_seconds histogram\n"
        'sglang:inter_token_latency_seconds_bucket{model_name="m",le="+Inf"} 50\n'
        'sglang:inter_token_latency_seconds_sum{model_name="m"} 2.5\n'
        'sglang:inter_token_latency_seconds_count{model_name="m"} 50\n'
    )
    assert parse_metrics(text, SGLANG_PROFILE, "m") == ParsedMetrics(7, 3, 0.4, 2.5, 50)


def test_sglang_old_tpot_name_is_the_fallback() -> None:
    text = (
        "sglang:num_queue_reqs 0\nsglang:num_running_reqs 1\n"
        "sglang:time_per_output_token_seconds_sum 1.5\n"
        "sglang:time_per_output_token_seconds_count 30\n"
    )
    parsed = parse_metrics(text, SGLANG_PROFILE, None)
    assert (parsed.tpot_sum, parsed.tpot_count) == (1.5, 30)


def test_tgi_profile_has_no_kv_usage() -> None:
    text = (
        "# TYPE tgi_queue_size gauge\ntgi_queue_size 4\n"
        "# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 16\n"
        "# TYPE tgi_request_mean_time_per_token_duration histogram\n"
        'tgi_request_mean_time_per_token_duration_bucket{le="+Inf"} 8\n'
        "tgi_request_mean_time_per_token_duration_sum 0.4\n"
        "tgi_request_mean_time_per_token_duration_count 8\n"
    )
    assert parse_metrics(text, TGI_PROFILE, None) == ParsedMetrics(4, 16, None, 0.4, 8)


def test_profile_for_picks_the_engine() -> None:
    assert profile_for(BackendSettings(engine="sglang")) == SGLANG_PROFILE
    assert profile_for(BackendSettings()) == VLLM_PROFILE
    assert engine_profile("tgi") == TGI_PROFILE


def test_unknown_engine_profile_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown engine"):
        engine_profile("llamacpp")


def test_metric_names_override_replaces_every_candidate() -> None:
    profile = profile_for(
        BackendSettings(metric_names={"waiting": "my:queue_len", "kv_usage": "my:kv"})
    )
    assert profile.waiting == ("my:queue_len",)
    assert profile.kv_usage == ("my:kv",)
    assert profile.running == VLLM_PROFILE.running
    text = vllm_text(waiting=9, kv_usage=0.3) + "my:queue_len 2\nmy:kv 0.8\n"
    parsed = parse_metrics(text, profile, None)
    assert (parsed.waiting, parsed.kv_usage) == (2, 0.8)


def test_renamed_queue_gauges_drop_the_finished_counter() -> None:
    # Gauges from another exporter need not move in step with vLLM's counter.
    assert (
        profile_for(BackendSettings(metric_names={"running": "my:batch"})).requests_finished == ()
    )
    kept = profile_for(BackendSettings(metric_names={"kv_usage": "my:kv"}))
    assert kept.requests_finished == VLLM_PROFILE.requests_finished


def test_overridden_name_absent_means_stale_even_if_the_default_exists() -> None:
    profile = profile_for(BackendSettings(metric_names={"waiting": "my:queue_len"}))
    with pytest.raises(MetricsParseError, match="my:queue_len"):
        parse_metrics(vllm_text(), profile, None)


def test_profile_needs_waiting_and_running() -> None:
    with pytest.raises(ValueError, match="waiting"):
        MetricProfile(engine="x", waiting=(), running=("r",))


# -- garbage means stale, never zero load --------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(os.urandom(512).decode("latin-1"), id="binary-junk"),
        pytest.param("\x00\x01\x02\xff\xfe\x89PNG\r\n", id="binary-header"),
        pytest.param("<html><body><h1>502 Bad Gateway</h1></body></html>", id="html"),
        pytest.param('vllm:num_requests_waiting{engine="0",model_na', id="truncated-labels"),
        pytest.param('vllm:num_requests_waiting{engine="0"} ', id="truncated-value"),
        pytest.param('{"error": "not found"}', id="json"),
        pytest.param("", id="empty"),
        pytest.param("\n\n# just a comment\n", id="comments-only"),
        pytest.param("vllm:num_requests_running 3\n", id="waiting-missing"),
        pytest.param("vllm:num_requests_waiting 3\n", id="running-missing"),
        pytest.param("vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n", id="nan"),
        pytest.param("vllm:num_requests_waiting +Inf\nvllm:num_requests_running 1\n", id="inf"),
        pytest.param("vllm:num_requests_waiting -2\nvllm:num_requests_running 1\n", id="negative"),
    ],
)
def test_garbage_is_a_parse_error(text: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(text, VLLM_PROFILE, None)


def test_nan_in_a_histogram_we_read_is_an_error() -> None:
    text = vllm_text().replace('_sum{engine="0",model_name="tiny"} 1.0', '_sum{engine="0"} NaN')
    with pytest.raises(MetricsParseError, match="nan"):
        parse_metrics(text, VLLM_PROFILE, None)


def test_nan_in_a_series_we_do_not_read_is_ignored() -> None:
    text = vllm_text() + "vllm:something_else NaN\n"
    assert parse_metrics(text, VLLM_PROFILE, None).waiting == 2


def test_junk_in_a_line_we_do_not_read_is_ignored() -> None:
    # Only the lines that can hold our samples are parsed (a real page is ~600 lines).
    text = vllm_text() + "some_exporter_bug{ this is not a sample\n"
    assert parse_metrics(text, VLLM_PROFILE, None).waiting == 2


def test_junk_in_a_line_we_read_is_an_error() -> None:
    text = vllm_text() + "vllm:num_requests_waiting{engine=1} 3\n"
    with pytest.raises(MetricsParseError, match="not Prometheus text"):
        parse_metrics(text, VLLM_PROFILE, None)


def test_truncated_page_after_the_signals_is_still_an_error(midburst_text: str) -> None:
    # A page cut mid-line is not trusted even when the lines we need came before the cut.
    cut = midburst_text[: len(midburst_text) // 2]
    cut = cut[: cut.rindex("{") + 5]
    with pytest.raises(MetricsParseError, match="not Prometheus text"):
        parse_metrics(cut, VLLM_PROFILE, "tiny")


def test_parse_error_message_is_short() -> None:
    with pytest.raises(MetricsParseError) as caught:
        parse_metrics("x" * 10_000 + " y z", VLLM_PROFILE, None)
    assert len(str(caught.value)) < 200


# -- the plain-line reader and prometheus_client agree ---------------------------------------------

EDGE_LINES = [
    'vllm:num_requests_waiting{engine="0",model_name="tiny"} 4',
    'vllm:num_requests_waiting{engine="1",model_name="tiny",} 1e+01',
    'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0 1733000000000',
    'vllm:num_requests_running{engine="1",model_name="t\\"iny"} 2',  # an escape: the fallback
    'vllm:num_requests_running{engine="2",model_name="other"} 7',
    "vllm:num_requests_running\t5",  # a tab: the fallback
    'vllm:kv_cache_usage_perc{engine="0"} .5',
    'vllm:kv_cache_usage_perc{engine="1",engine="2"} 0.25',  # a label twice: the fallback
]


@pytest.mark.parametrize("model_name", ["tiny", None])
def test_plain_lines_read_as_prometheus_client_reads_them(
    midburst_text: str, kvfull_text: str, model_name: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast reader of plain sample lines is an optimisation only: with every line sent to
    prometheus_client instead, every capture and edge line gives the same numbers."""
    from fair_sched_plugin.engine_metrics import parser

    # Without the label named twice (the numbers), and with it (the same refusal).
    edges = ["\n".join(EDGE_LINES[:-1]) + "\n", "\n".join(EDGE_LINES) + "\n"]
    texts = [midburst_text, kvfull_text, *edges]

    def parse_all() -> list[ParsedMetrics | str]:
        """Each text's numbers, or its refusal's message."""
        results: list[ParsedMetrics | str] = []
        for text in texts:
            try:
                results.append(parse_metrics(text, VLLM_PROFILE, model_name))
            except MetricsParseError as exc:
                results.append(str(exc))
        return results

    fast = parse_all()

    class NeverPlain:
        @staticmethod
        def fullmatch(line: str) -> None:
            return None

    monkeypatch.setattr(parser, "_PLAIN_SAMPLE", NeverPlain)
    slow = parse_all()
    assert fast == slow
    assert all(isinstance(result, ParsedMetrics) for result in fast[:3])
    assert isinstance(fast[3], str)


# -- recent time per output token ----------------------------------------------------------------


def _histogram(tpot_sum: float | None, tpot_count: float | None) -> ParsedMetrics:
    return ParsedMetrics(0, 0, None, tpot_sum, tpot_count)


def test_recent_tpot_is_the_delta_not_the_lifetime_mean() -> None:
    earlier = _histogram(100.0, 10_000)  # lifetime mean 10 ms
    later = _histogram(104.0, 10_020)  # 20 tokens at 200 ms each since
    assert recent_tpot(earlier, later) == pytest.approx(0.2)


def test_recent_tpot_needs_an_earlier_scrape() -> None:
    assert recent_tpot(None, _histogram(1.0, 10)) is None


def test_recent_tpot_is_none_without_new_tokens() -> None:
    assert recent_tpot(_histogram(1.0, 10), _histogram(1.0, 10)) is None


def test_recent_tpot_is_none_after_a_counter_reset() -> None:
    assert recent_tpot(_histogram(50.0, 5000), _histogram(0.3, 20)) is None


def test_recent_tpot_is_none_when_the_sum_goes_backwards() -> None:
    assert recent_tpot(_histogram(50.0, 10), _histogram(0.5, 20)) is None


def test_recent_tpot_is_none_without_a_histogram() -> None:
    assert recent_tpot(_histogram(None, None), _histogram(1.0, 10)) is None
    assert recent_tpot(_histogram(1.0, 10), _histogram(None, None)) is None


def test_recent_tpot_between_the_two_real_captures_is_a_reset(
    midburst_text: str, kvfull_text: str
) -> None:
    # The captures come from two engine runs: the second's counters are lower.
    first = parse_metrics(midburst_text, VLLM_PROFILE, "tiny")
    second = parse_metrics(kvfull_text, VLLM_PROFILE, "tiny")
    assert recent_tpot(first, second) is None


def test_midburst_capture_has_the_ttft_and_queue_time_histograms(midburst_text: str) -> None:
    """Inputs of `waiting_below: auto`, from the real vLLM 0.32 capture."""
    parsed = parse_metrics(midburst_text, VLLM_PROFILE, "tiny")
    assert (parsed.ttft_sum, parsed.ttft_count) == (pytest.approx(83.53219795227051), 124)
    assert (parsed.queue_time_sum, parsed.queue_time_count) == (pytest.approx(77.450443792), 116)
    bare = MetricProfile("bare", ("vllm:num_requests_waiting",), ("vllm:num_requests_running",))
    assert parse_metrics(midburst_text, bare, "tiny").ttft_sum is None  # not in the profile


def test_recent_mean_is_the_delta_between_two_scrapes() -> None:
    assert recent_mean((10.0, 20.0), (13.0, 26.0)) == 0.5
    assert recent_mean((10.0, 20.0), (10.0, 20.0)) is None  # nothing observed in between
    assert recent_mean((10.0, 20.0), (1.0, 2.0)) is None  # the engine restarted
    assert recent_mean((None, None), (1.0, 2.0)) is None  # not exported
