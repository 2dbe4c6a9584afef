"""Property tests of the pure layout layer (DESIGN.md §2, §7): ownership, sync partitions, topologies, plans.

The reference checks below are written from the definitions, not from the implementation, so a bug in
ntp_megatron.layout shows up as a disagreement rather than being copied into the expectation.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ntp_megatron.layout import (
    FAMILIES,
    Move,
    Replica,
    Topology,
    TopologyError,
    balanced_counts,
    join_topology,
    make_topology,
    next_topology,
    parse_dead_slots,
    replica_layout,
    survivor_ranks,
    sync_partitions,
    transition_plan,
)

FAST = settings(max_examples=100, deadline=None)
SLOW = settings(max_examples=50, deadline=None)


# ---------------------------------------------------------------------------------------------------------------
# Strategies


@st.composite
def layout_args(draw, max_width: int = 9, max_units: int = 60):
    """(num_units, width, sync_width) with sync_width <= width <= num_units."""
    width = draw(st.integers(1, max_width))
    sync_width = draw(st.integers(1, width))
    num_units = draw(st.integers(width, max_units))
    return num_units, width, sync_width


@st.composite
def topologies(draw, max_tp: int = 6, max_dp: int = 4):
    """A starting topology with random dead slots (each replica keeps at least one slot)."""
    tp_base = draw(st.integers(1, max_tp))
    dp = draw(st.integers(1, max_dp))
    dead = []
    for r in range(dp):
        lost = draw(st.sets(st.integers(0, tp_base - 1), max_size=tp_base - 1))
        dead += [(r, s) for s in sorted(lost)]
    dead = draw(st.permutations(dead))
    families = draw(st.sets(st.sampled_from(FAMILIES), min_size=1))
    units = {f: draw(st.integers(tp_base, 3 * tp_base + 5)) for f in sorted(families)}
    return make_topology(tp_base, dp, units, dead_slots=dead, generation=draw(st.integers(0, 3)))


def dead_ranks_of(draw, topo: Topology) -> list[int]:
    return draw(st.lists(st.sampled_from(range(topo.world_size)), unique=True, max_size=topo.world_size))


# ---------------------------------------------------------------------------------------------------------------
# Unit-level math


def test_examples_from_the_interface():
    assert balanced_counts(8, 3) == [3, 3, 2]
    assert balanced_counts(7, 7) == [1] * 7
    assert sync_partitions(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert replica_layout(8, 4, 3) == [[0, 1], [3, 4], [6, 7], [2, 5]]
    assert replica_layout(8, 3, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # Two extras, leftovers of several partitions filling extras in rank order.
    assert replica_layout(10, 5, 2) == [[0, 1], [5, 6], [2, 3], [4, 7], [8, 9]]


@FAST
@given(st.integers(0, 200), st.integers(1, 20))
def test_balanced_counts(num_units, width):
    counts = balanced_counts(num_units, width)
    assert len(counts) == width and sum(counts) == num_units
    assert counts == sorted(counts, reverse=True)
    assert max(counts) - min(counts) <= 1


@FAST
@given(st.integers(0, 200), st.integers(1, 20))
def test_sync_partitions_are_contiguous_balanced_blocks(num_units, sync_width):
    parts = sync_partitions(num_units, sync_width)
    assert [u for p in parts for u in p] == list(range(num_units))
    assert [len(p) for p in parts] == balanced_counts(num_units, sync_width)


@FAST
@given(layout_args())
def test_replica_layout_owns_every_unit_once_balanced_and_ascending(args):
    num_units, width, sync_width = args
    layout = replica_layout(num_units, width, sync_width)
    assert len(layout) == width
    flat = [u for units in layout for u in units]
    assert sorted(flat) == list(range(num_units)) and len(flat) == num_units
    assert [len(units) for units in layout] == balanced_counts(num_units, width)
    assert all(units == sorted(units) and units for units in layout)


@FAST
@given(layout_args())
def test_cores_hold_a_prefix_of_their_partition_and_extras_the_leftovers(args):
    num_units, width, sync_width = args
    layout = replica_layout(num_units, width, sync_width)
    parts = sync_partitions(num_units, sync_width)
    counts = balanced_counts(num_units, width)
    for i in range(sync_width):
        assert counts[i] <= len(parts[i])  # the property the construction relies on
        assert layout[i] == parts[i][:counts[i]]
    leftovers = [u for i, p in enumerate(parts) for u in p[counts[i]:]]
    assert [u for units in layout[sync_width:] for u in units] == leftovers
    if width == sync_width:
        assert layout == parts


def test_core_never_exceeds_its_partition_exhaustively():
    """The closed-form argument in replica_layout's docstring, checked on every small case."""
    for num_units in range(1, 70):
        for sync_width in range(1, min(num_units, 12) + 1):
            parts = balanced_counts(num_units, sync_width)
            for width in range(sync_width, min(num_units, 12) + 1):
                counts = balanced_counts(num_units, width)
                assert all(counts[i] <= parts[i] for i in range(sync_width)), (num_units, width, sync_width)


