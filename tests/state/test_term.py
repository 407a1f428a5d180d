"""A leadership term over the core, and a replica's own requests: the races between them, without
Redis (the same code runs for memory:// and for a Redis leader)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

from fair_sched_plugin.core import InflightLimitGate, TierLimits
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.state import ReplicaScheduler
from fair_sched_plugin.state.term import Term
from fair_sched_plugin.testing import make_ticket, settle

TIERS = (TierLimits("interactive"),)


def term(cap: int = 1) -> tuple[Term, list[tuple[str, Any]]]:
    replies: list[tuple[str, Any]] = []
    core = FairScheduler(TIERS, InflightLimitGate(cap))
    return Term(core, 7, lambda replica, reply: replies.append((replica, reply))), replies


async def test_cancel_reaches_the_leader_between_the_grant_and_its_callback() -> None:
    """Race: the core granted B (its reservation's callback not run yet) when B's cancel
    arrives. The lease is abandoned in the callback, never replied, and C gets the slot."""
    current, replies = term()
    current.submit(("f", 0, 1), make_ticket("A"))
    await settle()
    current.submit(("f", 0, 2), make_ticket("B"))
    current.submit(("f", 0, 3), make_ticket("C"))
    current.end(("f", 0, 1), None, abandoned=False)  # the core grants B now ...
    current.cancel(("f", 0, 2))  # ... and B's cancel arrives before the callback ran
    await settle()
    granted = [reply[3] for _, reply in replies if reply[0] == "g"]
    assert granted == [1, 3]
    stats = current.core.statistics()
    assert (stats.in_flight, stats.abandoned_total) == (1, 1)


async def test_a_term_drained_while_a_grant_callback_is_pending() -> None:
    """Race: the term ends (the leader steps down) after the core granted a ticket but before
    the grant's callback ran: the lease ends unused and nothing is replied (the replica
    re-sends the ticket to the next leader)."""
    current, replies = term()
    current.submit(("f", 0, 1), make_ticket("A"))  # granted at once
    current.submit(("f", 0, 2), make_ticket("B"))
    current.end(("f", 0, 1), None, abandoned=False)  # the core grants B, callback pending
    current.drain()
    await settle()
    assert [reply[3] for _, reply in replies] == [1]
    stats = current.core.statistics()
    assert (stats.in_flight, stats.queued) == (0, 0)


async def test_a_ticket_cancelled_during_a_hold_is_never_granted() -> None:
    """Race: a new leader holds grants; a ticket re-sent to it is cancelled before the hold
    ends. It never reaches the core."""
    current, replies = term()
    current.holding = True
    current.submit(("f", 0, 1), make_ticket("A"))
    current.submit(("f", 0, 2), make_ticket("B"))
    current.cancel(("f", 0, 1))
    assert current.statistics().queued == 1
    current.end_hold()
    await settle()
    assert [reply[3] for _, reply in replies if reply[0] == "g"] == [2]


async def test_a_ticket_re_sent_to_a_leader_that_has_it_is_not_queued_twice() -> None:
    """Race: a replica re-sends its parked ticket to a leader that already queued (or granted)
    it; the duplicate is ignored, so it is granted once."""
    current, replies = term()
    current.submit(("f", 0, 1), make_ticket("A"))
    await settle()
    current.submit(("f", 0, 1), make_ticket("A"))
    current.submit(("f", 0, 2), make_ticket("B"))
    current.submit(("f", 0, 2), make_ticket("B"))
    assert current.core.statistics().queued == 1
    current.end(("f", 0, 1), None, abandoned=False)
    await settle()
    assert [reply[3] for _, reply in replies if reply[0] == "g"] == [1, 2]


async def test_a_replica_rejoining_with_a_new_session_replaces_its_old_one() -> None:
    """Race: a replica comes back from an outage (new session) while the leader still holds
    its old session's lease: the old one ends (its capacity is not counted twice) and the
    adopted one counts."""
    current, _ = term(cap=2)
    assert current.accepts("f", 0)
    current.submit(("f", 0, 1), make_ticket("A"))
    await settle()
    assert current.accepts("f", 1)
    current.adopt(("f", 1, 1), make_ticket("A"), started=True)
    assert current.core.statistics().in_flight == 1
    assert not current.accepts("f", 0)  # late messages of the old session are ignored


async def test_a_reply_of_an_earlier_session_is_ignored() -> None:
    """Race: after rejoining, a grant written for the replica's previous session arrives; the
    ticket waits for the current session's grant and is granted once. (The replica layer on its
    own term, as a replica cut off from Redis runs: memory:// hands out the core's leases.)"""
    replica = ReplicaScheduler(FairScheduler(TIERS, InflightLimitGate(1)))
    holder = await replica.acquire(make_ticket("A"))
    parked = asyncio.ensure_future(replica.acquire(make_ticket("B")))
    await settle()
    tid = max(replica._parked)
    replica._on_reply(("g", replica._epoch, replica._session - 1, tid, 1.0, None))
    assert not parked.done()
    holder.release()
    lease = await asyncio.wait_for(parked, 5)
    assert replica.statistics().in_flight == 1
    lease.release()
    await replica.aclose()


def test_memory_state_never_imports_redis() -> None:
    """redis is an optional extra: a memory:// service runs without it."""
    code = (
        "import sys; from fair_sched_plugin.runtime.service import SchedulingService; "
        "SchedulingService({}); print('redis' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


async def test_a_second_grant_for_a_lease_already_held_is_ignored() -> None:
    """Race: after an outage a grant for a ticket the replica already holds (granted locally,
    adopted by the leader) arrives late; it is neither used again nor handed back (the lease
    running under that id must stay counted)."""
    replica = ReplicaScheduler(FairScheduler(TIERS, InflightLimitGate(2)))
    lease = await replica.acquire(make_ticket("A"))
    replica._on_reply(("g", replica._epoch, replica._session, lease.lease_id, 1.0, None))
    await settle()
    assert replica.statistics().in_flight == 1
    assert lease.active
    lease.release()
    assert replica.statistics().in_flight == 0
    await replica.aclose()
