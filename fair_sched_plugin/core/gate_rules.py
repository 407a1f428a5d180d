"""The metrics gate's decision rules: whether one deployment has room for one more request of a
tier, read from its ledger (core/deployment_ledger.py).

Pending requests that will find a free running slot never enter the engine's queue: the
engine fills free slots from its own queue first, ours take what is left, the rest waits.

    max(0, waiting - free_slots) + max(0, pending - max(0, free_slots - waiting))

A deployment has room while that estimate is below the tier's threshold (`waiting_below`, or
its tuner's with `auto`), and its TPOT and KV usage are below the tier's. Without fresh metrics
it has room while its requests in flight are below a fixed cap (`fallback_max_inflight`).

A threshold below 1 (`waiting_below: 0`, or `auto` down to a minimum of 0) keeps no engine queue
at all: a request is released only when the engine's queue estimate with it added is still 0,
that is into a running slot left free for it. Such a tier probes for slots too, from none on an
idle engine (else its first slot would never count free). Each probe past the engine's real
slots puts one request in its queue until a slot frees, so with such a tier `max_num_seqs`
(the probes' ceiling) should be given: without it the engine holds a queue of about one while
saturated, which is what the tier exists to avoid.

With `fair_engine_queue` a user with no request in the engine's queue (a newcomer) may go past
the threshold by the deployment's running slots: the engine serves its request before the
queued ones of users who have some there.

A tier's `reserve_slots` keeps that many of the engine's running slots free of requests from
its users who already hold one in flight (the scheduler asks `into_reserve` only for a user who
holds none): whoever comes next starts in a free slot instead of waiting for one to end. It is
counted against `max_num_seqs`, never the learned capacity (which the reservation itself would
lower window by window), so it needs the slots given; a fallback engine reserves nothing.

Replicas that share one engine without shared state (`MetricsGate.share_with`) each spend only
their share of every threshold, cap and free slot.
"""

from __future__ import annotations

from .deployment_ledger import DeploymentLedger
from .ticket import TierLimits


def blocked_reason(
    ledger: DeploymentLedger,
    tier: TierLimits,
    now: float,
    sharers: int,
    *,
    newcomer: bool = False,
    into_reserve: bool = False,
) -> str | None:
    """Why the deployment has no room for one more request of the tier; None if it has."""
    snapshot = ledger.latest
    if ledger.mode != "metrics" or snapshot is None:
        if ledger.in_flight < share(ledger.group.fallback_max_inflight, sharers):
            return None
        return "fallback_inflight"
    # Free running slots are capacity too: replicas sharing one engine split them as well
    # (whole slots, so the shares never add up to more than the engine has).
    free_slots = ledger.free_slots(sharers)
    allowed = waiting_below(ledger, tier, now)
    if newcomer:
        allowed += ledger.capacity()
    if allowed < 1:
        # No engine queue at all (`waiting_below: 0`, or `auto` down to 0): a request waits
        # in our queue, where its user's turn comes, until a running slot is free for it too.
        # A queue of one makes a newcomer wait for two completions instead of one.
        if engine_queue_estimate(snapshot.waiting, ledger.pending_count + 1, free_slots):
            return "waiting"
    elif engine_queue_estimate(snapshot.waiting, ledger.pending_count, free_slots) >= share(
        allowed, sharers
    ):
        return "waiting"
    if _at_or_over(snapshot.tpot_s, tier.tpot_below_s):
        return "tpot"
    if _at_or_over(snapshot.kv_usage, tier.kv_usage_below):
        return "kv_usage"
    # Into the reserve only into a slot that is free: never into the engine's queue.
    if tier.reserve_slots and _over_slots(ledger, 0 if into_reserve else tier.reserve_slots):
        return "reserved"
    return None


def _over_slots(ledger: DeploymentLedger, kept_free: int) -> bool:
    """One more request on the deployment would leave fewer than `kept_free` of its running
    slots free. Its load is the whole engine's (scraped running and waiting, with our first
    bytes, ends and requests on their way), so replicas sharing it need no share of it; our
    own requests in flight bound it from below, where a lagging /metrics shows fewer than
    run (a request the grace settled as arrived that no scrape shows yet counts nowhere else)."""
    slots = ledger.group.max_num_seqs
    used = max(ledger.load(), float(ledger.in_flight))
    return slots is not None and used + 1 > slots - kept_free


def waiting_below(ledger: DeploymentLedger, tier: TierLimits, now: float) -> float:
    """The engine queue the tier allows on the deployment: fixed, or its tuner's now."""
    if tier.auto_waiting_below is None:
        return tier.waiting_below
    return ledger.tuner(tier, tier.auto_waiting_below, now).allowed


def engine_queue_estimate(waiting: float, pending: float, free_slots: float) -> float:
    """The engine's queue once our pending requests arrive: it fills free slots from its own
    queue first, ours take what is left, the rest waits."""
    left_free = max(0.0, free_slots - waiting)
    return max(0.0, waiting - free_slots) + max(0.0, pending - left_free)


def share(limit: float, sharers: int) -> float:
    """One replica's part of a threshold or cap shared by `sharers` replicas (at least 1)."""
    return limit if sharers == 1 else max(1.0, limit / sharers)


def placement_slots(ledger: DeploymentLedger, sharers: int) -> float:
    """The deployment's running slots for placement: learned (or max_num_seqs) with metrics,
    the fallback cap without; at least 1."""
    if ledger.mode != "metrics":
        return max(1.0, share(ledger.group.fallback_max_inflight, sharers))
    return max(1.0, ledger.capacity())


def _at_or_over(value: float | None, ceiling: float | None) -> bool:
    return value is not None and ceiling is not None and value >= ceiling
