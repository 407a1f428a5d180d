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

Until the engine has been seen saturated the capacity is underestimated, which only makes the
gate more careful. Without this, a tier that wants the queue empty (`waiting_below: 1`) would
refill free slots one round trip at a time. The capacity is the peak of a sliding window
(`capacity_window_s`, two buckets), not of all time: an engine restarted with fewer slots, or
one short-lived spike, would otherwise count slots free for ever and let pending requests into
the engine's queue.

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
from .ticket import Lease, TierLimits

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
    scrape_requested: bool = False
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

    # ------------------------------------------------------------------ inputs

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
            state.latest_ok[snapshot.url] = snapshot
            state.last_error.pop(snapshot.url, None)
            self._learn_capacity(state, snapshot)
            self._account_scraped(state)
        else:
            state.last_error[snapshot.url] = snapshot.error or "scrape failed"
        state.scrape_requested = False
        self._refresh_mode(state)
        self._notify(model)

    def on_released(self, lease: Lease) -> None:
        state = self._groups.get(lease.ticket.model)
        if state is None:
            model = lease.ticket.model
            self._unknown_in_flight[model] = self._unknown_in_flight.get(model, 0) + 1
            return
        state.in_flight += 1
        state.pending.append(lease)
        state.pending_ids.add(lease.lease_id)
        state.pending_count += 1

    def on_started(self, lease: Lease) -> None:
        state = self._groups.get(lease.ticket.model)
        if state is not None and self._settle(state, lease):
            state.first_bytes.append(self._clock.now())
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
        if queued_in_engine >= self._share(tier.waiting_below * deployments):
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

    def _learn_capacity(self, state: _GroupState, snapshot: BackendSnapshot) -> None:
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
        state.capacity[url] = max(state.capacity.get(url, 0.0), snapshot.running)

    @staticmethod
    def _free_slots(state: _GroupState) -> float:
        free = sum(
            max(
                0.0,
                max(state.capacity.get(url, 0.0), state.capacity_previous.get(url, 0.0))
                - snapshot.running,
            )
            for url, snapshot in state.latest_ok.items()
        )
        return max(0.0, free - len(state.first_bytes))

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

    def _account_scraped(self, state: _GroupState) -> None:
        """Forget what every deployment's latest scrape must already show: the first bytes that
        came back before it was sent (as running), and the leases released at least
        `arrival_grace_s` before that (as waiting or running). A first byte that came back while
        a scrape was on its way is kept: that scrape may not show it, and forgetting it would
        count its slot free twice."""
        if len(state.latest_ok) < len(state.spec.metrics_urls):
            return
        sent_at = min(s.started_at for s in state.latest_ok.values())
        first_bytes = state.first_bytes
        while first_bytes and first_bytes[0] <= sent_at:
            first_bytes.popleft()
        seen_until = sent_at - state.spec.arrival_grace_s
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
