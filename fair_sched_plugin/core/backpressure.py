"""The metrics-driven admission gate: release only while the engine's queue is short.

Metrics lag: between two scrapes the engine's waiting count is stale, and a request we release
needs a moment to reach the engine. So a released request keeps counting against the threshold
("pending") until the engine demonstrably has it: its first byte came back, it ended, or a scrape
*sent* at least `arrival_grace_s` after its release has been read (that scrape must include it,
as waiting or running). The estimate of the engine's queue is therefore

    waiting_at_last_scrape + pending

which over-counts briefly (a request already in the engine's queue is also pending until the
grace passes) and never under-counts the way "reset credits on every scrape" does. Pending
requests that find a free running slot never queue there: the rules count them out
(core/gate_rules.py).

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

Several deployments behind one model name: every rule above is a deployment's own.
Each has its snapshot, mode, pending leases, learned capacity, first bytes and ends, and its own
threshold (the tier's `waiting_below`, or its tuner's, as users read it: per engine). A request
may be released when some deployment has room for its tier; `place` then binds it to one of those
(`core/placement.py`: prefix affinity within a load bound, else the least loaded by load per
running slot), and its first byte and end settle against that deployment. The old rule, one group
with the waiting counts summed against the threshold times the number of deployments, let one
replica's queue grow far past the threshold while another idled (a slow engine
reached 11 waiting with `waiting_below: 3`). A lease that names no deployment of the group (one
adopted from an older replica after a failover, or granted by a gate that did not place) counts
against the least loaded deployment at its release and stays there until it ends: it runs
somewhere we cannot tell, and that is where a wrong guess costs least (the deployment with the
most room to spare). Without fresh metrics a deployment falls back to a fixed in-flight cap of
its own (`fallback_max_inflight`) while the others keep their metrics, and is placed on only
when none of them has room (see `_candidates`).

Where the rest lives: what the gate keeps per deployment (settling pending leases against
scrapes, the learned capacity) in core/deployment_ledger.py, the rules that decide room in
core/gate_rules.py, and what it shows (status rows, transitions) in core/gate_status.py. All of
it is pure: the watcher feeds it snapshots, the clock is injected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from .clock import Clock, MonotonicClock
from .deployment_ledger import BackendGroup, Deployment, DeploymentLedger
from .gate import CapacityListener
from .gate_rules import blocked_reason, engine_queue_estimate, placement_slots, share, waiting_below
from .gate_status import DeploymentStatus, GateMode, GateTransition, GroupStatus, group_status
from .placement import Candidate, Placer
from .snapshot import BackendSnapshot
from .ticket import Lease, Ticket, TierLimits
from .tuning import TunerStatus

__all__ = [
    "BackendGroup",
    "Deployment",
    "DeploymentStatus",
    "GateMode",
    "GateTransition",
    "GroupStatus",
    "MetricsGate",
    "engine_queue_estimate",
]


@dataclass
class _GroupState:
    spec: BackendGroup
    placer: Placer
    ledgers: dict[str, DeploymentLedger] = field(default_factory=dict)
    by_url: dict[str, DeploymentLedger] = field(default_factory=dict)
    # Where each released lease counts: its own deployment, or the least loaded one for a lease
    # whose deployment this group does not know (see on_released).
    counted: dict[int, DeploymentLedger] = field(default_factory=dict)
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
        # Only the time is read: every rule takes it as a value.
        self._now = (clock or MonotonicClock()).now
        self._on_transition = on_transition
        self._request_scrape = request_scrape
        self._listener: CapacityListener | None = None
        self._sharers = 1
        self._model_sharers: dict[str, int] = {}
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

    def share_with(self, replicas: int, models: Iterable[str] | None = None) -> None:
        """Spend only 1/`replicas` of every threshold, cap and free slot (at least 1 each
        for thresholds and caps): several
        replicas that each run their own gate against one engine (shared state unreachable)
        must not each spend all of it. 1 restores the whole. `models`: only theirs (a leader
        per model group: each group falls back and rejoins on its own); None: every model
        not given its own share."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1 (got {replicas})")
        if models is None:
            widened = replicas < self._sharers
            self._sharers = replicas
        else:
            widened = False
            for model in models:
                widened = widened or replicas < self._sharers_of(model)
                self._model_sharers[model] = replicas
        if widened:
            self._notify(None)

    def _sharers_of(self, model: str) -> int:
        return self._model_sharers.get(model, self._sharers)

    def set_listener(self, listener: CapacityListener) -> None:
        self._listener = listener

    def update(self, model: str, snapshot: BackendSnapshot) -> None:
        """A scrape of one of the group's deployments finished (successfully or not)."""
        state = self._groups.get(model)
        ledger = state.by_url.get(snapshot.url) if state is not None else None
        if state is None or ledger is None:
            return
        now = self._now()
        if snapshot.ok:
            ledger.scraped(
                snapshot,
                now,
                shared=self._sharers_of(model) > 1,
                ends_in_step=self._growth_settles,
                stale_after_s=self._stale_after_s,
            )
        else:
            ledger.last_error = snapshot.error or "scrape failed"
        ledger.scrape_requested = False
        self._refresh_mode(ledger, now)
        self._notify(model)

    def on_released(self, lease: Lease) -> None:
        state = self._groups.get(lease.ticket.model)
        if state is None:
            model = lease.ticket.model
            self._unknown_in_flight[model] = self._unknown_in_flight.get(model, 0) + 1
            return
        ledger = state.ledgers.get(lease.deployment or "")
        if ledger is None:
            # Not placed by this gate (an older replica's lease adopted after a failover, or a
            # gate that did not place): it counts where it does the least harm, the least
            # loaded deployment, and stays there until it ends.
            ledger = self._least_loaded(state)
        state.counted[lease.lease_id] = ledger
        ledger.released(lease)

    def on_started(self, lease: Lease) -> None:
        state = self._groups.get(lease.ticket.model)
        ledger = state.counted.get(lease.lease_id) if state is not None else None
        if ledger is not None and ledger.started(lease, self._now()):
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
        ledger = state.counted.pop(lease.lease_id, None)
        if ledger is None:
            return  # never released through this gate: nothing counted
        if ledger.ended(lease, self._now()):
            self._notify(model)

    # ------------------------------------------------------------------ decision

    def may_release(self, model: str, tier: TierLimits) -> bool:
        """Some deployment of the model has room for one more request of this tier."""
        state = self._groups.get(model)
        if state is None:
            sharers = self._sharers_of(model)
            cap = self._unknown_cap if sharers == 1 else share(self._unknown_cap, sharers)
            return self._unknown_in_flight.get(model, 0) < cap
        now = self._now()
        reason = None
        room = False
        for ledger in state.ledgers.values():
            self._refresh_mode(ledger, now)
            ledger.blocked_reason = blocked_reason(ledger, tier, now, self._sharers_of(model))
            if ledger.blocked_reason is None:
                room = True
            elif reason is None:
                reason = ledger.blocked_reason
        state.blocked_reason = None if room else reason
        if room:
            return True
        scrape = False
        for ledger in state.ledgers.values():
            if ledger.blocked_reason != "waiting":
                continue
            # Held back for this engine's queue: demand its tuner and probing look for.
            ledger.held_back = True
            if waiting_below(ledger, tier, now) < 1:
                ledger.held_back_for_a_slot = True
            tuner = ledger.tuners.get(tier.name)
            if tuner is not None:
                tuner.note_held_back()
            if not ledger.scrape_requested and ledger.scrape_would_settle(now):
                # Credits are spent on requests a fresh scrape can account for: ask for it now
                # rather than at the next tick. Blocked by the engine's own queue, an earlier
                # scrape would change nothing, so none is asked for (no polling while parked).
                ledger.scrape_requested = scrape = True
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
        now = self._now()
        for ledger in state.ledgers.values():
            self._refresh_mode(ledger, now)
            if blocked_reason(ledger, tier, now, self._sharers_of(model), newcomer=True) is None:
                return True
        return False

    def may_release_into_reserve(self, model: str, tier: TierLimits) -> bool:
        """With the tier's `reserve_slots`: some deployment has room for the tier once its
        reserved slots count too (for a user who holds no slot)."""
        state = self._groups.get(model)
        if state is None or not tier.reserve_slots:
            return False
        now = self._now()
        sharers = self._sharers_of(model)
        for ledger in state.ledgers.values():
            self._refresh_mode(ledger, now)
            if blocked_reason(ledger, tier, now, sharers, into_reserve=True) is None:
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
        if tier.reserve_slots and not any(c.has_room for c in candidates):
            # Released by `may_release_into_reserve`: the deployments with a reserved slot.
            candidates = self._candidates(state, tier, into_reserve=True)
        placement = state.placer.choose(ticket.prefix, candidates)
        if placement is None:
            return None  # may_release said otherwise a moment ago; on_released then decides
        state.placer.record(ticket.prefix, placement.deployment)
        return placement.deployment

    def prefers_elsewhere(self, ticket: Ticket, tier: TierLimits) -> bool:
        """Released now, the ticket would be bound away from the deployment that holds its
        prefix (no room there, or over the load bound) to one that has room: its prefix would
        be recomputed there (the scheduler's look-ahead may release someone else first)."""
        if not ticket.prefix:
            return False  # no prefix, no home (`_affinity_group`): asked on every release
        state = self._affinity_group(ticket)
        return state is not None and state.placer.spills(
            ticket.prefix, self._candidates(state, tier)
        )

    def waits_for_home(self, ticket: Ticket, tier: TierLimits) -> bool:
        """Released now, the ticket would spill into a deployment where it would only queue (no
        free running slot there): it waits for the one that holds its prefix instead."""
        if not ticket.prefix:
            return False  # no prefix, no home (`_affinity_group`): asked on every admission
        state = self._affinity_group(ticket)
        return state is not None and state.placer.waits(
            ticket.prefix, self._candidates(state, tier)
        )

    def _affinity_group(self, ticket: Ticket) -> _GroupState | None:
        """The ticket's group where prefix affinity can matter: several deployments, a prefix."""
        state = self._groups.get(ticket.model)
        if state is None or len(state.ledgers) < 2 or not ticket.prefix:
            return None
        return state

    def _candidates(
        self,
        state: _GroupState,
        tier: TierLimits,
        *,
        newcomer: bool = False,
        into_reserve: bool = False,
    ) -> list[Candidate]:
        """The deployments placement chooses among: those with fresh metrics while one of them
        has room for the tier, else all. A deployment without fresh metrics may be down, and
        one that refuses connections ends each request at once: counted only by its in-flight
        requests against the fallback cap, it would look least loaded for ever and take every
        request of a light load, each failing. (It still takes what the others have no room
        for, so an engine whose /metrics alone is broken keeps working.)"""
        now = self._now()
        candidates = []
        fresh: list[Candidate] = []
        sharers = self._sharers_of(state.spec.model)
        for ledger in state.ledgers.values():
            self._refresh_mode(ledger, now)
            candidate = Candidate(
                ledger.spec.key,
                ledger.load(),
                placement_slots(ledger, sharers),
                blocked_reason(
                    ledger, tier, now, sharers, newcomer=newcomer, into_reserve=into_reserve
                )
                is None,
            )
            candidates.append(candidate)
            if ledger.mode == "metrics":
                fresh.append(candidate)
        if len(fresh) < len(candidates) and any(candidate.has_room for candidate in fresh):
            return fresh
        return candidates

    def _least_loaded(self, state: _GroupState) -> DeploymentLedger:
        sharers = self._sharers_of(state.spec.model)
        return min(
            state.ledgers.values(),
            key=lambda ledger: ledger.load() / placement_slots(ledger, sharers),
        )

    def tuning(self, model: str) -> dict[str, dict[str, TunerStatus]]:
        """What each `waiting_below: auto` tier's tuner decided, per deployment of the group."""
        state = self._groups.get(model)
        if state is None:
            return {}
        return {
            key: {name: tuner.statistics() for name, tuner in ledger.tuners.items()}
            for key, ledger in state.ledgers.items()
        }

    # ------------------------------------------------------------------ observation

    def status(self) -> list[GroupStatus]:
        now = self._now()
        return [
            group_status(
                model,
                tuple(ledger.status(now) for ledger in state.ledgers.values()),
                state.blocked_reason,
            )
            for model, state in self._groups.items()
        ]

    def groups(self) -> Mapping[str, BackendGroup]:
        return {model: state.spec for model, state in self._groups.items()}

    # ------------------------------------------------------------------ internals

    def _notify(self, model: str | None) -> None:
        if self._listener is not None:
            self._listener(model)

    def _refresh_mode(self, ledger: DeploymentLedger, now: float) -> None:
        transition = ledger.refresh_mode(now, self._stale_after_s)
        if transition is not None and self._on_transition is not None:
            self._on_transition(transition)


def _new_group_state(spec: BackendGroup) -> _GroupState:
    state = _GroupState(
        spec, Placer(prefix_affinity=spec.prefix_affinity, load_bound=spec.load_bound)
    )
    for deployment in spec.deployments:
        state.ledgers[deployment.key] = state.by_url[deployment.metrics_url] = DeploymentLedger(
            deployment, spec
        )
    return state
