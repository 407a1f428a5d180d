"""/metrics: vLLM's names and format, values that follow the load, and the other profiles."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fair_sched_plugin.lab.emulator import RunningEmulator, run_emulator

from .conftest import WaitUntil, chat_body, fast_config, open_client

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MODEL = "emulated-model"


def parse_samples(text: str) -> dict[str, float]:
    """Sample name -> value for label-free lookups (one model, one engine)."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels:
                samples[sample.name] = sample.value
    return samples


def metric_types(text: str) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text)}


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    response = await http.get("/metrics")
    assert response.status_code == 200
    return parse_samples(response.text)


async def test_metrics_rise_with_load_and_fall_after(wait_until: WaitUntil) -> None:
    config = fast_config(max_num_seqs=8, base_step_ms=2.0)
    async with run_emulator(config) as emu, open_client(emu) as http:
        flood = [
            asyncio.create_task(http.post("/v1/chat/completions", json=chat_body(max_tokens=100)))
            for _ in range(40)
        ]
        await wait_until(lambda: emu.engine.statistics().requests_received == 40)
        during = await scrape(http)
        responses = await asyncio.gather(*flood)
        after = await scrape(http)
    assert during["vllm:num_requests_waiting"] > 0
    assert during["vllm:num_requests_running"] == 8
    assert 0 < during["vllm:kv_cache_usage_perc"] <= 1
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    usages = [response.json()["usage"] for response in responses]
    assert after["vllm:generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    assert after["vllm:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert after["vllm:e2e_request_latency_seconds_count"] == 40
    assert after["vllm:time_to_first_token_seconds_count"] == 40
    assert after["vllm:request_queue_time_seconds_count"] == 40
    assert after["vllm:inter_token_latency_seconds_count"] == 40 * 99
    assert after["vllm:num_preemptions_total"] == 0


def finished_by_reason(text: str) -> dict[str, float]:
    return {
        sample.labels["finished_reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:request_success_total"
    }


async def test_finished_counter_plus_the_gauges_count_every_arrival(
    wait_until: WaitUntil,
) -> None:
    """What the gate's arrivals rule relies on: at any scrape, waiting + running + finished is
    every request the engine received (none aborted here), whatever the proxy has seen."""
    config = fast_config(max_num_seqs=4, base_step_ms=5.0)
    async with run_emulator(config) as emu, open_client(emu) as http:
        flood = [
            asyncio.create_task(http.post("/v1/chat/completions", json=chat_body(max_tokens=8)))
            for _ in range(12)
        ]
        await wait_until(lambda: emu.engine.statistics().requests_finished >= 2)
        seen = []
        while not all(task.done() for task in flood):
            text = (await http.get("/metrics")).text
            samples = parse_samples(text)
            in_engine = samples["vllm:num_requests_waiting"] + samples["vllm:num_requests_running"]
            seen.append((in_engine + sum(finished_by_reason(text).values()), in_engine))
        await asyncio.gather(*flood)
        after = finished_by_reason((await http.get("/metrics")).text)
    assert seen and all(total == 12 for total, _ in seen), seen
    assert any(in_engine for _, in_engine in seen)  # some scrape caught it mid-flood
    # The emulator ends a request only at max_tokens: vLLM's "length"; every reason is printed.
    assert after == {"stop": 0, "length": 12, "abort": 0, "error": 0, "repetition": 0}


async def test_without_the_success_counter_vllms_page_lacks_only_that() -> None:
    """`success_counter=False`: vLLM's gauges and histograms, no `request_success_total` (an
    engine whose finished requests the gate cannot count)."""
    async with run_emulator(fast_config(success_counter=False)) as emu, open_client(emu) as http:
        await http.post("/v1/chat/completions", json=chat_body(max_tokens=3))
        text = (await http.get("/metrics")).text
    samples = parse_samples(text)
    assert not finished_by_reason(text)
    assert samples["vllm:num_requests_waiting"] == 0
    assert samples["vllm:time_to_first_token_seconds_count"] == 1
    assert samples["vllm:inter_token_latency_seconds_count"] == 2


async def test_an_aborted_request_is_not_counted_as_finished(wait_until: WaitUntil) -> None:
    """Like vLLM (vllm-project/vllm#31503): an abort leaves the gauges without a count, so
    the gate under-counts arrivals by it (a lease pending a little longer, never one released
    too many)."""
    async with run_emulator(fast_config(max_num_seqs=1)) as emu, open_client(emu) as http:
        body = chat_body(max_tokens=100_000, stream=True)
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert (await anext(response.aiter_lines())).startswith("data: ")
        await wait_until(lambda: emu.engine.statistics().requests_aborted == 1)
        finished = finished_by_reason((await http.get("/metrics")).text)
    assert sum(finished.values()) == 0


async def test_vllm_names_labels_and_types_match_a_real_capture(
    client: httpx.AsyncClient,
) -> None:
    await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    ours = (await client.get("/metrics")).text
    real = (FIXTURES / "vllm-0.32-cpu-metrics-midburst.txt").read_text(encoding="utf-8")
    our_types = metric_types(ours)
    real_types = metric_types(real)
    for name, metric_type in our_types.items():
        assert real_types.get(name) == metric_type, name
    for family in text_string_to_metric_families(ours):
        for sample in family.samples:
            assert {"model_name", "engine"} <= set(sample.labels), sample
            assert sample.labels["engine"] == "0"
    # The same exposition lines (TYPE/HELP, _bucket/_sum/_count/_total/_created) as vLLM.
    real_lines = {line for line in real.splitlines() if line.startswith("# ")}
    our_lines = {line for line in ours.splitlines() if line.startswith("# ")}
    assert our_lines <= real_lines
    labels = 'engine="0",model_name="emulated-model"'
    for expected in (
        f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="0.3",model_name="{MODEL}"}} 1.0',
        f"vllm:e2e_request_latency_seconds_count{{{labels}}} 1.0",
        f"vllm:e2e_request_latency_seconds_sum{{{labels}}} ",
        f"vllm:e2e_request_latency_seconds_created{{{labels}}} ",
        f"vllm:generation_tokens_total{{{labels}}} 2.0",
        f"vllm:generation_tokens_created{{{labels}}} ",
    ):
        assert expected in ours


