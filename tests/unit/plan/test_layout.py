"""Property tests of the pure layout layer: canonical blocks, sticky shrinking, widening, sync groups, plans.

The reference checks below are written from the definitions (the rules in ntp_megatron.plan.layout's module
docstring), not from the implementation, so a bug in ntp_megatron.plan.layout shows up as a disagreement rather than
being copied into the expectation. Topologies are reached by random histories (dead slots at start, then shrinks
and joins), because with sticky shrinking a layout depends on the whole history.
"""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.plan.layout import (
    FAMILIES,
    POLICIES,
    Move,
    Replica,
    Topology,
    TopologyError,
    balanced_counts,
    canonical_blocks,
    join_topology,
    make_topology,
    next_topology,
    parse_dead_slots,
    parse_stage_slots,
    restart_layout,
    survivor_ranks,
    transition_plan,
)

FAST = settings(max_examples=100, deadline=None)
HISTORY = settings(max_examples=60, deadline=None)


# ---------------------------------------------------------------------------------------------------------------
# Reference model, written from the rules. A replica state is (live slots, holdings, proxies) with
# holdings[family][slot] = set of units.


def ref_blocks(num_units: int, tp_base: int) -> list[list[int]]:
    """Block s: contiguous, sizes num_units // tp_base plus one for the first num_units % tp_base blocks."""
    out, start = [], 0
    for s in range(tp_base):
        size = num_units // tp_base + (1 if s < num_units % tp_base else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def ref_block_of(num_units: int, tp_base: int, unit: int) -> int:
    return next(s for s, block in enumerate(ref_blocks(num_units, tp_base)) if unit in block)


@dataclass
class RefReplica:
    live: list[int]
    hold: dict[str, dict[int, set[int]]]
    proxy: dict[int, int]


def ref_state(topo: Topology, index: int) -> RefReplica:
    rep = topo.replica(index)
    hold = {f: {s: set(units) for s, units in zip(rep.slots, topo.layout(f, index))} for f in topo.units}
    return RefReplica(list(rep.slots), hold, dict(rep.proxies))


def ref_healthy(tp_base: int, units: dict[str, int]) -> RefReplica:
    hold = {f: {s: set(b) for s, b in enumerate(ref_blocks(n, tp_base))} for f, n in units.items()}
    return RefReplica(list(range(tp_base)), hold, {})


def ref_shrink(state: RefReplica, dying: set[int], tp_base: int, units: dict[str, int]) -> RefReplica:
    """Survivors keep their units and proxy roles; per block ascending: proxy rule, then the dealing rule."""
    alive = [s for s in state.live if s not in dying]
    hold = {f: {s: set(state.hold[f][s]) for s in alive} for f in units}
    released = {f: sorted(u for d in dying for u in state.hold[f][d]) for f in units}
    proxy = {b: p for b, p in state.proxy.items() if p not in dying}
    needs_proxy = set(dying) | {b for b, p in state.proxy.items() if p in dying}
    todo = needs_proxy | {ref_block_of(units[f], tp_base, u) for f in units for u in released[f]}
    for b in sorted(todo):
        if b in needs_proxy:
            def key(s):
                roles = list(proxy.values()).count(s)
                of_b = sum(ref_block_of(units[f], tp_base, u) == b for f in units for u in hold[f][s])
                return roles, -of_b, s
            proxy[b] = sorted(alive, key=key)[0]
        for f in sorted(units):
            for u in released[f]:
                if ref_block_of(units[f], tp_base, u) != b:
                    continue
                fewest = min(len(hold[f][s]) for s in alive)
                candidates = [s for s in alive if len(hold[f][s]) == fewest]
                hold[f][proxy[b] if proxy[b] in candidates else candidates[0]].add(u)
    return RefReplica(alive, hold, proxy)


def ref_join(state: RefReplica, joining: set[int], tp_base: int, units: dict[str, int]) -> RefReplica:
    """Joined slots take their block back, their proxy roles end; then the lowest most-loaded slot gives its
    largest dealt unit to the unit's proxy if least loaded, else to the lowest least-loaded slot."""
    live = sorted(set(state.live) | joining)
    if len(live) == tp_base:
        return ref_healthy(tp_base, units)
    proxy = {b: p for b, p in state.proxy.items() if b not in joining}
    hold = {}
    for f, n in units.items():
        blocks = ref_blocks(n, tp_base)
        back = {u for j in joining for u in blocks[j]}
        hold[f] = {s: set(blocks[s]) if s in joining else state.hold[f][s] - back for s in live}
        while True:
            counts = {s: len(hold[f][s]) for s in live}
            if max(counts.values()) - min(counts.values()) <= 1:
                break
            donor = [s for s in live if counts[s] == max(counts.values())][0]
            unit = max(hold[f][donor] - set(blocks[donor]))
            least = [s for s in live if counts[s] == min(counts.values())]
            p = proxy[ref_block_of(n, tp_base, unit)]
            hold[f][donor].remove(unit)
            hold[f][p if p in least else least[0]].add(unit)
    return RefReplica(live, hold, proxy)


def assert_matches_ref(topo: Topology, index: int, ref: RefReplica) -> None:
    got = ref_state(topo, index)
    assert got.live == ref.live
    assert got.proxy == ref.proxy
    assert got.hold == ref.hold


# ---------------------------------------------------------------------------------------------------------------
# Strategies: random histories


@dataclass
class Step:
    kind: str  # "shrink" or "join"
    old: Topology
    new: Topology
    dead_ranks: list[int]
    joined: list[tuple[int, int]]
    min_tp: int


@dataclass
class History:
    tp_base: int
    dp: int
    units: dict[str, int]
    dead_slots: list[tuple[int, int]]
    start: Topology
    steps: list[Step]

    @property
    def topologies(self) -> list[Topology]:
        return [self.start, *(step.new for step in self.steps)]


