"""Properties of a request's life (`request/lifecycle.py`): any sequence of events, late and repeated ones
and end observers that raise included, ends its lease once, with the charge its end implies,
and leaves nothing parked or running once the request is over."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_sched_plugin.core import InflightLimitGate, TierLimits
from fair_sched_plugin.request.lifecycle import (
    END_STATES,
    EVENTS,
    TRANSITIONS,
    End,
    Event,
    RequestLife,
    State,
)
from fair_sched_plugin.request.watch import RequestWatch
from fair_sched_plugin.runtime.driver import FairScheduler
from fair_sched_plugin.testing import FakeClock
from tests.core.conftest import ticket

STOPS = (Event.CLIENT_LEFT, Event.LEASE_EXPIRED, Event.SEND_STALLED, Event.SHUTDOWN)

# An event, a usage report (tokens, cost), or a flag that the next end observer raises.
STEPS = st.lists(
    st.one_of(
        st.sampled_from(EVENTS),
        st.tuples(st.integers(0, 500), st.one_of(st.none(), st.floats(0, 1))),
        st.just("raise"),
    ),
    max_size=25,
)


class ObserverFailed(Exception):
    pass


class RecordedLease:
    """A lease end that records what it was told, and raises when told to."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.raise_next = False

    def started(self) -> None:
        self.calls.append(("started",))

    def ended(self, end: End, tokens_used: int | None, cost_used: float | None) -> None:
        self.calls.append(("ended", end, tokens_used, cost_used))  # type: ignore[arg-type]
        if self.raise_next:
            raise ObserverFailed


def expected_end(steps: list[object], parked: bool) -> tuple[End | None, object]:
    """How the lease should end, from the rules in the module docstring rather than the table:
    (end, usage charged), or (None, final state) where no lease ever ended."""
    granted = not parked
    forwarded = answered = responded = stopped = False
    usage: tuple[int | None, float | None] = (None, None)
    for step in steps:
        if step == "raise":
            continue
        if isinstance(step, tuple):
            usage = step
            continue
        assert isinstance(step, Event)
        if not granted:
            if step is Event.GRANTED:
                granted = True
            elif step is Event.REFUSED:
                return None, State.REFUSED
            elif step in (Event.WITHDRAWN, Event.CLOSED, *STOPS):
                return None, State.WITHDRAWN
            continue
        if step is Event.FORWARDED and not (answered or responded or stopped):
            forwarded = True
        elif step is Event.FIRST_BYTE:
            answered = True
        elif step is Event.RESPONSE_STARTED and not stopped:
            responded = True
        elif step is Event.RESPONSE_COMPLETE and (answered or not stopped):
            return "completed", usage
        elif step is Event.ENGINE_FAILED and not answered:
            return "abandoned", None
        elif step is Event.ENGINE_TIMED_OUT and not answered:
            return "interrupted", None
        elif step is Event.WITHDRAWN and not (forwarded or answered or responded):
            return "abandoned", None
        elif step in STOPS and not (answered or responded):
            if not forwarded:
                return "abandoned", None  # nothing reached the engine
            stopped = True
        elif step is Event.CLOSED:
            if answered or responded:
                return "completed", usage
            return ("interrupted" if stopped else "abandoned"), None
    return None, None


def play(steps: list[object], life: RequestLife, lease: RecordedLease) -> None:
    for step in steps:
        if step == "raise":
            lease.raise_next = True
        elif isinstance(step, tuple):
            life.usage(*step)
        else:
            assert isinstance(step, Event)
            with contextlib.suppress(ObserverFailed):
                life.handle(step)


@given(steps=STEPS, parked=st.booleans())
def test_any_events_end_the_lease_once_with_the_charge_its_end_implies(
    steps: list[object], parked: bool
) -> None:
    lease = RecordedLease()
    life = RequestLife(None if parked else lease, State.PARKED if parked else State.GRANTED)
    play(steps, life, lease)
    # The request is over: whatever it still held ends now, and a late event changes nothing.
    play([Event.CLOSED, *steps, Event.CLOSED], life, lease)
    assert life.state in END_STATES
    ends = [call for call in lease.calls if call[0] == "ended"]
    starts = [call for call in lease.calls if call[0] == "started"]
    assert len(ends) <= 1 and len(starts) <= 1
    if starts:
        assert lease.calls.index(starts[0]) < lease.calls.index(ends[0])
        assert ends[0][1] == "completed"  # an answered request is never free, nor guessed
    want, detail = expected_end([*steps, Event.CLOSED], parked)
    if want is None:
        assert not ends and life.state is detail
        return
    assert life.state is State.ENDED and life.end == want
    if parked:
        return  # granted without a lease to end here: see the test below
    assert ends and ends[0][1] == want
    if want == "completed":
        assert ends[0][2:] == detail  # the last usage reported before the end