async def test_every_served_model_has_its_own_series(wait_until: WaitUntil) -> None:
    config = fast_config(models=("model-a", "model-b"))
    async with run_emulator(config) as emu, open_client(emu) as http:
        await http.post("/v1/chat/completions", json=chat_body(max_tokens=3, model="model-b"))
        text = (await http.get("/metrics")).text
    tokens = {
        sample.labels["model_name"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:generation_tokens_total"
    }
    assert tokens == {"model-a": 0, "model-b": 3}


async def _profile_samples(profile: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    async with run_emulator(fast_config(metrics_profile=profile)) as emu, open_client(emu) as http:
        await http.post("/v1/chat/completions", json=chat_body(max_tokens=3))
        text = (await http.get("/metrics")).text
    families = list(text_string_to_metric_families(text))
    labels = [sample.labels for family in families for sample in family.samples]
    return {family.name: family.type for family in families}, labels


async def test_sglang_profile_prints_sglang_names() -> None:
    types, labels = await _profile_samples("sglang")
    assert types["sglang:num_queue_reqs"] == "gauge"
    assert types["sglang:num_running_reqs"] == "gauge"
    assert types["sglang:token_usage"] == "gauge"
    assert types["sglang:inter_token_latency_seconds"] == "histogram"
    assert not any(name.startswith("vllm:") for name in types)
    assert all(label.get("model_name") == MODEL for label in labels)


async def test_tgi_profile_prints_tgi_names_without_a_model_label() -> None:
    types, labels = await _profile_samples("tgi")
    assert types["tgi_queue_size"] == "gauge"
    assert types["tgi_batch_current_size"] == "gauge"
    assert types["tgi_request_mean_time_per_token_duration"] == "histogram"
    assert not any(name.startswith(("vllm:", "sglang:")) for name in types)
    assert all("model_name" not in label for label in labels)


async def test_emulators_in_one_process_keep_separate_registries(emu: RunningEmulator) -> None:
    async with run_emulator(fast_config()) as other, open_client(other) as http:
        await http.post("/v1/chat/completions", json=chat_body(max_tokens=5))
        assert (await scrape(http))["vllm:generation_tokens_total"] == 5
    async with open_client(emu) as http:
        assert (await scrape(http))["vllm:generation_tokens_total"] == 0


async def test_the_filtered_page_has_only_the_named_samples_and_plain_metrics_ignores_it(
    emu: RunningEmulator,
) -> None:
    """As vLLM 0.32: `/metrics/?name[]=...` renders only those samples (a histogram's `_sum`
    and `_count` without its buckets); `/metrics` renders the whole page whatever the query."""
    names = [
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
    ]
    query = [("name[]", name) for name in names]
    async with open_client(emu) as http:
        await http.post("/v1/chat/completions", json=chat_body(max_tokens=5))
        whole = await http.get("/metrics")
        filtered = await http.get("/metrics/", params=query)
        ignored = await http.get("/metrics", params=query)
    assert filtered.status_code == 200
    assert set(parse_samples(filtered.text)) == set(names)
    assert "_bucket" not in filtered.text
    assert len(filtered.content) * 10 < len(whole.content)
    assert set(parse_samples(ignored.text)) == set(parse_samples(whole.text))


async def test_the_filtered_page_can_be_switched_off(emu: RunningEmulator) -> None:
    emu.engine.faults.update({"metrics_filter": False})
    async with open_client(emu) as http:
        refused = await http.get("/metrics/", params={"name[]": "vllm:num_requests_waiting"})
        whole = await http.get("/metrics")
    assert refused.status_code == 404
    assert whole.status_code == 200
