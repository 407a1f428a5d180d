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
scrape also settles as many pending requests as reached the engine since the previous one, less
ours settled in between by their first byte or end (they are among those arrivals). Where the
engine counts its finished requests (`BackendSnapshot.requests_finished`: vLLM's
`request_success_total`), the arrivals are its growth (waiting + running) plus its finished
count between the two scrapes: the engine's own numbers, in step with each other. Elsewhere our
ends stand for the requests that left, each in the interval of the first scrape sent after we
saw it; behind a loaded proxy an end comes a second or two late, often after the scrape that
showed the engine shrink: that interval counts an arrival short, and the end's own one too many.
An interval that counts fewer arrivals than it subtracts leaves the difference owed (at most one
a lease in flight there), and later arrivals make it up before they settle anything: clipped at
zero instead, each late end settled a lease still on its way, and a flood through a loaded proxy
put the engine's queue at 8 against 3. The price: a request that refills a slot whose end is
still on its way stays pending until its first byte (or the grace). A finished count that went
down (a restarted engine) settles nothing. An engine that does not count aborted requests (vLLM
does not) hides an arrival per abort: a lease stays pending a little longer, never one released
too many. With `metrics_lag_s` a scrape is
taken to show the engine as of `started_at - metrics_lag_s`: first bytes and pending requests
are forgotten against that time, and ends seen after it give their slots back.

A threshold below 1 (`waiting_below: 0`, or `auto` down to a minimum of 0) keeps no engine queue
at all: a request is released only when the engine's queue estimate with it added is still 0,
that is into a running slot left free for it. Such a tier probes for slots too, from none on an
idle engine (else its first slot would never count free). Each probe past the engine's real
slots puts one request in its queue until a slot frees, so with such a tier `max_num_seqs`
(the probes' ceiling) should be given: without it the engine holds a queue of about one while
saturated, which is what the tier exists to avoid.

The engine's queue in user order (`fair_engine_queue`): the priority each request carries
counts its user's requests not yet streaming (`Lease.engine_rank`, the scheduler's count), so the
engine serves a user's first request before anyone's second. A user with none there then waits
in the engine for a slot, not behind its queue: `may_release_newcomer` lets its request go past
the tier's threshold by up to the deployment's running slots (placement then counts that room
too), and the tier's tuner measures only such requests (the others wait for their own user's,
by design) with neither the engine's TTFT (all of its queue) nor the drain ceiling (Little's law
on the whole queue is no newcomer's wait); between newcomers the last one's latency stands.

A tier with `waiting_below: auto` has its threshold set by a `QueueTuner` (core/tuning.py) that
the gate owns per deployment and tier, and feeds with that tier's release-to-first-byte times of
the requests bound there, that engine's TTFT and TPOT, and whether its queue held requests back.

Several deployments behind one model name (issue #16): every rule above is a deployment's own.
Each has its snapshot, mode, pending leases, learned capacity, first bytes and ends, and its own
threshold (the tier's `waiting_below`, or its tuner's, as users read it: per engine). A request
may be released when some deployment has room for its tier; `place` then binds it to one of those
(`core/placement.py`: prefix affinity within a load bound, else the least loaded by load per
running slot), and its first byte and end settle against that deployment. The old rule, one group
with the waiting counts summed against the threshold times the number of deployments, let one
replica's queue grow far past the threshold while another idled (the slow engine of issue #16
reached 11 waiting with `waiting_below: 3`). A lease that names no deployment of the group (one
adopted from an older replica after a failover, or granted by a gate that did not place) counts
against the least loaded deployment at its release and stays there until it ends: it runs
somewhere we cannot tell, and that is where a wrong guess costs least (the deployment with the
most room to spare). Without fresh metrics a deployment falls back to a fixed in-flight cap of
its own (`fallback_max_inflight`) while the others keep their metrics, and is placed on only
when none of them has room (see `_candidates`). This module is pure: the
watcher feeds it snapshots, the clock is injected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from .clock import Clock, MonotonicClock
from .gate import CapacityListener
from .placement import Candidate, Placer
from .snapshot import BackendSnapshot
from .ticket import Lease, Ticket, TierLimits
from .tuning import QueueTuner, TunerStatus

GateMode = Literal["starting", "metrics", "fallback"]

_MAX_FIRST_BYTES = 10_000
# How many of a deployment's latest release-to-first-byte times stretch its grace.
_FIRST_BYTES_FOR_GRACE = 8
# Weight of the newest good scrape in a deployment's smoothed scrape duration.
_SCRAPE_SMOOTHING = 0.3


class Deployment(NamedTuple):
    """One engine behind a model name."""

    # The name a lease's `deployment` carries: the api_base without a trailing "/", or the
    # metrics URL where no api_base is known.
    key: str
    metrics_url: str


@dataclass(frozen=True)
class BackendGroup:
    """One model group's deployments and the gate's settings for it."""

    model: str
    deployments: tuple[Deployment, ...]
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
    # Placement among the deployments (core/placement.py): prefix affinity with bounded load.
    prefix_affinity: bool = True
    load_bound: float = 1.25
    # The engine orders its own queue by user too (the priority sent counts the user's requests
    # not yet started): a user with none there may go past the threshold by the running slots
    # (`may_release_newcomer`), and `auto` measures its latency on such users' requests only.
    fair_engine_queue: bool = False

    @property
    def metrics_urls(self) -> tuple[str, ...]:
        return tuple(deployment.metrics_url for deployment in self.deployments)