@st.composite
def histories(draw, max_tp: int = 5, max_dp: int = 3, max_steps: int = 5):
    """Start with random dead slots, then up to ``max_steps`` random shrinks (some dropping replicas) and joins
    (some bringing dropped replicas back)."""
    tp_base = draw(st.integers(1, max_tp))
    dp = draw(st.integers(1, max_dp))
    families = draw(st.sets(st.sampled_from(FAMILIES), min_size=1))
    units = {f: draw(st.integers(tp_base, 3 * tp_base + 3)) for f in sorted(families)}
    dead = []
    for r in range(dp):
        lost = draw(st.sets(st.integers(0, tp_base - 1), max_size=tp_base - 1))
        dead += [(r, s) for s in sorted(lost)]
    dead = draw(st.permutations(dead))
    start = topo = make_topology(tp_base, dp, units, dead_slots=dead)
    steps = []
    for _ in range(draw(st.integers(0, max_steps))):
        if draw(st.booleans()):
            # Few ranks at a time, so that replicas mostly survive and later steps see degraded layouts.
            dead_ranks = draw(st.lists(st.sampled_from(range(topo.world_size)), unique=True, max_size=2))
            proxy_ranks = sorted({topo.sync_member(rep.index, b) for rep in topo.replicas for b in rep.proxies})
            if proxy_ranks and draw(st.booleans()):  # proxies dying is a case of its own: make it common
                dead_ranks = sorted({draw(st.sampled_from(proxy_ranks)), *dead_ranks[1:]})
            min_tp = draw(st.sampled_from([1, 1, 2]))
            try:
                new = next_topology(topo, dead_ranks, min_tp=min_tp)
            except TopologyError:
                continue
            steps.append(Step("shrink", topo, new, dead_ranks, [], min_tp))
        else:
            free = [(r, s) for r in range(dp) for s in range(tp_base) if topo.rank_of(r, s) is None]
            if not free:
                continue
            joined = draw(st.lists(st.sampled_from(free), unique=True, min_size=1, max_size=2))
            new = join_topology(topo, joined)
            steps.append(Step("join", topo, new, [], joined, 1))
        topo = new
    return History(tp_base, dp, units, list(dead), start, steps)


# ---------------------------------------------------------------------------------------------------------------
# Canonical blocks


