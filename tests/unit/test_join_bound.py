"""The lower bound of the bytes an admission moves (``reformed`` events' ``lower_bound_bytes``): every unit the new
processes must hold, since they start with none. Checked against the units the transition plan delivers to them,
counted from the two topologies alone."""

from __future__ import annotations

import pytest

from ntp_megatron.layout import join_topology, make_topology, next_topology, transition_plan
from ntp_megatron.reshard import join_lower_bound_bytes, plan_transfers

UNITS = {"heads": 8, "ffn": 24, "vocab": 16}
PER_UNIT = {"heads": 3, "ffn": 5, "vocab": 7}  # elements per unit of each family (any positive numbers)


def delivered_bytes(old, new, joined) -> int:
    """Bytes the plan sends to the processes of ``joined`` slots (4-byte elements)."""
    joiners = {new.rank_of(replica, slot) for replica, slot in joined}
    return sum(PER_UNIT[m.family] * 4 for m in transition_plan(old, new) if m.dst in joiners)


def test_a_joiner_alone_rebuilding_a_dropped_replica_is_bounded_by_all_its_units():
    """TP2 x 2; replica 1 loses both slots and is dropped; one replacement brings it back alone at TP1, holding
    every unit of every family."""
    start = make_topology(2, 2, UNITS)
    dropped = next_topology(start, [start.rank_of(1, 0), start.rank_of(1, 1)], min_tp=1)
    assert [rep.index for rep in dropped.replicas] == [0]
    back = join_topology(dropped, [(1, 1)], min_tp=1)
    assert [rep.width for rep in back.replicas] == [2, 1]
    everything = sum(UNITS[f] * PER_UNIT[f] * 4 for f in UNITS)
    assert delivered_bytes(dropped, back, [(1, 1)]) == everything
    assert join_lower_bound_bytes(back, [(1, 1)], PER_UNIT) == everything


@pytest.mark.parametrize("tp, dead, joined", [
    (2, [(1, 1)], [(1, 1)]),                    # the slot's block back
    (4, [(1, 2), (1, 3)], [(1, 3)]),            # one of two dead slots back: its block, and a share of the other
    (4, [(0, 0), (1, 1)], [(0, 0), (1, 1)]),    # two replicas at once
])
def test_joiners_into_a_live_replica(tp, dead, joined):
    start = make_topology(tp, 2, UNITS)
    degraded = next_topology(start, [start.rank_of(*slot) for slot in dead])
    new = join_topology(degraded, joined)
    bound = join_lower_bound_bytes(new, joined, PER_UNIT)
    assert bound == delivered_bytes(degraded, new, joined)
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
    transfers = plan_transfers(degraded, new, [])
    for slot in joined:
        rank = new.rank_of(*slot)
        to_joiner = [t for t in transfers if t.dst == rank]
        assert sum(t.replicated for t in to_joiner) == 1, to_joiner
    assert not any(t.replicated for t in transfers if t.dst not in {new.rank_of(*s) for s in joined})