def test_replica_layout_errors():
    with pytest.raises(ValueError, match="below the sync width"):
        replica_layout(8, 2, 3)
    with pytest.raises(ValueError) as err:
        replica_layout(3, 4, 2)
    assert "3" in str(err.value) and "4" in str(err.value)
    with pytest.raises(ValueError):
        balanced_counts(4, 0)
    with pytest.raises(ValueError):
        replica_layout(8.0, 4, 3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# DESIGN.md's worked example: 8 heads, replicas TP4 and TP3 (m = 3)


def worked_example() -> Topology:
    return make_topology(tp_base=4, dp=2, units={"heads": 8}, dead_slots=[(1, 3)])


def test_worked_example_literally():
    topo = worked_example()
    assert topo.sync_width == 3 and topo.world_size == 7
    assert topo.replicas == (Replica(0, (0, 1, 2, 3), (0, 1, 2, 3)), Replica(1, (0, 1, 2), (4, 5, 6)))
    assert topo.partitions("heads") == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert topo.layout("heads", 1) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert topo.layout("heads", 0) == [[0, 1], [3, 4], [6, 7], [2, 5]]  # core0, core1, core2, extra
    # DP all-reduce groups: (TP3 r0, TP4 core0), (TP3 r1, TP4 core1), (TP3 r2, TP4 core2).
    assert topo.sync_groups() == [(0, 4), (1, 5), (2, 6)]
    # The extra (rank 3) sends head 2 to core0 and head 5 to core1 before the all-reduce, and nothing to core2.
    assert topo.partition_holders("heads", 0, 0) == [(0, [0, 1]), (3, [2])]
    assert topo.partition_holders("heads", 0, 1) == [(1, [3, 4]), (3, [5])]
    assert topo.partition_holders("heads", 0, 2) == [(2, [6, 7])]
    assert topo.partition_holders("heads", 1, 1) == [(5, [3, 4, 5])]
    assert topo.units_of(3, "heads") == [2, 5] and topo.local_rank(3) == 3 and topo.replica_of(5).index == 1


def test_worked_example_failure_and_rejoin():
    """TP4 replica loses slot 1: both replicas are TP3 (m stays 3); then slot 1 comes back."""
    old = worked_example()
    new = next_topology(old, [1])
    assert new.generation == 1 and new.replicas == (Replica(0, (0, 2, 3), (0, 1, 2)), Replica(1, (0, 1, 2), (3, 4, 5)))
    assert new.layout("heads", 0) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert survivor_ranks(old, new, [1]) == {0: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 5}
    plan = transition_plan(old, new, [1])
    assert plan == [
        Move("heads", 2, 0, dst=0, src=3, peer=None),   # the extra's head 2 goes to core0 (slot 0)
        Move("heads", 3, 0, dst=1, src=None, peer=5),   # dead slot 1's heads come from replica 1's core1
        Move("heads", 4, 0, dst=1, src=None, peer=5),
        Move("heads", 5, 0, dst=1, src=3, peer=None),
        Move("heads", 6, 0, dst=2, src=2, peer=None),   # slot 3 becomes core2: old slot 2 hands 6, 7 over
        Move("heads", 7, 0, dst=2, src=2, peer=None),
    ]
    back = join_topology(new, [(0, 1)])
    assert back.generation == 2 and back.replicas == old.replicas
    assert back.layout("heads", 0) == old.layout("heads", 0)
    # Units come back from survivors of the same replica, never from the peer.
    assert all(mv.src is not None and mv.replica == 0 for mv in transition_plan(new, back))


# ---------------------------------------------------------------------------------------------------------------
# Topologies


@SLOW
@given(topologies())
def test_topology_layouts_sync_groups_and_partition_holders(topo):
    m = topo.sync_width
    assert m == min(rep.width for rep in topo.replicas)
    assert topo.world_size == sum(len(rep.slots) for rep in topo.replicas)
    groups = topo.sync_groups()
    assert len(groups) == m
    cores = {rep.ranks[i] for rep in topo.replicas for i in range(m)}
    grouped = [r for g in groups for r in g]
    assert sorted(grouped) == sorted(cores)  # every core in exactly one group, extras in none
    for i, group in enumerate(groups):
        assert [topo.replica_of(r).index for r in group] == [rep.index for rep in topo.replicas]
        assert all(topo.local_rank(r) == i for r in group)
    for family, num_units in topo.units.items():
        parts = topo.partitions(family)
        for rep in topo.replicas:
            layout = topo.layout(family, rep.index)
            assert sorted(u for units in layout for u in units) == list(range(num_units))
            for pos, rank in enumerate(rep.ranks):
                assert topo.units_of(rank, family) == layout[pos]
                assert topo.replica_of(rank) == rep and topo.local_rank(rank) == pos
                assert topo.slot_of(rank) == (rep.index, rep.slots[pos])
                assert topo.rank_of(rep.index, rep.slots[pos]) == rank
            for i, part in enumerate(parts):
                holders = topo.partition_holders(family, rep.index, i)
                assert holders[0][0] == rep.ranks[i]  # core first
                extras = [rank for rank, _ in holders[1:]]
                assert extras == sorted(extras) and all(topo.local_rank(r) >= m for r in extras)
                held = [u for _, units in holders for u in units]
                assert sorted(held) == part  # partition i covered exactly once per replica
                assert all(units for _, units in holders)
                for rank, units in holders:
                    assert set(units) <= set(topo.units_of(rank, family))
                # Nobody outside the listed holders holds a unit of this partition.
                others = set(rep.ranks) - {rank for rank, _ in holders}
                assert all(not set(topo.units_of(r, family)) & set(part) for r in others)


@SLOW
@given(topologies())
def test_json_round_trip(topo):
    blob = json.dumps(topo.to_json())
    back = Topology.from_json(json.loads(blob))
    assert back == topo and hash(back) == hash(topo)
    assert back.to_json() == topo.to_json()
    assert json.dumps(back.to_json()) == blob


def test_move_json_round_trip_and_shape():
    for mv in (Move("ffn", 3, 1, 4, 2, None), Move("vocab", 0, 0, 1, None, 7)):
        assert Move.from_json(json.loads(json.dumps(mv.to_json()))) == mv
    with pytest.raises(ValueError):
        Move("ffn", 3, 1, 4, None, None)
    with pytest.raises(ValueError):
        Topology.from_json({"generation": 0, "tp_base": 2, "units": {}})


def test_topology_is_frozen_and_copies_its_units():
    units = {"heads": 8}
    topo = make_topology(2, 2, units)
    units["heads"] = 1
    assert topo.units == {"heads": 8}
    with pytest.raises(AttributeError):
        topo.generation = 3  # type: ignore[misc]


def test_topology_rejects_inconsistent_ranks():
    with pytest.raises(ValueError, match="ranks must be exactly"):
        Topology(0, 2, {"heads": 4}, (Replica(0, (0, 1), (0, 2)),))
    with pytest.raises(ValueError, match="out of range"):
        Topology(0, 2, {"heads": 4}, (Replica(0, (0, 2), (0, 1)),))


@SLOW
@given(st.integers(1, 6), st.integers(1, 4), st.data())
def test_make_topology_numbers_live_slots_in_replica_slot_order(tp_base, dp, data):
    dead = data.draw(st.sets(st.tuples(st.integers(0, dp - 1), st.integers(0, tp_base - 1))))
    assume(all(sum((r, s) not in dead for s in range(tp_base)) for r in range(dp)))
    topo = make_topology(tp_base, dp, {"heads": tp_base, "vocab": 100}, dead_slots=sorted(dead, reverse=True))
    live = [(r, s) for r in range(dp) for s in range(tp_base) if (r, s) not in dead]
    assert [topo.slot_of(rank) for rank in range(topo.world_size)] == live
    assert [rep.index for rep in topo.replicas] == list(range(dp))
    assert topo.generation == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dead_slots=[(2, 0)]), "replica 2 out of range 0..1"),
        (dict(dead_slots=[(0, 4)]), "slot 4 out of range 0..3"),
        (dict(dead_slots=[(0, -1)]), "slot -1 out of range 0..3"),
        (dict(dead_slots=[(1, s) for s in range(4)]), "replica 1 has no live slot"),
        (dict(dead_slots=[(1, 0), (1, 1)], min_tp=3), "replica 1 starts with 2 live slots, below ntp.min_tp (3)"),
        (dict(units={"heads": 3}), "family 'heads' has 3 units, fewer than the 4 live ranks of replica 0"),
        (dict(min_tp=5), "ntp.min_tp (5) must be <= tp_base (4)"),
        (dict(dead_slots=["1:3"]), "dead slot must be a (replica, slot) pair"),
    ],
)
def test_make_topology_errors(kwargs, message):
    args = dict(tp_base=4, dp=2, units={"heads": 8})
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        make_topology(**args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_make_topology_units_only_need_to_cover_live_width():
    topo = make_topology(4, 2, {"heads": 3}, dead_slots=[(0, 3), (1, 0)])
    assert topo.sync_width == 3 and topo.layout("heads", 1) == [[0], [1], [2]]


def test_parse_dead_slots():
    assert parse_dead_slots(["1:3", "0:2"]) == [(1, 3), (0, 2)]
    assert parse_dead_slots([" 1 : 3 "]) == [(1, 3)]
    assert parse_dead_slots("1:3,0:2") == [(1, 3), (0, 2)]
    assert parse_dead_slots([(1, 3), [0, 2]]) == [(1, 3), (0, 2)]
    assert parse_dead_slots([]) == [] and parse_dead_slots(None) == []
    for bad in (["1-3"], ["1:3:4"], [63], ["a:b"], ["-1:3"], [(1, 2, 3)], [(True, 1)], ["１:3"]):
        with pytest.raises(ValueError) as err:
            parse_dead_slots(bad)
        assert str(err.value).startswith("ntp.dead_slots: expected 'replica:slot' like '1:3', got ")


# ---------------------------------------------------------------------------------------------------------------
# next_topology


@SLOW
@given(topologies(), st.integers(1, 4), st.data())
def test_next_topology_drop_replica(topo, min_tp, data):
    dead = dead_ranks_of(data.draw, topo)
    survivors = {rep.index: [s for s, r in zip(rep.slots, rep.ranks) if r not in dead] for rep in topo.replicas}
    kept = {i: slots for i, slots in survivors.items() if len(slots) >= min_tp}
    if not kept:
        with pytest.raises(TopologyError):
            next_topology(topo, dead, min_tp=min_tp)
        return
    new = next_topology(topo, dead, min_tp=min_tp)
    # Deterministic, and independent of the order the dead ranks were reported in.
    assert new == next_topology(topo, list(reversed(dead)), min_tp=min_tp)
    assert new.generation == topo.generation + 1
    assert new.tp_base == topo.tp_base and new.units == topo.units
    assert {rep.index: list(rep.slots) for rep in new.replicas} == kept
    live = [(i, s) for i in sorted(kept) for s in kept[i]]
    assert [new.slot_of(rank) for rank in range(new.world_size)] == live
    assert new.sync_width == min(len(s) for s in kept.values())
    for rep in new.replicas:
        for family in new.units:
            assert new.layout(family, rep.index) == replica_layout(new.units[family], rep.width, new.sync_width)


@SLOW
@given(topologies(), st.integers(1, 4), st.data())
def test_next_topology_fail_policy(topo, min_tp, data):
    dead = dead_ranks_of(data.draw, topo)
    short = [rep.index for rep in topo.replicas if sum(r not in dead for r in rep.ranks) < min_tp]
    if short:
        with pytest.raises(TopologyError) as err:
            next_topology(topo, dead, min_tp=min_tp, policy="fail")
        assert f"replica {short[0]} fell below ntp.min_tp ({min_tp})" in str(err.value)
    else:
        assert next_topology(topo, dead, min_tp=min_tp, policy="fail") == next_topology(topo, dead, min_tp=min_tp)


def test_next_topology_examples_and_errors():
    topo = make_topology(4, 3, {"heads": 8, "ffn": 32})
    new = next_topology(topo, [4, 5, 6, 7])  # replica 1 lost every slot
    assert [rep.index for rep in new.replicas] == [0, 2] and new.replicas[1].ranks == (4, 5, 6, 7)
    dropped = next_topology(topo, [1, 2], min_tp=3)
    assert [rep.index for rep in dropped.replicas] == [1, 2] and dropped.sync_width == 4
    with pytest.raises(TopologyError, match="no replica survives"):
        next_topology(topo, range(12))
    with pytest.raises(TopologyError, match="no replica survives"):
        next_topology(topo, [0, 4, 8], min_tp=4)
    with pytest.raises(ValueError, match="rank 12 is not live"):
        next_topology(topo, [12])
    with pytest.raises(ValueError, match="policy must be one of"):
        next_topology(topo, [1], policy="restart")  # type: ignore[arg-type]
    assert next_topology(topo, []).replicas == topo.replicas


# ---------------------------------------------------------------------------------------------------------------
# transition_plan


def check_plan(old: Topology, new: Topology, dead: list[int]) -> list[Move] | None:
    """Apply the plan to the survivors' old holdings and check it against the definitions; return it (None
    when some unit has no surviving holder, after checking that the plan refuses)."""
    alive_old = {(rep.index, s): r for rep in old.replicas for s, r in zip(rep.slots, rep.ranks) if r not in dead}
    survivor = {key: rank for key, rank in alive_old.items() if new.rank_of(*key) is not None}
    lost_units = {
        f: set(range(n)) - {u for rank in survivor.values() for u in old.units_of(rank, f)}
        for f, n in new.units.items()
    }
    if any(lost_units.values()):
        with pytest.raises(TopologyError, match="no surviving holder"):
            transition_plan(old, new, dead)
        return None
    plan = transition_plan(old, new, dead)
    assert plan == sorted(plan, key=lambda mv: (mv.family, mv.replica, mv.unit))
    assert plan == transition_plan(old, new, list(reversed(dead)))  # deterministic
    expected_moves = 0
    for family, num_units in new.units.items():
        for rep in new.replicas:
            received: dict[int, set[int]] = {r: set() for r in rep.ranks}
            for mv in (mv for mv in plan if mv.family == family and mv.replica == rep.index):
                assert mv.dst in received and mv.unit not in received[mv.dst]
                received[mv.dst].add(mv.unit)
                if mv.src is not None:
                    assert mv.peer is None
                    assert old.replica_of(mv.src).index == rep.index
                    assert mv.src in survivor.values() and mv.unit in old.units_of(mv.src, family)
                else:
                    # src None only when no survivor of this replica held the unit.
                    assert not any(mv.unit in old.units_of(r, family) for (i, _), r in survivor.items()
                                   if i == rep.index)
                    assert old.replica_of(mv.peer).index != rep.index
                    assert mv.peer in survivor.values() and mv.unit in old.units_of(mv.peer, family)
                    holders = [i for (i, _), r in survivor.items() if mv.unit in old.units_of(r, family)]
                    assert old.replica_of(mv.peer).index == min(holders)  # lowest replica index first
            for rank, slot in zip(rep.ranks, rep.slots):
                needed = set(new.units_of(rank, family))
                key = (rep.index, slot)
                kept = set(old.units_of(survivor[key], family)) if key in survivor else set()
                assert not received[rank] & kept  # never moves a unit that stays put
                assert (kept & needed) | received[rank] == needed  # new layout fully covered
                expected_moves += len(needed - kept)
    assert len(plan) == expected_moves  # minimal
    return plan


@SLOW
@given(topologies(), st.data())
def test_transition_plan_after_failure(old, data):
    dead = dead_ranks_of(data.draw, old)
    min_tp = data.draw(st.integers(1, 3))
    try:
        new = next_topology(old, dead, min_tp=min_tp)
    except TopologyError:
        return
    plan = check_plan(old, new, dead)
    # The dead slots are out of `new` anyway, so the plan must not depend on being told about them.
    if plan is not None:
        assert transition_plan(old, new) == plan


@SLOW
@given(topologies(), st.data())
def test_transition_plan_when_slots_rejoin(old, data):
    free = [(rep.index, s) for rep in old.replicas for s in range(old.tp_base) if s not in rep.slots]
    joined = data.draw(st.lists(st.sampled_from(free), unique=True)) if free else []
    new = join_topology(old, joined)
    assert new.generation == old.generation + 1
    assert all(mv.src is not None for mv in check_plan(old, new, []))  # widening never needs a peer


@SLOW
@given(topologies(), st.data())
def test_transition_plan_when_dead_slots_are_refilled_at_once(old, data):
    """A slot that died and was refilled in the same re-formation is a new, empty process."""
    dead = dead_ranks_of(data.draw, old)
    new = next_topology(old, [])
    plan = check_plan(old, new, dead)
    if plan is not None:
        assert all(mv.src not in dead and mv.peer not in dead for mv in plan)
        # A refilled process holds nothing, and every rank needs at least one unit of each family.
        assert {new.rank_of(*old.slot_of(r)) for r in dead} <= {mv.dst for mv in plan}


def test_transition_plan_nothing_changes():
    topo = make_topology(4, 2, {"heads": 8, "ffn": 40, "vocab": 64}, dead_slots=[(0, 1)])
    assert transition_plan(topo, next_topology(topo, [])) == []


def test_transition_plan_lost_unit_and_model_mismatch():
    topo = make_topology(2, 1, {"heads": 4})
    with pytest.raises(TopologyError, match="no surviving holder"):
        transition_plan(topo, next_topology(topo, [1]), [1])
    with pytest.raises(ValueError, match="different models"):
        transition_plan(topo, make_topology(2, 1, {"heads": 6}))


def test_lookup_errors_name_what_is_live():
    topo = make_topology(2, 3, {"heads": 4, "vocab": 10})
    dropped = next_topology(topo, [2, 3])
    assert dropped.replica(2).ranks == (2, 3) and {topo, dropped, Topology.from_json(topo.to_json())} == {topo, dropped}
    with pytest.raises(ValueError, match=r"no replica with index 1; live replicas: \[0, 2\]"):
        dropped.layout("heads", 1)
    with pytest.raises(ValueError, match="unknown unit family 'ffn'"):
        topo.units_of(0, "ffn")
    with pytest.raises(ValueError, match=r"partition 2 out of range 0..1"):
        topo.partition_holders("heads", 0, 2)
    assert topo.rank_of(1, 5) is None and dropped.rank_of(1, 0) is None