def test_canonical_block_examples():
    assert canonical_blocks(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert canonical_blocks(6, 4) == [[0, 1], [2, 3], [4], [5]]
    assert canonical_blocks(7, 1) == [list(range(7))]
    assert balanced_counts(8, 3) == [3, 3, 2]
    assert balanced_counts(7, 7) == [1] * 7


@FAST
@given(st.integers(0, 200), st.integers(1, 20))
def test_balanced_counts(num_units, width):
    counts = balanced_counts(num_units, width)
    assert len(counts) == width and sum(counts) == num_units
    assert counts == sorted(counts, reverse=True)
    assert max(counts) - min(counts) <= 1


@FAST
@given(st.integers(0, 200), st.integers(1, 20))
def test_canonical_blocks_are_contiguous_balanced_larger_first(num_units, tp_base):
    blocks = canonical_blocks(num_units, tp_base)
    assert blocks == ref_blocks(num_units, tp_base)
    assert [u for b in blocks for u in b] == list(range(num_units))
    assert [len(b) for b in blocks] == balanced_counts(num_units, tp_base)


def test_canonical_blocks_reject_non_ints():
    with pytest.raises(ValueError, match="num_units must be an int, got 8.0"):
        canonical_blocks(8.0, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tp_base must be >= 1, got 0"):
        canonical_blocks(8, 0)
    with pytest.raises(ValueError):
        balanced_counts(4, 0)


# ---------------------------------------------------------------------------------------------------------------
# The worked example: 8 heads, TP4 + TP4, replica 1 loses slot 3


UNITS = {"heads": 8, "ffn": 32, "vocab": 10}


def test_worked_example():
    old = make_topology(tp_base=4, dp=2, units=UNITS)
    new = next_topology(old, [7])  # rank 7 = replica 1, slot 3
    assert new.generation == 1 and new.world_size == 7
    assert new.replicas[0] == Replica(0, (0, 1, 2, 3), (0, 1, 2, 3))  # replica 0 does not change
    assert new.replicas[1].slots == (0, 1, 2) and new.replicas[1].ranks == (4, 5, 6)
    assert new.layout("heads", 0) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert new.layout("heads", 1) == [[0, 1, 6], [2, 3, 7], [4, 5]]
    assert new.replica(1).proxies == {3: 0} and new.proxy(1, 3) == 0 and new.proxy(1, 1) == 1
    assert new.sync_groups() == [(0, 4), (1, 5), (2, 6), (3, 4)]
    assert new.member_blocks(4) == [0, 3] and new.member_blocks(5) == [1] and new.member_blocks(3) == [3]
    assert new.block_holders("heads", 1, 3) == [(4, [6]), (5, [7])]
    assert new.block_holders("heads", 0, 3) == [(3, [6, 7])]
    assert not new.is_healthy(1) and new.is_healthy(0)

    plan = transition_plan(old, new, [7])
    heads = [mv for mv in plan if mv.family == "heads"]
    assert heads == [Move("heads", 6, 1, dst=4, src=None, peer=3), Move("heads", 7, 1, dst=5, src=None, peer=3)]
    for family in ("ffn", "vocab"):  # the same for the other families: exactly the dead rank's units
        moves = [mv for mv in plan if mv.family == family]
        assert sorted(mv.unit for mv in moves) == old.units_of(7, family) == old.block(family, 3)
        assert all(mv.replica == 1 and mv.peer == 3 and mv.src is None for mv in moves)
    # ffn: 8 units of block 3 dealt round-robin over the equal counts, proxy (slot 0) first.
    assert new.layout("ffn", 1) == [[*range(0, 8), 24, 27, 30], [*range(8, 16), 25, 28, 31], [*range(16, 24), 26, 29]]

    back = join_topology(new, [(1, 3)])
    assert back.replicas == old.replicas and back.generation == 2
    assert all(mv.src is not None and mv.dst == 7 for mv in transition_plan(new, back))


def test_proxy_may_hold_none_of_its_block():
    """6 heads over TP4: blocks [0,1] [2,3] [4] [5]. Slot 2 dies: slot 0 becomes proxy of block 2 (no roles,
    nobody holds any of it, lowest slot), but head 4 goes to the least loaded rank, slot 3."""
    topo = make_topology(4, 1, {"heads": 6}, dead_slots=[(0, 2)])
    assert topo.layout("heads", 0) == [[0, 1], [2, 3], [4, 5]]
    assert topo.replica(0).proxies == {2: 0}
    assert topo.block_holders("heads", 0, 2) == [(0, []), (2, [4])]
    assert topo.sync_groups() == [(0,), (1,), (0,), (2,)]


def test_proxy_rule_fewest_roles_then_largest_holder():
    topo = make_topology(4, 1, {"heads": 8}, dead_slots=[(0, 2), (0, 3)])
    # Block 2 -> slot 0 (lowest), block 3 -> slot 1 (fewest roles). Heads 4, 5 -> 0 then 1; 6, 7 -> 1 then 0.
    assert topo.replica(0).proxies == {2: 0, 3: 1}
    assert topo.layout("heads", 0) == [[0, 1, 4, 7], [2, 3, 5, 6]]
    # Slot 0 dies: its block 0 and its proxy role of block 2 need a proxy; slot 1 is the only one left.
    assert next_topology(topo, [0]).replica(0).proxies == {0: 1, 2: 1, 3: 1}
    three = make_topology(4, 1, {"heads": 12}, dead_slots=[(0, 3)])
    assert three.layout("heads", 0) == [[0, 1, 2, 9], [3, 4, 5, 10], [6, 7, 8, 11]]
    after = next_topology(three, [1])  # block 1 dies: slot 2 (no role) beats slot 0 (proxy of block 3)
    assert after.replica(0).proxies == {1: 2, 3: 0}
    # Block 1 first: 3 -> slot 2 (tie, proxy), 4 -> slot 0 (fewer), 5 -> slot 2 (tie, proxy); then block 3's
    # head 10 -> slot 0 (fewer).
    assert after.layout("heads", 0) == [[0, 1, 2, 4, 9, 10], [3, 5, 6, 7, 8, 11]]
    # Equal roles: the slot holding most of the block wins. 7 heads over TP4: blocks [0,1] [2,3] [4,5] [6].
    seven = make_topology(4, 1, {"heads": 7}, dead_slots=[(0, 0)])
    assert seven.layout("heads", 0) == [[1, 2, 3], [4, 5], [0, 6]] and seven.replica(0).proxies == {0: 1}
    # Slot 1 dies (owner of block 1, proxy of block 0). Block 0: slots 2 and 3 have no role, slot 3 holds head 0
    # -> slot 3 (not the lower slot 2); head 1 -> slot 3 (tie, proxy). Block 1: slot 2 has fewer roles -> slot 2;
    # head 2 -> slot 2 (fewer), head 3 -> slot 2 (tie, proxy).
    lost = next_topology(seven, [0])
    assert lost.replica(0).proxies == {0: 3, 1: 2}
    assert lost.layout("heads", 0) == [[2, 3, 4, 5], [0, 1, 6]]


# ---------------------------------------------------------------------------------------------------------------
# Invariants of every reachable topology


def check_invariants(topo: Topology) -> None:
    tp = topo.tp_base
    assert topo.world_size == sum(rep.width for rep in topo.replicas)
    for family, n in topo.units.items():
        blocks = ref_blocks(n, tp)
        for s in range(tp):
            assert topo.block(family, s) == blocks[s]
        for rep in topo.replicas:
            layout = topo.layout(family, rep.index)
            flat = [u for units in layout for u in units]
            assert sorted(flat) == list(range(n)) and len(flat) == n  # every unit exactly once
            assert all(units == sorted(units) for units in layout)
            counts = [len(units) for units in layout]
            assert max(counts) - min(counts) <= 1  # balanced
            for slot, units in zip(rep.slots, layout):
                assert set(blocks[slot]) <= set(units)  # a live slot holds its own block
            if rep.width == tp:
                assert topo.is_healthy(rep.index)
                assert layout == blocks  # healthy = canonical
                assert rep.proxies == {} and rep.dealt == {}
            else:
                assert not topo.is_healthy(rep.index)
                assert sorted(rep.proxies) == [s for s in range(tp) if s not in rep.slots]
                assert set(rep.proxies.values()) <= set(rep.slots)
            for pos, (slot, rank) in enumerate(zip(rep.slots, rep.ranks)):
                assert topo.units_of(rank, family) == layout[pos]
                assert topo.replica_of(rank) == rep and topo.local_rank(rank) == pos
                assert topo.slot_of(rank) == (rep.index, slot) and topo.rank_of(rep.index, slot) == rank
            for b in range(tp):
                holders = topo.block_holders(family, rep.index, b)
                assert holders[0][0] == topo.sync_member(rep.index, b)  # member first
                others = [rank for rank, _ in holders[1:]]
                assert others == sorted(others) and all(units for _, units in holders[1:])
                assert sorted(u for _, units in holders for u in units) == blocks[b]  # block covered once
                for rank, units in holders:
                    assert units == [u for u in topo.units_of(rank, family) if u in blocks[b]]
                listed = {rank for rank, _ in holders}
                assert all(not set(topo.units_of(r, family)) & set(blocks[b]) for r in set(rep.ranks) - listed)
    groups = topo.sync_groups()
    assert len(groups) == tp  # always tp_base groups
    for b, group in enumerate(groups):
        assert [topo.replica_of(r).index for r in group] == [rep.index for rep in topo.replicas]
        for rep, rank in zip(topo.replicas, group):
            slot = topo.slot_of(rank)[1]
            assert slot == b if b in rep.slots else slot == rep.proxies[b]
            assert topo.proxy(rep.index, b) == slot
    for rank in range(topo.world_size):
        assert topo.member_blocks(rank) == [b for b, group in enumerate(groups) if rank in group]


@HISTORY
@given(histories())
def test_every_topology_of_a_history_is_valid(history):
    for topo in history.topologies:
        check_invariants(topo)
        blob = json.dumps(topo.to_json())
        back = Topology.from_json(json.loads(blob))
        assert back == topo and hash(back) == hash(topo) and json.dumps(back.to_json()) == blob


@HISTORY
@given(histories())
def test_start_with_dead_slots_is_the_healthy_topology_shrunk_at_once(history):
    start, tp, units = history.start, history.tp_base, history.units
    assert [rep.index for rep in start.replicas] == list(range(history.dp)) and start.generation == 0
    live = [(r, s) for r in range(history.dp) for s in range(tp) if (r, s) not in history.dead_slots]
    assert [start.slot_of(rank) for rank in range(start.world_size)] == live
    for r in range(history.dp):
        dying = {s for (i, s) in history.dead_slots if i == r}
        assert_matches_ref(start, r, ref_shrink(ref_healthy(tp, units), dying, tp, units))


# ---------------------------------------------------------------------------------------------------------------
# Shrinking


@HISTORY
@given(histories())
def test_shrinking_is_sticky_and_moves_exactly_the_dead_ranks_units(history):
    for step in (s for s in history.steps if s.kind == "shrink"):
        old, new, dead = step.old, step.new, set(step.dead_ranks)
        assert new.generation == old.generation + 1
        kept = [rep for rep in old.replicas if sum(r not in dead for r in rep.ranks) >= step.min_tp]
        assert [rep.index for rep in new.replicas] == [rep.index for rep in kept]
        assert [new.slot_of(r) for r in range(new.world_size)] == [
            (rep.index, s) for rep in kept for s, r in zip(rep.slots, rep.ranks) if r not in dead]
        for rep in kept:
            dying = {s for s, r in zip(rep.slots, rep.ranks) if r in dead}
            assert_matches_ref(new, rep.index, ref_shrink(ref_state(old, rep.index), dying, old.tp_base, old.units))
            if not dying:  # untouched (healthy or not): same units, same proxies, only ranks renumbered
                assert new.replica(rep.index).proxies == rep.proxies and new.replica(rep.index).dealt == rep.dealt
            # Proxies are sticky: a proxy keeps its role unless it dies.
            for b, p in rep.proxies.items():
                if p not in dying:
                    assert new.replica(rep.index).proxies[b] == p
            for family in old.units:
                released = set()
                gained = set()
                for slot, rank in zip(rep.slots, rep.ranks):
                    if rank in dead:
                        released |= set(old.units_of(rank, family))
                        continue
                    before = set(old.units_of(rank, family))
                    after = set(new.units_of(new.rank_of(rep.index, slot), family))
                    assert before <= after  # survivors keep everything they held
                    gained |= after - before
                assert gained == released  # exactly the dead ranks' units move


@HISTORY
@given(histories())
def test_next_topology_is_deterministic(history):
    for step in (s for s in history.steps if s.kind == "shrink"):
        again = next_topology(step.old, list(reversed(step.dead_ranks)), min_tp=step.min_tp)
        via_json = next_topology(Topology.from_json(json.loads(json.dumps(step.old.to_json()))), step.dead_ranks,
                                 min_tp=step.min_tp)
        assert again == step.new and via_json == step.new and again.to_json() == step.new.to_json()
    for step in (s for s in history.steps if s.kind == "join"):
        assert join_topology(Topology.from_json(step.old.to_json()), list(reversed(step.joined))) == step.new


# ---------------------------------------------------------------------------------------------------------------
# Widening


@HISTORY
@given(histories())
def test_widening_restores_canonical_blocks(history):
    for step in (s for s in history.steps if s.kind == "join"):
        old, new, tp = step.old, step.new, step.old.tp_base
        joined: dict[int, set[int]] = {}
        for r, s in step.joined:
            joined.setdefault(r, set()).add(s)
        assert [rep.index for rep in new.replicas] == sorted({rep.index for rep in old.replicas} | set(joined))
        assert [new.slot_of(r) for r in range(new.world_size)] == [
            (rep.index, s) for rep in new.replicas for s in rep.slots]
        for rep in new.replicas:
            slots = joined.get(rep.index, set())
            if rep.index not in {o.index for o in old.replicas}:  # a dropped replica comes back
                dying = set(range(tp)) - slots
                assert_matches_ref(new, rep.index, ref_shrink(ref_healthy(tp, old.units), dying, tp, old.units))
                continue
            before = old.replica(rep.index)
            if not slots:
                assert rep.proxies == before.proxies and rep.dealt == before.dealt
                continue
            assert_matches_ref(new, rep.index, ref_join(ref_state(old, rep.index), slots, tp, old.units))
            if rep.width == tp:  # full rejoin: exactly canonical, nothing dealt, no proxy
                assert rep.proxies == {} and rep.dealt == {}
            # Proxies of still-dead blocks stay.
            assert rep.proxies == {b: p for b, p in before.proxies.items() if b not in slots}
            for family, n in old.units.items():
                blocks = ref_blocks(n, tp)
                for s in slots:  # a joined slot holds its whole canonical block (plus what rebalancing gives it)
                    held = new.units_of(new.rank_of(rep.index, s), family)
                    assert set(blocks[s]) <= set(held)
                    if rep.width == tp:
                        assert held == blocks[s]
                # Fewest moves: after the joined blocks come back, the only other moves are rebalancing ones,
                # and there are exactly as many as the larger of (excess above ceil, deficit below floor).
                back = {u for s in slots for u in blocks[s]}
                after_return = {s: set(old.units_of(old.rank_of(rep.index, s), family)) - back
                                for s in before.slots}
                counts = [len(u) for u in after_return.values()] + [len(blocks[s]) for s in slots]
                low, high = n // rep.width, -(-n // rep.width)
                needed = max(sum(max(0, c - high) for c in counts), sum(max(0, low - c) for c in counts))
                moved = sum(len(after_return[s] - set(new.units_of(new.rank_of(rep.index, s), family)))
                            for s in before.slots)
                assert moved == needed


def test_join_examples():
    topo = make_topology(4, 1, {"heads": 8}, dead_slots=[(0, 2), (0, 3)])
    assert topo.layout("heads", 0) == [[0, 1, 4, 7], [2, 3, 5, 6]]
    one = join_topology(topo, [(0, 2)])
    # Slot 2 takes 4, 5 back; slot 0 (2 + {7}) and slot 1 (2 + {6}) are balanced with slot 2: no other move.
    assert one.layout("heads", 0) == [[0, 1, 7], [2, 3, 6], [4, 5]] and one.replica(0).proxies == {3: 1}
    assert one.sync_groups() == [(0,), (1,), (2,), (1,)]
    plan = transition_plan(topo, one)
    assert plan == [Move("heads", 4, 0, dst=2, src=0, peer=None), Move("heads", 5, 0, dst=2, src=1, peer=None)]
    # Rebalancing: 12 heads, TP4 with slots 2 and 3 dead; slot 3 rejoins.
    wide = make_topology(4, 1, {"heads": 12}, dead_slots=[(0, 2), (0, 3)])
    assert wide.layout("heads", 0) == [[0, 1, 2, 6, 8, 11], [3, 4, 5, 7, 9, 10]]
    assert wide.replica(0).proxies == {2: 0, 3: 1}
    rejoined = join_topology(wide, [(0, 3)])
    # Slot 3 takes 9, 10, 11 back: counts 5, 4, 3. The lowest most-loaded slot (0) gives its largest dealt unit,
    # 8, to the least loaded slot (3; the proxy of block 2 is slot 0 itself, not least loaded): counts 4, 4, 4.
    assert rejoined.layout("heads", 0) == [[0, 1, 2, 6], [3, 4, 5, 7], [8, 9, 10, 11]]
    assert rejoined.replica(0).proxies == {2: 0}
    moves = transition_plan(wide, rejoined)
    assert [(mv.unit, mv.src, mv.dst) for mv in moves] == [(8, 0, 2), (9, 1, 2), (10, 1, 2), (11, 0, 2)]


def test_join_rebalance_prefers_the_proxy_among_the_least_loaded():
    """11 heads over TP4: blocks [0,1,2] [3,4,5] [6,7,8] [9,10]; only slot 3 starts live (proxy of 0, 1, 2)."""
    topo = make_topology(4, 1, {"heads": 11}, dead_slots=[(0, 0), (0, 1), (0, 2)])
    # Slot 0 takes 0, 1, 2 back (counts 3 / 8); slot 3 gives its largest dealt heads, 8 then 7, to slot 0.
    one = join_topology(topo, [(0, 0)])
    assert one.layout("heads", 0) == [[0, 1, 2, 7, 8], [3, 4, 5, 6, 9, 10]]
    assert one.replica(0).proxies == {1: 3, 2: 3}
    # Slot 1 takes 3, 4, 5 back: counts 5 / 3 / 3. Slot 0 gives head 8 (block 2); slots 1 and 3 are both least
    # loaded, and slot 3 is the proxy of block 2, so it gets it rather than the lower slot 1.
    two = join_topology(one, [(0, 1)])
    assert two.layout("heads", 0) == [[0, 1, 2, 7], [3, 4, 5], [6, 8, 9, 10]]
    assert two.replica(0).proxies == {2: 3}
    assert transition_plan(one, two) == [Move("heads", 3, 0, dst=1, src=1, peer=None),
                                         Move("heads", 4, 0, dst=1, src=1, peer=None),
                                         Move("heads", 5, 0, dst=1, src=1, peer=None),
                                         Move("heads", 8, 0, dst=2, src=0, peer=None)]


def test_join_of_a_dropped_replica_and_min_tp():
    topo = make_topology(4, 3, {"heads": 8, "vocab": 12})
    dropped = next_topology(topo, [4, 5, 6], min_tp=2)  # replica 1 keeps 1 slot < 2: dropped
    assert [rep.index for rep in dropped.replicas] == [0, 2]
    with pytest.raises(TopologyError, match=r"dropped replica 1 would come back with 1 slots, below ntp.min_tp \(2\)"):
        join_topology(dropped, [(1, 0)], min_tp=2)
    back = join_topology(dropped, [(1, 3), (1, 0)], min_tp=2)
    assert [rep.index for rep in back.replicas] == [0, 1, 2] and back.replica(1).slots == (0, 3)
    assert back.replica(1) == make_topology(4, 3, {"heads": 8, "vocab": 12},
                                            dead_slots=[(1, 1), (1, 2)]).replica(1)
    plan = [mv for mv in transition_plan(dropped, back) if mv.replica == 1]
    assert plan and all(mv.peer is not None and mv.src is None for mv in plan)
    assert {mv.peer for mv in plan} <= set(range(4))  # from replica 0: healthy and lowest index
    full = join_topology(dropped, [(1, s) for s in range(4)])
    assert full.replica(1).proxies == {} and full.layout("heads", 1) == canonical_blocks(8, 4)


@pytest.mark.parametrize(
    "joined, error, message",
    [
        ([(0, 1)], ValueError, "joined slot (0, 1) is already live in generation 1"),
        ([(1, 3), (1, 3)], ValueError, "joined slot (1, 3) is listed twice"),
        ([(1, 4)], ValueError, "joined slot 1:4: slot 4 out of range 0..3"),
        ([(1, -1)], ValueError, "slot of joined slot 1:-1 must be >= 0, got -1"),
        ([(1.0, 3)], ValueError, "replica of joined slot (1.0, 3) must be an int, got 1.0"),
        (["1:3"], ValueError, "joined slot must be a (replica, slot) pair, got '1:3'"),
    ],
)
def test_join_errors(joined, error, message):
    topo = next_topology(make_topology(4, 2, {"heads": 8}), [7])
    with pytest.raises(error) as err:
        join_topology(topo, joined)
    assert message in str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# Policies and errors of next_topology


@HISTORY
@given(histories(max_steps=2), st.integers(1, 4), st.data())
def test_next_topology_policies(history, min_tp, data):
    topo = history.topologies[-1]
    dead = data.draw(st.lists(st.sampled_from(range(topo.world_size)), unique=True))
    left = {rep.index: sum(r not in dead for r in rep.ranks) for rep in topo.replicas}
    kept = [i for i, n in left.items() if n >= min_tp]
    short = [i for i, n in left.items() if n < min_tp]
    if short:
        with pytest.raises(TopologyError) as err:
            next_topology(topo, dead, min_tp=min_tp, policy="stop")
        assert f"replica {short[0]} fell below ntp.min_tp ({min_tp})" in str(err.value)
    if not kept:
        with pytest.raises(TopologyError, match="no replica survives"):
            next_topology(topo, dead, min_tp=min_tp)
        return
    new = next_topology(topo, dead, min_tp=min_tp, policy="drop_replica")
    assert [rep.index for rep in new.replicas] == kept  # dropped ones vanish, the others keep their index
    if not short:
        assert next_topology(topo, dead, min_tp=min_tp, policy="stop") == new


def test_next_topology_examples_and_errors():
    topo = make_topology(4, 3, {"heads": 8, "ffn": 32})
    new = next_topology(topo, [4, 5, 6, 7])  # replica 1 lost every slot
    assert [rep.index for rep in new.replicas] == [0, 2] and new.replicas[1].ranks == (4, 5, 6, 7)
    assert new.replicas[1].slots == (0, 1, 2, 3) and new.layout("ffn", 2) == canonical_blocks(32, 4)
    dropped = next_topology(topo, [1, 2], min_tp=3)
    assert [rep.index for rep in dropped.replicas] == [1, 2] and len(dropped.sync_groups()) == 4
    with pytest.raises(TopologyError, match=r"replica 0 fell below ntp.min_tp \(3\): 2 live slots left after "
                                            r"losing slots \[1, 2\] \(policy 'stop'\)"):
        next_topology(topo, [1, 2], min_tp=3, policy="stop")
    with pytest.raises(TopologyError, match="no replica survives"):
        next_topology(topo, range(12))
    with pytest.raises(TopologyError, match="no replica survives"):
        next_topology(topo, [0, 4, 8], min_tp=4)
    with pytest.raises(ValueError, match="rank 12 is not live"):
        next_topology(topo, [12])
    with pytest.raises(ValueError, match=r"must be one of \['drop_replica', 'stop', 'restart'\], got 'fail'"):
        next_topology(topo, [1], policy="fail")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_tp must be an int"):
        next_topology(topo, [1], min_tp=2.0)  # type: ignore[arg-type]
    assert POLICIES == ("drop_replica", "stop", "restart")
    with pytest.raises(TopologyError, match=r"\(policy 'restart'\)"):  # the launcher restarts the job instead
        next_topology(topo, [1, 2], min_tp=3, policy="restart")
    assert next_topology(topo, []).replicas == topo.replicas


@HISTORY
@given(histories(max_steps=2), st.integers(1, 4), st.data())
def test_restart_layout_keeps_every_replica_that_can_run(history, min_tp, data):
    """A restart keeps each replica's live slots (whatever shape the run had reached) under its own index, drops
    replicas below min_tp, and the result is a valid starting configuration with exactly those slots live."""
    topo = history.topologies[-1]
    dp = max(rep.index for rep in topo.replicas) + 1
    dead = set(data.draw(st.lists(st.sampled_from(range(topo.world_size)), unique=True)))
    live = [topo.slot_of(r) for r in range(topo.world_size) if r not in dead]
    per_replica = {i: sorted(slot for rep, slot in live if rep == i) for i in range(dp)}
    kept = [i for i in range(dp) if len(per_replica[i]) >= min_tp]
    if not kept:
        with pytest.raises(TopologyError, match="no replica keeps"):
            restart_layout(topo.tp_base, dp, live, min_tp)
        return
    dropped, dead_slots = restart_layout(topo.tp_base, dp, live, min_tp)
    assert dropped == [i for i in range(dp) if i not in kept]
    start = make_topology(topo.tp_base, dp, topo.units, dead_slots=dead_slots, min_tp=min_tp, dropped=dropped)
    assert [rep.index for rep in start.replicas] == kept
    assert all(list(rep.slots) == per_replica[rep.index] for rep in start.replicas)


def test_restart_layout_examples():
    assert restart_layout(2, 2, [(0, 0), (0, 1), (1, 0)], min_tp=2) == ([1], [])
    assert restart_layout(4, 2, [(0, 0), (0, 2), (1, 1), (1, 2), (1, 3)], min_tp=2) == ([], [(0, 1), (0, 3), (1, 0)])
    assert restart_layout(4, 3, [(1, 0), (1, 1), (1, 2), (2, 3)], min_tp=2) == ([0, 2], [(1, 3)])
    with pytest.raises(TopologyError, match=r"no replica keeps ntp.min_tp \(3\) live slots"):
        restart_layout(4, 2, [(0, 0), (0, 1), (1, 0)], min_tp=3)
    with pytest.raises(ValueError, match=r"live slot \(2, 0\): replica 2 out of range 0..1"):
        restart_layout(4, 2, [(2, 0)])
    start = make_topology(4, 3, {"heads": 8, "ffn": 32}, dead_slots=[(1, 3)], dropped=[0, 2])
    assert [rep.index for rep in start.replicas] == [1] and start.world_size == 3
    with pytest.raises(ValueError, match="every replica"):
        make_topology(2, 2, {"heads": 8, "ffn": 32}, dropped=[0, 1])
    with pytest.raises(ValueError, match=r"dead slot 0:1: replica 0 is dropped"):
        make_topology(2, 2, {"heads": 8, "ffn": 32}, dead_slots=[(0, 1)], dropped=[0])


# ---------------------------------------------------------------------------------------------------------------
# make_topology, Topology validation, serialisation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dead_slots=[(2, 0)]), "dead slot 2:0: replica 2 out of range 0..1"),
        (dict(dead_slots=[(0, 4)]), "dead slot 0:4: slot 4 out of range 0..3"),
        (dict(dead_slots=[(0, -1)]), "slot of dead slot 0:-1 must be >= 0, got -1"),
        (dict(dead_slots=[(1, s) for s in range(4)]), "replica 1 has no live slot"),
        (dict(dead_slots=[(1, 0), (1, 1)], min_tp=3), "replica 1 starts with 2 live slots, below ntp.min_tp (3)"),
        (dict(units={"heads": 8, "ffn": 3}), "family 'ffn' has 3 units, fewer than tp_base (4)"),
        (dict(units={"heads": 3}, dead_slots=[(0, 3)]), "family 'heads' has 3 units, fewer than tp_base (4)"),
        (dict(units={"heads": 8.0}), "units['heads'] must be an int, got 8.0"),
        (dict(units={}), "units must be a non-empty mapping"),
        (dict(min_tp=5), "ntp.min_tp (5) must be <= tp_base (4)"),
        (dict(tp_base=4.0), "tp_base must be an int, got 4.0"),
        (dict(dp="2"), "dp must be an int, got '2'"),
        (dict(dead_slots=["1:3"]), "dead slot must be a (replica, slot) pair"),
    ],
)
def test_make_topology_errors(kwargs, message):
    args = dict(tp_base=4, dp=2, units={"heads": 8})
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        make_topology(**args)
    assert message in str(err.value) and "\n" not in str(err.value)


