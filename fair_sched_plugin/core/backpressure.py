"""The metrics-driven admission gate: release only while the engine's queue is short.

Metrics lag: between two scrapes the engine's waiting count is stale, and a request we release
needs a moment to reach the engine. So a released request keeps counting against the threshold
("pending") until the engine demonstrably has it: its first byte came back, it ended, or a scrape
*sent* at least `arrival_grace_s` after its release has been read (that scrape must include it,
as waiting or running). The estimate of the engine's queue is therefore

    waiting_at_last_scrape + pending

which over-counts briefly (a request already in the engine's queue is also pending until the
grace passes) and never under-counts the way "reset credits on every scrape" does.

Pending requests that will find a free running slot never enter the engine's queue. The gate
learns each deployment's capacity as the most requests it has seen running at once, and lets
pending requests fill the slots the last scrape showed free (less those taken since):

    max(0, waiting - free_slots) + max(0, pending - max(0, free_slots - waiting))

A scrape with a queue shows the capacity exactly (the engine queues only when it takes no more,
slots or KV cache), and replaces what was learned. Without a queue the capacity is at least what
runs; while the gate holds requests back, nothing it released is still on its way, and the
engine runs at the learned capacity with an empty queue, it probes one slot more per scrape, so
an engine never seen saturated is not kept under-filled (`max_num_seqs`, where configured, is
the starting value and the ceiling). Without free slots, a tier that wants the queue empty
(`waiting_below: 1`) would refill free slots one round trip at a time. The capacity is the peak
of a sliding window (`capacity_window_s`, two buckets), not of all time: an engine restarted
with fewer slots, or one short-lived spike, would otherwise count slots free for ever and let
pending requests into the engine's queue.

Work-conserving against late signals (issue #17): a pending request that already runs would
otherwise count twice (pending, and running in the scrape) until its first byte, which a
CPU-starved proxy sees late; that eats the queue credit that keeps the engine full. So each
scrape also settles as many pending requests as the engine's requests grew since the previous
one (plus our ends in between, which hide as many arrivals). With `metrics_lag_s` a scrape is
taken to show the engine as of `started_at - metrics_lag_s`: first bytes and pending requests
are forgotten against that time, and ends seen after it give their slots back.

A tier with `waiting_below: auto` has its threshold set by a `QueueTuner` (core/tuning.py) that
the gate owns per model group and tier, and feeds with that tier's release-to-first-byte times,
the engine's TTFT and TPOT, and whether the queue held requests back.

Several deployments behind one model name are one group: their waiting counts are summed and the
threshold scales with the number of deployments; TPOT and KV usage are the worst deployment's; a
group is only as fresh as its stalest deployment. Without fresh metrics the group falls back to a
fixed in-flight cap. This module is pure: the watcher feeds it snapshots, the clock is injected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from .clock import Clock, LoopClock
from .gate import CapacityListener
from .snapshot import BackendSnapshot
from .ticket import Lease, Ticket, TierLimits
from .tuning import QueueTuner, TunerStatus

GateMode = Literal["starting", "metrics", "fallback"]

_MAX_FIRST_BYTES = 10_000


@dataclass(frozen=True)
class BackendGroup:
    """One model group's deployments and the gate's settings for it."""

    model: str
    metrics_urls: tuple[str, ...]
    arrival_grace_s: float = 1.0
    fallback_max_inflight: int = 4  # per deployment
    # How long a peak of running requests is remembered as the deployment's capacity.
    capacity_window_s: float = 60.0
    # Each deployment's running slots when known (vLLM's --max-num-seqs): the capacity from the
    # first scrape on, and the ceiling of what probing learns. None: learned from scrapes.
    max_num_seqs: int | None = None
    # How far behind the engine's /metrics is: a scrape sent at t shows the engine as of
    # t - metrics_lag_s (vLLM's can lag seconds behind under load).
    metrics_lag_s: float = 0.0


class GateTransition(NamedTuple):
    model: str
    old: GateMode
    new: GateMode
    reason: str


class GroupStatus(NamedTuple):
    """What the gate knows about one model group (for metrics and the status page)."""

    model: str
    mode: GateMode
    deployments: int
    waiting: float | None
    running: float | None
    tpot_s: float | None
    kv_usage: float | None
    pending: int
    free_slots: float
    in_flight: int
    last_scrape_age_s: float | None
    blocked_reason: str | None
    # Per tier with `waiting_below: auto`: the engine queue its tuner allows now (whole group).
    allowed_queue: tuple[tuple[str, float], ...] = ()


@dataclass
class _GroupState:
    spec: BackendGroup
    latest_ok: dict[str, BackendSnapshot] = field(default_factory=dict)
    last_error: dict[str, str] = field(default_factory=dict)
    in_flight: int = 0
    # Leases released and not yet shown to have reached the engine, in release order.
    pending: deque[Lease] = field(default_factory=deque)
    pending_count: int = 0
    pending_ids: set[int] = field(default_factory=set)
    mode: GateMode = "starting"
    # Most requests seen running at once, per deployment: the learned capacity. The peak of the
    # current window and of the one before (two buckets make a sliding window).
    capacity: dict[str, float] = field(default_factory=dict)
    capacity_previous: dict[str, float] = field(default_factory=dict)
    capacity_window_started: float | None = None
    # When each first byte since the scrapes came back: slots taken that no scrape can show yet.
    # Bounded: only an outage of every scrape lets it fill, and then free slots are not used.
    first_bytes: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_FIRST_BYTES))
    # When each started request's end was seen since the scrapes' as-of time: slots freed that
    # no scrape can show yet (only with metrics_lag_s; see _account_scraped).
    ends: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_FIRST_BYTES))
    scrape_requested: bool = False
    # Started leases that ended since the last scrape (see _settle_arrivals).
    ends_since_scrape: int = 0
    # The gate held a request back for the engine's queue since the last scrape (demand).
    held_back: bool = False
    # `waiting_below: auto` tiers' controllers, by tier name, made on the tier's first decision.
    tuners: dict[str, QueueTuner] = field(default_factory=dict)
    blocked_reason: str | None = None


class MetricsGate:
    """An `AdmissionGate` fed by engine metrics; see the module docstring for the rules."""

    def __init__(
        self,
        groups: Iterable[BackendGroup],
        *,
        stale_after_s: float,
        unknown_model_max_inflight: int = 64,
        clock: Clock | None = None,
        on_transition: Callable[[GateTransition], None] | None = None,
        request_scrape: Callable[[str], None] | None = None,
    ) -> None:
        self._groups = {group.model: _GroupState(group) for group in groups}
        self._stale_after_s = stale_after_s
        self._unknown_cap = unknown_model_max_inflight
        self._unknown_in_flight: dict[str, int] = {}
        self._clock: Clock = clock or LoopClock()
        self._on_transition = on_transition
        self._request_scrape = request_scrape
        self._listener: CapacityListener | None = None
        self._sharers = 1
        self._growth_settles = True

    # ------------------------------------------------------------------ inputs

    def ends_arrive_out_of_step(self) -> None:
        """Stop settling pending releases by the engine's growth between scrapes: that rule adds
        the ends seen since the last scrape, which is only right when ends are seen as they
        happen. A leader hears other replicas' ends through Redis, after scrapes that already
        showed them, and would settle (and release) as many requests too many."""
        self._growth_settles = False

    def share_with(self, replicas: int) -> None:
        """Spend only 1/`replicas` of every threshold, cap and free slot (at least 1 each
        for thresholds and caps): several
        replicas that each run their own gate against one engine (shared state unreachable)
        must not each spend all of it. 1 restores the whole."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1 (got {replicas})")
        widened = replicas < self._sharers
        self._sharers = replicas
        if widened:
            self._notify(None)

    def _share(self, limit: float) -> float:
        return limit if self._sharers == 1 else max(1.0, limit / self._sharers)

    def set_listener(self, listener: CapacityListener) -> None:
        self._listener = listener

    def update(self, model: str, snapshot: BackendSnapshot) -> None:
        """A scrape of one of the group's deployments finished (successfully or not)."""
        state = self._groups.get(model)
        if state is None or snapshot.url not in state.spec.metrics_urls:
            return
        if snapshot.ok:
            previous = state.latest_ok.get(snapshot.url)
            state.latest_ok[snapshot.url] = snapshot
            state.last_error.pop(snapshot.url, None)
            # Replicas sharing the engine (share_with) each see the others' arrivals as growth:
            # taken for their own, they would let as many more in, n times over.
            if self._sharers > 1 or not self._growth_settles:
                state.ends_since_scrape = 0
            elif previous is not None and previous.started_at < snapshot.started_at:
                self._settle_arrivals(state, previous, snapshot)
            self._account_scraped(state)
            # After the settling: probing asks whether anything is still on its way.
            self._learn_capacity(state, snapshot)
            state.held_back = False
            now = self._clock.now()
            for tuner in state.tuners.values():
                tuner.observe_engine(now, snapshot.ttft_s, snapshot.tpot_s)
                tuner.tick(now)
        else:
            state.last_error[snapshot.url] = snapshot.error or "scrape failed"
        state.scrape_requested = False
        self._refresh_mode(state)
        self._notify(model)

    def place(self, ticket: Ticket, tier: TierLimits) -> str | None:
        return None

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        return False

    def on_released(self, lease: Lease) -> None:
        state = self._groups.get(lease.ticket.model)
        if state is None:
            model = lease.ticket.model
            self._unknown_in_flight[model] = self._unknown_in_flight.get(model, 0) + 1
            return
        state.in_flight += 1
        tuner = state.tuners.get(lease.ticket.tier)
        if tuner is not None:
            tuner.observe_released(lease.lease_id, lease.released_at)
        state.pending.append(lease)
        state.pending_ids.add(lease.lease_id)
        state.pending_count += 1

    def on_started(self, lease: Lease) -> None:
        state = self._groups.get(lease.ticket.model)
        if state is None:
            return
        now = self._clock.now()
        tuner = state.tuners.get(lease.ticket.tier)
        if tuner is not None:
            tuner.observe_first_byte(lease.lease_id, lease.released_at, now - lease.released_at)
        if self._settle(state, lease):
            state.first_bytes.append(now)
            self._notify(lease.ticket.model)

    def on_ended(self, lease: Lease) -> None:
        model = lease.ticket.model
        state = self._groups.get(model)
        if state is None:
            remaining = self._unknown_in_flight.get(model, 0) - 1
            if remaining > 0:
                self._unknown_in_flight[model] = remaining
            else:
                self._unknown_in_flight.pop(model, None)
        else:
            state.in_flight -= 1
            self._settle(state, lease)
            for name, tuner in state.tuners.items():
                if name == lease.ticket.tier:
                    tuner.observe_ended(lease.lease_id)
                if lease.started:
                    tuner.observe_completion()
            if lease.started:
                state.ends_since_scrape += 1
            if lease.started and state.spec.metrics_lag_s > 0:
                state.ends.append(self._clock.now())
                self._notify(model)

    # ------------------------------------------------------------------ decision

    def may_release(self, model: str, tier: TierLimits) -> bool:
        state = self._groups.get(model)
        if state is None:
            return self._unknown_in_flight.get(model, 0) < self._share(self._unknown_cap)
        self._refresh_mode(state)
        reason = self._blocked_reason(state, tier)
        state.blocked_reason = reason
        if reason is None:
            return True
        if reason == "waiting":
            state.held_back = True
            tuner = state.tuners.get(tier.name)
            if tuner is not None:
                tuner.note_held_back()
        if reason == "waiting" and not state.scrape_requested and self._scrape_would_settle(state):
            # Credits are spent on requests a fresh scrape can account for: ask for it now
            # rather than at the next tick. Blocked by the engine's own queue, an earlier scrape
            # would change nothing, so none is asked for (no polling while parked).
            state.scrape_requested = True
            if self._request_scrape is not None:
                self._request_scrape(model)
        return False

    def _scrape_would_settle(self, state: _GroupState) -> bool:
        pending = state.pending
        while pending and pending[0].lease_id not in state.pending_ids:
            pending.popleft()  # settled by first byte or end already
        if not pending:
            return False
        return pending[0].released_at + state.spec.arrival_grace_s <= self._clock.now()

    def _blocked_reason(self, state: _GroupState, tier: TierLimits) -> str | None:
        deployments = len(state.spec.metrics_urls)
        if state.mode != "metrics":
            if state.in_flight < self._share(state.spec.fallback_max_inflight * deployments):
                return None
            return "fallback_inflight"
        snapshots = state.latest_ok.values()
        waiting = sum(snapshot.waiting for snapshot in snapshots)
        # Free running slots are capacity too: replicas sharing one engine split them as well
        # (whole slots, so the shares never add up to more than the engine has).
        free_slots = self._free_slots(state)
        if self._sharers > 1:
            free_slots = float(int(free_slots) // self._sharers)
        queued_in_engine = engine_queue_estimate(waiting, state.pending_count, free_slots)
        if queued_in_engine >= self._share(self._waiting_below(state, tier) * deployments):
            return "waiting"
        if tier.tpot_below_s is not None:
            tpot = _worst(snapshot.tpot_s for snapshot in snapshots)
            if tpot is not None and tpot >= tier.tpot_below_s:
                return "tpot"
        if tier.kv_usage_below is not None:
            kv_usage = _worst(snapshot.kv_usage for snapshot in snapshots)
            if kv_usage is not None and kv_usage >= tier.kv_usage_below:
                return "kv_usage"
        return None

    def _waiting_below(self, state: _GroupState, tier: TierLimits) -> float:
        if tier.auto_waiting_below is None:
            return tier.waiting_below
        tuner = state.tuners.get(tier.name)
        if tuner is None:
            minimum, maximum = tier.auto_waiting_below
            tuner = state.tuners[tier.name] = QueueTuner(
                minimum=minimum,
                maximum=maximum,
                ttft_target_s=tier.ttft_target_s,
                tpot_target_s=tier.tpot_below_s,
                initial=tier.waiting_below,
                started_at=self._clock.now(),
            )
        return tuner.allowed

    def tuning(self, model: str) -> dict[str, TunerStatus]:
        """What each `waiting_below: auto` tier's tuner of this model group decided."""
        state = self._groups.get(model)
        if state is None:
            return {}
        return {name: tuner.statistics() for name, tuner in state.tuners.items()}

    def _learn_capacity(self, state: _GroupState, snapshot: BackendSnapshot) -> None:
        """Learn the deployment's running slots from one scrape (see the module docstring)."""
        now = self._clock.now()
        started = state.capacity_window_started
        if started is None:
            state.capacity_window_started = now
        elif now - started >= state.spec.capacity_window_s:
            # A new window: the one that ended becomes the previous one; one idle for longer
            # than a whole window leaves nothing behind.
            long_ago = now - started >= 2 * state.spec.capacity_window_s
            state.capacity_previous = {} if long_ago else state.capacity
            state.capacity = {}
            state.capacity_window_started = now
        url = snapshot.url
        ceiling = state.spec.max_num_seqs
        running = snapshot.running
        if snapshot.waiting > 0:
            # A queue forms only when the engine takes no more: what runs now is its capacity
            # (lower than max_num_seqs when the KV cache is the limit). Authoritative, so it
            # replaces both buckets: a probe must not leave a phantom free slot behind.
            state.capacity[url] = running
            state.capacity_previous[url] = running
            return
        known = self._capacity(state, url)
        if ceiling is not None and url not in state.capacity and url not in state.capacity_previous:
            running = float(ceiling)  # configured and not yet contradicted by a queue
        elif state.tuners and state.held_back and not state.pending_count and 0 < running >= known:
            # Running at the learned capacity with an empty queue while we held requests back
            # and none of ours is on its way: the engine may have more slots. Probe one more
            # per scrape; a queue forming shows the real number. Without this an engine never
            # seen saturated keeps slots unused, since the gate only saturates it through slots
            # it believes free (issue #17). Only for `waiting_below: auto` tiers (those have a
            # tuner): a probe into a slot that does not exist puts one request in the engine's
            # queue beyond the threshold until the next scrape, and a fixed threshold is a promise.
            running += 1
        if ceiling is not None:
            running = min(running, float(ceiling))
        state.capacity[url] = max(state.capacity.get(url, 0.0), running)

    @staticmethod
    def _capacity(state: _GroupState, url: str) -> float:
        learned = max(state.capacity.get(url, 0.0), state.capacity_previous.get(url, 0.0))
        ceiling = state.spec.max_num_seqs
        if ceiling is not None and url not in state.capacity and url not in state.capacity_previous:
            return float(ceiling)
        return learned

    @staticmethod
    def _free_slots(state: _GroupState) -> float:
        free = sum(
            max(0.0, MetricsGate._capacity(state, url) - snapshot.running)
            for url, snapshot in state.latest_ok.items()
        )
        return max(0.0, free - len(state.first_bytes) + len(state.ends))

    # ------------------------------------------------------------------ observation

    def status(self) -> list[GroupStatus]:
        now = self._clock.now()
        result = []
        for model, state in self._groups.items():
            snapshots = list(state.latest_ok.values())
            fresh = bool(snapshots)
            result.append(
                GroupStatus(
                    model=model,
                    mode=state.mode,
                    deployments=len(state.spec.metrics_urls),
                    waiting=sum(s.waiting for s in snapshots) if fresh else None,
                    running=sum(s.running for s in snapshots) if fresh else None,
                    tpot_s=_worst(s.tpot_s for s in snapshots),
                    kv_usage=_worst(s.kv_usage for s in snapshots),
                    pending=state.pending_count,
                    free_slots=self._free_slots(state) if fresh else 0.0,
                    in_flight=state.in_flight,
                    last_scrape_age_s=(
                        now - min(s.started_at for s in snapshots) if fresh else None
                    ),
                    blocked_reason=state.blocked_reason,
                    allowed_queue=tuple(
                        (name, tuner.allowed * len(state.spec.metrics_urls))
                        for name, tuner in state.tuners.items()
                    ),
                )
            )
        return result

    def groups(self) -> Mapping[str, BackendGroup]:
        return {model: state.spec for model, state in self._groups.items()}

    # ------------------------------------------------------------------ internals

    def _notify(self, model: str | None) -> None:
        if self._listener is not None:
            self._listener(model)

    def _settle(self, state: _GroupState, lease: Lease) -> bool:
        """The lease no longer counts as pending; True if it did until now."""
        if lease.lease_id not in state.pending_ids:
            return False
        state.pending_ids.discard(lease.lease_id)
        state.pending_count -= 1
        # The deque entry is dropped lazily in _account_scraped; keep the deque from
        # growing without bound when first bytes settle leases faster than scrapes arrive.
        if len(state.pending) > 64 and len(state.pending) > 2 * state.pending_count:
            state.pending = deque(x for x in state.pending if x.lease_id in state.pending_ids)
        return True

    def _settle_arrivals(
        self, state: _GroupState, previous: BackendSnapshot, snapshot: BackendSnapshot
    ) -> None:
        """Settle as many pending leases (oldest first) as the engine's requests grew between
        two scrapes: at least that many arrived. Waiting out the grace instead counts a request
        that already runs as pending too, which eats the queue credit the engine needs to stay
        full when first bytes come back late (a CPU-starved proxy, issue #17). Another client's
        arrivals taken for ours let at most that many more in, and the next scrape shows them."""
        grown = snapshot.waiting + snapshot.running - previous.waiting - previous.running
        # Requests that left the engine in between hide as many arrivals: our own ends since the
        # last scrape stand for them (seen late, like everything else the proxy sees).
        arrived = int(grown) + state.ends_since_scrape
        state.ends_since_scrape = 0
        as_of = snapshot.started_at - state.spec.metrics_lag_s
        pending = state.pending
        while arrived > 0 and pending and pending[0].released_at <= as_of:
            lease = pending.popleft()
            if lease.lease_id in state.pending_ids:
                state.pending_ids.discard(lease.lease_id)
                state.pending_count -= 1
                arrived -= 1

    def _account_scraped(self, state: _GroupState) -> None:
        """Forget what every deployment's latest scrape must already show: the first bytes that
        came back before it was sent (as running), and the leases released at least
        `arrival_grace_s` before that (as waiting or running). A first byte that came back while
        a scrape was on its way is kept: that scrape may not show it, and forgetting it would
        count its slot free twice."""
        if len(state.latest_ok) < len(state.spec.metrics_urls):
            return
        grace = state.spec.arrival_grace_s
        as_of = min(s.started_at for s in state.latest_ok.values()) - state.spec.metrics_lag_s
        first_bytes = state.first_bytes
        while first_bytes and first_bytes[0] <= as_of:
            first_bytes.popleft()
        # An end seen more than the grace after the as-of time: the engine freed that slot after
        # the scrape's view, so the scrape still shows it taken. Closer than that it may not.
        ends = state.ends
        while ends and ends[0] <= as_of + grace:
            ends.popleft()
        seen_until = as_of - grace
        pending = state.pending
        while pending and pending[0].released_at <= seen_until:
            lease = pending.popleft()
            if lease.lease_id in state.pending_ids:
                state.pending_ids.discard(lease.lease_id)
                state.pending_count -= 1

    def _refresh_mode(self, state: _GroupState) -> None:
        now = self._clock.now()
        reason = None
        never_scraped = False
        for url in state.spec.metrics_urls:
            snapshot = state.latest_ok.get(url)
            error = state.last_error.get(url)
            if snapshot is None:
                never_scraped = error is None
                reason = f"no successful scrape of {url} yet" + (f" ({error})" if error else "")
                break
            age = now - snapshot.started_at
            if age > self._stale_after_s:
                reason = f"metrics of {url} are {age:.1f} s old" + (f" ({error})" if error else "")
                break
        if reason is None:
            mode: GateMode = "metrics"
        elif state.mode == "starting" and never_scraped:
            mode = "starting"  # no answer yet at all: not news, the in-flight cap applies
        else:
            mode = "fallback"
        if mode != state.mode:
            transition = GateTransition(
                state.spec.model, state.mode, mode, reason or "metrics fresh"
            )
            state.mode = mode
            if self._on_transition is not None:
                self._on_transition(transition)


def engine_queue_estimate(waiting: float, pending: float, free_slots: float) -> float:
    """The engine's queue once our pending requests arrive: it fills free slots from its own
    queue first, ours take what is left, the rest waits."""
    left_free = max(0.0, free_slots - waiting)
    return max(0.0, waiting - free_slots) + max(0.0, pending - left_free)


def _worst(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return max(present) if present else None
