"""One topology type (ntp_megatron.plan.stages.JobTopology): a job without pipeline stages is a job of one stage, and
every job-level function on it agrees with its stage's layout function (ntp_megatron.plan.layout), identities and
JSON included."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from ntp_megatron.plan import layout, stages
from ntp_megatron.plan.layout import TopologyError, make_topology
from ntp_megatron.plan.stages import JobTopology

pytestmark = pytest.mark.unit

UNITS = {"heads": 8, "ffn": 24, "vocab": 29}


@st.composite
def layouts(draw):
    """A starting layout of one stage, possibly degraded, and a random set of its ranks."""
    tp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 3))
    slots = [(r, s) for r in range(dp) for s in range(tp)]
    dead = draw(st.lists(st.sampled_from(slots), unique=True, max_size=len(slots)))
    dead = [d for d in dead if sum(1 for x in dead if x[0] == d[0]) < tp]  # every replica keeps a live slot
    topo = make_topology(tp, dp, UNITS, dead_slots=dead)
    ranks = draw(st.lists(st.sampled_from(list(topo.ranks)), unique=True, max_size=topo.world_size))
    min_tp = draw(st.integers(1, 2))
    return topo, ranks, min_tp


def outcome(fn):
    """What ``fn()`` gives, or its error's type and message."""
    try:
        return fn()
    except ValueError as exc:  # TopologyError included
        return type(exc), str(exc)


def as_job(value):
    return JobTopology.one_stage(value) if isinstance(value, layout.Topology) else value


@settings(max_examples=200, deadline=None)
@given(layouts(), st.sampled_from(["drop_replica", "stop"]))
def test_next_and_transition_of_a_one_stage_job_are_its_layouts(case, policy):
    topo, dead, min_tp = case
    job = JobTopology.one_stage(topo)
    want = outcome(lambda: layout.next_topology(topo, dead, min_tp=min_tp, policy=policy))
    got = outcome(lambda: stages.next_topology(job, dead, min_tp=min_tp, policy=policy))
    assert got == as_job(want)
    if isinstance(got, JobTopology):
        assert got.to_json() == want.to_json()
        assert outcome(lambda: stages.transition_plan(job, got, dead)) == \
            outcome(lambda: layout.transition_plan(topo, want, dead))
        info = {"base": topo.generation, "dead": [topo.slot_of(r) for r in dead]}
        assert stages.published_topology(job, info, 7, min_tp, policy) == stages.with_generation(got, 7)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_join_and_rebalance_of_a_one_stage_job_are_its_layouts(case):
    topo, dead, min_tp = case
    try:
        shrunk = layout.next_topology(topo, dead, min_tp=1)
    except TopologyError:
        return
    job = JobTopology.one_stage(shrunk)
    missing = [(r, s) for r in range(len(topo.replicas) + 1) for s in range(topo.tp_base)
               if shrunk.rank_of(r, s) is None][:3]
    want = outcome(lambda: layout.join_topology(shrunk, missing, min_tp=min_tp))
    assert outcome(lambda: stages.join_topology(job, missing, min_tp=min_tp)) == as_job(want)
    info = {"base": shrunk.generation, "dead": [], "joined": [list(s) for s in missing]}
    if missing and not isinstance(want, tuple):
        assert stages.published_topology(job, info, 9, min_tp) == stages.with_generation(as_job(want), 9)
        assert stages.transition_plan(job, as_job(want)) == layout.transition_plan(shrunk, want)
    rep = shrunk.replicas[0]
    weights = {slot: 100 - 30 * (i % 2) for i, slot in enumerate(rep.slots)}
    assert stages.rebalanced_topology(job, {(rep.index, 0): weights}) == \
        as_job(layout.rebalanced_topology(shrunk, {rep.index: weights}))
    assert stages.rebalanced_topology(job, {}) == as_job(layout.rebalanced_topology(shrunk, {}))


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_a_one_stage_job_keeps_its_layouts_identities_widths_and_json(case):
    topo, _, _ = case
    job = JobTopology.one_stage(topo)
    assert job.num_stages == 1 and job.only_stage is topo and job.world_size == topo.world_size
    for rank in topo.ranks:
        assert job.slot_of(rank) == topo.slot_of(rank) and len(job.slot_of(rank)) == 2  # (replica, slot)
        assert job.rank_of(*topo.slot_of(rank)) == rank == job.rank_of(*topo.slot_of(rank), 0)
        assert job.units_of(rank, "heads") == topo.units_of(rank, "heads")
        assert stages.named_stage(job.slot_of(rank)) is None and stages.identity_stage(job.slot_of(rank)) == 0
    assert job.to_json() == topo.to_json()  # published as the plain layout
    assert stages.JobTopology.from_json(json.loads(json.dumps(topo.to_json()))) == job
    dp = len(topo.replicas) + 1
    assert stages.tp_per_replica(job, dp) == [rep.width for rep in topo.replicas] + [0]
    assert stages.live_widths(job) == [rep.width for rep in topo.replicas]
    assert stages.replica_widths(job, topo.replicas[0].index) == [topo.replicas[0].width]
    assert stages.replica_widths(job, dp) is None


def test_only_stage_is_refused_with_stages():
    job = stages.make_pipeline_topology(2, 1, 2, UNITS)
    with pytest.raises(ValueError, match="without pipeline stages; the job has 2"):
        job.only_stage
    assert stages.named_stage(job.slot_of(job.world_size - 1)) == 1
