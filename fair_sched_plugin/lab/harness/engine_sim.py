"""A scripted engine for gate tests: FIFO queue, `max_num_seqs` slots, fixed service time, and
every signal late the way a real deployment makes it late (requests reach the engine after
`transit_s`, the proxy sees first bytes and ends `proxy_delay_s` after the engine, and a scrape
shows the engine as it was `lag_s` before). Pure: FakeClock time, no sleeps, no event loop."""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fair_sched_plugin.core import BackendSnapshot, Lease, MetricsGate, Ticket, TierLimits
from fair_sched_plugin.testing import FakeClock, GateLeaseOwner

URL = "http://engine/metrics"


@dataclass
class _Request:
    lease: Lease
    tier: str
    arrives_at: float
    started_at: float = 0.0


@dataclass
class Sample:
    """The engine's true state at one tick, and what the gate allowed."""

    at: float
    waiting: int
    running: int
    parked: int
    allowed: float | None = None


@dataclass
class EngineSim:
    gate: MetricsGate
    clock: FakeClock
    max_num_seqs: int = 8
    service_s: float = 1.0
    transit_s: float = 0.05
    # Each request's way to the engine takes up to this much longer (uniform, seeded by
    # `seed`): a starved proxy forwards some requests later than others, out of release order.
    transit_jitter_s: float = 0.0
    seed: int = 0
    proxy_delay_s: float = 0.0
    lag_s: float = 0.0
    poll_s: float = 0.1
    tick_s: float = 0.01
    prefill_s: float = 0.02
    # Scripted changes: the engine's speed as a function of time (1.0 = normal, 3.0 = 3x slower).
    slowdown: Callable[[float], float] = lambda at: 1.0
    url: str = URL
    # Export the engine's count of finished requests in each scrape (vLLM's
    # request_success_total), as of the scrape's lagged view like the gauges.
    finished_counter: bool = False
    # Added to that count (an engine restarted with its counters at this offset, say).
    finished_offset: int = 0
    # Time to first byte as the proxy measures it, per tier: (release time, seconds).
    ttfb: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    # Requests on their way to the engine: (arrival time, order, request), a heap.
    _in_transit: list[tuple[float, int, _Request]] = field(default_factory=list)
    _rng: random.Random = field(init=False)
    _waiting: deque[_Request] = field(default_factory=deque)
    _running: list[_Request] = field(default_factory=list)
    _history: deque[tuple[float, int, int, int]] = field(default_factory=deque)
    _events: list[tuple[float, int, str, _Request]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)
    _next_scrape: float = 0.0
    _lease_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _completed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def run(
        self,
        seconds: float,
        parked: dict[TierLimits, int],
        model: str = "m",
        allowed: Callable[[], float | None] = lambda: None,
    ) -> list[Sample]:
        """Run for `seconds` with `parked[tier]` requests waiting in our queue at the start
        (most urgent tier first); return this run's samples."""
        owner = GateLeaseOwner(self.gate)
        left = dict(parked)
        first = len(self.samples)
        end = self.clock.now() + seconds
        while self.clock.now() < end:
            now = self.clock.now()
            self._step_engine(now)
            self._deliver_events(now)
            if now >= self._next_scrape:
                self.gate.update(model, self._scrape(now))
                self._next_scrape = now + self.poll_s
            for tier, count in left.items():
                while count and self.gate.may_release(model, tier):
                    ticket = Ticket(model, "user", tier.name)
                    lease = Lease(owner, ticket, next(self._lease_ids), now, now, 0.0)
                    self.gate.on_released(lease)
                    self.admit(lease, tier.name)
                    count -= 1
                left[tier] = count
                if count:
                    break  # strict priority: a lower tier waits while a higher one is parked
            self.samples.append(
                Sample(now, len(self._waiting), len(self._running), sum(left.values()), allowed())
            )
            self.clock.advance(self.tick_s)
        return self.samples[first:]

    def step(self, now: float, model: str = "m") -> None:
        """Advance the engine to `now`, deliver what the proxy sees, scrape when due."""
        self._step_engine(now)
        self._deliver_events(now)
        if now >= self._next_scrape:
            self.gate.update(model, self._scrape(now))
            self._next_scrape = now + self.poll_s

    def admit(self, lease: Lease, tier: str) -> None:
        """A request released to this engine (it arrives after `transit_s`, plus up to
        `transit_jitter_s`)."""
        transit = self.transit_s
        if self.transit_jitter_s:
            transit += self._rng.uniform(0.0, self.transit_jitter_s)
        arrives_at = self.clock.now() + transit
        heapq.heappush(
            self._in_transit, (arrives_at, next(self._order), _Request(lease, tier, arrives_at))
        )

    @property
    def queue(self) -> tuple[int, int]:
        """The engine's true (waiting, running) now."""
        return len(self._waiting), len(self._running)

    @property
    def completed(self) -> int:
        return self._completed

    def _step_engine(self, now: float) -> None:
        while self._in_transit and self._in_transit[0][0] <= now:
            self._waiting.append(heapq.heappop(self._in_transit)[2])
        service = self.service_s * self.slowdown(now)
        for request in [r for r in self._running if now - r.started_at >= service]:
            self._running.remove(request)
            self._completed += 1
            self._schedule(now + self.proxy_delay_s, "end", request)
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting.popleft()
            request.started_at = now
            self._running.append(request)
            first_byte = now + self.prefill_s * self.slowdown(now)
            self._schedule(first_byte + self.proxy_delay_s, "first", request)
        self._history.append((now, len(self._waiting), len(self._running), self._completed))
        while len(self._history) > 1 and self._history[1][0] <= now - self.lag_s:
            self._history.popleft()

    def _schedule(self, at: float, kind: str, request: _Request) -> None:
        heapq.heappush(self._events, (at, next(self._order), kind, request))

    def _deliver_events(self, now: float) -> None:
        while self._events and self._events[0][0] <= now:
            at, _, kind, request = heapq.heappop(self._events)
            lease = request.lease
            if kind == "first":
                self.ttfb.setdefault(request.tier, []).append(
                    (lease.released_at, at - lease.released_at)
                )
                lease.mark_started()
            else:
                lease.release()

    def _scrape(self, now: float) -> BackendSnapshot:
        _, waiting, running, completed = self._history[0]
        return BackendSnapshot(
            url=self.url,
            started_at=now,
            ok=True,
            waiting=waiting,
            running=running,
            requests_finished=completed + self.finished_offset if self.finished_counter else None,
        )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def run_deployments(
    gate: MetricsGate,
    clock: FakeClock,
    engines: dict[str, EngineSim],
    seconds: float,
    parked: int,
    tier: TierLimits,
    sample: Callable[[float], None] = lambda at: None,
) -> int:
    """Several engines behind one model: each released request goes to the deployment the gate
    placed it on (`engines` by deployment key). Returns how many are still parked at the end."""
    owner = GateLeaseOwner(gate)
    lease_ids = itertools.count(1)
    tick_s = min(engine.tick_s for engine in engines.values())
    end = clock.now() + seconds
    while clock.now() < end:
        now = clock.now()
        for engine in engines.values():
            engine.step(now)
        while parked and gate.may_release("m", tier):
            ticket = Ticket("m", "user", tier.name)
            deployment = gate.place(ticket, tier)
            assert deployment is not None
            lease = Lease(owner, ticket, next(lease_ids), now, now, 0.0, deployment=deployment)
            gate.on_released(lease)
            engines[deployment].admit(lease, tier.name)
            parked -= 1
        sample(now)
        clock.advance(tick_s)
    return parked