def degraded_json() -> dict:
    return next_topology(make_topology(4, 2, {"heads": 8}), [7]).to_json()


def edit(change):
    """A blob maker (built at test time, so that a broken implementation fails a test, not the collection)."""
    def make() -> dict:
        d = degraded_json()
        change(d["replicas"][1])
        return d
    return make


@pytest.mark.parametrize(
    "make_blob, message",
    [
        (edit(lambda r: r.update(proxies=[])), "every dead block needs exactly one proxy"),
        (edit(lambda r: r.update(proxies=[[3, 0], [2, 1]])), "every dead block needs exactly one proxy"),
        (edit(lambda r: r.update(proxies=[[3, 3]])), "proxy of block 3 is slot 3, which is not live"),
        (edit(lambda r: r["dealt"].update(heads=[[6, 0]])), "units [7] of the dead blocks [3] are not dealt"),
        (edit(lambda r: r["dealt"].update(heads=[[5, 0], [6, 0], [7, 1]])), "not within one unit of the shares"),
        (edit(lambda r: r["dealt"].update(heads=[[6, 0], [7, 1], [9, 1]])), "dealt unit 9 out of range 0..7"),
        (edit(lambda r: r["dealt"].update(heads=[[6, 0], [7, 0]])), "not within one unit of the shares"),
        (edit(lambda r: r["dealt"].update(heads=[[6, 0], [7, 3]])), "holder of dealt unit 7"),
        (edit(lambda r: r["dealt"].update(heads=[[6, 0], [6, 1]])), "lists key 6 twice"),
        (edit(lambda r: r.update(dealt={})), "is degraded (dead blocks [3]) but lists no dealt units"),
        (edit(lambda r: r.update(dealt={"heads": [[6, 0], [7, 1]], "ffn": []})), "dealt must list the families"),
        (edit(lambda r: r.update(slots=[0, 1, 2, 3], ranks=[4, 5, 6, 7], proxies=[])),
         "every slot live and its slots alike (no weights) but lists dealt units: it must be canonical"),
        (edit(lambda r: r.update(slots=[0, 1, 2, 3], ranks=[4, 5, 6, 7], proxies=[],
                                 weights=[[0, 100], [1, 100], [2, 100], [3, 50]])),
         "not within one unit of the shares"),
        (edit(lambda r: r.update(slots=[0, 1, 2, 3], ranks=[4, 5, 6, 7], proxies=[], dealt={"heads": [[7, 3]]},
                                 weights=[[0, 100], [1, 100], [2, 100], [3, 50]])),
         "unit 7 is listed as dealt to slot 3, its own block's slot"),
        (edit(lambda r: r.update(weights=[[0, 100], [1, 50]])), "weights must list exactly the live slots [0, 1, 2]"),
        (edit(lambda r: r.update(weights=[[0, 100], [1, 0], [2, 100]])), "weight of slot 1 must be >= 1"),
        (edit(lambda r: r.update(proxies=[[3, "0"]])), "proxy of block 3 must be an int"),
        (edit(lambda r: r.pop("dealt")), "replica JSON must have exactly the keys"),
        (lambda: {"generation": 0, "tp_base": 2, "units": {}}, "topology JSON must have exactly the keys"),
        (lambda: {**degraded_json(), "units": {"heads": 3}}, "family 'heads' has 3 units, fewer than tp_base (4)"),
    ],
)
def test_topology_validation(make_blob, message):
    blob = make_blob()
    with pytest.raises(ValueError) as err:
        Topology.from_json(blob)
    assert message in str(err.value)


