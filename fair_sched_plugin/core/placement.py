"""Placement: which deployment of a model takes a released request.

The gate knows which deployments have room; this policy chooses among them:

1. **Prefix affinity.** A ticket's `prefix` is its prompt's chained block hashes
   (`fair_sched_plugin.request.prefix`): two prompts share their first k hashes exactly when
   their first k blocks are the same text. The deployment where the longest leading run of
   these blocks was placed most recently probably still has them in its prefix cache, so the
   request goes there.
   Only that one: after a spill the older home is not a fallback, so each prefix keeps one
   home and the engines' caches, each holding part of all prefixes, hold different ones (with
   every home a fallback, prefixes drift onto every deployment and each cache must hold all).
2. **Bounded load** (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam,
   2018): an affinity target is not used when it would then hold more than `load_bound` times
   its share of all the requests on the model's deployments, its share being in proportion to
   its capacity, rounded up to whole requests, and counting the one being placed. A hot prefix
   spills to another deployment instead of queueing behind itself. A target with a free running
   slot is always within the bound: there the request neither queues nor waits, and spilling it
   would only recompute its prefix elsewhere.
3. **Least loaded** otherwise: the deployment with room whose load per running slot is lowest
   once this request is on it, so unequal replicas get work in proportion to their slots. Ties go
   to the lowest deployment key (the same answer for the same state, in every replica).

**Spill only what no one else can use.** Before a ticket is released to be spilled (`spills`:
its target has no room, or is over the bound, and another deployment has room), the scheduler
looks a few users ahead in fairness order for one whose own prefix's deployment has room
(`AdmissionGate.prefers_elsewhere`, the scheduler's `LOOKAHEAD`); that user goes first and the
held one keeps its turn. When nobody within the look-ahead can use the room, the held one
spills only into a free running slot, where it starts at once (`waits` is False). Where the
spill would only queue (the other deployment has queue room but every running slot busy), it
waits instead: its own deployment frees a slot about as soon (both are busy, and that one has
its prefix cached), and the next request end or scrape decides again, so the wait lasts at most
until a slot frees on either. No deployment with a free running slot idles while work is
queued, and a hot prefix with nobody else waiting still spills into every free slot. In the
same spirit, a target over the bound that still has room keeps the request when the spill
would only queue. The bound
counts queued requests, and a replica whose users' requests reach the scheduler a moment later
(a busy LiteLLM forwards them over a second or more) looks idle for that moment: spilling into
it then would move a prefix's home for nothing (measured on #16's shared-prefix bench before
this rule: 15 of 100 repeat requests moved home, each a miss and an eviction).

The index of where blocks went is bounded (`remembered_blocks` blocks, each with the deployment
it went to last, least recently placed forgotten first) and a decision costs O(log blocks of the
prompt), never O(users).
Pure: no I/O, no clock; the gate owns one `Placer` per model and calls `record` with the
deployment each ticket was bound to.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Candidate", "Placement", "Placer"]


class Candidate(NamedTuple):
    """A deployment of the model as the gate sees it at this decision."""

    deployment: str
    # Requests the gate counts there now: running + engine-queue estimate (pending included).
    load: float
    # Its running slots (learned, or the engine's max_num_seqs), >= 1.
    capacity: float
    # The tier being released may release one more there now.
    has_room: bool


class Placement(NamedTuple):
    deployment: str
    # Chosen because its prefix was placed there recently (a likely prefix-cache hit).
    affinity: bool


class Placer:
    """Prefix affinity with bounded load, else least loaded (see the module docstring)."""

    def __init__(
        self,
        *,
        prefix_affinity: bool = True,
        load_bound: float = 1.25,
        remembered_blocks: int = 100_000,
    ) -> None:
        if load_bound < 1:
            raise ValueError(f"load_bound must be >= 1 (got {load_bound!r})")
        if remembered_blocks < 1:
            raise ValueError(f"remembered_blocks must be >= 1 (got {remembered_blocks!r})")
        self._prefix_affinity = prefix_affinity
        self._load_bound = load_bound
        self._remembered_blocks = remembered_blocks
        # block hash -> the deployment a prompt with that block (and so with every block before
        # it) was placed on most recently; least recently placed first.
        self._blocks: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        """Blocks remembered now (at most `remembered_blocks`)."""
        return len(self._blocks)

    def choose(self, prefix: tuple[int, ...], candidates: Sequence[Candidate]) -> Placement | None:
        """Where a ticket with this prefix goes now; None when no candidate has room."""
        return self._choose(self._affinity_target(prefix, candidates), candidates)

    def spills(self, prefix: tuple[int, ...], candidates: Sequence[Candidate]) -> bool:
        """`choose` would now bind this prefix away from the deployment it went to last: that
        one has no room for it, or is over the load bound, while another has room. The
        scheduler then first looks for a user whose own prefix's deployment has room (see the
        module docstring: spill only what no one else can use)."""
        return self._spill(prefix, candidates) is not None

    def waits(self, prefix: tuple[int, ...], candidates: Sequence[Candidate]) -> bool:
        """`choose` would spill this prefix into a deployment where it would queue, not start
        (no free running slot there): its own deployment, full now, frees a slot about as soon,
        and there the prefix is cached. The scheduler then holds it (see the module docstring:
        spill only into a free running slot)."""
        spill = self._spill(prefix, candidates)
        return spill is not None and not _free_slot(spill)

    def _spill(self, prefix: tuple[int, ...], candidates: Sequence[Candidate]) -> Candidate | None:
        """The candidate `choose` would bind this prefix to instead of the deployment it went
        to last; None when it would stay there, or has nowhere to go."""
        target = self._affinity_target(prefix, candidates)
        if target is None:
            return None
        placement = self._choose(target, candidates)
        if placement is None or placement.deployment == target.deployment:
            return None
        return next(c for c in candidates if c.deployment == placement.deployment)

    def record(self, prefix: tuple[int, ...], deployment: str) -> None:
        """A ticket with this prefix was bound to `deployment`."""
        if not self._prefix_affinity or not prefix:
            return
        blocks = self._blocks
        # Last block first, so the leading blocks are the most recently placed: eviction then
        # forgets a prompt's tail before its head, and a remembered block's predecessors are
        # always remembered too (what `_affinity_target`'s binary search relies on).
        move_to_end = blocks.move_to_end
        for block in reversed(prefix):
            blocks[block] = deployment
            move_to_end(block)
        while len(blocks) > self._remembered_blocks:
            blocks.popitem(last=False)

    def _choose(
        self, target: Candidate | None, candidates: Sequence[Candidate]
    ) -> Placement | None:
        if target is not None and target.has_room and self._within_bound(target, candidates):
            return Placement(target.deployment, affinity=True)
        least: Candidate | None = None
        least_key = (math.inf, "")
        for candidate in candidates:
            if not candidate.has_room:
                continue
            key = ((candidate.load + 1) / candidate.capacity, candidate.deployment)
            if least is None or key < least_key:
                least, least_key = candidate, key
        if least is None:
            return None
        if (
            target is not None
            and target.has_room
            and least.deployment != target.deployment
            and not _free_slot(least)
        ):
            # Over the bound, but the spill would only queue elsewhere and recompute the prefix
            # there: it queues where the prefix is cached.
            return Placement(target.deployment, affinity=True)
        return Placement(least.deployment, affinity=False)

    def _affinity_target(
        self, prefix: tuple[int, ...], candidates: Sequence[Candidate]
    ) -> Candidate | None:
        """The candidate where the longest leading run of `prefix` was placed most recently."""
        blocks = self._blocks
        if not self._prefix_affinity or not prefix or prefix[0] not in blocks:
            return None
        # The remembered blocks of a prefix are a leading run (see `record`): binary search for
        # its end, O(log blocks) lookups.
        low, high = 1, len(prefix)  # prefix[low - 1] is remembered; past `high` nothing is
        while low < high:
            middle = (low + high + 1) // 2
            if prefix[middle - 1] in blocks:
                low = middle
            else:
                high = middle - 1
        by_deployment = {candidate.deployment: candidate for candidate in candidates}
        # A deployment that is gone (no longer a candidate): its shorter runs may be elsewhere.
        for index in range(low - 1, -1, -1):
            target = by_deployment.get(blocks[prefix[index]])
            if target is not None:
                return target
        return None

    def _within_bound(self, target: Candidate, candidates: Sequence[Candidate]) -> bool:
        """Would `target` stay within `load_bound` times its capacity's share of all the load,
        counting the request being placed (or does it have a free running slot)?"""
        if _free_slot(target):
            return True
        total_load = sum(candidate.load for candidate in candidates) + 1
        total_capacity = sum(candidate.capacity for candidate in candidates)
        share = self._load_bound * total_load * target.capacity / total_capacity
        # Whole requests, as Mirrokni et al. round; the epsilon keeps 2.0000000001 at 2.
        return target.load + 1 <= math.ceil(share - 1e-9)


def _free_slot(candidate: Candidate) -> bool:
    """The deployment has a running slot free for one more request: it starts at once there."""
    return candidate.load + 1 <= candidate.capacity
