"""The leader's statistics document as a follower reads it (pure: no Redis)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fair_sched_plugin.core import (
    BackendGroup,
    BackendSnapshot,
    Deployment,
    DeploymentStatus,
    FairnessReading,
    GroupStatus,
    MetricsGate,
    TierLimits,
)
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.state.wire import read_published, statistics_document
from fair_sched_plugin.testing import FakeClock

AUTO = TierLimits("interactive", waiting_below=2, auto_waiting_below=(1, 8), ttft_target_s=1.0)


def _leader(clock: FakeClock) -> tuple[FairScheduler, MetricsGate]:
    urls = ("http://a/metrics", "http://b/metrics")
    group = BackendGroup("m", (Deployment("http://a/v1", urls[0]), Deployment(urls[1], urls[1])))
    gate = MetricsGate([group], stale_after_s=1.0, clock=clock)
    scheduler = FairScheduler([AUTO], gate, clock=clock)
    for url in urls:
        gate.update("m", BackendSnapshot(url, clock.now(), ok=True, waiting=1, running=4))
    gate.may_release("m", AUTO)  # the tuners start
    return scheduler, gate


def _document(scheduler: FairScheduler, gate_rows: list[Any]) -> str:
    stats = scheduler.statistics()
    return json.dumps(
        {
            "scheduler": {
                **stats._asdict(),
                "queued_by_model_tier": [
                    [m, t, n] for (m, t), n in stats.queued_by_model_tier.items()
                ],
                "in_flight_by_model": list(stats.in_flight_by_model.items()),
            },
            "gate": gate_rows,
        }
    )


def test_a_gate_row_survives_the_wire_by_name() -> None:
    _, gate = _leader(FakeClock())
    (row,) = gate.status()
    assert row.per_deployment and row.allowed_queue  # the nested parts are on the trip too
    assert GroupStatus.from_wire(json.loads(json.dumps(row.to_wire()))) == row
    assert set(row.to_wire()) == set(GroupStatus._fields)
    assert set(row.to_wire()["per_deployment"][0]) == set(DeploymentStatus._fields)


def test_a_follower_reads_the_leaders_gate_rows_per_deployment() -> None:
    scheduler, gate = _leader(FakeClock())
    stats = scheduler.statistics()
    published = read_published(statistics_document("leader", 1, 2, stats, gate.status()))
    assert published == (stats, tuple(gate.status()), ())
    (row,) = published.gate
    assert [d.deployment for d in row.per_deployment] == ["http://a/v1", "http://b/metrics"]
    assert row.per_deployment[0].allowed_queue == (("interactive", 2.0),)


def test_an_older_leaders_positional_rows_still_read() -> None:
    """During a rolling upgrade the leader may be a version that wrote `list(row)`."""
    scheduler, gate = _leader(FakeClock())
    positional = json.loads(json.dumps([list(row) for row in gate.status()]))
    assert read_published(_document(scheduler, positional)).gate == tuple(gate.status())
    # Older still: no per-deployment rows, no allowed queue.
    oldest = [row[:-2] for row in positional]
    (row,) = read_published(_document(scheduler, oldest)).gate
    assert row.per_deployment == () and row.allowed_queue == ()
    assert row.free_slots == gate.status()[0].free_slots


def test_a_newer_leaders_added_fields_are_ignored() -> None:
    scheduler, gate = _leader(FakeClock())
    rows = [{**row.to_wire(), "added_later": 1} for row in gate.status()]
    assert read_published(_document(scheduler, rows)).gate == tuple(gate.status())


def test_a_row_missing_a_field_fails_naming_it() -> None:
    scheduler, gate = _leader(FakeClock())
    (row,) = [row.to_wire() for row in gate.status()]
    del row["free_slots"]
    with pytest.raises(ValueError, match="GroupStatus on the wire lacks free_slots"):
        read_published(_document(scheduler, [row]))
    (row,) = [row.to_wire() for row in gate.status()]
    del row["per_deployment"][0]["in_flight"]
    with pytest.raises(ValueError, match="DeploymentStatus on the wire lacks in_flight"):
        read_published(_document(scheduler, [row]))


def test_a_positional_row_longer_than_any_older_leader_wrote_is_refused() -> None:
    scheduler, gate = _leader(FakeClock())
    rows = [[*list(row), "extra"] for row in gate.status()]
    with pytest.raises(ValueError, match="positional gate row has 15 fields"):
        read_published(_document(scheduler, rows))


READING = FairnessReading(
    "m", "interactive", 2, (("tokens", 0.75), ("requests", 1.0)), 96.0, 1.5, 60
)


def test_a_follower_reads_the_leaders_fairness_gauges() -> None:
    scheduler, gate = _leader(FakeClock())
    stats = scheduler.statistics()
    document = statistics_document("leader", 1, 2, stats, gate.status(), [READING])
    assert read_published(document).fairness == (READING,)


def test_an_older_leaders_document_has_no_fairness_gauges() -> None:
    scheduler, _ = _leader(FakeClock())
    assert read_published(_document(scheduler, [])).fairness == ()


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("jain_index", (("tokens", 1.5),)),
        ("jain_index", (("watts", 0.5),)),
        ("service_gap_tokens", -1.0),
        ("starved_wait_s", float("nan")),
        ("users", -1),
        ("model", ""),
    ],
)
def test_a_fairness_gauge_out_of_range_is_refused(field: str, bad: object) -> None:
    scheduler, _ = _leader(FakeClock())
    reading = READING._replace(**{field: bad})
    document = statistics_document("leader", 1, 2, scheduler.statistics(), [], [reading])
    with pytest.raises(ValueError, match="fairness"):
        read_published(document)