def test_topology_rejects_inconsistent_ranks_and_slots():
    with pytest.raises(ValueError, match="ranks must be exactly"):
        Topology(0, 2, {"heads": 4}, (Replica(0, (0, 1), (0, 2)),))
    with pytest.raises(ValueError, match="out of range"):
        Topology(0, 2, {"heads": 4}, (Replica(0, (0, 2), (0, 1), proxies={1: 0}, dealt={"heads": {2: 0, 3: 2}}),))
    with pytest.raises(ValueError, match="distinct and ascending"):
        Replica(0, (1, 0), (0, 1))
    with pytest.raises(TopologyError):
        Topology(0, 2, {"heads": 4}, ())


def test_topology_is_frozen_hashable_and_copies_its_inputs():
    units = {"heads": 8}
    dealt = {"heads": {6: 0, 7: 1}}
    rep = Replica(0, (0, 1, 2), (0, 1, 2), proxies={3: 0}, dealt=dealt)
    topo = Topology(0, 4, units, (rep,))
    units["heads"] = 1
    dealt["heads"][6] = 2
    assert topo.units == {"heads": 8} and topo.layout("heads", 0) == [[0, 1, 6], [2, 3, 7], [4, 5]]
    with pytest.raises(AttributeError):
        topo.generation = 3  # type: ignore[misc]
    for mapping in (topo.units, rep.proxies, rep.dealt, rep.dealt["heads"]):
        with pytest.raises(TypeError, match="read-only"):
            mapping[0] = 1
        with pytest.raises(TypeError, match="read-only"):
            mapping.update({})
    for clone in (pickle.loads(pickle.dumps(topo)), copy.deepcopy(topo), copy.copy(topo)):
        assert clone == topo and hash(clone) == hash(topo) and clone.to_json() == topo.to_json()
    assert len({topo, Topology.from_json(topo.to_json()), make_topology(4, 1, {"heads": 8})}) == 2


