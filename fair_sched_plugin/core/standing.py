"""Indexes behind what a waiting client is told, so each answer costs O(log n), not a scan.

`waiting.estimate_position` defines a position over the whole backlog (O(backlogged users));
keep-alive comments, `Retry-After` and the where-do-I-stand endpoint ask for it per request, so
the scheduler keeps these counts as queues change instead, and answers the same number:

- `DepthIndex`: the depths of the users' queues in one (model, tier), as a Fenwick tree over
  "users at least j deep" (j = 1, 2, ...): the sum over users of min(depth, k) is a prefix sum.
- `BacklogIndex`: depths per (model, tier, user) fed one request at a time, for a scheduler that
  has no queues of its own (a follower replica's view of its own parked requests).
- `ArrivalRanks`: items in arrival order that leave in any order, with an item's rank among
  those still in (a caller's own index among its parked requests).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


def _grow(tree: list[int], size: int) -> None:
    """Double a Fenwick tree over 1..`size` (a power of two) in place: the new nodes below
    2*size cover only new (zero) slots; node 2*size covers everything, as node `size` did."""
    tree.extend([0] * size)
    tree[2 * size] = tree[size]


def _add(tree: list[int], index: int, delta: int) -> None:
    size = len(tree) - 1
    while index <= size:
        tree[index] += delta
        index += index & -index


class DepthIndex:
    """How deep the users' queues are in one (model, tier); `total` is the sum of the depths.

    Told of every change of one queue's depth by one (`deeper`, `shallower`): O(log depth).
    """

    __slots__ = ("_tree", "total")

    def __init__(self) -> None:
        self._tree = [0, 0]  # 1-based over depths 1..1; doubled as deeper queues appear
        self.total = 0

    def deeper(self, depth: int) -> None:
        """A user's queue grew to `depth`."""
        tree = self._tree
        size = len(tree) - 1
        while depth > size:
            _grow(tree, size)
            size *= 2
        while depth <= size:  # `_add(tree, depth, 1)`, inline: on every admission's path
            tree[depth] += 1
            depth += depth & -depth
        self.total += 1

    def shallower(self, depth: int) -> None:
        """A user's queue of `depth` lost a request."""
        tree = self._tree
        size = len(tree) - 1
        while depth <= size:  # `_add(tree, depth, -1)`, inline: on every release's path
            tree[depth] -= 1
            depth += depth & -depth
        self.total -= 1

    def capped_total(self, k: int) -> int:
        """The sum over users of min(depth, k)."""
        tree = self._tree
        if k >= len(tree) - 1:
            return self.total
        total = 0
        while k > 0:  # the prefix sum over 1..k (inline: it is on every estimate's path)
            total += tree[k]
            k -= k & -k
        return total


def position_in(own_index: int, own_depth: int, ahead: int, depths: DepthIndex) -> int:
    """`waiting.estimate_position` from the indexes: `ahead` is everything queued in more
    urgent tiers, `depths` the tier's index, `own_depth` the caller's own depth in it."""
    others = depths.capped_total(own_index) - min(own_depth, own_index)
    return ahead + others + own_index


class BacklogIndex:
    """Depths per (model, tier, user), told of each request that comes and goes; answers
    `estimate_position` for `tiers` (most urgent first) in O(tiers + log depth)."""

    __slots__ = ("_depths", "_indexes", "_tiers")

    def __init__(self, tiers: Sequence[str]) -> None:
        self._tiers = tuple(tiers)
        self._depths: dict[tuple[str, str, str], int] = {}
        self._indexes: dict[str, dict[str, DepthIndex]] = {}

    def add(self, model: str, tier: str, user: str) -> None:
        key = (model, tier, user)
        depth = self._depths.get(key, 0) + 1
        self._depths[key] = depth
        by_tier = self._indexes.setdefault(model, {})
        index = by_tier.get(tier)
        if index is None:
            index = by_tier[tier] = DepthIndex()
        index.deeper(depth)

    def remove(self, model: str, tier: str, user: str) -> None:
        key = (model, tier, user)
        depth = self._depths.get(key, 0)
        if not depth:
            return
        self._indexes[model][tier].shallower(depth)
        if depth == 1:
            del self._depths[key]
            by_tier = self._indexes[model]
            if not by_tier[tier].total:
                del by_tier[tier]
                if not by_tier:
                    del self._indexes[model]
        else:
            self._depths[key] = depth - 1

    def clear(self) -> None:
        self._depths.clear()
        self._indexes.clear()

    def depth(self, model: str, tier: str, user: str) -> int:
        return self._depths.get((model, tier, user), 0)

    def position(self, model: str, tier: str, user: str, own_index: int) -> int:
        by_tier = self._indexes.get(model, {})
        ahead = 0
        for name in self._tiers:
            if name == tier:
                break
            index = by_tier.get(name)
            if index is not None:
                ahead += index.total
        depths = by_tier.get(tier) or DepthIndex()
        return position_in(own_index, self.depth(model, tier, user), ahead, depths)


class ArrivalRanks(Generic[T]):
    """Items in arrival order that may leave in any order: `add`, `discard` and `rank` (the
    1-based place among the items still in) are O(log n) (compaction is amortised O(1))."""

    __slots__ = ("_slots", "_tree", "_used")

    def __init__(self) -> None:
        # Insertion order is arrival order, also after a compaction (it re-adds in order).
        self._slots: dict[T, int] = {}
        self._tree = [0, 0]
        self._used = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[T]:
        return iter(self._slots)

    def __contains__(self, item: object) -> bool:
        return item in self._slots

    def add(self, item: T) -> None:
        if item in self._slots:
            return
        self._used += 1
        while self._used > len(self._tree) - 1:
            _grow(self._tree, len(self._tree) - 1)
        self._slots[item] = self._used
        _add(self._tree, self._used, 1)

    def discard(self, item: T) -> int:
        """Take `item` out (if in); returns how many items remain."""
        slot = self._slots.pop(item, None)
        if slot is None:
            return len(self._slots)
        _add(self._tree, slot, -1)
        if self._used > 2 * len(self._slots) + 32:
            self._compact()
        return len(self._slots)

    def rank(self, item: T) -> int:
        """1 for the oldest item still in; KeyError for an item not in."""
        tree = self._tree
        slot = self._slots[item]
        rank = 0
        while slot > 0:  # the prefix sum over 1..slot (inline, as in `capped_total`)
            rank += tree[slot]
            slot -= slot & -slot
        return rank

    def _compact(self) -> None:
        """Give the items still in the slots 1..n again (slots of left items are not reused
        otherwise, so memory would grow with the items that ever came)."""
        self._slots = {item: slot for slot, item in enumerate(self._slots, start=1)}
        self._used = len(self._slots)
        size = 1
        while size < self._used:
            size *= 2
        tree = [0] * (size + 1)
        for slot in range(1, self._used + 1):
            tree[slot] = 1
        for slot in range(1, size + 1):  # linear-time build: each node adds into its parent
            parent = slot + (slot & -slot)
            if parent <= size:
                tree[parent] += tree[slot]
        self._tree = tree
