"""Weighted dealing (a slow rank holds fewer units): property tests of the pure layout layer.

The checks are written from the definitions, not from the implementation: a family's shares are proportional to
the weights with at least one unit each (checked by what characterises them, not by recomputing them), every
unit is held exactly once, each count is within one unit of its share, and a rebalance moves as few units as
any layout within one unit of the shares could (found by trying every such count vector).
"""

from __future__ import annotations

import itertools
import json
from fractions import Fraction
from math import ceil, floor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.plan import stages
from ntp_megatron.plan.layout import (
    Topology,
    join_topology,
    make_topology,
    next_topology,
    rebalanced_topology,
    shares,
    transition_plan,
)

pytestmark = pytest.mark.unit

PROPS = settings(max_examples=80, deadline=None)


@PROPS
@given(st.integers(1, 8).flatmap(lambda k: st.tuples(st.integers(k, 60), st.lists(st.integers(1, 300), min_size=k,
                                                                                    max_size=k))))
def test_shares_are_proportional_with_one_unit_at_least(case):
    num_units, raw = case
    weights = dict(enumerate(raw))
    got = shares(num_units, weights)
    assert sorted(got) == sorted(weights) and sum(got.values()) == num_units
    assert all(isinstance(q, Fraction) and q >= 1 for q in got.values())
    above = [s for s, q in got.items() if q > 1]
    if above:
        rate = got[above[0]] / weights[above[0]]  # units per weight, the same for every slot above one unit
        assert all(got[s] / weights[s] == rate for s in above)
        assert all(weights[s] * rate <= 1 for s, q in got.items() if q == 1)  # pinned only where it would be less
    else:
        assert num_units == len(weights)


def test_shares_examples():
    assert shares(8, {0: 2, 1: 1, 2: 1}) == {0: 4, 1: 2, 2: 2}
    assert shares(8, {0: 100, 1: 50, 2: 100, 3: 100}) == {0: Fraction(16, 7), 1: Fraction(8, 7),
                                                          2: Fraction(16, 7), 3: Fraction(16, 7)}
    assert shares(4, {0: 100, 1: 1, 2: 1, 3: 1}) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert shares(6, {0: 100, 1: 1, 2: 1}) == {0: 4, 1: 1, 2: 1}
    with pytest.raises(ValueError, match="cannot give each"):
        shares(2, {0: 1, 1: 1, 2: 1})


def test_worked_example_slow_slot_1_at_half_speed():
    """TP4 x DP2, 8 heads and 16 FFN units: replica 0's slot 1 at half speed. Its share is 8/7 heads and 16/7 FFN
    units, the others' 16/7 and 32/7: it keeps 1 head and 2 FFN units (keeping 2 heads would make it the slowest at
    4 head-times, against 3 for a slot holding 3) and lends its block's last ones. Heads first (the coarsest family):
    the extra head goes to the lowest slot, so the FFN's extras go to the slots with nothing extra yet. Replica 1
    and the sync groups do not change."""
    start = make_topology(4, 2, {"heads": 8, "ffn": 16})
    slow = rebalanced_topology(start, {0: {0: 100, 1: 50, 2: 100, 3: 100}})
    assert slow.generation == 1
    assert slow.layout("heads", 0) == [[0, 1, 3], [2], [4, 5], [6, 7]]
    # FFN: slot 0 already holds the extra head, so the two extra FFN units go to slots 2 and 3.
    assert slow.layout("ffn", 0) == [[0, 1, 2, 3], [4, 5], [7, 8, 9, 10, 11], [6, 12, 13, 14, 15]]
    assert slow.replica(1) == start.replica(1) and slow.sync_groups() == start.sync_groups()
    assert not slow.is_healthy(0) and slow.is_healthy(1)
    assert slow.block_holders("heads", 0, 1) == [(1, [2]), (0, [3])]  # slot 1 gathers its block's gradient
    moves = transition_plan(start, slow)
    assert [(m.family, m.unit, m.src, m.dst) for m in moves] == [("ffn", 6, 1, 3), ("ffn", 7, 1, 2),
                                                                 ("heads", 3, 1, 0)]
    back = rebalanced_topology(slow, {0: {}})
    assert back.replica(0) == start.replica(0) and back.is_healthy(0)
    assert [(m.family, m.unit, m.src, m.dst) for m in transition_plan(slow, back)] == [
        ("ffn", 6, 3, 1), ("ffn", 7, 2, 1), ("heads", 3, 0, 1)]
    blob = json.dumps(slow.to_json())
    assert Topology.from_json(json.loads(blob)) == slow and '"weights"' in blob
    assert '"weights"' not in json.dumps(start.to_json())  # a topology without weights reads as before


