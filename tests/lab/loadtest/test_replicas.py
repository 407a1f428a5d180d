"""The replica scenarios' workload and summaries, from scripted records and samples."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fair_sched_plugin.cli import main
from fair_sched_plugin.lab.demo import add_demo_parsers
from fair_sched_plugin.lab.loadtest.client import RequestRecord
from fair_sched_plugin.lab.loadtest.replicas import (
    BLOCK_TOKENS,
    EngineSample,
    EngineTrace,
    SharedPrefixSize,
    best_hit_rate,
    engine_summary,
    jain_while_backlogged,
    replica_fair_sched,
    shared_prefix_requests,
    system_prompt,
)


def test_best_hit_rate_every_users_first_request_misses() -> None:
    prompt = "s" * (BLOCK_TOKENS * 4 * 10)  # 10 whole blocks
    ask = [{"role": "system", "content": prompt}, {"role": "user", "content": "q" * 40}]
    requests = [(0, ask), (1, ask), (0, ask), (0, ask)]
    tokens_each = (len(prompt) + 40) // 4  # 170
    # User 1's prompt is the same text, but a prefix is cached per user here: what the scenario
    # sends never shares a block between users (its prompts differ from the first character).
    hit = 2 * 10 * BLOCK_TOKENS + 2 * 0  # user 0's 2nd and 3rd: the 10 blocks, tail (10 t) not
    assert best_hit_rate(requests) == pytest.approx(hit / (4 * tokens_each))


def test_best_hit_rate_counts_only_whole_blocks_of_the_common_start() -> None:
    first = [{"role": "user", "content": "a" * (BLOCK_TOKENS * 4 * 3 + 8)}]
    second = [{"role": "user", "content": "a" * (BLOCK_TOKENS * 4 * 3 + 8) + "b" * 400}]
    rate = best_hit_rate([(0, first), (0, second)])
    queried = (BLOCK_TOKENS * 4 * 3 + 8) // 4 + (BLOCK_TOKENS * 4 * 3 + 8 + 400) // 4
    assert rate == pytest.approx(3 * BLOCK_TOKENS / queried)


def test_shared_prefix_workload_round_by_round_with_distinct_prompts() -> None:
    size = SharedPrefixSize(users=5, requests_per_user=3, system_prompt_tokens=200)
    requests = shared_prefix_requests(size)
    assert [user for user, _ in requests[:6]] == [0, 1, 2, 3, 4, 0]
    assert len(requests) == 15
    prompts = {messages[0]["content"] for _, messages in requests}
    assert len(prompts) == 5
    assert all(len(prompt) == 800 for prompt in prompts)
    # Different from the first block on: users never share a cached block.
    assert len({prompt[: BLOCK_TOKENS * 4] for prompt in prompts}) == 5
    assert system_prompt(3, 200) == system_prompt(3, 200)


def test_cache_holds_a_little_more_than_half_of_all_prompts() -> None:
    size = SharedPrefixSize(users=20, system_prompt_tokens=1500, cache_share=0.6)
    assert size.prompt_blocks == 94
    assert 0.5 * 20 * 94 < size.cache_blocks < 20 * 94
    assert size.engine().prefix_cache_blocks == size.cache_blocks


def _record(user: str, first: float, ended: float, tokens: int = 10) -> RequestRecord:
    return RequestRecord(user, "user", 0.0, first_token=first, ended=ended, tokens=tokens)


def test_jain_counts_service_until_the_first_user_has_nothing_left() -> None:
    records = [
        _record("a", 0.0, 2.0),  # a's last request ends at 2 s: the window
        _record("b", 0.0, 2.0),
        _record("b", 2.0, 4.0),  # after the window: not counted
        _record("c", 1.0, 3.0),  # half inside
    ]
    # a 10, b 10, c 5
    assert jain_while_backlogged(records) == pytest.approx(25**2 / (3 * (100 + 100 + 25)))


def test_jain_is_one_for_equal_service_and_none_for_one_user() -> None:
    assert jain_while_backlogged([_record("a", 0, 1), _record("b", 0, 1)]) == 1.0
    assert jain_while_backlogged([_record("a", 0, 1)]) is None


def test_engine_summary_hit_rate_from_counter_growth_and_waiting_while_running() -> None:
    engine = EngineTrace("engine 1", "http://127.0.0.1:1")
    engine.samples = [
        EngineSample(0.0, 0, 0, 1000.0, 100.0),
        EngineSample(1.0, 4, 8, 3000.0, 1100.0),
        EngineSample(2.0, 2, 8, 5000.0, 2100.0),
        EngineSample(9.0, 0, 0, 5000.0, 2100.0),  # after the run: left out of the means
    ]
    engine.stats_before = {"requests_received": 1}
    engine.stats_after = {"requests_received": 41, "max_waiting_seen": 5}
    summary = engine_summary(engine, until_s=2.0)
    assert summary["hit_rate"] == pytest.approx(2000 / 4000)
    assert summary["max_waiting_sampled"] == 4
    assert summary["mean_waiting_sampled"] == 2.0
    assert summary["max_waiting_seen"] == 5
    assert summary["requests_received"] == 40


def test_the_plugin_gates_each_deployment_of_tiny() -> None:
    section = replica_fair_sched(["http://a/v1", "http://b/v1"], 3, [{"name": "x", "keys": ["k"]}])
    assert section["backends"]["tiny"]["api_bases"] == ["http://a/v1", "http://b/v1"]
    assert section["tiers"] == [{"name": "interactive", "waiting_below": 3}]


def test_bench_knows_the_replica_scenarios_and_skips_them_for_a_real_engine(
    tmp_path: Path,
) -> None:
    """Both need emulators (speed, prefix cache): against `--engine` they say so, start nothing."""
    out = tmp_path / "report"
    argv = ["bench", "--scenarios", "unequal-replicas,shared-prefixes", "--out", str(out)]
    assert main([*argv, "--engine", "http://127.0.0.1:9"]) == 0
    report = (out / "index.md").read_text()
    assert "## Unequal replicas" in report
    assert "## Shared prefixes" in report
    assert report.count("Skipped:") == 2


def test_demo_takes_replicas() -> None:
    parser = argparse.ArgumentParser()
    add_demo_parsers(parser.add_subparsers())
    args = parser.parse_args(["demo", "--replicas", "--quick"])
    assert args.replicas and args.quick
