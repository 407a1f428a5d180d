"""The life of one turn of a request, as one state machine: its states and transitions as data.

Everything that can change where a request's turn stands is an `Event` sent to its
`RequestLife`; the table `TRANSITIONS` alone says where each event leads and whether the
lease ends there, and how (`End`). Integrations, the driver and the request's watch report what
they saw (the client left, the engine answered or failed, usage came, the response ended) and
never end a lease themselves. An end state has no way out, so a lease ends exactly once
whatever arrives late or twice; an event a state does not list changes nothing (a usage report
after the end, a second disconnect). A new event (a deadline passing, an eviction) is one row.

    parked --granted--> granted --forwarded--> forwarded --first byte--> answering
       |                  |                       |  \\                    |
    refused / withdrawn   ended                   | stopped (client left,  ended (completed)
                          (abandoned)             |  lease expired, ...)
                                                  ended (abandoned / interrupted)

The end's charge follows from the state it ends from:

- completed: a response went out (or the engine's first byte did): charged the usage the engine
  reported (`RequestLife.usage`), else the estimate;
- interrupted: the engine had the request and we stopped it (or gave up waiting for it):
  charged what the engine can have generated before the abort reached it, never refunded;
- abandoned: the engine never had it (or never answered): the turn passes on uncharged.

Pure: no event loop, no I/O; the lease is ended through the small `LeaseEnd` protocol.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Protocol

__all__ = [
    "END_STATES",
    "EVENTS",
    "STATES",
    "TRANSITIONS",
    "End",
    "Event",
    "LeaseEnd",
    "RequestLife",
    "State",
]


class State:
    """Where a request's turn stands (compared by identity: a table lookup hashes no Python)."""

    __slots__ = ("name",)

    PARKED: ClassVar[State]  # waiting in the queue for a turn
    GRANTED: ClassVar[State]  # holds a lease; the engine does not have the request yet
    FORWARDED: ClassVar[State]  # the engine has the request; nothing came back yet
    STOPPED: ClassVar[State]  # forwarded, then stopped by us: interrupted when the request ends
    RESPONDING: ClassVar[State]  # a response started going out (not the engine's first byte)
    ANSWERING: ClassVar[State]  # the engine's first byte came (recorded on the lease)
    ENDED: ClassVar[State]  # the lease ended (`RequestLife.end` says how)
    WITHDRAWN: ClassVar[State]  # left the queue, or handed its unused turn back
    REFUSED: ClassVar[State]  # the scheduler refused it (queue full, timed out, closed)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"State.{self.name}"


class Event:
    """What happened to a request (compared by identity, like `State`)."""

    __slots__ = ("name",)

    GRANTED: ClassVar[Event]  # the scheduler gave the request its turn (a lease)
    REFUSED: ClassVar[Event]  # the scheduler refused it while parked
    WITHDRAWN: ClassVar[Event]  # the caller no longer wants its turn (it stopped waiting)
    FORWARDED: ClassVar[Event]  # the request went on to the engine
    RESPONSE_STARTED: ClassVar[Event]  # a response start went out to the client
    FIRST_BYTE: ClassVar[Event]  # the engine's first chunk (an adapter saw it, or we sent it)
    ENGINE_FAILED: ClassVar[Event]  # the engine never answered (refused, failed before)
    ENGINE_TIMED_OUT: ClassVar[Event]  # we gave up waiting for the engine's answer
    RESPONSE_COMPLETE: ClassVar[Event]  # the response's last byte went out
    CLIENT_LEFT: ClassVar[Event]
    LEASE_EXPIRED: ClassVar[Event]  # held longer than `max_lease_s`
    SEND_STALLED: ClassVar[Event]  # the client stopped reading (`send_timeout_s`)
    SHUTDOWN: ClassVar[Event]  # the drain's grace period is over
    CLOSED: ClassVar[Event]  # the request is over: whatever it still holds ends now

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Event.{self.name}"