# ---------------------------------------------------------------------------------------------------------------
# Random histories of deaths, joins and rebalances


@st.composite
def weighted_histories(draw):
    tp = draw(st.integers(2, 5))
    dp = draw(st.integers(1, 3))
    units = {"heads": draw(st.integers(tp, 3 * tp)), "ffn": draw(st.integers(tp, 40)), "vocab": draw(st.integers(tp, 30))}
    topo = make_topology(tp, dp, units)
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["rebalance", "rebalance", "shrink", "join"]))
        if kind == "shrink":
            candidates = [rank for rep in topo.replicas if rep.width > 1 for rank in rep.ranks]
            if not candidates:
                continue
            dead = [draw(st.sampled_from(candidates))]
            new = next_topology(topo, dead)
            steps.append(("shrink", topo, new, dead))
        elif kind == "join":
            missing = [(rep.index, s) for rep in topo.replicas for s in range(tp) if s not in rep.slots]
            if not missing:
                continue
            joined = draw(st.lists(st.sampled_from(missing), min_size=1, max_size=len(missing), unique=True))
            new = join_topology(topo, joined)
            steps.append(("join", topo, new, []))
        else:
            rep = draw(st.sampled_from(topo.replicas))
            even = draw(st.booleans()) and draw(st.booleans())
            weights = {} if even else {s: draw(st.integers(1, 200)) for s in rep.slots}
            new = rebalanced_topology(topo, {rep.index: weights})
            steps.append(("rebalance", topo, new, (rep.index, weights)))
        topo = new
    return steps


def holders(topo: Topology, family: str, replica: int) -> dict[int, int]:
    """Unit -> slot holding it in that replica (every unit exactly once, or the assertion fails)."""
    rep = topo.replica(replica)
    out: dict[int, int] = {}
    for slot, units in zip(rep.slots, topo.layout(family, replica)):
        for unit in units:
            assert unit not in out, f"unit {unit} held twice"
            out[unit] = slot
    assert sorted(out) == list(range(topo.units[family])), "a unit is held by nobody"
    return out


def weights_of(topo: Topology, replica: int) -> dict[int, int]:
    rep = topo.replica(replica)
    return dict(rep.weights) if rep.weights else dict.fromkeys(rep.slots, 1)


def check_within_one(topo: Topology) -> None:
    for rep in topo.replicas:
        for family, n in topo.units.items():
            held = holders(topo, family, rep.index)
            ideal = shares(n, weights_of(topo, rep.index))
            for slot in rep.slots:
                count = sum(1 for s in held.values() if s == slot)
                assert floor(ideal[slot]) <= count <= ceil(ideal[slot]), (family, rep.index, slot, count, ideal)
        if rep.width == topo.tp_base and not rep.weights:
            assert topo.is_healthy(rep.index)  # every slot live and alike: canonical
        if topo.is_healthy(rep.index):
            for family in topo.units:
                assert topo.layout(family, rep.index) == [topo.block(family, s) for s in rep.slots]


def best_counts(before: dict[int, int], slots: list[int], ideal: dict, weights: dict) -> tuple[Fraction, int]:
    """Over every count vector within one unit of ``ideal``: the smallest time of the slowest slot
    (count / weight), and the fewest units that change holder to reach a vector with that time (a slot keeps
    min(count, target) of what it held; the rest moves)."""
    have = {s: sum(1 for h in before.values() if h == s) for s in slots}
    total = sum(have.values())
    best = None
    for targets in itertools.product(*[sorted({floor(ideal[s]), ceil(ideal[s])}) for s in slots]):
        if sum(targets) != total:
            continue
        slowest = max(Fraction(t, weights[s]) for s, t in zip(slots, targets))
        moved = sum(max(0, have[s] - t) for s, t in zip(slots, targets))
        best = (slowest, moved) if best is None else min(best, (slowest, moved))
    return best


@PROPS
@given(weighted_histories())
def test_every_weighted_topology_holds_each_unit_once_within_one_unit_of_its_share(steps):
    for kind, old, new, _ in steps:
        check_within_one(new)
        assert Topology.from_json(json.loads(json.dumps(new.to_json()))) == new


