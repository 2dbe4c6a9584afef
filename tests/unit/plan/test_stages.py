"""Job topologies with pipeline stages (ntp_megatron.plan.stages): one NTP layout per stage, ranks stage by stage, and the pairing at
stage boundaries of different TP degrees."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from ntp_megatron.plan.layout import Topology, make_topology
from ntp_megatron.plan.stages import JobTopology, make_pipeline_topology

pytestmark = pytest.mark.unit

UNITS = {"heads": 8, "ffn": 24, "vocab": 29}


@st.composite
def pipelines(draw):
    tp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 3))
    pp = draw(st.integers(2, 4))
    slots = [(r, s, p) for r in range(dp) for s in range(tp) for p in range(pp)]
    dead = draw(st.lists(st.sampled_from(slots), unique=True, max_size=len(slots)))
    # every stage of every replica keeps a live slot
    dead = [d for d in dead if sum(1 for x in dead if x[0] == d[0] and x[2] == d[2]) < tp]
    return tp, dp, pp, dead


@settings(max_examples=150, deadline=None)
@given(pipelines())
def test_stages_are_numbered_in_megatrons_order_and_round_trip(case):
    tp, dp, pp, dead = case
    topo = make_pipeline_topology(tp, dp, pp, UNITS, dead_slots=dead)
    assert topo.world_size == tp * dp * pp - len(dead)
    ranks = []
    for p, stage in enumerate(topo.stages):
        alone = make_topology(tp, dp, UNITS, [(r, s) for r, s, q in dead if q == p])
        assert stage.layout("ffn", 0) == alone.layout("ffn", 0) and stage.world_size == alone.world_size
        assert list(stage.ranks) == [r + stage.rank_base for r in alone.ranks]
        ranks += list(stage.ranks)
    assert ranks == list(range(topo.world_size))  # stage by stage, no gap
    for rank in range(topo.world_size):
        replica, slot, stage = topo.slot_of(rank)
        assert (replica, slot, stage) not in dead and topo.rank_of(replica, slot, stage) == rank
        assert topo.stage_of(rank).stage == stage
    assert all(topo.rank_of(*d) is None for d in dead)
    again = JobTopology.from_json(topo.to_json())
    assert again == topo and isinstance(again, JobTopology) and again.num_stages == pp
    alone = JobTopology.from_json(topo.stages[0].to_json())  # a plain layout's JSON: a job of one stage
    assert isinstance(alone, JobTopology) and alone.stages == (topo.stages[0],) and isinstance(alone.stages[0], Topology)
    assert alone.to_json() == topo.stages[0].to_json()


@settings(max_examples=150, deadline=None)
@given(pipelines())
def test_every_rank_gets_each_boundary_tensor_once_from_its_own_replica(case):
    tp, dp, pp, dead = case
    topo = make_pipeline_topology(tp, dp, pp, UNITS, dead_slots=dead)
    for direction, first in (("forward", 0), ("backward", pp - 1)):
        received: dict[int, list[int]] = {r: [] for r in range(topo.world_size)}
        for sender in range(topo.world_size):
            for target in topo.sends_to(sender, direction):
                received[target].append(sender)
        for rank, senders in received.items():
            replica, _, stage = topo.slot_of(rank)
            source = topo.receives_from(rank, direction)
            if stage == first:
                assert senders == [] and source is None
                continue
            assert senders == [source], (direction, rank, senders, source)
            s_replica, _, s_stage = topo.slot_of(source)
            assert s_replica == replica and s_stage == stage + (-1 if direction == "forward" else 1)
            mine, theirs = topo.stage_of(rank), topo.stage_of(source)
            # TP rank i of the receiver takes from TP rank i mod (the sender's width): at equal widths, i from i
            width = theirs.replica(replica).width
            assert theirs.local_rank(source) == mine.local_rank(rank) % width


def test_a_tp2_stage_next_to_a_tp1_stage():
    """The prototype's case: stage 0 at TP2 (ranks 0, 1), stage 1 at TP1 (rank 2, slot 0 of stage 1 dead)."""
    topo = make_pipeline_topology(2, 1, 2, UNITS, dead_slots=[(0, 1, 1)])
    assert [topo.slot_of(r) for r in range(3)] == [(0, 0, 0), (0, 1, 0), (0, 0, 1)]
    assert topo.sends_to(0, "forward") == [2] and topo.sends_to(1, "forward") == []  # rank 1's copy unused
    assert topo.receives_from(2, "forward") == 0
    assert topo.sends_to(2, "backward") == [0, 1]  # the narrow stage sends its gradient twice
    assert topo.receives_from(0, "backward") == topo.receives_from(1, "backward") == 2
    assert topo.widths(0) == [2, 1] and topo.replica_ranks(0) == [0, 1, 2]


def test_bad_pipelines_are_refused():
    with pytest.raises(ValueError, match="stage 2 out of range 0..1"):
        make_pipeline_topology(2, 1, 2, UNITS, dead_slots=[(0, 1, 2)])
    with pytest.raises(ValueError, match="stage 1: replica 0 has no live slot"):
        make_pipeline_topology(2, 1, 2, UNITS, dead_slots=[(0, 0, 1), (0, 1, 1)])
    with pytest.raises(ValueError, match="stage 1: replica 0 starts with 1 live slots, below ntp.min_tp"):
        make_pipeline_topology(2, 1, 2, UNITS, dead_slots=[(0, 0, 1)], min_tp=2)
    one = make_topology(2, 1, UNITS)
    with pytest.raises(ValueError, match="expected stage 1 with ranks from 2"):
        JobTopology((one, one))
    with pytest.raises(ValueError, match="at least one stage"):
        JobTopology(())
    assert JobTopology((one,)) == JobTopology.one_stage(one) and JobTopology((one,)).num_stages == 1