class GateTransition(NamedTuple):
    model: str
    old: GateMode
    new: GateMode
    reason: str
    # The deployment whose metrics went stale or came back (its key).
    deployment: str


class DeploymentStatus(NamedTuple):
    """What the gate knows about one deployment (for metrics and the status page)."""

    deployment: str
    mode: GateMode
    waiting: float | None
    running: float | None
    tpot_s: float | None
    kv_usage: float | None
    pending: int
    free_slots: float
    in_flight: int
    last_scrape_age_s: float | None
    blocked_reason: str | None
    # Per tier with `waiting_below: auto`: the engine queue its tuner allows now.
    allowed_queue: tuple[tuple[str, float], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """This row as JSON values keyed by field name (how a leader publishes it)."""
        return {**self._asdict(), "allowed_queue": [list(pair) for pair in self.allowed_queue]}

    @classmethod
    def from_wire(cls, fields: object) -> DeploymentStatus:
        """The row `to_wire` wrote, by name: names a newer replica added are ignored, a field
        added with a default may be missing; ValueError names whatever else is wrong."""
        values = _named_fields(cls, fields)
        values["allowed_queue"] = _allowed_queue(values.get("allowed_queue", ()))
        return cls(**values)


class GroupStatus(NamedTuple):
    """One model group: its deployments' rows and their sums (for metrics and the status page).

    The sums are for reading at a glance; every decision is a deployment's own. `mode` is the
    worst deployment's (fallback, then starting), `blocked_reason` the last decision's when no
    deployment had room (None when one had)."""

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
    # Per tier with `waiting_below: auto`: the engine queue its tuners allow now (all deployments).
    allowed_queue: tuple[tuple[str, float], ...] = ()
    per_deployment: tuple[DeploymentStatus, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """This group as JSON values keyed by field name, its deployments' rows included."""
        return {
            **self._asdict(),
            "allowed_queue": [list(pair) for pair in self.allowed_queue],
            "per_deployment": [row.to_wire() for row in self.per_deployment],
        }

    @classmethod
    def from_wire(cls, fields: object) -> GroupStatus:
        """The group `to_wire` wrote, by name (see `DeploymentStatus.from_wire`)."""
        values = _named_fields(cls, fields)
        values["allowed_queue"] = _allowed_queue(values.get("allowed_queue", ()))
        rows = values.get("per_deployment", ())
        if not isinstance(rows, list | tuple):
            raise ValueError(f"GroupStatus.per_deployment is not a list: {rows!r:.60}")
        values["per_deployment"] = tuple(DeploymentStatus.from_wire(row) for row in rows)
        return cls(**values)


def _named_fields(cls: type[DeploymentStatus | GroupStatus], fields: object) -> dict[str, Any]:
    if not isinstance(fields, Mapping):
        raise ValueError(
            f"a {cls.__name__} on the wire is an object keyed by field name, not {fields!r:.60}"
        )
    missing = [n for n in cls._fields if n not in fields and n not in cls._field_defaults]
    if missing:
        raise ValueError(f"a {cls.__name__} on the wire lacks {', '.join(missing)}")
    return {name: fields[name] for name in cls._fields if name in fields}


def _allowed_queue(pairs: object) -> tuple[tuple[str, float], ...]:
    if not isinstance(pairs, list | tuple):
        raise ValueError(f"allowed_queue is not a list of [tier, queue] pairs: {pairs!r:.60}")
    return tuple((str(name), float(queue)) for name, queue in pairs)


@dataclass
class _DeploymentState:
    spec: Deployment
    # The latest successful scrape (kept when later ones fail: its age decides the mode).
    latest: BackendSnapshot | None = None
    last_error: str | None = None
    mode: GateMode = "starting"
    in_flight: int = 0
    # Leases bound here, released and not yet shown to have reached the engine, in release order.
    pending: deque[Lease] = field(default_factory=deque)
    pending_count: int = 0
    pending_ids: set[int] = field(default_factory=set)
    # Most requests seen running at once: the learned capacity. The peak of the current window
    # and of the one before (two buckets make a sliding window); None: nothing seen in it.
    capacity: float | None = None
    capacity_previous: float | None = None
    capacity_window_started: float | None = None
    # When each first byte since the scrapes came back: slots taken that no scrape can show yet.
    # Bounded: only an outage of every scrape lets it fill, and then free slots are not used.
    first_bytes: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_FIRST_BYTES))
    # When each started request's end was seen since the scrape's as-of time: slots freed that
    # no scrape can show yet (only with metrics_lag_s; see _account_scraped).
    ends: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_FIRST_BYTES))
    scrape_requested: bool = False
    # When each started lease's end was seen, not yet counted against a scrape (see
    # _settle_arrivals: an end counts in the first interval whose scrape was sent after it).
    # (Bounded like `ends`: while scrapes fail nothing takes them, and a long outage must not
    # grow memory; the oldest are the ones a scrape would count first anyway.)
    unattributed_ends: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_FIRST_BYTES))
    # Pending leases settled by their first byte or end since the last scrape: arrivals the
    # engine's growth may show too (see _settle_arrivals).
    settled_since_scrape: int = 0
    # Arrivals counted short of what was subtracted in earlier intervals, not yet made up by a
    # later one's (see _settle_arrivals); at most the leases in flight here.
    arrivals_owed: int = 0
    # How long the latest first bytes took from release (see _grace_s): a starved proxy makes
    # the way to the engine longer than `arrival_grace_s`.
    first_byte_after: deque[float] = field(
        default_factory=lambda: deque(maxlen=_FIRST_BYTES_FOR_GRACE)
    )
    # The gate held a request back for this engine's queue since the last scrape (demand).
    held_back: bool = False
    # ... by a tier without an engine queue (below 1): it needs a free slot, so it probes.
    held_back_for_a_slot: bool = False
    # `waiting_below: auto` tiers' controllers, by tier name, made on the tier's first decision.
    tuners: dict[str, QueueTuner] = field(default_factory=dict)
    # How long a good scrape takes to come back (smoothed): a slow /metrics is late, not gone.
    scrape_s: float = 0.0
    blocked_reason: str | None = None


