"""The messages replicas send each other through Redis, read without Redis: every field is
checked to its documented range where it is read (`core/ticket.py`'s ranges for what one request
may claim), so the deciding core never sees a 400-digit integer, a NaN or a negative count; and
what a lease used (tokens and money) reaches the deciding core, whichever backend carries it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from fair_sched_plugin.core import InflightLimitGate, Lease, TierLimits
from fair_sched_plugin.errors import DeadlineUnreachable
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.state import open_state, wire
from fair_sched_plugin.state.term import Term
from fair_sched_plugin.state.wire import OutOfRange, parse_reply, read_message, read_published
from fair_sched_plugin.testing import make_ticket, settle

TIERS = (TierLimits("interactive"),)
HUGE = int("9" * 400)  # what wedged a leader: its charge raised OverflowError
NAN = float("nan")

HEADER = ["s", 1, 0, "follower", 3]
TICKET = [
    "m",
    "A",
    "interactive",
    1.0,
    40,
    [],
    0.5,
]  # model, user, tier, weight, cost, prefix, price


def ticket(**changes: Any) -> list[Any]:
    fields = dict(
        zip(("model", "user", "tier", "weight", "cost", "prefix", "price"), TICKET, strict=True)
    )
    fields.update(changes)
    return [*HEADER, *fields.values()]


def adopted(**changes: Any) -> list[Any]:
    started = changes.pop("started", True)
    deployment = changes.pop("deployment", None)
    *fields, price = ticket(**changes)[5:]
    return ["a", 1, 0, "follower", 3, *fields, started, deployment, price]


def end(tokens: Any = 12, abandoned: Any = False, cost: Any = 0.25) -> list[Any]:
    return ["e", 1, 0, "follower", 3, tokens, abandoned, cost]


def spend(usd: Any = 0.5, tokens: Any = 10, principal: Any = "A") -> list[Any]:
    return ["$", 1, 0, "follower", 0, principal, usd, tokens]


def header(**changes: Any) -> list[Any]:
    fields = dict(
        zip(("kind", "epoch", "session", "replica", "tid"), ["c", 1, 0, "follower", 3], strict=True)
    )
    fields.update(changes)
    return list(fields.values())


# (the field the log line names, a message with it out of range)
BAD_MESSAGES: dict[str, tuple[str, list[Any]]] = {
    "epoch huge": ("epoch", header(epoch=HUGE)),
    "epoch negative": ("epoch", header(epoch=-1)),
    "epoch float": ("epoch", header(epoch=1.5)),
    "session huge": ("session", header(session=HUGE)),
    "session negative": ("session", header(session=-3)),
    "id huge": ("id", header(tid=HUGE)),
    "id negative": ("id", header(tid=-1)),
    "id bool": ("id", header(tid=True)),
    "replica empty": ("replica", header(replica="")),
    "replica long": ("replica", header(replica="r" * 10_000)),
    "kind": ("kind", header(kind="z")),
    "ticket cost huge": ("ticket cost", ticket(cost=HUGE)),
    "ticket cost negative": ("ticket cost", ticket(cost=-5)),
    "ticket cost float": ("ticket cost", ticket(cost=40.5)),
    "ticket weight nan": ("ticket weight", ticket(weight=NAN)),
    "ticket weight huge": ("ticket weight", ticket(weight=HUGE)),
    "ticket weight zero": ("ticket weight", ticket(weight=0)),
    "ticket weight negative": ("ticket weight", ticket(weight=-1.0)),
    "ticket price huge": ("ticket price", ticket(price=HUGE)),
    "ticket price nan": ("ticket price", ticket(price=NAN)),
    "ticket price infinite": ("ticket price", ticket(price=float("inf"))),
    "ticket price negative": ("ticket price", ticket(price=-0.5)),
    "ticket tier unknown": ("ticket tier", ticket(tier="gold")),
    "ticket user": ("ticket user", ticket(user=7)),
    "ticket prefix": ("ticket prefix", ticket(prefix=[HUGE])),
    "adopted cost huge": ("ticket cost", adopted(cost=HUGE)),
    "adopted price nan": ("ticket price", adopted(price=NAN)),
    "adopted started": ("started", adopted(started="yes")),
    "adopted deployment": ("deployment", adopted(deployment=5)),
    "end abandoned": ("abandoned", end(abandoned=0)),
    "spend usd huge": ("spend usd", spend(usd=HUGE)),
    "spend usd nan": ("spend usd", spend(usd=NAN)),
    "spend usd negative": ("spend usd", spend(usd=-1.0)),
    "spend tokens huge": ("spend tokens", spend(tokens=HUGE)),
    "spend tokens negative": ("spend tokens", spend(tokens=-1)),
    "spend principal": ("spend principal", spend(principal=None)),
}


@pytest.mark.parametrize("case", list(BAD_MESSAGES))
def test_a_follower_message_out_of_range_is_refused_naming_the_field(case: str) -> None:
    field, message = BAD_MESSAGES[case]
    with pytest.raises(OutOfRange) as refused:
        read_message(json.dumps(message), TIERS)
    assert refused.value.field == field
    assert len(str(refused.value)) < 120  # a 400-digit value is not repeated in full


def test_messages_in_range_are_read_and_older_ones_still_are() -> None:
    read = read_message(json.dumps(ticket()), TIERS)
    assert read.body[0] == make_ticket("A", cost=40, price=0.5)
    # Without the price (a follower older than the field): priced at nothing, as it was.
    assert read_message(json.dumps(ticket()[:-1]), TIERS).body[0].price == 0.0
    assert read_message(json.dumps(end()), TIERS).body == (12, 0.25, False)
    # Without the cost (older), and tokens unknown (-1).
    assert read_message(json.dumps(end(-1)[:-1]), TIERS).body == (None, None, False)
    assert read_message(json.dumps(adopted()), TIERS).body[0].price == 0.5
    assert read_message(json.dumps(adopted()[:-1]), TIERS).body[0].price == 0.0
    assert read_message(json.dumps(spend()), TIERS).body == ("A", 0.5, 10)


def test_json_nested_too_deeply_is_refused_not_raised() -> None:
    with pytest.raises(ValueError):
        read_message("[" * 100_000, TIERS)
    with pytest.raises(ValueError):
        parse_reply("[" * 100_000)


def grant(**changes: Any) -> list[Any]:
    fields = dict(zip(("tid", "charged", "deployment", "rank"), [3, 1.0, None, 0], strict=True))
    fields.update(changes)
    return ["g", 1, 0, *fields.values()]


def rejection(retry_after: Any) -> list[Any]:
    return ["f", 1, 0, 3, "the queue is full", retry_after, "user"]


BAD_REPLIES: dict[str, tuple[str, list[Any]]] = {
    "epoch huge": ("epoch", ["g", HUGE, 0, 3, 1.0, None, 0]),
    "epoch negative": ("epoch", ["p", -1, 0, 3]),
    "session huge": ("session", ["g", 1, HUGE, 3, 1.0, None, 0]),
    "id huge": ("id", grant(tid=HUGE)),
    "id negative": ("id", grant(tid=-1)),
    "charged nan": ("charged", grant(charged=NAN)),
    "charged huge": ("charged", grant(charged=HUGE)),
    "charged negative": ("charged", grant(charged=-1.0)),
    "rank huge": ("engine rank", grant(rank=HUGE)),
    "rank negative": ("engine rank", grant(rank=-1)),
    "deployment": ("deployment", grant(deployment=["x"])),
    "nonce huge": ("nonce", ["p", 1, 0, HUGE]),
    "retry after huge": ("retry after", rejection(HUGE)),
    "retry after nan": ("retry after", rejection(NAN)),
    "retry after negative": ("retry after", rejection(-1)),
    "leader": ("leader", ["h", 2, 0, 5]),
}


@pytest.mark.parametrize("case", list(BAD_REPLIES))
def test_a_leader_reply_out_of_range_is_refused_naming_the_field(case: str) -> None:
    field, reply = BAD_REPLIES[case]
    with pytest.raises(OutOfRange) as refused:
        parse_reply(json.dumps(reply))
    assert refused.value.field == field
    assert len(str(refused.value)) < 120


def test_a_published_count_out_of_range_is_refused() -> None:
    counts = dict.fromkeys(
        (
            "queued",
            "in_flight",
            "released_total",
            "completed_total",
            "cancelled_total",
            "abandoned_total",
            "rejected_full_total",
            "timed_out_total",
        ),
        0,
    )
    for bad in (HUGE, -1):
        document = {
            "scheduler": {
                **counts,
                "queued": bad,
                "queued_by_model_tier": [],
                "in_flight_by_model": [],
            },
            "gate": [],
        }
        with pytest.raises(OutOfRange) as refused:
            read_published(json.dumps(document))
        assert refused.value.field == "a scheduler count"


def cost_core() -> tuple[FairScheduler, list[Lease]]:
    core = FairScheduler(TIERS, InflightLimitGate(4), fairness="cost")
    ended: list[Lease] = []
    core.add_end_listener(lambda lease, abandoned: ended.append(lease))
    return core, ended


async def test_a_lease_end_carries_tokens_and_cost_into_a_memory_replicas_core() -> None:
    """Before: the replica forwarded `tokens_used` only, so `fairness: cost` charged the
    estimate scaled by tokens, never what the request cost."""
    core, ended = cost_core()
    replica = open_state("memory://", core)
    lease = replica.try_acquire(make_ticket("A", cost=300, price=2.0))
    assert lease is not None
    lease.release(20, cost_used=0.125)
    await settle()
    assert [(e.tokens_used, e.cost_used) for e in ended] == [(20, 0.125)]
    await replica.aclose()


async def test_a_term_ends_a_lease_with_its_cost() -> None:
    core, ended = cost_core()
    current = Term(core, 7, lambda replica, reply: None)
    current.submit(("f", 0, 1), make_ticket("A", cost=300, price=2.0))
    await settle()
    current.end(("f", 0, 1), 20, abandoned=False, cost_used=0.125)
    assert [(e.tokens_used, e.cost_used) for e in ended] == [(20, 0.125)]


async def test_a_replica_leaves_out_usage_out_of_range_and_still_ends_the_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Usage a caller reports out of range (an engine's `usage` gone wrong) never reaches the
    core: the lease ends, charged its estimate, and the log names what was left out."""
    core, ended = cost_core()
    replica = open_state("memory://", core)
    lease = replica.try_acquire(make_ticket("A", cost=300, price=2.0))
    assert lease is not None
    with caplog.at_level(logging.WARNING, logger="fair_sched"):
        lease.release(HUGE, cost_used=NAN)
    await settle()
    assert [(e.tokens_used, e.cost_used) for e in ended] == [(None, None)]
    assert core.statistics().in_flight == 0
    logged = " ".join(record.getMessage() for record in caplog.records)
    assert "tokens used" in logged and "cost used" in logged
    assert "9" * 100 not in logged
    await replica.aclose()


def test_a_deadline_refusal_reaches_the_follower_as_one() -> None:
    refusal = DeadlineUnreachable("cannot start within its limit", retry_after_s=3.0)
    reply = wire.rejection(7, ("replica", 2, 12), refusal)
    error = wire.error_from(parse_reply(json.dumps(list(reply))))
    assert isinstance(error, DeadlineUnreachable) and error.retry_after_s == 3.0
    assert str(error) == "cannot start within its limit"
