"""The lower bound of the bytes a re-formation moves (``reformed`` events' ``lower_bound_bytes``): the sum over the
new generation's ranks of what each lacks (``own_lower_bound_bytes``): every unit a new process must hold, since it
starts with none, and every unit a survivor gains. Checked against the units the transition plan delivers, counted
from the two topologies alone, also per pipeline stage."""

from __future__ import annotations

import pytest

from ntp_megatron.plan.layout import join_topology, make_topology, next_topology
from ntp_megatron.core.unit_moves import own_lower_bound_bytes, plan_transfers
from ntp_megatron.plan import stages
from ntp_megatron.plan.stages import JobTopology

UNITS = {"heads": 8, "ffn": 24, "vocab": 16}
PER_UNIT = {"heads": 3, "ffn": 5, "vocab": 7}  # elements per unit of each family (any positive numbers)


def delivered_bytes(old, new, joined) -> int:
    """Bytes the plan sends to the processes of ``joined`` slots (4-byte elements)."""
    joiners = {new.rank_of(*slot) for slot in joined}
    return sum(PER_UNIT[m.family] * 4 for m in stages.transition_plan(old, new) if m.dst in joiners)


def join_lower_bound_bytes(old, new, joined) -> int:
    """What the joiners lack (no replicated parameters counted here)."""
    return sum(own_lower_bound_bytes(old, new, None, new.rank_of(*slot), PER_UNIT, 0) for slot in joined)


def total_lower_bound_bytes(old, new, dead=()) -> int:
    """What every rank of ``new`` lacks (no replicated parameters counted here)."""
    total = 0
    for rank in range(new.world_size):
        old_rank = old.rank_of(*new.slot_of(rank))
        total += own_lower_bound_bytes(old, new, old_rank if old_rank not in dead else None, rank, PER_UNIT, 0)
    return total


def one(topology) -> JobTopology:
    """A job without pipeline stages."""
    return JobTopology.one_stage(topology)


def test_a_joiner_alone_rebuilding_a_dropped_replica_is_bounded_by_all_its_units():
    """TP2 x 2; replica 1 loses both slots and is dropped; one replacement brings it back alone at TP1, holding
    every unit of every family."""
    start = make_topology(2, 2, UNITS)
    dropped = next_topology(start, [start.rank_of(1, 0), start.rank_of(1, 1)], min_tp=1)
    assert [rep.index for rep in dropped.replicas] == [0]
    back = join_topology(dropped, [(1, 1)], min_tp=1)
    assert [rep.width for rep in back.replicas] == [2, 1]
    everything = sum(UNITS[f] * PER_UNIT[f] * 4 for f in UNITS)
    assert delivered_bytes(one(dropped), one(back), [(1, 1)]) == everything
    assert join_lower_bound_bytes(one(dropped), one(back), [(1, 1)]) == everything


@pytest.mark.parametrize("tp, dead, joined", [
    (2, [(1, 1)], [(1, 1)]),                    # the slot's block back
    (4, [(1, 2), (1, 3)], [(1, 3)]),            # one of two dead slots back: its block, and a share of the other
    (4, [(0, 0), (1, 1)], [(0, 0), (1, 1)]),    # two replicas at once
])
def test_joiners_into_a_live_replica(tp, dead, joined):
    start = make_topology(tp, 2, UNITS)
    degraded = next_topology(start, [start.rank_of(*slot) for slot in dead])
    new = join_topology(degraded, joined)
    bound = join_lower_bound_bytes(one(degraded), one(new), joined)
    assert bound == delivered_bytes(one(degraded), one(new), joined) == \
        total_lower_bound_bytes(one(degraded), one(new))
    blocks = sum(len(new.block(f, slot)) * PER_UNIT[f] * 4 for _, slot in joined for f in UNITS)
    assert bound >= blocks


@pytest.mark.parametrize("tp, dead, joined", [
    (2, [(1, 0), (1, 1)], [(1, 1)]),            # a dropped replica rebuilt alone: units from both of replica 0's ranks
    (4, [(1, 2), (1, 3)], [(1, 2), (1, 3)]),    # two joiners at once
    (2, [(1, 1)], [(1, 1)]),
])
def test_a_joiner_gets_the_replicated_parameters_once(tp, dead, joined):
    """A process new to the job holds no replicated parameter (norms, biases, position embeddings): exactly one of
    the messages it receives carries them, whichever number of ranks send it units."""
    start = make_topology(tp, 2, UNITS)
    degraded = next_topology(start, [start.rank_of(*slot) for slot in dead], min_tp=1)
    new = join_topology(degraded, joined, min_tp=1)
    transfers = plan_transfers(one(degraded), one(new), [])
    for slot in joined:
        rank = new.rank_of(*slot)
        to_joiner = [t for t in transfers if t.dst == rank]
        assert sum(t.replicated for t in to_joiner) == 1, to_joiner
    assert not any(t.replicated for t in transfers if t.dst not in {new.rank_of(*s) for s in joined})


@pytest.mark.parametrize("dead", [[(1, 0, 1)], [(0, 1, 0), (1, 0, 1)], [(1, 0, 0), (1, 1, 1)], [(0, 0, 0), (0, 1, 0)]])
def test_a_failure_with_stages_moves_what_the_survivors_of_the_stage_lack(dead):
    """PP2 × TP2 × 2: the dead ranks' units, and nothing else, go to ranks of their own stage that lack them; the
    bound counts exactly the plan's deliveries (a replica that loses a whole stage leaves every stage)."""
    start = stages.make_pipeline_topology(2, 2, 2, UNITS)
    dead_ranks = [start.rank_of(*slot) for slot in dead]
    new = stages.next_topology(start, dead_ranks)
    plan = stages.transition_plan(start, new, dead_ranks)
    assert all(new.stage_of(m.dst).stage == start.stage_of(m.peer if m.src is None else m.src).stage for m in plan)
    assert total_lower_bound_bytes(start, new, dead_ranks) == sum(PER_UNIT[m.family] * 4 for m in plan)
    lost = sum(len(start.units_of(r, f)) * PER_UNIT[f] * 4 for r in dead_ranks for f in UNITS
               if start.replica_of(r).index in new.replica_indices)
    assert total_lower_bound_bytes(start, new, dead_ranks) == lost


def test_a_rejoin_into_a_stage():
    start = stages.make_pipeline_topology(2, 2, 2, UNITS)
    degraded = stages.next_topology(start, [start.rank_of(1, 0, 1)])
    back = stages.join_topology(degraded, [(1, 0, 1)])
    assert back.widths(1) == [2, 2] and back.stages[1].layout("ffn", 1) == start.stages[1].layout("ffn", 1)
    assert join_lower_bound_bytes(degraded, back, [(1, 0, 1)]) == delivered_bytes(degraded, back, [(1, 0, 1)]) > 0
