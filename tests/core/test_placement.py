"""Placer: prefix affinity (longest match, most recent), bounded load, least loaded by slots."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from fair_sched_plugin.core.placement import Candidate, Placement, Placer


def cand(name: str, load: float = 0, capacity: float = 8, has_room: bool = True) -> Candidate:
    return Candidate(deployment=name, load=load, capacity=capacity, has_room=has_room)


def test_new_prefix_goes_least_loaded_by_load_per_slot() -> None:
    placer = Placer()
    candidates = [cand("a", load=4, capacity=8), cand("b", load=9, capacity=24)]
    # a: 5/8 after placing, b: 10/24: b is less loaded per slot although it holds more requests.
    assert placer.choose((1, 2), candidates) == Placement("b", affinity=False)


def test_recorded_prefix_is_placed_back_where_it_went() -> None:
    placer = Placer()
    placer.record((1, 2, 3), "b")
    candidates = [cand("a", load=0), cand("b", load=3)]
    assert placer.choose((1, 2, 3, 4), candidates) == Placement("b", affinity=True)
    assert not placer.spills((1, 2, 3, 4), candidates)


def test_longest_leading_match_wins_over_a_more_recent_shorter_one() -> None:
    placer = Placer()
    # Chained hashes: (1, 2, 3) and (1, 5) share their first block only.
    placer.record((1, 2, 3), "a")
    placer.record((1, 5), "b")
    candidates = [cand("a", load=2), cand("b", load=2)]
    assert placer.choose((1, 2, 3, 9), candidates) == Placement("a", affinity=True)
    # Only the first block matches both: the most recent placement of it wins.
    assert placer.choose((1, 7), candidates) == Placement("b", affinity=True)


def test_a_prefix_matching_nowhere_is_not_affine() -> None:
    placer = Placer()
    placer.record((1, 2), "a")
    # The first block differs, so the second cannot be the same block (chained hashes).
    assert not placer.spills((9, 2), [cand("a", load=9, has_room=False), cand("b")])
    assert placer.choose((), [cand("a", load=1), cand("b")]) == Placement("b", affinity=False)


def test_deployments_that_are_not_candidates_are_ignored() -> None:
    placer = Placer()
    placer.record((1, 2), "gone")
    placer.record((1,), "a")
    assert placer.choose((1, 2), [cand("a", load=3), cand("b")]) == Placement("a", affinity=True)


def test_hot_prefix_spills_once_over_the_load_bound() -> None:
    placer = Placer(load_bound=1.25)
    placer.record((1, 2), "a")
    # a has no free slot: 12 + 1 against ceil(1.25 * (12 + 8 + 1) * 8 / 16) = 14: stays.
    within = [cand("a", load=12), cand("b", load=8)]
    assert placer.choose((1, 2), within) == Placement("a", affinity=True)
    # 14 + 1 against ceil(1.25 * (14 + 6 + 1) / 2) = 14: over the bound, spills.
    over = [cand("a", load=14), cand("b", load=6)]
    assert placer.choose((1, 2), over) == Placement("b", affinity=False)
    # Over the bound with room at home, as without room there: it would spill, so the
    # scheduler first looks for a user whose own home is b.
    assert placer.spills((1, 2), over)
    assert not placer.spills((1, 2), within)


def test_free_running_slot_keeps_affinity_whatever_the_mean() -> None:
    placer = Placer(load_bound=1.25)
    placer.record((1,), "a")
    # a runs 6 of 8 while b idles: far over 1.25 x the mean, but the request starts at once on a
    # with its prefix cached; spilling it would only recompute the prefix on b.
    assert placer.choose((1,), [cand("a", load=6), cand("b", load=0)]).affinity  # type: ignore[union-attr]


def test_larger_load_bound_keeps_affinity_longer() -> None:
    loose = Placer(load_bound=2.0)
    loose.record((1,), "a")
    assert loose.choose((1,), [cand("a", load=14), cand("b", load=6)]) == Placement("a", True)


def test_affinity_target_without_room_spills() -> None:
    placer = Placer()
    placer.record((1, 2), "a")
    candidates = [cand("a", load=9, has_room=False), cand("b", load=8)]
    assert placer.choose((1, 2), candidates) == Placement("b", affinity=False)
    assert placer.spills((1, 2), candidates)
    # Nowhere else to go: not a spill (the gate holds it, or it goes home once there is room).
    assert not placer.spills((1, 2), [cand("a", load=9, has_room=False), cand("b", has_room=False)])


def test_over_the_bound_but_still_the_least_loaded_is_not_a_spill() -> None:
    placer = Placer(load_bound=1.0)
    placer.record((1,), "a")
    # a (9 of 8 slots) is over 1.0 x its share, but b (no room) cannot take it: it stays on a.
    candidates = [cand("a", load=8), cand("b", load=6, has_room=False)]
    assert placer.choose((1,), candidates) == Placement("a", affinity=False)
    assert not placer.spills((1,), candidates)


def test_no_candidate_with_room_gives_none() -> None:
    placer = Placer()
    placer.record((1,), "a")
    full = [cand("a", load=11, has_room=False), cand("b", load=11, has_room=False)]
    assert placer.choose((1,), full) is None
    assert placer.choose((), full) is None
    assert placer.choose((), []) is None


def test_affinity_off_is_pure_least_loaded() -> None:
    placer = Placer(prefix_affinity=False)
    placer.record((1, 2), "a")
    assert len(placer) == 0  # nothing remembered
    candidates = [cand("a", load=0), cand("b", load=0)]
    assert placer.choose((1, 2), candidates) == Placement("a", affinity=False)
    assert placer.choose((1, 2), [cand("a", load=1), cand("b")]) == Placement("b", False)
    assert not placer.spills((1, 2), [cand("a", has_room=False), cand("b")])


def test_ties_break_by_deployment_key_whatever_the_candidates_order() -> None:
    forward = [cand("a"), cand("b"), cand("c")]
    assert Placer().choose((), forward) == Placement("a", False)
    assert Placer().choose((), list(reversed(forward))) == Placement("a", False)


def test_same_history_gives_the_same_decisions() -> None:
    def run() -> list[Placement | None]:
        rng = random.Random(7)
        placer = Placer(remembered_blocks=50)
        decisions = []
        loads = {"a": 0.0, "b": 0.0, "c": 0.0}
        for _ in range(2000):
            prefix = tuple(range(rng.randrange(5), rng.randrange(5, 9)))
            candidates = [cand(name, load=load) for name, load in loads.items()]
            placement = placer.choose(prefix, candidates)
            decisions.append(placement)
            if placement is not None:
                placer.record(prefix, placement.deployment)
                loads[placement.deployment] += 1
            done = rng.choice(sorted(loads))
            loads[done] = max(0.0, loads[done] - 1)
        return decisions

    assert run() == run()


def test_new_prefixes_split_in_proportion_to_capacity() -> None:
    """A closed loop (32 requests in flight; a uniformly random one ends, a new one is placed):
    a replica with 24 slots takes three times the work of one with 8."""
    rng = random.Random(1)
    placer = Placer()
    capacity = {"small": 8.0, "large": 24.0}
    in_flight: list[str] = []
    placed: Counter[str] = Counter()
    for step in range(20_000):
        if len(in_flight) == 32:
            in_flight.pop(rng.randrange(32))
        load = Counter(in_flight)
        candidates = [
            cand(name, load=load[name], capacity=slots) for name, slots in capacity.items()
        ]
        placement = placer.choose((step,), candidates)
        assert placement is not None and not placement.affinity
        placer.record((step,), placement.deployment)
        in_flight.append(placement.deployment)
        placed[placement.deployment] += 1
    assert placed["large"] / placed["small"] == pytest.approx(3.0, rel=0.05)


def test_memory_stays_bounded_under_many_distinct_prefixes() -> None:
    placer = Placer(remembered_blocks=1000)
    for index in range(100_000):
        prefix = (index * 4, index * 4 + 1, index * 4 + 2, index * 4 + 3)
        placer.record(prefix, "a" if index % 2 else "b")
        assert len(placer) <= 1000
    assert len(placer) >= 997  # full, less at most one prompt's blocks
    # The most recent prompts are still remembered; the oldest are forgotten.
    last = 99_999
    candidates = [cand("a"), cand("b")]
    assert placer.choose((last * 4, last * 4 + 1), candidates) == Placement("a", affinity=True)
    assert placer.choose((0, 1), candidates) == Placement("a", affinity=False)


def test_eviction_forgets_a_prompts_tail_before_its_head() -> None:
    placer = Placer(remembered_blocks=4)
    placer.record((1, 2, 3), "a")
    placer.record((9, 8), "b")  # 5 blocks: the oldest, a's last, goes
    assert len(placer) == 4
    assert placer.choose((1, 2, 3), [cand("a", load=3), cand("b")]) == Placement("a", True)


def test_a_spilled_prefix_follows_its_most_recent_placement() -> None:
    placer = Placer()
    placer.record((1, 2), "a")
    placer.record((1, 2), "b")  # spilled there: its one home is b now
    assert len(placer) == 2
    assert placer.choose((1, 2), [cand("a"), cand("b")]) == Placement("b", affinity=True)
    assert placer.choose((1, 2), [cand("a"), cand("b", load=2)]) == Placement("b", True)


def test_a_gone_deployment_leaves_the_shorter_runs_placed_elsewhere() -> None:
    placer = Placer()
    placer.record((1, 2), "a")
    placer.record((1, 2, 3, 4), "gone")  # its blocks 1 and 2 now point at "gone" too
    placer.record((1, 5), "b")  # block 1 points at b
    candidates = [cand("a"), cand("b")]
    # The longest run's deployment is no candidate: the deepest block that names one wins.
    assert placer.choose((1, 2, 3, 4), candidates) == Placement("b", affinity=True)
    assert placer.choose((9,), candidates) == Placement("a", affinity=False)


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="load_bound"):
        Placer(load_bound=0.5)
    with pytest.raises(ValueError, match="remembered_blocks"):
        Placer(remembered_blocks=0)


def test_a_spill_that_would_only_queue_waits_for_home() -> None:
    placer = Placer()
    placer.record((1,), "a")
    # a is full; b has queue room but every running slot busy: spilled there, the request would
    # queue behind b's own and recompute its prefix, so it waits for a.
    queue_room = [cand("a", load=11, has_room=False), cand("b", load=9)]
    assert placer.spills((1,), queue_room)
    assert placer.waits((1,), queue_room)
    # A free running slot on b: it would start at once there, so it spills.
    free_slot = [cand("a", load=11, has_room=False), cand("b", load=7)]
    assert placer.spills((1,), free_slot)
    assert not placer.waits((1,), free_slot)
    # A new prefix never waits: any deployment is as good as another.
    assert not placer.waits((9,), queue_room)


def test_over_the_bound_stays_home_when_the_spill_would_only_queue() -> None:
    placer = Placer(load_bound=1.0)
    placer.record((1,), "a")
    # a (10 of 8 slots, room for the tier) is over 1.0 x its share of 9 + 9 + 1, but b has no
    # free running slot: the request queues either way, so it queues where its prefix is.
    candidates = [cand("a", load=9), cand("b", load=9)]
    assert placer.choose((1,), candidates) == Placement("a", affinity=True)
    assert not placer.spills((1,), candidates)
    assert not placer.waits((1,), candidates)
