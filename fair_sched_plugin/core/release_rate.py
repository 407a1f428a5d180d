"""How fast a model's backlog drains, and when a parked ticket can expect to start.

`DrainRate` measures the releases per second from a backlogged queue; `start_after_s` turns a
ticket's place in the fair order into the earliest time it can expect to start, so a ticket that
cannot start before its deadline is refused at once instead of at the deadline.
"""

from __future__ import annotations

# Releases are timed in runs of this many (a release only counts; the run's end samples the
# clock): the first run's rate is the first known, so a prediction refuses nothing before it.
RUN = 8
# The runs the rate averages over (an exponential average with about this memory).
RUNS_AVERAGED = 4
# No release from the backlog for this long: the rate measured before is no longer evidence.
DRAIN_STALE_S = 30.0

_NEVER = float("-inf")


class DrainRate:
    """Releases per second from a model's backlog, timed from the moment the queue became
    backlogged (idle time is not drain time, so a quiet hour does not read as a slow engine).

    The core counts a release inline (`in_run += 1`) and calls `run_ended` every `RUN`
    releases: what every release costs is one store."""

    __slots__ = ("_filling", "_mean_gap", "_runs", "in_run", "per_s", "run_since")

    def __init__(self) -> None:
        self._mean_gap = 0.0
        self._runs = 0
        self._filling = False
        # Releases counted since `run_since` (the run's start, or when the backlog began).
        self.in_run = 0
        self.run_since = _NEVER
        # The rate as of the last run (0: not known yet), read on the admission path without a
        # call; `rate(now)` adds the staleness check.
        self.per_s = 0.0

    def backlog_began(self, now: float) -> None:
        """The queue was empty until now: the run starts over (its releases so far were not
        from a backlog, or were before an idle time), and its first run is not sampled: it
        fills the engine's free slots at once, faster than any drain."""
        self.in_run = 0
        self.run_since = now
        self._filling = True

    def released(self, now: float) -> None:
        """One request left the backlogged queue at `now` (what the core does inline)."""
        self.in_run += 1
        if self.in_run >= RUN:
            self.run_ended(now)

    def run_ended(self, now: float) -> None:
        """`in_run` releases since `run_since`: average their mean gap in."""
        count, self.in_run = self.in_run, 0
        since, self.run_since = self.run_since, now
        if self._filling:
            self._filling = False
            return
        if since == _NEVER or count <= 0:
            return
        runs = self._runs
        if runs < RUNS_AVERAGED:
            self._runs = runs = runs + 1
        gap = (now - since) / count
        self._mean_gap = mean = self._mean_gap + (gap - self._mean_gap) / runs
        self.per_s = 1.0 / mean if mean > 1e-9 else 0.0

    def rate(self, now: float) -> float | None:
        """Releases per second, or None while too few were seen, none lately, or all at once.
        The average, or the run in progress where that is already under half of it: a drain
        that slowed down is seen within half a run, not only at its end."""
        per_s = self.per_s
        if not per_s:
            return None
        released = self.in_run
        elapsed = now - self.run_since
        if not released:
            if elapsed > DRAIN_STALE_S:
                return None
            # None for as long as a whole run should take: slower than that, at least.
            if elapsed * per_s > RUN:
                return 1.0 / elapsed
            return per_s
        # Half a run is evidence; fewer releases are not (a drain comes in bunches: the slots
        # of alike requests free together, then none for a while).
        if released >= RUN // 2 and elapsed * per_s > 2 * released:
            return released / elapsed
        return per_s


class TurnRate:
    """Releases of a tier per unit of its virtual time: how many requests go per round of its
    fair order (round robin: one per backlogged user, one per user who comes back meanwhile; in
    the policy's unit for the others). A request whose start tag is `d` above the tier's has
    about `d * per_unit` releases of the tier before it. Sampled at the ends of the model's
    drain runs, from the tier's release count and virtual time; only runs where the virtual time
    moved count."""

    __slots__ = (
        "_runs",
        "arrival_mark",
        "per_unit",
        "releases",
        "releases_mark",
        "share",
        "time_mark",
    )

    def __init__(self) -> None:
        self._runs = 0
        self.releases = 0  # counted inline by the core
        self.releases_mark = 0
        self.time_mark = 0.0
        # The arrival number at the last sample: a user whose backlog began later is not in
        # `per_unit` yet.
        self.arrival_mark = 0
        self.per_unit = 0.0  # 0: not known yet
        # Its part of the model's releases in the runs where it had any (tier shares: what
        # turns its releases into the model's).
        self.share = 0.0

    def sample(self, virtual_time: float, arrival: int) -> None:
        """The end of a run of the model's releases (`RUN` of them)."""
        released = self.releases - self.releases_mark
        moved = virtual_time - self.time_mark
        self.releases_mark = self.releases
        self.time_mark = virtual_time
        self.arrival_mark = arrival
        if released <= 0 or moved <= 1e-12:
            return
        runs = self._runs
        if runs < RUNS_AVERAGED:
            self._runs = runs = runs + 1
        self.per_unit += (released / moved - self.per_unit) / runs
        self.share += (min(1.0, released / RUN) - self.share) / runs


def start_after_s(position: int, rate: float) -> float:
    """The earliest the request at `position` (1: the next one released) can expect to start,
    in seconds from now, at `rate` releases per second."""
    return (position - 1) / rate
