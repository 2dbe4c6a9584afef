"""Distributed-optimizer instances in the groups, counted and checked without processes (the fake
torch.distributed of tests/unit/test_group_scaling.py): NTP off, the dense grid's partial groups are Megatron's
(intra-instance part of the data-parallel group, twins across instances, the instance as grad-norm group), made
by their members alone, so a rank makes three calls more whatever the world."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ntp_megatron.config import load_job_config
from ntp_megatron.shard_layout import instance_of, instances
from ntp_megatron.training.parallel import uniform_parallel
from tests.unit.test_group_scaling import FakeWorld


@pytest.fixture
def fake_world(monkeypatch):
    def install(size: int, rank: int) -> FakeWorld:
        world = FakeWorld(size, rank)
        for name in ("new_group", "get_rank", "get_world_size"):
            monkeypatch.setattr(dist, name, getattr(world, name))
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        return world

    yield install
    ps.destroy_model_parallel()


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
        local = [call for call in world.calls if call["local"]]
        assert len(world.calls) == tp + 2 + (3 if k > 1 else 0) and len(local) == 2 + (3 if k > 1 else 0)
        assert all(rank in call["ranks"] for call in local) and all(c["timeout"] for c in world.calls)
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
