"""The leader's statistics document as a follower reads it (pure: no Redis)."""

from __future__ import annotations

import json

from fair_sched_plugin.core import (
    BackendGroup,
    BackendSnapshot,
    Deployment,
    FairScheduler,
    MetricsGate,
    TierLimits,
)
from fair_sched_plugin.state.replica import _read_published
from fair_sched_plugin.testing import FakeClock

AUTO = TierLimits("interactive", waiting_below=2, auto_waiting_below=(1, 8), ttft_target_s=1.0)


def test_a_follower_reads_the_leaders_gate_rows_per_deployment() -> None:
    clock = FakeClock()
    urls = ("http://a/metrics", "http://b/metrics")
    group = BackendGroup("m", (Deployment("http://a/v1", urls[0]), Deployment(urls[1], urls[1])))
    gate = MetricsGate([group], stale_after_s=1.0, clock=clock)
    scheduler = FairScheduler([AUTO], gate, clock=clock)
    for url in urls:
        gate.update("m", BackendSnapshot(url, clock.now(), ok=True, waiting=1, running=4))
    gate.may_release("m", AUTO)  # the tuners start
    stats = scheduler.statistics()
    document = {
        "scheduler": {
            **stats._asdict(),
            "queued_by_model_tier": [[m, t, n] for (m, t), n in stats.queued_by_model_tier.items()],
            "in_flight_by_model": list(stats.in_flight_by_model.items()),
        },
        # As `ReplicaScheduler._document` writes it.
        "gate": [list(row) for row in gate.status()],
    }
    published = _read_published(json.dumps(document))
    assert published is not None
    assert published.gate == tuple(gate.status())
    (row,) = published.gate
    assert [d.deployment for d in row.per_deployment] == ["http://a/v1", urls[1]]
    assert row.per_deployment[0].allowed_queue == (("interactive", 2.0),)
    # An older leader's rows (no per-deployment part) still read.
    older = {**document, "gate": [list(row)[:-1] for row in gate.status()]}
    published = _read_published(json.dumps(older))
    assert published is not None and published.gate[0].per_deployment == ()