@given(steps=STEPS)
def test_a_turn_granted_to_a_request_that_stopped_waiting_goes_back_unused(
    steps: list[object],
) -> None:
    life = RequestLife(None, State.PARKED)
    for step in steps:
        if isinstance(step, Event) and step is not Event.GRANTED:
            life.handle(step)
    lease = RecordedLease()
    if life.granted(lease):
        assert life.state is State.GRANTED and not lease.calls
    else:
        assert lease.calls == [("ended", "abandoned", None, None)]


def test_every_end_state_is_final() -> None:
    assert not [key for key in TRANSITIONS if key[0] in END_STATES]


def test_no_row_ends_a_lease_it_does_not_hold() -> None:
    assert all(
        state is not State.PARKED or end is None for (state, _), (_, end) in TRANSITIONS.items()
    )


# The same sequences through a request's watch holding the core's real leases: after the
# request's end nothing is parked or in flight, and every lease is counted ended once.

WATCH_STEPS = st.lists(
    st.sampled_from(
        [
            "forwarded",
            "answered",
            "never answered",
            "timed out",
            "report",
            "client left",
            "lease expired",
            "shutdown",
            "hold another",
            "raise",
        ]
    ),
    max_size=20,
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(steps=WATCH_STEPS)
def test_a_watch_ends_every_lease_it_held_once(steps: list[str]) -> None:
    asyncio.run(_watch_plays(steps))


async def _watch_plays(steps: list[str]) -> None:
    clock = FakeClock()
    scheduler = FairScheduler((TierLimits("interactive"),), InflightLimitGate(100), clock=clock)
    ended: list[tuple[int, bool]] = []
    raising = False

    def listener(lease: object, abandoned: bool) -> None:
        ended.append((id(lease), abandoned))
        if raising:
            raise ObserverFailed  # logged by the core; the lease is ended all the same

    scheduler.add_end_listener(listener)
    watch = RequestWatch(None, None, max_lease_s=3600)
    lease = scheduler.try_acquire(ticket("u"))
    assert lease is not None
    watch.hold(lease)
    held = [lease]
    for step in steps:
        current = watch.lease
        if step == "raise":
            raising = True
        elif step == "forwarded":
            watch.forwarded()
        elif step == "answered":
            watch.engine_answered()
        elif step == "never answered":
            watch.engine_never_answered()
        elif step == "timed out":
            watch.engine_timed_out()
        elif step == "report" and current is not None:
            watch.report(current, 42, None)
        elif step == "client left":
            watch._client_left()
        elif step == "lease expired":
            watch._lease_expired()
        elif step == "shutdown":
            watch.shutdown()
        elif step == "hold another" and current is None:
            another = scheduler.try_acquire(ticket("u"))
            assert another is not None
            watch.hold(another)
            held.append(another)
    watch.close()
    watch.close()  # a second end of the request changes nothing
    stats = scheduler.statistics()
    assert (stats.queued, stats.in_flight) == (0, 0)
    assert stats.completed_total + stats.abandoned_total == len(held) == stats.released_total
    assert sorted(key for key, _ in ended) == sorted(id(lease) for lease in held)
    assert all(not lease.active for lease in held)


@pytest.mark.parametrize("stop", STOPS)
def test_a_stop_before_the_engine_has_the_request_passes_the_turn_on_at_once(
    stop: Event,
) -> None:
    lease = RecordedLease()
    life = RequestLife(lease)
    life.handle(stop)
    assert lease.calls == [("ended", "abandoned", None, None)]


@pytest.mark.parametrize("stop", STOPS)
def test_a_stop_after_the_engine_has_the_request_charges_it_when_the_request_ends(
    stop: Event,
) -> None:
    lease = RecordedLease()
    life = RequestLife(lease)
    life.handle(Event.FORWARDED)
    life.handle(stop)
    assert not lease.calls  # its upstream closes first
    life.handle(Event.CLOSED)
    assert lease.calls == [("ended", "interrupted", None, None)]