STATES = tuple(
    State(name)
    for name in (
        "PARKED",
        "GRANTED",
        "FORWARDED",
        "STOPPED",
        "RESPONDING",
        "ANSWERING",
        "ENDED",
        "WITHDRAWN",
        "REFUSED",
    )
)
EVENTS = tuple(
    Event(name)
    for name in (
        "GRANTED",
        "REFUSED",
        "WITHDRAWN",
        "FORWARDED",
        "RESPONSE_STARTED",
        "FIRST_BYTE",
        "ENGINE_FAILED",
        "ENGINE_TIMED_OUT",
        "RESPONSE_COMPLETE",
        "CLIENT_LEFT",
        "LEASE_EXPIRED",
        "SEND_STALLED",
        "SHUTDOWN",
        "CLOSED",
    )
)
for _state in STATES:
    setattr(State, _state.name, _state)
for _event in EVENTS:
    setattr(Event, _event.name, _event)

End = Literal["completed", "interrupted", "abandoned"]

END_STATES = frozenset({State.ENDED, State.WITHDRAWN, State.REFUSED})

# Events that stop a running request: the app is cancelled, its upstream closes.
_STOPS = (Event.CLIENT_LEFT, Event.LEASE_EXPIRED, Event.SEND_STALLED, Event.SHUTDOWN)


def _table() -> dict[tuple[State, Event], tuple[State, End | None]]:
    t: dict[tuple[State, Event], tuple[State, End | None]] = {
        (State.PARKED, Event.GRANTED): (State.GRANTED, None),
        (State.PARKED, Event.REFUSED): (State.REFUSED, None),
        (State.PARKED, Event.WITHDRAWN): (State.WITHDRAWN, None),
        (State.PARKED, Event.CLOSED): (State.WITHDRAWN, None),
        # A turn granted and never used goes back: the engine never saw it.
        (State.GRANTED, Event.WITHDRAWN): (State.ENDED, "abandoned"),
        (State.GRANTED, Event.FORWARDED): (State.FORWARDED, None),
        (State.GRANTED, Event.RESPONSE_STARTED): (State.RESPONDING, None),
        (State.GRANTED, Event.FIRST_BYTE): (State.ANSWERING, None),
        (State.GRANTED, Event.RESPONSE_COMPLETE): (State.ENDED, "completed"),
        (State.GRANTED, Event.ENGINE_FAILED): (State.ENDED, "abandoned"),
        # The adapter says the engine had it: never free, or each such request would be.
        (State.GRANTED, Event.ENGINE_TIMED_OUT): (State.ENDED, "interrupted"),
        (State.GRANTED, Event.CLOSED): (State.ENDED, "abandoned"),
        (State.FORWARDED, Event.RESPONSE_STARTED): (State.RESPONDING, None),
        (State.FORWARDED, Event.FIRST_BYTE): (State.ANSWERING, None),
        (State.FORWARDED, Event.RESPONSE_COMPLETE): (State.ENDED, "completed"),
        (State.FORWARDED, Event.ENGINE_FAILED): (State.ENDED, "abandoned"),
        (State.FORWARDED, Event.ENGINE_TIMED_OUT): (State.ENDED, "interrupted"),
        # The app failed after forwarding, without an answer and without our stopping it.
        (State.FORWARDED, Event.CLOSED): (State.ENDED, "abandoned"),
        # Stopped after the engine had it: charged when the request ends (after its upstream
        # closed), unless the engine's answer still arrives first.
        (State.STOPPED, Event.FIRST_BYTE): (State.ANSWERING, None),
        (State.STOPPED, Event.ENGINE_FAILED): (State.ENDED, "abandoned"),
        (State.STOPPED, Event.ENGINE_TIMED_OUT): (State.ENDED, "interrupted"),
        (State.STOPPED, Event.CLOSED): (State.ENDED, "interrupted"),
        (State.RESPONDING, Event.FIRST_BYTE): (State.ANSWERING, None),
        # Our own response start (a keep-alive's, an app's) is not the engine's answer.
        (State.RESPONDING, Event.ENGINE_FAILED): (State.ENDED, "abandoned"),
        (State.RESPONDING, Event.ENGINE_TIMED_OUT): (State.ENDED, "interrupted"),
        (State.RESPONDING, Event.RESPONSE_COMPLETE): (State.ENDED, "completed"),
        (State.RESPONDING, Event.CLOSED): (State.ENDED, "completed"),
        (State.ANSWERING, Event.RESPONSE_COMPLETE): (State.ENDED, "completed"),
        (State.ANSWERING, Event.CLOSED): (State.ENDED, "completed"),
    }
    for stop in _STOPS:
        t[State.PARKED, stop] = (State.WITHDRAWN, None)
        # Nothing reached the engine: the turn passes on now.
        t[State.GRANTED, stop] = (State.ENDED, "abandoned")
        t[State.FORWARDED, stop] = (State.STOPPED, None)
        # RESPONDING, ANSWERING: the response says what was used; it ends with the request.
    return t


