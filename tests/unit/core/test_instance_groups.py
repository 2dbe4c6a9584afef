"""Distributed-optimizer instances in the groups, counted and checked without processes (the fake
torch.distributed of tests/unit/core/test_group_scaling.py). NTP off: the dense grid's partial groups are Megatron's
(intra-instance part of the data-parallel group, twins across instances, the instance as grad-norm group), made
by their members alone, so a rank makes three calls more whatever the world. NTP (groups.build_groups): for
every block a rank serves, the intra-instance part of its sync group and its twins' group, by the same rule over
the launch replica indices."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megatron.core import parallel_state as ps

from ntp_megatron.config.schema import load_job_config
from ntp_megatron.core.groups import build_groups, group_mapping
from ntp_megatron.plan.group_plan import intra_group_ranks, sync_group_ranks
from ntp_megatron.plan.layout import make_topology, next_topology
from ntp_megatron.plan.optimizer_shards import instance_of, instances, shard_holders
from ntp_megatron.plan.stages import JobTopology
from ntp_megatron.training.parallel import uniform_parallel
from tests.unit.core.test_group_scaling import fake_world  # noqa: F401 - the fixture


@pytest.mark.parametrize("tp, dp, k", [(1, 4, 2), (2, 2, 2), (8, 1280, 4), (4, 6, 3), (2, 4, 1)])
def test_dense_partial_groups_follow_megatrons_rule_at_constant_cost(fake_world, tp, dp, k):
    cfg = load_job_config(None, ["ntp.enabled=false", f"parallel.tensor_model_parallel_size={tp}",
                                 f"parallel.data_parallel_size={dp}", "parallel.use_distributed_optimizer=true",
                                 f"parallel.num_distributed_optimizer_instances={k}", "training.micro_batch_size=1",
                                 f"training.global_batch_size={dp}", "model.num_attention_heads=16",
                                 "model.hidden_size=128"])
    world_size = tp * dp
    for rank in sorted({0, 1 % world_size, world_size // 2 + 1, world_size - 1}):
        world = fake_world(world_size, rank)
        pg = uniform_parallel(cfg).pg
        replica, slot = divmod(rank, tp)
        instance, position = instance_of(replica, dp, k)
        assert len(world.calls) == 3 + (3 if k > 1 else 0)  # TP, alone, DP (+ intra, inter, instance)
        assert all(c["local"] and rank in c["ranks"] and c["timeout"] for c in world.calls)
        if k == 1:
            assert pg.intra_dp_cp is pg.dp and pg.inter_dist_opt is None and pg.intra_dist_opt is dist.group.WORLD
            continue
        members = instances(dp, k)
        assert pg.intra_dp_cp.ranks == [r * tp + slot for r in members[instance]] == pg.intra_expt_dp.ranks
        assert pg.inter_dist_opt.ranks == [inst[position] * tp + slot for inst in members]
        assert pg.intra_dist_opt.ranks == [r * tp + s for r in members[instance] for s in range(tp)]
        # What Megatron reads: its instance id is this rank's place among its twins; its shard position the
        # place in the intra group; the grad norm is reduced over the instance, never the world.
        assert (pg.inter_dist_opt.rank(), pg.intra_dp_cp.rank()) == (instance, position)
        assert ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True) is pg.intra_dp_cp
        assert ps.get_inter_distributed_optimizer_instance_group() is pg.inter_dist_opt
        assert ps.get_intra_distributed_optimizer_instance_group() is pg.intra_dist_opt
        assert ps.get_data_parallel_group() is pg.dp and pg.dp.ranks == list(range(slot, world_size, tp))


UNITS = {"heads": 8, "ffn": 24, "vocab": 29}


@st.composite
def ntp_cases(draw):
    k = draw(st.sampled_from([1, 2, 3]))
    tp_base, dp = draw(st.integers(1, 4)), k * draw(st.integers(1, 3))
    slots = [(r, s) for r in range(dp) for s in range(1, tp_base)]  # slot 0 stays: every replica keeps a rank
    dead = draw(st.lists(st.sampled_from(slots), unique=True, max_size=3)) if slots else []
    topology = make_topology(tp_base, dp, UNITS, dead_slots=dead)
    ranks = draw(st.lists(st.integers(0, topology.world_size - 1), min_size=1, max_size=3, unique=True))
    return tp_base, dp, k, topology, ranks


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ntp_cases())
def test_ntp_groups_with_instances_split_each_sync_group_by_megatrons_rule(fake_world, case):
    tp_base, dp, k, topology, ranks = case
    for rank in ranks:
        world = fake_world(topology.world_size, rank)
        groups = build_groups(JobTopology.one_stage(topology), rank, 60.0, dp=dp, instances=k)
        replica = topology.replica_of(rank).index
        instance, position = instance_of(replica, dp, k)
        assert (groups.instances, groups.instance, groups.position) == (k, instance, position)
        assert len(world.calls) == tp_base + 2 + (tp_base * (k + dp // k) if k > 1 else 0)
        assert sorted(groups.intra) == sorted(groups.sync) == topology.member_blocks(rank)
        for block, sync in groups.sync.items():
            intra = groups.intra[block]
            assert intra.ranks == list(intra_group_ranks(topology, block, dp, k, instance))
            assert sorted(r for i in range(k) for r in intra_group_ranks(topology, block, dp, k, i)) == \
                list(sync_group_ranks(topology, block)) == sync.ranks, "the instances split the sync group"
            assert intra.rank() == position, "Megatron's shard position is the rank in the intra group"
            pg = groups.with_sync_groups(block)
            assert (pg.dp, pg.dp_cp, pg.intra_dp_cp) == (sync, sync, intra)
            if k == 1:
                assert intra is sync and not groups.inter and pg.inter_dist_opt is None
                continue
            inter = groups.inter[block]
            assert inter.ranks == sorted(shard_holders(topology, dp, k, (block, position)))
            assert inter.rank() == instance, "Megatron's instance id is the rank in the inter group"
            assert pg.inter_dist_opt is inter
        # not installed: Megatron's globals keep one instance until the distributed optimizer is wired in
        assert groups.pg_collection.inter_dist_opt is None


def test_a_reformation_maps_the_intra_and_inter_groups_of_blocks_served_in_both(fake_world):
    old_topology = make_topology(2, 4, UNITS)
    new_topology = next_topology(old_topology, [old_topology.rank_of(1, 1)])
    rank_old, rank_new = old_topology.rank_of(0, 1), new_topology.rank_of(0, 1)
    fake_world(old_topology.world_size, rank_old)
    old = build_groups(JobTopology.one_stage(old_topology), rank_old, 60.0, dp=4, instances=2)
    fake_world(new_topology.world_size, rank_new)
    new = build_groups(JobTopology.one_stage(new_topology), rank_new, 60.0, dp=4, instances=2)
    mapping = group_mapping(old, new)
    assert mapping[id(old.intra[1])] is new.intra[1] and mapping[id(old.inter[1])] is new.inter[1]
    assert new.intra[1].ranks == [rank_new, new_topology.sync_member(1, 1)]
    assert new.inter[1].ranks == [rank_new, new_topology.sync_member(2, 1)]  # the twin: replica 2