@dataclass
class _GroupState:
    spec: BackendGroup
    placer: Placer
    deployments: dict[str, _DeploymentState] = field(default_factory=dict)
    by_url: dict[str, _DeploymentState] = field(default_factory=dict)
    # Where each released lease counts: its own deployment, or the least loaded one for a lease
    # whose deployment this group does not know (see on_released).
    counted: dict[int, _DeploymentState] = field(default_factory=dict)
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
        self._groups = {group.model: _new_group_state(group) for group in groups}
        self._stale_after_s = stale_after_s
        self._unknown_cap = unknown_model_max_inflight
        self._unknown_in_flight: dict[str, int] = {}
        self._clock: Clock = clock or MonotonicClock()
        self._on_transition = on_transition
        self._request_scrape = request_scrape
        self._listener: CapacityListener | None = None
        self._sharers = 1
        self._growth_settles = True

    # ------------------------------------------------------------------ inputs

    def ends_arrive_out_of_step(self) -> None:
        """Stop settling pending releases by the engine's growth between scrapes where the engine
        exports no finished counter: there the rule adds the ends seen since the last scrape,
        which is only right when ends are seen as they happen. A leader hears other replicas'
        ends through Redis, after scrapes that already showed them, and would settle (and
        release) as many requests too many. Engines that count their finished requests (vLLM)
        keep the rule: it then reads no end of ours."""
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
        deployment = state.by_url.get(snapshot.url) if state is not None else None
        if state is None or deployment is None:
            return
        if snapshot.ok:
            previous = deployment.latest
            deployment.latest = snapshot
            deployment.last_error = None
            took = max(0.0, self._clock.now() - snapshot.started_at)
            deployment.scrape_s += _SCRAPE_SMOOTHING * (took - deployment.scrape_s)
            # Replicas sharing the engine (share_with) each see the others' arrivals as growth:
            # taken for their own, they would let as many more in, n times over.
            # Arrivals counted by the engine's own finished counter need none of our ends, so
            # a leader that hears ends late through Redis may settle by them too.
            finished = _finished_delta(previous, snapshot)
            if self._sharers > 1 or not (self._growth_settles or finished is not None):
                self._forget_arrivals(state.spec, deployment, snapshot)
            elif previous is not None and previous.started_at < snapshot.started_at:
                self._settle_arrivals(state.spec, deployment, previous, snapshot, finished)
            else:  # nothing to compare with: what happened before this scrape is in it
                self._forget_arrivals(state.spec, deployment, snapshot)
            self._account_scraped(state.spec, deployment)
            # After the settling: probing asks whether anything is still on its way.
            self._learn_capacity(state.spec, deployment, snapshot)
            deployment.held_back = deployment.held_back_for_a_slot = False
            now = self._clock.now()
            # The engine's finished count since the previous scrape, for the tuners' drain rate.
            counted = (
                None
                if finished is None or previous is None
                else (finished, snapshot.started_at - previous.started_at)
            )
            # With the engine's queue in user order its mean TTFT is the backlogged users' wait,
            # not what a newcomer sees: `auto` then goes by our newcomers' first bytes alone.
            engine_ttft = None if state.spec.fair_engine_queue else snapshot.ttft_s
            for tuner in deployment.tuners.values():
                tuner.observe_engine(now, engine_ttft, snapshot.tpot_s, snapshot.waiting, counted)
                tuner.tick(now)
        else:
            deployment.last_error = snapshot.error or "scrape failed"
        deployment.scrape_requested = False
        self._refresh_mode(state, deployment)
        self._notify(model)

    def on_released(self, lease: Lease) -> None:
        state = self._groups.get(lease.ticket.model)
        if state is None:
            model = lease.ticket.model
            self._unknown_in_flight[model] = self._unknown_in_flight.get(model, 0) + 1
            return
        deployment = state.deployments.get(lease.deployment or "")
        if deployment is None:
            # Not placed by this gate (an older replica's lease adopted after a failover, or a
            # gate that did not place): it counts where it does the least harm, the least
            # loaded deployment, and stays there until it ends.
            deployment = self._least_loaded(state)
        state.counted[lease.lease_id] = deployment
        deployment.in_flight += 1
        tuner = deployment.tuners.get(lease.ticket.tier)
        if tuner is not None and _measures(state.spec, lease):
            tuner.observe_released(lease.lease_id, lease.released_at)
        deployment.pending.append(lease)
        deployment.pending_ids.add(lease.lease_id)
        deployment.pending_count += 1

    def on_started(self, lease: Lease) -> None:
        state = self._groups.get(lease.ticket.model)
        deployment = state.counted.get(lease.lease_id) if state is not None else None
        if state is None or deployment is None:
            return
        now = self._clock.now()
        tuner = deployment.tuners.get(lease.ticket.tier)
        if tuner is not None and _measures(state.spec, lease):
            tuner.observe_first_byte(lease.lease_id, lease.released_at, now - lease.released_at)
        deployment.first_byte_after.append(now - lease.released_at)
        if self._settle(deployment, lease):
            deployment.settled_since_scrape += 1
            deployment.first_bytes.append(now)
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
            return
        deployment = state.counted.pop(lease.lease_id, None)
        if deployment is None:
            return  # never released through this gate: nothing counted
        deployment.in_flight -= 1
        if self._settle(deployment, lease):
            deployment.settled_since_scrape += 1
        for name, tuner in deployment.tuners.items():
            if name == lease.ticket.tier:
                tuner.observe_ended(lease.lease_id)
            if lease.started:
                tuner.observe_completion()
        if lease.started:
            deployment.unattributed_ends.append(self._clock.now())
        if lease.started and state.spec.metrics_lag_s > 0:
            deployment.ends.append(self._clock.now())
            self._notify(model)

    # ------------------------------------------------------------------ decision

    def may_release(self, model: str, tier: TierLimits) -> bool:
        """Some deployment of the model has room for one more request of this tier."""
        state = self._groups.get(model)
        if state is None:
            return self._unknown_in_flight.get(model, 0) < self._share(self._unknown_cap)
        reason = None
        room = False
        for deployment in state.deployments.values():
            self._refresh_mode(state, deployment)
            deployment.blocked_reason = self._blocked_reason(state.spec, deployment, tier)
            if deployment.blocked_reason is None:
                room = True
            elif reason is None:
                reason = deployment.blocked_reason
        state.blocked_reason = None if room else reason
        if room:
            return True
        scrape = False
        for deployment in state.deployments.values():
            if deployment.blocked_reason != "waiting":
                continue
            # Held back for this engine's queue: demand its tuner and probing look for.
            deployment.held_back = True
            if self._waiting_below(state.spec, deployment, tier) < 1:
                deployment.held_back_for_a_slot = True
            tuner = deployment.tuners.get(tier.name)
            if tuner is not None:
                tuner.note_held_back()
            if not deployment.scrape_requested and self._scrape_would_settle(
                state.spec, deployment
            ):
                # Credits are spent on requests a fresh scrape can account for: ask for it now
                # rather than at the next tick. Blocked by the engine's own queue, an earlier
                # scrape would change nothing, so none is asked for (no polling while parked).
                deployment.scrape_requested = scrape = True
        if scrape and self._request_scrape is not None:
            self._request_scrape(model)
        return False

    def orders_engine_queue(self, model: str) -> bool:
        state = self._groups.get(model)
        return state is not None and state.spec.fair_engine_queue

    def may_release_newcomer(self, model: str, tier: TierLimits) -> bool:
        """With `fair_engine_queue`: some deployment has room for the tier with its threshold
        raised by its running slots (the engine serves this user's request before the queued
        ones of users who have some there, so a queue up to a round of slots deeper delays it
        no more than a slot's turnover). Never without fresh metrics."""
        state = self._groups.get(model)
        if state is None or not state.spec.fair_engine_queue:
            return False
        for deployment in state.deployments.values():
            self._refresh_mode(state, deployment)
            if self._blocked_reason(state.spec, deployment, tier, newcomer=True) is None:
                return True
        return False

    def place(self, ticket: Ticket, tier: TierLimits) -> str | None:
        """Bind the ticket to a deployment with room: prefix affinity within the load bound,
        else the least loaded (core/placement.py)."""
        state = self._groups.get(ticket.model)
        if state is None:
            return None
        candidates = self._candidates(state, tier)
        if state.spec.fair_engine_queue and not any(c.has_room for c in candidates):
            # Released by `may_release_newcomer`: the deployments with room for a newcomer.
            candidates = self._candidates(state, tier, newcomer=True)
        placement = state.placer.choose(ticket.prefix, candidates)
        if placement is None:
            return None  # may_release said otherwise a moment ago; on_released then decides
        state.placer.record(ticket.prefix, placement.deployment)
        return placement.deployment

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        """Released now, the ticket would be bound away from the deployment that holds its
        prefix (no room there, or over the load bound) to one that has room: its prefix would
        be recomputed there (the scheduler's look-ahead may release someone else first)."""
        state = self._affinity_group(ticket)
        return state is not None and state.placer.spills(
            ticket.prefix, self._candidates(state, tier)
        )

    def waits_for_home(self, ticket: Ticket, tier: TierLimits) -> bool:
        """Released now, the ticket would spill into a deployment where it would only queue (no
        free running slot there): it waits for the one that holds its prefix instead."""
        state = self._affinity_group(ticket)
        return state is not None and state.placer.waits(
            ticket.prefix, self._candidates(state, tier)
        )

    def _affinity_group(self, ticket: Ticket) -> _GroupState | None:
        """The ticket's group where prefix affinity can matter: several deployments, a prefix."""
        state = self._groups.get(ticket.model)
        if state is None or len(state.deployments) < 2 or not ticket.prefix:
            return None
        return state

    def _candidates(
        self, state: _GroupState, tier: TierLimits, *, newcomer: bool = False
    ) -> list[Candidate]:
        """The deployments placement chooses among: those with fresh metrics while one of them
        has room for the tier, else all. A deployment without fresh metrics may be down, and
        one that refuses connections ends each request at once: counted only by its in-flight
        requests against the fallback cap, it would look least loaded for ever and take every
        request of a light load, each failing. (It still takes what the others have no room
        for, so an engine whose /metrics alone is broken keeps working.)"""
        candidates = []
        fresh: list[Candidate] = []
        for deployment in state.deployments.values():
            self._refresh_mode(state, deployment)
            candidate = Candidate(
                deployment.spec.key,
                self._load(deployment),
                self._slots(state.spec, deployment),
                self._blocked_reason(state.spec, deployment, tier, newcomer=newcomer) is None,
            )
            candidates.append(candidate)
            if deployment.mode == "metrics":
                fresh.append(candidate)
        if len(fresh) < len(candidates) and any(candidate.has_room for candidate in fresh):
            return fresh
        return candidates

    def _least_loaded(self, state: _GroupState) -> _DeploymentState:
        return min(
            state.deployments.values(),
            key=lambda d: self._load(d) / self._slots(state.spec, d),
        )

    def _load(self, deployment: _DeploymentState) -> float:
        """Requests the gate counts on the deployment now: running (with first bytes and ends
        since the scrape), the engine's queue, and ours on their way; in flight without metrics."""
        snapshot = deployment.latest
        if deployment.mode != "metrics" or snapshot is None:
            return float(deployment.in_flight)
        running = snapshot.running + len(deployment.first_bytes) - len(deployment.ends)
        return max(0.0, running) + snapshot.waiting + deployment.pending_count

    def _slots(self, spec: BackendGroup, deployment: _DeploymentState) -> float:
        """The deployment's running slots for placement: learned (or max_num_seqs) with
        metrics, the fallback cap without; at least 1."""
        if deployment.mode != "metrics":
            return max(1.0, self._share(spec.fallback_max_inflight))
        return max(1.0, self._capacity(spec, deployment))

    def _scrape_would_settle(self, spec: BackendGroup, deployment: _DeploymentState) -> bool:
        pending = deployment.pending
        while pending and pending[0].lease_id not in deployment.pending_ids:
            pending.popleft()  # settled by first byte or end already
        if not pending:
            return False
        return pending[0].released_at + _grace_s(spec, deployment) <= self._clock.now()

    def _blocked_reason(
        self,
        spec: BackendGroup,
        deployment: _DeploymentState,
        tier: TierLimits,
        *,
        newcomer: bool = False,
    ) -> str | None:
        snapshot = deployment.latest
        if deployment.mode != "metrics" or snapshot is None:
            if deployment.in_flight < self._share(spec.fallback_max_inflight):
                return None
            return "fallback_inflight"
        # Free running slots are capacity too: replicas sharing one engine split them as well
        # (whole slots, so the shares never add up to more than the engine has).
        free_slots = self._free_slots(spec, deployment, own_share=True)
        allowed = self._waiting_below(spec, deployment, tier)
        if newcomer:
            allowed += self._capacity(spec, deployment)
        if allowed < 1:
            # No engine queue at all (`waiting_below: 0`, or `auto` down to 0): a request waits
            # in our queue, where its user's turn comes, until a running slot is free for it too.
            # A queue of one makes a newcomer wait for two completions instead of one.
            if engine_queue_estimate(snapshot.waiting, deployment.pending_count + 1, free_slots):
                return "waiting"
        elif engine_queue_estimate(
            snapshot.waiting, deployment.pending_count, free_slots
        ) >= self._share(allowed):
            return "waiting"
        if _at_or_over(snapshot.tpot_s, tier.tpot_below_s):
            return "tpot"
        if _at_or_over(snapshot.kv_usage, tier.kv_usage_below):
            return "kv_usage"
        return None

    def _waiting_below(
        self, spec: BackendGroup, deployment: _DeploymentState, tier: TierLimits
    ) -> float:
        if tier.auto_waiting_below is None:
            return tier.waiting_below
        tuner = deployment.tuners.get(tier.name)
        if tuner is None:
            minimum, maximum = tier.auto_waiting_below
            tuner = deployment.tuners[tier.name] = QueueTuner(
                minimum=minimum,
                maximum=maximum,
                ttft_target_s=tier.ttft_target_s,
                tpot_target_s=tier.tpot_below_s,
                initial=tier.waiting_below,
                started_at=self._clock.now(),
                # A newcomer waits for a slot, not behind the queue (`fair_engine_queue`), and
                # only newcomers are measured (`_measures`).
                newcomers_only=spec.fair_engine_queue,
            )
        return tuner.allowed

    def tuning(self, model: str) -> dict[str, dict[str, TunerStatus]]:
        """What each `waiting_below: auto` tier's tuner decided, per deployment of the group."""
        state = self._groups.get(model)
        if state is None:
            return {}
        return {
            key: {name: tuner.statistics() for name, tuner in deployment.tuners.items()}
            for key, deployment in state.deployments.items()
        }

    def _learn_capacity(
        self, spec: BackendGroup, deployment: _DeploymentState, snapshot: BackendSnapshot
    ) -> None:
        """Learn the deployment's running slots from one scrape (see the module docstring)."""
        now = self._clock.now()
        started = deployment.capacity_window_started
        if started is None:
            deployment.capacity_window_started = now
        elif now - started >= spec.capacity_window_s:
            # A new window: the one that ended becomes the previous one; one idle for longer
            # than a whole window leaves nothing behind.
            long_ago = now - started >= 2 * spec.capacity_window_s
            deployment.capacity_previous = None if long_ago else deployment.capacity
            deployment.capacity = None
            deployment.capacity_window_started = now
        ceiling = spec.max_num_seqs
        running = snapshot.running
        if snapshot.waiting > 0:
            # A queue forms only when the engine takes no more: what runs now is its capacity
            # (lower than max_num_seqs when the KV cache is the limit). Authoritative, so it
            # replaces both buckets: a probe must not leave a phantom free slot behind.
            deployment.capacity = deployment.capacity_previous = running
            return
        known = self._capacity(spec, deployment)
        unseen = deployment.capacity is None and deployment.capacity_previous is None
        if ceiling is not None and unseen:
            running = float(ceiling)  # configured and not yet contradicted by a queue
        elif self._probes(deployment, running, known):
            # Running at the learned capacity with an empty queue while we held requests back
            # and none of ours is on its way: the engine may have more slots. Probe one more
            # per scrape; a queue forming shows the real number. Without this an engine never
            # seen saturated keeps slots unused, since the gate only saturates it through slots
            # it believes free (issue #17).
            running += 1
        if ceiling is not None:
            running = min(running, float(ceiling))
        deployment.capacity = max(deployment.capacity or 0.0, running)

    @staticmethod
    def _probes(deployment: _DeploymentState, running: float, known: float) -> bool:
        """Whether this scrape tries one running slot more (see `_learn_capacity`)."""
        if not deployment.held_back or deployment.pending_count or running < known:
            return False
        if deployment.held_back_for_a_slot:
            # A tier without an engine queue releases only into slots the gate counts free: it
            # must probe, from none on an idle engine. A probe into a slot that does not exist
            # is a request in the engine's queue, the wait this tier avoids, and an engine's
            # queue also holds requests that just arrived, so a queue does not prove the slots
            # (probing stops at `max_num_seqs`: give it with such a tier).
            return True
        # Otherwise only `waiting_below: auto` tiers (those have a tuner): a probe into a slot
        # that does not exist puts one request in the engine's queue beyond the threshold until
        # the next scrape, and a fixed threshold is a promise.
        return bool(deployment.tuners) and running > 0

    @staticmethod
    def _capacity(spec: BackendGroup, deployment: _DeploymentState) -> float:
        unseen = deployment.capacity is None and deployment.capacity_previous is None
        if spec.max_num_seqs is not None and unseen:
            return float(spec.max_num_seqs)
        return max(deployment.capacity or 0.0, deployment.capacity_previous or 0.0)

    def _free_slots(
        self, spec: BackendGroup, deployment: _DeploymentState, *, own_share: bool = False
    ) -> float:
        """Running slots free for our requests: the latest scrape's, less our first bytes since
        it, plus our ends since it.

        `own_share`: replicas sharing the engine (share_with) each take whole slots of the
        scrape's free ones, and only their own first bytes and ends count against that share.
        Below zero it is an overdraft: the engine gives slots in arrival order, so a replica
        whose requests started in more slots than its share has pushed another replica's
        requests into the queue, and counts them as its own queue. (Counted against the whole
        engine's free slots, or clipped at zero, three replicas each put one more into a queue
        already at the threshold; tests/state/test_redis_replicas.py saw 4 over 3.)"""
        if deployment.latest is None:
            return 0.0
        free = max(0.0, self._capacity(spec, deployment) - deployment.latest.running)
        used = len(deployment.first_bytes) - len(deployment.ends)
        if own_share and self._sharers > 1:
            return float(int(free) // self._sharers) - used
        return max(0.0, free - used)

    # ------------------------------------------------------------------ observation

    def status(self) -> list[GroupStatus]:
        now = self._clock.now()
        result = []
        for model, state in self._groups.items():
            rows = tuple(
                self._deployment_status(state.spec, deployment, now)
                for deployment in state.deployments.values()
            )
            fresh = [row for row in rows if row.waiting is not None]
            modes = {row.mode for row in rows}
            mode: GateMode = (
                "fallback"
                if "fallback" in modes
                else "starting"
                if "starting" in modes
                else "metrics"
            )
            allowed: dict[str, float] = {}
            for row in rows:
                for name, queue in row.allowed_queue:
                    allowed[name] = allowed.get(name, 0.0) + queue
            ages = [row.last_scrape_age_s for row in rows if row.last_scrape_age_s is not None]
            result.append(
                GroupStatus(
                    model=model,
                    mode=mode,
                    deployments=len(rows),
                    waiting=sum(row.waiting or 0.0 for row in fresh) if fresh else None,
                    running=sum(row.running or 0.0 for row in fresh) if fresh else None,
                    tpot_s=_worst(row.tpot_s for row in rows),
                    kv_usage=_worst(row.kv_usage for row in rows),
                    pending=sum(row.pending for row in rows),
                    free_slots=sum(row.free_slots for row in rows),
                    in_flight=sum(row.in_flight for row in rows),
                    last_scrape_age_s=max(ages) if ages else None,
                    blocked_reason=state.blocked_reason,
                    allowed_queue=tuple(allowed.items()),
                    per_deployment=rows,
                )
            )
        return result

    def _deployment_status(
        self, spec: BackendGroup, deployment: _DeploymentState, now: float
    ) -> DeploymentStatus:
        snapshot = deployment.latest
        return DeploymentStatus(
            deployment=deployment.spec.key,
            mode=deployment.mode,
            waiting=snapshot.waiting if snapshot else None,
            running=snapshot.running if snapshot else None,
            tpot_s=snapshot.tpot_s if snapshot else None,
            kv_usage=snapshot.kv_usage if snapshot else None,
            pending=deployment.pending_count,
            free_slots=self._free_slots(spec, deployment),
            in_flight=deployment.in_flight,
            last_scrape_age_s=now - snapshot.started_at if snapshot else None,
            blocked_reason=deployment.blocked_reason,
            allowed_queue=tuple((name, tuner.allowed) for name, tuner in deployment.tuners.items()),
        )

    def groups(self) -> Mapping[str, BackendGroup]:
        return {model: state.spec for model, state in self._groups.items()}

    # ------------------------------------------------------------------ internals

    def _notify(self, model: str | None) -> None:
        if self._listener is not None:
            self._listener(model)

    @staticmethod
    def _settle(deployment: _DeploymentState, lease: Lease) -> bool:
        """The lease no longer counts as pending; True if it did until now."""
        if lease.lease_id not in deployment.pending_ids:
            return False
        deployment.pending_ids.discard(lease.lease_id)
        deployment.pending_count -= 1
        # The deque entry is dropped lazily in _account_scraped; keep the deque from
        # growing without bound when first bytes settle leases faster than scrapes arrive.
        pending = deployment.pending
        if len(pending) > 64 and len(pending) > 2 * deployment.pending_count:
            deployment.pending = deque(x for x in pending if x.lease_id in deployment.pending_ids)
        return True

    @staticmethod
    def _settle_arrivals(
        spec: BackendGroup,
        deployment: _DeploymentState,
        previous: BackendSnapshot,
        snapshot: BackendSnapshot,
        finished: float | None,
    ) -> None:
        """Settle as many pending leases (oldest first) as requests reached the engine between
        two scrapes. Waiting out the grace instead counts a request that already runs as pending
        too, which eats the queue credit the engine needs to stay full when first bytes come
        back late (a CPU-starved proxy, issue #17). Another client's arrivals taken for ours let
        at most that many more in, and the next scrape shows them. `finished`: the engine's
        finished count between the two (`_finished_delta`), None where it has none."""
        grown = snapshot.waiting + snapshot.running - previous.waiting - previous.running
        as_of = snapshot.started_at - spec.metrics_lag_s
        ends = _take_until(deployment.unattributed_ends, as_of)
        if finished is None:
            # Requests that left the engine in between hide as many arrivals: our own ends stand
            # for them, each in the interval of the first scrape sent after we saw it (the
            # engine had let it go by then; seen after the scrape was sent, it may not have, and
            # the next interval counts it). Behind a lagging proxy (a loaded LiteLLM) an end is
            # often seen a scrape or more after the one that showed the engine shrink: that
            # interval counts too few arrivals and the end's own too many. The deficit is
            # carried (below) until the end makes it up, so it settles no lease that has not
            # arrived (issue #16's queue peaks of one to three over, before).
            arrivals = grown + ends
        elif finished < 0:
            # The counter went down: the engine restarted, what it had is gone, and how many
            # arrived is unknown. Nothing is settled; the grace and first bytes still are.
            arrivals = 0.0
        else:
            # The engine's own count, in step with the gauges: exact, whatever the proxy saw.
            arrivals = grown + finished
        # Ours settled since by their first byte or end may be among those arrivals: settling as
        # many others for them let as many more in (a wave of ends refilled by releases whose
        # first bytes came back before the scrape put the engine's queue 3 over a fixed
        # threshold). One that arrived before the last scrape keeps a lease pending a little
        # longer instead (until its own first byte, or the grace).
        #
        # Arrivals counted short (an end seen after the scrape that showed its request gone, a
        # first byte seen before the scrape that shows its arrival, an engine that does not
        # count aborts) are owed, not forgotten: clipped at zero, the interval that makes them
        # up settled as many leases that had not arrived, and a flood released one too many
        # each time (the engine's queue at 8 against 3 behind a loaded proxy; by the sums, the
        # leases settled never exceed the arrivals seen, with ends never ahead of departures).
        # What our ends can still make up is at most one a lease in flight here; beyond that
        # (another client's requests, aborts the engine saw and we did not) the deficit is
        # never made up and would only keep leases pending until first byte or grace for good.
        arrived = round(arrivals) - deployment.settled_since_scrape - deployment.arrivals_owed
        deployment.settled_since_scrape = 0
        pending = deployment.pending
        while arrived > 0 and pending and pending[0].released_at <= as_of:
            lease = pending.popleft()
            if lease.lease_id in deployment.pending_ids:
                deployment.pending_ids.discard(lease.lease_id)
                deployment.pending_count -= 1
                arrived -= 1
        # Arrivals left over with no lease to settle are others' (or ours settled already).
        deployment.arrivals_owed = min(max(0, -arrived), deployment.in_flight)

    @staticmethod
    def _forget_arrivals(
        spec: BackendGroup, deployment: _DeploymentState, snapshot: BackendSnapshot
    ) -> None:
        """No settling by growth at this scrape: what it shows starts the count afresh."""
        _take_until(deployment.unattributed_ends, snapshot.started_at - spec.metrics_lag_s)
        deployment.settled_since_scrape = deployment.arrivals_owed = 0

    @staticmethod
    def _account_scraped(spec: BackendGroup, deployment: _DeploymentState) -> None:
        """Forget what the deployment's latest scrape must already show: the first bytes that
        came back before it was sent (as running), and the leases released at least
        `arrival_grace_s` before that (as waiting or running). A first byte that came back while
        a scrape was on its way is kept: that scrape may not show it, and forgetting it would
        count its slot free twice."""
        assert deployment.latest is not None
        grace = spec.arrival_grace_s
        as_of = deployment.latest.started_at - spec.metrics_lag_s
        first_bytes = deployment.first_bytes
        while first_bytes and first_bytes[0] <= as_of:
            first_bytes.popleft()
        # An end seen more than the grace after the as-of time: the engine freed that slot after
        # the scrape's view, so the scrape still shows it taken. Closer than that it may not.
        ends = deployment.ends
        while ends and ends[0] <= as_of + grace:
            ends.popleft()
        seen_until = as_of - _grace_s(spec, deployment)
        pending = deployment.pending
        while pending and pending[0].released_at <= seen_until:
            lease = pending.popleft()
            if lease.lease_id in deployment.pending_ids:
                deployment.pending_ids.discard(lease.lease_id)
                deployment.pending_count -= 1
                # Its arrival may show in a later interval's growth (the grace guessed): there
                # it must settle no other lease (see _settle_arrivals).
                deployment.settled_since_scrape += 1

    def _refresh_mode(self, state: _GroupState, deployment: _DeploymentState) -> None:
        url = deployment.spec.metrics_url
        snapshot = deployment.latest
        error = deployment.last_error
        reason = None
        if snapshot is None:
            reason = f"no successful scrape of {url} yet" + (f" ({error})" if error else "")
        else:
            age = self._clock.now() - snapshot.started_at
            # A scrape that takes D shows the engine D before it lands, and the next one lands
            # no sooner than D later: between two good scrapes the snapshot is up to 2D old.
            # Counted against `stale_after_s`, a slow /metrics (vLLM's API server on a starved
            # CPU took a second and more, issue #17) sent the gate to its fallback cap while
            # every scrape succeeded, and the engine idled. Only good scrapes set D, so an engine
            # that stops answering is still found out after `stale_after_s` plus its usual 2D.
            if age > self._stale_after_s + 2 * deployment.scrape_s:
                reason = f"metrics of {url} are {age:.1f} s old" + (f" ({error})" if error else "")
        if reason is None:
            mode: GateMode = "metrics"
        elif deployment.mode == "starting" and snapshot is None and error is None:
            mode = "starting"  # no answer yet at all: not news, the in-flight cap applies
        else:
            mode = "fallback"
        if mode != deployment.mode:
            transition = GateTransition(
                state.spec.model,
                deployment.mode,
                mode,
                reason or "metrics fresh",
                deployment.spec.key,
            )
            deployment.mode = mode
            if self._on_transition is not None:
                self._on_transition(transition)


def _new_group_state(spec: BackendGroup) -> _GroupState:
    state = _GroupState(
        spec, Placer(prefix_affinity=spec.prefix_affinity, load_bound=spec.load_bound)
    )
    for deployment in spec.deployments:
        state.deployments[deployment.key] = state.by_url[deployment.metrics_url] = _DeploymentState(
            deployment
        )
    return state


def _grace_s(spec: BackendGroup, deployment: _DeploymentState) -> float:
    """How long after its release a pending lease is taken to be in a scrape: the configured
    grace, or the quickest of the deployment's latest release-to-first-byte times where even
    that took longer. A CPU-starved proxy (LiteLLM with busy loops on its core) took 2.1 s and
    more to forward requests the gate released: the 1 s grace settled them while they were
    still in it, the gate released as many more, and the engine's queue reached 5-7 against 3
    once all of them arrived. A first byte comes no sooner than its request reached the engine;
    the quickest one (no wait in the engine's queue) is the way there and back, which bounds
    the way there as well as the proxy's pace allows, at the price of the way back: a lease
    already in the engine that no growth settles stays pending that much longer."""
    recent = deployment.first_byte_after
    return max(spec.arrival_grace_s, min(recent)) if recent else spec.arrival_grace_s


def _take_until(times: deque[float], until: float) -> int:
    """Remove the times at or before `until` (in order) from the front; how many."""
    taken = 0
    while times and times[0] <= until:
        times.popleft()
        taken += 1
    return taken


def _finished_delta(previous: BackendSnapshot | None, snapshot: BackendSnapshot) -> float | None:
    """How many requests the engine finished between two scrapes by its own counter (negative
    after a restart); None where either scrape lacks the counter."""
    if previous is None or previous.requests_finished is None:
        return None
    if snapshot.requests_finished is None:
        return None
    return snapshot.requests_finished - previous.requests_finished


def engine_queue_estimate(waiting: float, pending: float, free_slots: float) -> float:
    """The engine's queue once our pending requests arrive: it fills free slots from its own
    queue first, ours take what is left, the rest waits."""
    left_free = max(0.0, free_slots - waiting)
    return max(0.0, waiting - free_slots) + max(0.0, pending - left_free)


def _at_or_over(value: float | None, ceiling: float | None) -> bool:
    return value is not None and ceiling is not None and value >= ceiling


def _worst(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return max(present) if present else None


def _measures(spec: BackendGroup, lease: Lease) -> bool:
    """Whether `auto`'s latency counts this request: every one, or with `fair_engine_queue` only
    the first of its user in the engine (those queued behind their own user's requests wait
    for them by design; the target is for a user without a backlog there)."""
    return not spec.fair_engine_queue or lease.engine_rank == 0
