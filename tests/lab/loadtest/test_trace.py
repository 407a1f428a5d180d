"""Traces: parsing with errors that name the line, and the synthetic shapes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from fair_sched_plugin.cli import main
from fair_sched_plugin.lab.loadtest.trace import (
    SHAPES,
    TraceError,
    TraceRequest,
    TraceShape,
    make_trace,
    parse_trace,
    prompt_messages,
    read_trace,
    write_trace,
)


def test_a_trace_parses_sorted_by_arrival() -> None:
    lines = [
        '{"t": 2.5, "user": "b", "prompt_tokens": 10, "max_tokens": 8, "tier": "batch"}',
        "",
        "# a comment",
        '{"arrival_s": 0.5, "user": "a", "prompt": "hello", "max_tokens": 4}',
    ]
    trace = parse_trace(lines, "day.jsonl")
    assert [(r.user, r.at_s, r.tier) for r in trace] == [("a", 0.5, None), ("b", 2.5, "batch")]
    assert trace[0].prompt == "hello"
    assert trace[1].prompt_tokens == 10


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "day.jsonl:2: not JSON"),
        ("[1, 2]", "day.jsonl:2: a line must be a JSON object"),
        ('{"user": "a", "prompt_tokens": 1, "max_tokens": 4}', "day.jsonl:2: missing 't'"),
        ('{"t": 1, "prompt_tokens": 1, "max_tokens": 4}', "day.jsonl:2: missing 'user'"),
        ('{"t": -1, "user": "a", "prompt_tokens": 1, "max_tokens": 4}', "day.jsonl:2: 't' must be"),
        ('{"t": 1, "user": "a", "prompt_tokens": 1, "max_tokens": 0}', "day.jsonl:2: 'max_tokens'"),
        ('{"t": 1, "user": "a", "prompt_tokens": 1, "max_tokens": 1e400}', "'max_tokens' must be"),
        ('{"t": 1, "user": "a", "max_tokens": 4}', "exactly one of 'prompt'"),
        (
            '{"t": 1, "user": "a", "prompt": "x", "prompt_tokens": 1, "max_tokens": 4}',
            "exactly one",
        ),
        ('{"t": 1, "user": "", "prompt_tokens": 1, "max_tokens": 4}', "'user' must be a string"),
        ('{"t": 1, "user": "a", "prompt_tokens": 1, "max_tokens": 4, "x": 1}', "unknown field"),
        ('{"t": 1, "user": "a", "prompt_tokens": 1, "max_tokens": 4, "prefix": "p"}', "together"),
        ('{"t": true, "user": "a", "prompt_tokens": 1, "max_tokens": 4}', "'t' must be a number"),
    ],
)
def test_a_bad_line_names_its_file_and_line(line: str, message: str) -> None:
    good = '{"t": 0, "user": "a", "prompt_tokens": 1, "max_tokens": 4}'
    with pytest.raises(TraceError, match=r"day\.jsonl:2") as caught:
        parse_trace([good, line], "day.jsonl")
    assert message in str(caught.value)


def test_an_empty_trace_is_refused() -> None:
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["", "# nothing"], "empty.jsonl")


def test_a_written_trace_reads_back_the_same(tmp_path: Path) -> None:
    trace = make_trace(TraceShape("prefix", requests=12, users=3, prefix_tokens=40))
    assert read_trace(write_trace(trace, tmp_path / "t.jsonl")) == trace


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_has_the_requested_size_and_is_seeded(shape: str) -> None:
    size = TraceShape(shape, requests=60, users=5, max_tokens=16, duration_s=4.0)
    trace = make_trace(size)
    assert len(trace) == 60
    assert trace == make_trace(size)
    assert all(r.max_tokens <= 16 for r in trace)
    assert [r.at_s for r in trace] == sorted(r.at_s for r in trace)
    assert max(r.at_s for r in trace) <= max(4.0, size.idle_s + 0.2)


def test_the_heavy_user_is_u0_in_flood_zipf_and_burst() -> None:
    for shape in ("flood", "zipf", "burst"):
        counts = Counter(r.user for r in make_trace(TraceShape(shape, requests=200, users=8)))
        assert counts.most_common(1)[0][0] == "u0", shape


def test_tiers_and_prefixes_are_in_the_trace() -> None:
    tiers = make_trace(TraceShape("tiers", requests=20, users=4, batch_users=2))
    assert {r.user for r in tiers if r.tier == "batch"} == {"u0", "u1"}
    assert {r.tier for r in tiers} == {"batch", "interactive"}
    prefix = make_trace(TraceShape("prefix", requests=8, users=4, prefix_tokens=50))
    first, second = (r for r in prefix if r.user == "u1")
    # The same system prompt, different questions: what a prefix cache reuses.
    system = [prompt_messages(first, 1)[0], prompt_messages(second, 5)[0]]
    assert system[0] == system[1] and system[0]["role"] == "system"
    assert prompt_messages(first, 1)[1] != prompt_messages(second, 5)[1]


def test_make_trace_command_writes_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "zipf.jsonl"
    assert (
        main(
            ["make-trace", "--shape", "zipf", "--requests", "30", "--users", "6", "--out", str(out)]
        )
        == 0
    )
    assert len(read_trace(out)) == 30
    assert "30 requests" in capsys.readouterr().out
    assert main(["make-trace", "--shape", "flood", "--users", "1", "--out", str(out)]) == 2


def test_a_trace_request_round_trips_through_json() -> None:
    request = TraceRequest(1.5, "u3", 32, prompt="hi", tier="batch")
    assert parse_trace([__import__("json").dumps(request.to_json())]) == [request]
