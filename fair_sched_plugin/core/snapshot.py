"""What one scrape of an engine's `/metrics` said, in engine-neutral terms."""

from __future__ import annotations

from typing import NamedTuple


class BackendSnapshot(NamedTuple):
    """One deployment's load as of one scrape.

    `started_at` is the clock time at which the scrape request was *sent* (any request we released
    before that instant may already be counted in `waiting`). `ok` is False when the scrape failed
    or could not be parsed: a failed scrape means *unknown*, never *zero load*; then the numeric
    fields are meaningless and `error` says why.
    """

    url: str
    started_at: float
    ok: bool
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float | None = None  # 0..1
    tpot_s: float | None = None  # recent time per output token (delta over the last interval)
    # The engine's own recent time to first token and time in its queue (means over the last
    # interval), where it exports them: inputs of `waiting_below: auto`, never of the gate.
    ttft_s: float | None = None
    queue_time_s: float | None = None
    # How many requests the engine has finished in its lifetime, for every reason (vLLM's
    # `request_success_total` summed over `finished_reason`), where it exports such a counter:
    # with the waiting and running counts it tells how many requests arrived between two
    # scrapes, in step with them (see core/deployment_ledger.py). None: not exported.
    requests_finished: float | None = None
    error: str | None = None

    @classmethod
    def failed(cls, url: str, started_at: float, error: str) -> BackendSnapshot:
        return cls(url=url, started_at=started_at, ok=False, error=error)