@PROPS
@given(weighted_histories())
def test_a_rebalance_moves_the_fewest_units_inside_its_replica_only(steps):
    for kind, old, new, what in (s for s in steps if s[0] == "rebalance"):
        index, weights = what
        for rep in old.replicas:
            after = new.replica(rep.index)
            assert after.slots == rep.slots and after.proxies == rep.proxies  # nobody dies, sync groups stay
            if rep.index != index:
                assert after.dealt == rep.dealt and after.weights == rep.weights
        assert new.sync_groups() == old.sync_groups()
        rep = old.replica(index)
        canonical = not weights or len(set(weights.values())) == 1
        for family, n in old.units.items():
            before, now = holders(old, family, index), holders(new, family, index)
            moved = sum(1 for u in range(n) if before[u] != now[u])
            if canonical and rep.width == old.tp_base:  # alike again: every lent unit goes home, nothing else
                home = {u: s for s in rep.slots for u in old.block(family, s)}
                assert now == home and moved == sum(1 for u in range(n) if before[u] != home[u])
            else:
                weights_now = weights_of(new, index)
                counts = {s: sum(1 for h in now.values() if h == s) for s in rep.slots}
                slowest = max(Fraction(c, weights_now[s]) for s, c in counts.items())
                assert (slowest, moved) == best_counts(before, list(rep.slots), shares(n, weights_now), weights_now)
        for move in transition_plan(old, new):
            assert move.replica == index and move.src is not None and move.peer is None  # from its own replica


@PROPS
@given(weighted_histories())
def test_deaths_and_joins_of_weighted_replicas(steps):
    """A death: untouched replicas keep everything; in the replica that lost a slot every survivor keeps all it held
    (a rebalance could never give it more than an even share after a death) and its slots are alike again (no
    weights). A join: the joined slot holds its whole block, weighs as the replica's fastest, and the others keep
    their weights."""
    for kind, old, new, what in (s for s in steps if s[0] in ("shrink", "join")):
        for rep in new.replicas:
            if rep.index not in {r.index for r in old.replicas}:
                continue
            before = old.replica(rep.index)
            if kind == "shrink":
                dead_slots = {s for s, r in zip(before.slots, before.ranks) if r in what}
                if not dead_slots:
                    assert rep.dealt == before.dealt and rep.weights == before.weights
                    continue
                assert rep.weights == {}
                for family in old.units:
                    for slot in rep.slots:
                        held = set(old.units_of(old.rank_of(rep.index, slot), family))
                        if not before.weights:  # sticky: a survivor of an even replica keeps everything
                            assert held <= set(new.units_of(new.rank_of(rep.index, slot), family))
            else:
                joined = [s for s in rep.slots if s not in before.slots]
                for slot in joined:
                    for family in old.units:
                        assert set(new.block(family, slot)) <= set(new.units_of(new.rank_of(rep.index, slot), family))
                    if rep.weights:
                        assert rep.weights[slot] == max(before.weights.values())
                if rep.weights:
                    assert all(rep.weights[s] == w for s, w in before.weights.items())


def test_rebalancing_a_stage_of_a_pipeline_leaves_the_other_stages():
    start = stages.make_pipeline_topology(3, 2, 2, {"heads": 6, "ffn": 9, "vocab": 12})
    new = stages.rebalanced_topology(start, {(1, 1): {0: 100, 1: 30, 2: 100}})
    assert new.stages[0].replicas == tuple(
        type(r)(r.index, r.slots, r.ranks, r.proxies, r.dealt, r.weights) for r in start.stages[0].replicas)
    assert new.stages[1].replica(1).weights == {0: 100, 1: 30, 2: 100}
    info = {"base": 0, "dead": [], "weights": stages.weights_to_json({(1, 1): {0: 100, 1: 30, 2: 100}})}
    assert stages.published_topology(start, info, 1) == new
    with pytest.raises(ValueError, match="stage 2 out of range"):
        stages.rebalanced_topology(start, {(0, 2): {}})


def test_rebalance_errors():
    topo = make_topology(4, 1, {"heads": 8}, dead_slots=[(0, 3)])
    with pytest.raises(ValueError, match=r"exactly its live slots \[0, 1, 2\]"):
        rebalanced_topology(topo, {0: {0: 1, 1: 1, 2: 1, 3: 1}})
    with pytest.raises(ValueError, match="weight of slot 1 must be >= 1"):
        rebalanced_topology(topo, {0: {0: 1, 1: 0, 2: 1}})
    with pytest.raises(ValueError, match="no replica with index 1"):
        rebalanced_topology(topo, {1: {}})