# {(state, event): (next state, how the lease ends there or None)}; a pair not listed changes
# nothing (a late or repeated event).
TRANSITIONS: dict[tuple[State, Event], tuple[State, End | None]] = _table()


class LeaseEnd(Protocol):
    """How a `RequestLife` ends its lease: once, the way the table says."""

    def started(self) -> None:
        """The engine's first byte (recorded before any end)."""

    def ended(self, end: End, tokens_used: int | None, cost_used: float | None) -> None:
        """The lease ends: `completed` with the usage reported (None: the estimate),
        `interrupted` charged what the engine can have generated, `abandoned` uncharged."""


class RequestLife:
    """One request's turn, moved only by `handle(event)` through `TRANSITIONS`."""

    __slots__ = ("_lease", "cost_used", "end", "state", "tokens_used")

    def __init__(self, lease: LeaseEnd | None = None, state: State = State.GRANTED) -> None:
        self._lease = lease
        self.state = state
        # How the lease ended (None: it has not, or there was none).
        self.end: End | None = None
        # The usage the engine reported last (`usage()`): a completed end charges it.
        self.tokens_used: int | None = None
        self.cost_used: float | None = None

    @property
    def over(self) -> bool:
        return self.state in END_STATES

    @property
    def holds(self) -> bool:
        """It holds a lease that has not ended."""
        return self.state not in END_STATES and self.state is not State.PARKED

    def granted(self, lease: LeaseEnd) -> bool:
        """The turn came: the lease is this life's from now on. False where the life had no
        use for it any more (it is then handed back, abandoned)."""
        if self.state is not State.PARKED:
            RequestLife(lease).handle(Event.WITHDRAWN)
            return False
        self._lease = lease
        self.handle(Event.GRANTED)
        return True

    def usage(self, tokens_used: int | None, cost_used: float | None) -> None:
        """What the engine says the request used; charged if the lease ends completed."""
        if self.state in END_STATES:
            return  # a late report: nothing left to charge
        self.tokens_used, self.cost_used = tokens_used, cost_used

    def handle(self, event: Event) -> State:
        """Move by `event` (a pair the table does not list changes nothing); return the state."""
        found = TRANSITIONS.get((self.state, event))
        if found is None:
            return self.state
        self.state, end = found
        lease = self._lease
        if self.state is State.ANSWERING and lease is not None:
            lease.started()
        if end is not None:
            # The state is final before anything hears of the end: an observer that raises
            # cannot make it end twice.
            self.end = end
            if lease is not None:
                lease.ended(end, self.tokens_used, self.cost_used)
        return self.state

    def __repr__(self) -> str:
        return f"<RequestLife {self.state.name}{f' ({self.end})' if self.end else ''}>"
