"""What the metrics gate knows about one deployment between scrapes: its latest scrape and mode,
the leases released there and not yet shown to have reached the engine (pending), the first
bytes and ends no scrape can show yet, and its learned capacity. The rules that read this to
decide are in core/gate_rules.py, the gate that feeds it in core/backpressure.py.

The gate learns each deployment's capacity as the most requests it has seen running at once, and
lets pending requests fill the slots the last scrape showed free (less those taken since). A
scrape with a queue shows the capacity exactly (the engine queues only when it takes no more,
slots or KV cache), and replaces what was learned. Without a queue the capacity is at least what
runs; while the gate holds requests back, nothing it released is still on its way, and the
engine runs at the learned capacity with an empty queue, it probes one slot more per scrape, so
an engine never seen saturated is not kept under-filled (`max_num_seqs`, where configured, is
the starting value and the ceiling). Without free slots, a tier that wants the queue empty
(`waiting_below: 1`) would refill free slots one round trip at a time. The capacity is the peak
of a sliding window (`capacity_window_s`, two buckets), not of all time: an engine restarted
with fewer slots, or one short-lived spike, would otherwise count slots free for ever and let
pending requests into the engine's queue.

Work-conserving against late signals: a pending request that already runs would
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
too many. With `metrics_lag_s` a scrape is taken to show the engine as of
`started_at - metrics_lag_s`: first bytes and pending requests are forgotten against that time,
and ends seen after it give their slots back.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from .gate_status import DeploymentStatus, GateMode, GateTransition
from .snapshot import BackendSnapshot
from .ticket import Lease, TierLimits
from .tuning import QueueTuner

_MAX_FIRST_BYTES = 10_000
# How many of a deployment's latest release-to-first-byte times stretch its grace, and of the
# ways back (round trip less the way there) that shorten it without the finished counter.
_FIRST_BYTES_FOR_GRACE = 8
# How many of the latest ways there (release to the scrape whose arrivals settled the lease) the
# grace covers: the slowest of them.
_ARRIVALS_FOR_GRACE = 32
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


@dataclass
class DeploymentLedger:
    """One deployment's bookkeeping; `group` holds the settings it is kept by."""

    spec: Deployment
    group: BackendGroup
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
    capacity_current: float | None = None
    capacity_previous: float | None = None
    capacity_window_started: float | None = None
    # When each first byte since the scrapes came back: slots taken that no scrape can show yet.
    # Bounded: only an outage of every scrape lets it fill, and then free slots are not used.
    first_bytes: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_FIRST_BYTES))
    # When each started request's end was seen since the scrape's as-of time: slots freed that
    # no scrape can show yet (only with metrics_lag_s; see account_scraped).
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
    # How long the latest first bytes took from release (see grace_s): a starved proxy makes
    # the way to the engine longer than `arrival_grace_s`.
    first_byte_after: deque[float] = field(
        default_factory=lambda: deque(maxlen=_FIRST_BYTES_FOR_GRACE)
    )
    # How long after their release the latest leases were shown arrived by a scrape's growth,
    # where it shows arrivals unambiguously (see _settle_arrivals), and without the finished
    # counter, how much longer the quickest round trip was at each (the way back): grace_s.
    arrived_after: deque[float] = field(default_factory=lambda: deque(maxlen=_ARRIVALS_FOR_GRACE))
    way_back: deque[float] = field(default_factory=lambda: deque(maxlen=_FIRST_BYTES_FOR_GRACE))
    # Release-to-first-byte times of the latest leases released after the engine was last seen
    # with a queue (they waited in none), and when that was (a scrape's as-of time): without the
    # counter the slowest of them bounds the slowest way there (see _slowest_way_there).
    queue_free_after: deque[float] = field(
        default_factory=lambda: deque(maxlen=_ARRIVALS_FOR_GRACE)
    )
    queue_seen_at: float = -math.inf
    # When each lease the grace settled was released, while no scrape has shown its arrival yet:
    # that arrival settles no other lease (see _settle_arrivals). At most the leases in flight.
    graced: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_FIRST_BYTES))
    # The gate held a request back for this engine's queue since the last scrape (demand).
    held_back: bool = False
    # ... by a tier without an engine queue (below 1): it needs a free slot, so it probes.
    held_back_for_a_slot: bool = False
    # `waiting_below: auto` tiers' controllers, by tier name, made on the tier's first decision.
    tuners: dict[str, QueueTuner] = field(default_factory=dict)
    # How long a good scrape takes to come back (smoothed): a slow /metrics is late, not gone.
    scrape_s: float = 0.0
    blocked_reason: str | None = None

    # ------------------------------------------------------------------ leases

    def released(self, lease: Lease) -> None:
        """A lease bound here (or counted here: see MetricsGate.on_released) was released."""
        self.in_flight += 1
        tuner = self.tuners.get(lease.ticket.tier)
        if tuner is not None and self._measures(lease):
            tuner.observe_released(lease.lease_id, lease.released_at)
        self.pending.append(lease)
        self.pending_ids.add(lease.lease_id)
        self.pending_count += 1

    def started(self, lease: Lease, now: float) -> bool:
        """The lease's first byte came back; True if it was pending until now (its slot is
        taken, and no scrape shows that yet)."""
        tuner = self.tuners.get(lease.ticket.tier)
        if tuner is not None and self._measures(lease):
            tuner.observe_first_byte(lease.lease_id, lease.released_at, now - lease.released_at)
        self.first_byte_after.append(now - lease.released_at)
        if lease.released_at > self.queue_seen_at:
            self.queue_free_after.append(now - lease.released_at)
        if not self._settle(lease):
            return False
        self.settled_since_scrape += 1
        self.first_bytes.append(now)
        return True

    def ended(self, lease: Lease, now: float) -> bool:
        """The lease ended; True if that gives a slot back before a scrape can show it (only
        with `metrics_lag_s`)."""
        self.in_flight -= 1
        if self._settle(lease):
            self.settled_since_scrape += 1
        for name, tuner in self.tuners.items():
            if name == lease.ticket.tier:
                tuner.observe_ended(lease.lease_id)
            if lease.started:
                tuner.observe_completion()
        if lease.started:
            self.unattributed_ends.append(now)
        if lease.started and self.group.metrics_lag_s > 0:
            self.ends.append(now)
            return True
        return False

    def _measures(self, lease: Lease) -> bool:
        """Whether `auto`'s latency counts this request: every one, or with `fair_engine_queue`
        only the first of its user in the engine (those queued behind their own user's requests
        wait for them by design; the target is for a user without a backlog there)."""
        return not self.group.fair_engine_queue or lease.engine_rank == 0

    def _settle(self, lease: Lease) -> bool:
        """The lease no longer counts as pending; True if it did until now."""
        if lease.lease_id not in self.pending_ids:
            return False
        self.pending_ids.discard(lease.lease_id)
        self.pending_count -= 1
        # The deque entry is dropped lazily in account_scraped; keep the deque from
        # growing without bound when first bytes settle leases faster than scrapes arrive.
        pending = self.pending
        if len(pending) > 64 and len(pending) > 2 * self.pending_count:
            self.pending = deque(x for x in pending if x.lease_id in self.pending_ids)
        return True

    # ------------------------------------------------------------------ scrapes

    def scraped(
        self,
        snapshot: BackendSnapshot,
        now: float,
        *,
        shared: bool,
        ends_in_step: bool,
        stale_after_s: float,
    ) -> None:
        """A successful scrape: settle what it shows, learn the capacity, feed the tuners.
        `shared`: other replicas release into this engine too (MetricsGate.share_with);
        `ends_in_step`: our ends are seen as they happen (MetricsGate.ends_arrive_out_of_step);
        `stale_after_s`: a previous scrape older than that is no interval to count arrivals in
        (see below)."""
        previous = self.latest
        self.latest = snapshot
        self.last_error = None
        if snapshot.waiting > 0:
            as_of = snapshot.started_at - self.group.metrics_lag_s
            self.queue_seen_at = max(self.queue_seen_at, as_of)
        took = max(0.0, now - snapshot.started_at)
        self.scrape_s += _SCRAPE_SMOOTHING * (took - self.scrape_s)
        # Replicas sharing the engine each see the others' arrivals as growth: taken for their
        # own, they would let as many more in, n times over.
        # Arrivals counted by the engine's own finished counter need none of our ends, so
        # a leader that hears ends late through Redis may settle by them too.
        finished = _finished_delta(previous, snapshot)
        if shared or not (ends_in_step or finished is not None):
            self._forget_arrivals(snapshot)
        elif (
            previous is not None
            and 0 < snapshot.started_at - previous.started_at <= stale_after_s + 2 * self.scrape_s
        ):
            self._settle_arrivals(previous, snapshot, finished)
        else:
            # Nothing to compare with: what happened before this scrape is in it. Nor with a
            # scrape older than the metrics stay fresh: its watcher paused while another replica
            # decided for the engine (or scrapes failed), and that replica's releases arrived
            # in between. Taken for ours, they settled every lease a new leader adopted,
            # those still on their way included, and it granted as many more.
            self._forget_arrivals(snapshot)
        self._account_scraped()
        # After the settling: probing asks whether anything is still on its way.
        self._learn_capacity(snapshot, now)
        self.held_back = self.held_back_for_a_slot = False
        # The engine's finished count since the previous scrape, for the tuners' drain rate.
        counted = (
            None
            if finished is None or previous is None
            else (finished, snapshot.started_at - previous.started_at)
        )
        # With the engine's queue in user order its mean TTFT is the backlogged users' wait,
        # not what a newcomer sees: `auto` then goes by our newcomers' first bytes alone.
        engine_ttft = None if self.group.fair_engine_queue else snapshot.ttft_s
        for tuner in self.tuners.values():
            tuner.observe_engine(now, engine_ttft, snapshot.tpot_s, snapshot.waiting, counted)
            tuner.tick(now)

    def _settle_arrivals(
        self, previous: BackendSnapshot, snapshot: BackendSnapshot, finished: float | None
    ) -> None:
        """Settle as many pending leases (oldest first) as requests reached the engine between
        two scrapes. Waiting out the grace instead counts a request that already runs as pending
        too, which eats the queue credit the engine needs to stay full when first bytes come
        back late (a CPU-starved proxy). Another client's arrivals taken for ours let
        at most that many more in, and the next scrape shows them. `finished`: the engine's
        finished count between the two (`_finished_delta`), None where it has none."""
        grown = snapshot.waiting + snapshot.running - previous.waiting - previous.running
        as_of = snapshot.started_at - self.group.metrics_lag_s
        ends = _take_until(self.unattributed_ends, as_of)
        if finished is None:
            # Requests that left the engine in between hide as many arrivals: our own ends stand
            # for them, each in the interval of the first scrape sent after we saw it (the
            # engine had let it go by then; seen after the scrape was sent, it may not have, and
            # the next interval counts it). Behind a lagging proxy (a loaded LiteLLM) an end is
            # often seen a scrape or more after the one that showed the engine shrink: that
            # interval counts too few arrivals and the end's own too many. The deficit is
            # carried (below) until the end makes it up, so it settles no lease that has not
            # arrived (counted at once, queues peaked one to three over the threshold).
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
        arrived = round(arrivals) - self.settled_since_scrape - self.arrivals_owed
        self.settled_since_scrape = 0
        # Leases the grace settled before their arrival showed come first (the oldest): theirs
        # may be among these arrivals, and settling others for them let as many more in. With the
        # finished counter each one that is shows how long the way there took, beyond the grace
        # (see grace_s); without it one that arrived in time may only show now (its arrival hid
        # behind a departure whose end we had not seen yet), so it shows nothing.
        counted = finished is not None
        # Without the counter an arrival may hide behind a departure (until we see its end),
        # except in an interval that began with the engine empty: there growth is arrivals.
        exact = counted or not (previous.waiting or previous.running)
        graced = self.graced
        while arrived > 0 and graced:
            released_at = graced.popleft()
            arrived -= 1
            if exact:
                self.arrived_after.append(as_of - released_at)
        # Without the counter an interval that counted an end may count arrivals late (those
        # that hid behind departures in earlier ones): only the others show the way there.
        shown = exact or not ends
        pending = self.pending
        while arrived > 0 and pending and pending[0].released_at <= as_of:
            lease = pending.popleft()
            if lease.lease_id in self.pending_ids:
                self.pending_ids.discard(lease.lease_id)
                self.pending_count -= 1
                arrived -= 1
                if shown:
                    self._arrived(as_of - lease.released_at, counted)
        # Arrivals left over with no lease to settle are others' (or ours settled already).
        self.arrivals_owed = min(max(0, -arrived), self.in_flight)

    def _forget_arrivals(self, snapshot: BackendSnapshot) -> None:
        """No settling by growth at this scrape: what it shows starts the count afresh."""
        _take_until(self.unattributed_ends, snapshot.started_at - self.group.metrics_lag_s)
        self.settled_since_scrape = self.arrivals_owed = 0
        self.graced.clear()

    def _arrived(self, after: float, exact: bool) -> None:
        """A scrape's growth showed a lease arrived `after` seconds from its release (see
        grace_s); without the finished counter, the quickest round trip less that is a way back."""
        self.arrived_after.append(after)
        if not exact and self.first_byte_after:
            self.way_back.append(min(self.first_byte_after) - after)

    def _account_scraped(self) -> None:
        """Forget what the latest scrape must already show: the first bytes that came back
        before it was sent (as running), and the leases released at least `arrival_grace_s`
        before that (as waiting or running). A first byte that came back while a scrape was on
        its way is kept: that scrape may not show it, and forgetting it would count its slot
        free twice."""
        assert self.latest is not None
        grace = self.group.arrival_grace_s
        as_of = self.latest.started_at - self.group.metrics_lag_s
        first_bytes = self.first_bytes
        while first_bytes and first_bytes[0] <= as_of:
            first_bytes.popleft()
        # An end seen more than the grace after the as-of time: the engine freed that slot after
        # the scrape's view, so the scrape still shows it taken. Closer than that it may not.
        ends = self.ends
        while ends and ends[0] <= as_of + grace:
            ends.popleft()
        seen_until = as_of - self.grace_s()
        pending = self.pending
        while pending and pending[0].released_at <= seen_until:
            lease = pending.popleft()
            if lease.lease_id in self.pending_ids:
                self.pending_ids.discard(lease.lease_id)
                self.pending_count -= 1
                # Its arrival may show in a later interval's growth (the grace guessed): there
                # it must settle no other lease (see _settle_arrivals).
                self.graced.append(lease.released_at)
        graced = self.graced
        while len(graced) > max(0, self.in_flight):
            graced.popleft()

    def grace_s(self) -> float:
        """How long after its release a pending lease is taken to be in a scrape: the configured
        grace, or longer where the deployment's latest leases took longer to arrive.

        A CPU-starved proxy (LiteLLM with busy loops on its core) took 2.1 s and more to forward
        requests the gate released: the 1 s grace settled them while they were still in it, the
        gate released as many more, and the engine's queue reached 5-7 against 3 once all of
        them arrived. So the grace is at least the slowest of the latest ways there that scrapes
        showed (release to the scrape whose arrivals settled the lease, a lease the grace had
        settled too soon included: see _settle_arrivals), where they show them unambiguously:
        with the engine's finished counter at every scrape, without it after a scrape that
        showed the engine empty (no departure can hide an arrival then; a lease the grace
        settled too soon, as a starved LiteLLM's first requests took 2.1 s, shows there) and,
        for the leases still pending, where the interval counted no end. With the counter the
        grace is also at least
        the quickest recent release-to-first-byte time: a first byte comes no sooner than its
        request reached the engine, and the quickest (no wait in the engine's queue) is the way
        there and back. A longer grace costs nothing there, since the arrivals settle leases
        before it passes.

        Without the counter a lease that refills a slot as another request leaves (its arrival
        hides behind that departure until we see the end) stays pending until the grace, its
        first byte or that end, and the last two come the way back late: a grace of the way
        there and back kept refills pending a way back too long, and behind a starved proxy (1 s
        there, 1 s back) `auto` ran 6.2 of 8 slots, with a queue of 11 as the hidden refills
        came out in bursts (7.8 and 5 with the 1 s grace, which the way there happened to be).
        There the quickest round trip counts less the way back, which each lease a scrape showed
        arrived measures (the quickest round trip then less its way there; the largest of the
        latest, so the grace is never the quickest way there alone): a proxy that slows down
        still stretches the grace as its first bytes do.

        Neither rule learns the slowest way there from a proxy that forwards out of order
        (0.5-3 s, seeded in the simulator): the slow leases are the ones the grace
        settles before their arrival shows, their arrivals show only in intervals that began
        with the engine empty (rare under a flood), and the arrivals that do show are the quick
        ones. The grace stayed at 1.2-1.5 s, leases 3 s on their way were settled, the gate
        released as many more, and the engine's queue reached 4-5 against 3 in 3 of 8 runs.
        So without the counter the grace is also at least the slowest way there that first
        bytes bound, which scrapes cannot confuse (see _slowest_way_there)."""
        grace = self.group.arrival_grace_s
        arrived = max(self.arrived_after, default=grace)
        recent = self.first_byte_after
        if not recent:
            return max(grace, arrived)
        round_trip = min(recent)
        snapshot = self.latest
        if snapshot is not None and snapshot.requests_finished is not None:
            return max(grace, arrived, round_trip)
        if self.way_back:
            round_trip -= max(self.way_back)
        return max(grace, arrived, round_trip, self._slowest_way_there())

    def _slowest_way_there(self) -> float:
        """Without the counter, a bound on the slowest of the latest ways there, from the round
        trips of leases that waited in no engine queue (released after every scrape that showed
        one): each is its way there, the prefill and the way back, so the slowest of them less
        the way back bounds the slowest way there from above. An arrival a scrape shows cannot
        tell which lease it was, nor when it happened when a departure hid it; a first byte is
        that lease's own.

        The way back is taken as the quickest of those round trips less the quickest arrival a
        scrape showed: that arrival happened no later than it showed, and no sooner than the
        quickest way there, so where the quickest round trip had the quickest way there this
        is at most its way back (plus prefill; elsewhere more by the difference of the two ways
        there), and subtracting less only keeps the grace longer. Behind a steady starved proxy
        (1 s there, 1 s back) that is the way there again, and the grace stays where `auto` fills
        the engine. A long prefill, or a queue that formed and drained between two scrapes,
        makes a round trip longer: the grace too, and a lease stays pending until the arrivals
        or its first byte settle it, never one released too many."""
        trips = self.queue_free_after
        if not trips:
            return 0.0
        arrived = self.arrived_after
        back = max(0.0, min(trips) - min(arrived)) if arrived else 0.0
        return max(trips) - back

    def scrape_would_settle(self, now: float) -> bool:
        """A fresh scrape would settle the oldest pending lease (its grace has passed)."""
        pending = self.pending
        while pending and pending[0].lease_id not in self.pending_ids:
            pending.popleft()  # settled by first byte or end already
        if not pending:
            return False
        return pending[0].released_at + self.grace_s() <= now

    def refresh_mode(self, now: float, stale_after_s: float) -> GateTransition | None:
        """Metrics while the latest scrape is fresh, else the fallback cap (or still starting);
        the transition when the mode changed."""
        url = self.spec.metrics_url
        snapshot = self.latest
        error = self.last_error
        reason = None
        if snapshot is None:
            reason = f"no successful scrape of {url} yet" + (f" ({error})" if error else "")
        else:
            age = now - snapshot.started_at
            # A scrape that takes D shows the engine D before it lands, and the next one lands
            # no sooner than D later: between two good scrapes the snapshot is up to 2D old.
            # Counted against `stale_after_s`, a slow /metrics (vLLM's API server on a starved
            # CPU took a second and more) sent the gate to its fallback cap while
            # every scrape succeeded, and the engine idled. Only good scrapes set D, so an engine
            # that stops answering is still found out after `stale_after_s` plus its usual 2D.
            if age > stale_after_s + 2 * self.scrape_s:
                reason = f"metrics of {url} are {age:.1f} s old" + (f" ({error})" if error else "")
        if reason is None:
            mode: GateMode = "metrics"
        elif self.mode == "starting" and snapshot is None and error is None:
            mode = "starting"  # no answer yet at all: not news, the in-flight cap applies
        else:
            mode = "fallback"
        if mode == self.mode:
            return None
        transition = GateTransition(
            self.group.model, self.mode, mode, reason or "metrics fresh", self.spec.key
        )
        self.mode = mode
        return transition

    # ------------------------------------------------------------------ capacity

    def _learn_capacity(self, snapshot: BackendSnapshot, now: float) -> None:
        """Learn the deployment's running slots from one scrape (see the module docstring)."""
        started = self.capacity_window_started
        window_s = self.group.capacity_window_s
        if started is None:
            self.capacity_window_started = now
        elif now - started >= window_s:
            # A new window: the one that ended becomes the previous one; one idle for longer
            # than a whole window leaves nothing behind.
            long_ago = now - started >= 2 * window_s
            self.capacity_previous = None if long_ago else self.capacity_current
            self.capacity_current = None
            self.capacity_window_started = now
        ceiling = self.group.max_num_seqs
        running = snapshot.running
        if snapshot.waiting > 0:
            # A queue forms only when the engine takes no more: what runs now is its capacity
            # (lower than max_num_seqs when the KV cache is the limit). Authoritative, so it
            # replaces both buckets: a probe must not leave a phantom free slot behind.
            self.capacity_current = self.capacity_previous = running
            return
        known = self.capacity()
        unseen = self.capacity_current is None and self.capacity_previous is None
        if ceiling is not None and unseen:
            running = float(ceiling)  # configured and not yet contradicted by a queue
        elif self._probes(running, known):
            # Running at the learned capacity with an empty queue while we held requests back
            # and none of ours is on its way: the engine may have more slots. Probe one more
            # per scrape; a queue forming shows the real number. Without this an engine never
            # seen saturated keeps slots unused, since the gate only saturates it through slots
            # it believes free.
            running += 1
        if ceiling is not None:
            running = min(running, float(ceiling))
        self.capacity_current = max(self.capacity_current or 0.0, running)

    def _probes(self, running: float, known: float) -> bool:
        """Whether this scrape tries one running slot more (see `_learn_capacity`)."""
        if not self.held_back or self.pending_count or running < known:
            return False
        if self.held_back_for_a_slot:
            # A tier without an engine queue releases only into slots the gate counts free: it
            # must probe, from none on an idle engine. A probe into a slot that does not exist
            # is a request in the engine's queue, the wait this tier avoids, and an engine's
            # queue also holds requests that just arrived, so a queue does not prove the slots
            # (probing stops at `max_num_seqs`: give it with such a tier).
            return True
        # Otherwise only `waiting_below: auto` tiers (those have a tuner): a probe into a slot
        # that does not exist puts one request in the engine's queue beyond the threshold until
        # the next scrape, and a fixed threshold is a promise.
        return bool(self.tuners) and running > 0

    def capacity(self) -> float:
        """The running slots: learned (the peak of the window), or `max_num_seqs` until a
        scrape was seen."""
        unseen = self.capacity_current is None and self.capacity_previous is None
        if self.group.max_num_seqs is not None and unseen:
            return float(self.group.max_num_seqs)
        return max(self.capacity_current or 0.0, self.capacity_previous or 0.0)

    def free_slots(self, sharers: int = 1) -> float:
        """Running slots free for our requests: the latest scrape's, less our first bytes since
        it, plus our ends since it.

        `sharers` > 1: replicas sharing the engine (MetricsGate.share_with) each take whole
        slots of the scrape's free ones, and only their own first bytes and ends count against
        that share. Below zero it is an overdraft: the engine gives slots in arrival order, so a
        replica whose requests started in more slots than its share has pushed another replica's
        requests into the queue, and counts them as its own queue. (Counted against the whole
        engine's free slots, or clipped at zero, three replicas each put one more into a queue
        already at the threshold; tests/state/test_redis_replicas.py saw 4 over 3.)"""
        if self.latest is None:
            return 0.0
        free = max(0.0, self.capacity() - self.latest.running)
        used = len(self.first_bytes) - len(self.ends)
        if sharers > 1:
            return float(int(free) // sharers) - used
        return max(0.0, free - used)

    def load(self) -> float:
        """Requests the gate counts on the deployment now: running (with first bytes and ends
        since the scrape), the engine's queue, and ours on their way; in flight without metrics."""
        snapshot = self.latest
        if self.mode != "metrics" or snapshot is None:
            return float(self.in_flight)
        running = snapshot.running + len(self.first_bytes) - len(self.ends)
        return max(0.0, running) + snapshot.waiting + self.pending_count

    def tuner(self, tier: TierLimits, bounds: tuple[int, int], now: float) -> QueueTuner:
        """The `waiting_below: auto` tier's tuner here (`bounds`: the tier's minimum and maximum
        queue), made on the tier's first decision."""
        tuner = self.tuners.get(tier.name)
        if tuner is None:
            minimum, maximum = bounds
            tuner = self.tuners[tier.name] = QueueTuner(
                minimum=minimum,
                maximum=maximum,
                ttft_target_s=tier.ttft_target_s,
                tpot_target_s=tier.tpot_below_s,
                initial=tier.waiting_below,
                started_at=now,
                # A newcomer waits for a slot, not behind the queue (`fair_engine_queue`), and
                # only newcomers are measured (`_measures`).
                newcomers_only=self.group.fair_engine_queue,
            )
        return tuner

    def status(self, now: float) -> DeploymentStatus:
        snapshot = self.latest
        return DeploymentStatus(
            deployment=self.spec.key,
            mode=self.mode,
            waiting=snapshot.waiting if snapshot else None,
            running=snapshot.running if snapshot else None,
            tpot_s=snapshot.tpot_s if snapshot else None,
            kv_usage=snapshot.kv_usage if snapshot else None,
            pending=self.pending_count,
            free_slots=self.free_slots(),
            in_flight=self.in_flight,
            last_scrape_age_s=now - snapshot.started_at if snapshot else None,
            blocked_reason=self.blocked_reason,
            allowed_queue=tuple((name, tuner.allowed) for name, tuner in self.tuners.items()),
        )


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