def test_move_json_round_trip_and_shape():
    for mv in (Move("ffn", 3, 1, 4, 2, None), Move("vocab", 0, 0, 1, None, 7)):
        assert Move.from_json(json.loads(json.dumps(mv.to_json()))) == mv
    with pytest.raises(ValueError):
        Move("ffn", 3, 1, 4, None, None)


def test_lookup_errors_name_what_is_live():
    topo = make_topology(2, 3, {"heads": 4, "vocab": 10})
    dropped = next_topology(topo, [2, 3])
    assert dropped.replica(2).ranks == (2, 3)
    with pytest.raises(ValueError, match=r"no replica with index 1; live replicas: \[0, 2\]"):
        dropped.layout("heads", 1)
    with pytest.raises(ValueError, match="unknown unit family 'ffn'"):
        topo.units_of(0, "ffn")
    with pytest.raises(ValueError, match=r"block 2 out of range 0..1"):
        topo.block_holders("heads", 0, 2)
    with pytest.raises(ValueError, match=r"block must be an int"):
        topo.proxy(0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 6 is not live"):
        topo.member_blocks(6)
    assert topo.rank_of(1, 5) is None and dropped.rank_of(1, 0) is None


def test_parse_dead_slots():
    assert parse_dead_slots(["1:3", "0:2"]) == [(1, 3), (0, 2)]
    assert parse_dead_slots([" 1 : 3 "]) == [(1, 3)]
    assert parse_dead_slots("1:3,0:2") == [(1, 3), (0, 2)]
    assert parse_dead_slots([(1, 3), [0, 2]]) == [(1, 3), (0, 2)]
    assert parse_dead_slots([]) == [] and parse_dead_slots(None) == []
    assert parse_dead_slots(["1:3@0", (0, 2, 0)]) == [(1, 3), (0, 2)]  # stage 0 may be named
    for bad in (["1-3"], ["1:3:4"], [63], ["a:b"], ["-1:3"], [(1, 2, 3, 4)], [(True, 1)], ["１:3"], ["1:3@"],
                ["1:3@-1"], ["1@3"]):
        with pytest.raises(ValueError) as err:
            parse_dead_slots(bad)
        assert str(err.value).startswith("ntp.dead_slots: expected 'replica:slot' like '1:3', or "
                                         "'replica:slot@stage' like '1:3@1', got "), err.value
    for other_stage in (["1:3@1"], [(1, 2, 3)]):
        with pytest.raises(ValueError, match="names stage [13], but the job has one pipeline stage"):
            parse_dead_slots(other_stage)


def test_parse_stage_slots():
    assert parse_stage_slots(["1:3@1", "0:2", " 2 : 0 @ 3 "]) == [(1, 3, 1), (0, 2, 0), (2, 0, 3)]
    assert parse_stage_slots("1:3@1,0:2") == [(1, 3, 1), (0, 2, 0)]
    assert parse_stage_slots([(1, 3), [0, 2, 1]]) == [(1, 3, 0), (0, 2, 1)]


# ---------------------------------------------------------------------------------------------------------------
# transition_plan


def check_plan(old: Topology, new: Topology, dead: list[int]) -> list[Move] | None:
    """Apply the plan to the survivors' old holdings and check it against the definitions; return it (None
    when some needed unit has no surviving holder, after checking that the plan refuses)."""
    alive = {(rep.index, s): r for rep in old.replicas for s, r in zip(rep.slots, rep.ranks) if r not in dead}
    survivor = {key: rank for key, rank in alive.items() if new.rank_of(*key) is not None}
    held = {f: {u for rank in survivor.values() for u in old.units_of(rank, f)} for f in new.units}
    if any(held[f] != set(range(n)) for f, n in new.units.items()):
        with pytest.raises(TopologyError, match="no surviving holder"):
            transition_plan(old, new, dead)
        return None
    plan = transition_plan(old, new, dead)
    assert plan == sorted(plan, key=lambda mv: (mv.family, mv.replica, mv.unit))
    assert plan == transition_plan(old, new, list(reversed(dead)))  # deterministic
    expected_moves = 0
    for family in new.units:
        for rep in new.replicas:
            # Start from the survivors' old holdings, apply the plan, compare with the new layout.
            holdings = {rank: set(old.units_of(survivor[(rep.index, s)], family)) if (rep.index, s) in survivor
                        else set() for s, rank in zip(rep.slots, rep.ranks)}
            received: dict[int, set[int]] = {r: set() for r in rep.ranks}
            for mv in (mv for mv in plan if mv.family == family and mv.replica == rep.index):
                assert mv.dst in received and mv.unit not in received[mv.dst] and mv.unit not in holdings[mv.dst]
                received[mv.dst].add(mv.unit)
                source = mv.src if mv.src is not None else mv.peer
                assert source in survivor.values() and mv.unit in old.units_of(source, family)  # it holds it
                same = [r for (i, _), r in survivor.items() if i == rep.index and mv.unit in old.units_of(r, family)]
                if mv.src is not None:
                    assert mv.peer is None and [mv.src] == same
                else:
                    assert not same and old.replica_of(mv.peer).index != rep.index
                    holders = [i for (i, _), r in survivor.items() if mv.unit in old.units_of(r, family)]
                    best = min(holders, key=lambda i: (not old.is_healthy(i), i))
                    assert old.replica_of(mv.peer).index == best  # healthy first, then lowest index
            for rank in rep.ranks:
                needed = set(new.units_of(rank, family))
                expected_moves += len(needed - holdings[rank])
                # Apply: a receiving rank gets the unit; the layout it ends with is the new one.
                final = (holdings[rank] & needed) | received[rank]
                assert final == needed
    assert len(plan) == expected_moves  # minimal
    return plan


@HISTORY
@given(histories())
def test_transition_plans_along_a_history(history):
    for step in history.steps:
        plan = check_plan(step.old, step.new, step.dead_ranks)
        if step.kind == "shrink" and plan is not None:
            assert transition_plan(step.old, step.new) == plan  # dead slots are out of `new` anyway
            dead = set(step.dead_ranks)
            for rep in step.new.replicas:  # only the dead ranks' units move into a surviving replica
                old_rep = step.old.replica(rep.index)
                for family in step.old.units:
                    lost = sorted(u for r in old_rep.ranks if r in dead for u in step.old.units_of(r, family))
                    assert sorted(mv.unit for mv in plan if mv.family == family and mv.replica == rep.index) == lost
        if step.kind == "join":
            old_indices = {rep.index for rep in step.old.replicas}
            # Widening a surviving replica never needs a peer; a returning replica needs peers for everything.
            assert all((mv.src is not None) == (mv.replica in old_indices) for mv in plan)


@HISTORY
@given(histories(max_steps=2), st.data())
def test_transition_plan_when_dead_slots_are_refilled_at_once(history, data):
    """A slot that died and was refilled in the same re-formation is a new, empty process."""
    old = history.topologies[-1]
    dead = data.draw(st.lists(st.sampled_from(range(old.world_size)), unique=True))
    new = next_topology(old, [])
    plan = check_plan(old, new, dead)
    if plan is not None:
        assert all(mv.src not in dead and mv.peer not in dead for mv in plan)
        assert {new.rank_of(*old.slot_of(r)) for r in dead} <= {mv.dst for mv in plan}


def test_transition_plan_nothing_changes_lost_unit_and_model_mismatch():
    topo = make_topology(4, 2, {"heads": 8, "ffn": 40, "vocab": 64}, dead_slots=[(0, 1)])
    assert transition_plan(topo, next_topology(topo, [])) == []
    single = make_topology(2, 1, {"heads": 4})
    with pytest.raises(TopologyError, match="no surviving holder"):
        transition_plan(single, next_topology(single, [1]), [1])
    with pytest.raises(ValueError, match="different models"):
        transition_plan(single, make_topology(2, 1, {"heads": 6}))


def test_peer_prefers_a_healthy_replica():
    """Replica 0 is degraded (slot 3 dead), replica 1 healthy; replica 2 loses slot 3: its units come from
    replica 1 even though replica 0 has the lower index and also holds them."""
    old = make_topology(4, 3, {"heads": 8}, dead_slots=[(0, 3)])
    new = next_topology(old, [old.rank_of(2, 3)])
    plan = transition_plan(old, new, [old.rank_of(2, 3)])
    assert [(mv.unit, mv.peer) for mv in plan] == [(6, old.rank_of(1, 3)), (7, old.rank_of(1, 3))]
    assert survivor_ranks(old, new, [old.rank_of(2, 3)]) == {r: r for r in range(old.world_size - 1)}
