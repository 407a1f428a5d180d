"""The rejection log: at most one line per key and interval, counting what it skipped."""

from __future__ import annotations

from fair_sched_plugin.observability._rejection_log import RejectionLogLimiter


def test_rejection_log_lines_are_limited_per_key_and_count_what_was_skipped() -> None:
    now = [0.0]
    limiter = RejectionLogLimiter(60.0, max_keys=2, clock=lambda: now[0])
    assert limiter.allow("alice") == 0
    assert limiter.allow("alice") is None
    assert limiter.allow("alice") is None
    assert limiter.allow("bob") == 0  # another key has its own allowance
    now[0] = 61.0
    assert limiter.allow("alice") == 2  # logged again, saying two were skipped
    assert limiter.allow("alice") is None
    # A third key evicts the least recently logged one (bob), which starts afresh.
    assert limiter.allow("carol") == 0
    assert limiter.allow("bob") == 0
