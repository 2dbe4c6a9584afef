"""Process groups at cluster scale, counted without processes: a fake torch.distributed for a 10,240- or
102,400-rank world records every ``new_group`` call one rank makes while the real builders run (NTP's
``ntp_parallel`` with dead slots, the plain ``uniform_parallel``). A rank must make TP + 2 calls whatever
the number of replicas, and no world-sized group. Upstream's initializer made 112,646 calls per rank at
10,240 ranks (TP 1) and joined six world-sized groups; the fake gives up after a budget, so the old code
fails fast. Then the same builder in real gloo processes, through a failure and a return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ntp_megatron.config.schema import load_job_config
from ntp_megatron.core.groups import GroupPool, build_groups
from ntp_megatron.plan import stages
from ntp_megatron.plan.group_plan import rank_group_calls, rank_group_keys
from ntp_megatron.plan.layout import make_topology
from ntp_megatron.plan.stages import JobTopology
from ntp_megatron.training.parallel import ntp_parallel, uniform_parallel

TP = 8
BUDGET = 64
"""More ``new_group`` calls than this on one rank: the builder does not scale (it fails the test at once)."""
# dead slots: one replica down to TP 7, one to TP 6 (two blocks dealt), and the last replica down to TP 5
DEAD = [(0, 3), (5, 0), (5, 1), (-1, 7), (-1, 6), (-1, 0)]


class FakeGroup:
    def __init__(self, ranks: list[int], me: int) -> None:
        self.ranks, self.me = ranks, me

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self.ranks.index(self.me)


@dataclass
class FakeWorld:
    """torch.distributed as one rank of a ``size``-rank world sees it."""

    size: int
    rank: int
    calls: list[dict] = field(default_factory=list)

    def new_group(self, ranks=None, timeout=None, use_local_synchronization=False, **_kw):
        members = list(range(self.size)) if ranks is None else sorted(ranks)
        self.calls.append({"ranks": members, "timeout": timeout, "local": use_local_synchronization})
        if len(self.calls) > BUDGET:
            raise AssertionError(f"more than {BUDGET} new_group calls on rank {self.rank} of {self.size}")
        return FakeGroup(members, self.rank) if self.rank in members else dist.GroupMember.NON_GROUP_MEMBER

    def get_rank(self, group=None) -> int:
        return self.rank if group is None else group.rank()

    def get_world_size(self, group=None) -> int:
        return self.size if group is None else group.size()


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


def _cfg(dp: int, ntp: bool):
    return load_job_config(None, [f"ntp.enabled={str(ntp).lower()}", f"parallel.tensor_model_parallel_size={TP}",
                                  f"parallel.data_parallel_size={dp}", "training.micro_batch_size=1",
                                  f"training.global_batch_size={dp}", "model.num_attention_heads=16",
                                  "model.hidden_size=128"])


def _check_calls(world: FakeWorld, largest_allowed: int) -> None:
    """``TP`` groups every rank makes (one per slot or block: the groups across replicas), two made by
    their members alone (this rank's replica and this rank by itself), none world-sized, all with a timeout."""
    local = [call for call in world.calls if call["local"]]
    assert len(local) == 2 and all(world.rank in call["ranks"] for call in local), local
    assert len(world.calls) - len(local) == TP
    assert max(len(call["ranks"]) for call in world.calls) <= largest_allowed < world.size
    assert all(call["timeout"] is not None for call in world.calls), "a group without a timeout"


@pytest.mark.parametrize("replicas", [1280, 12800])
def test_ntp_groups_do_not_grow_with_the_world(fake_world, replicas):
    """TP8 × ``replicas`` with dead slots: a healthy rank, a proxy of dead blocks and a non-proxy rank of a
    degraded replica each make ten ``new_group`` calls, the largest group is a sync group (one rank per
    replica), and Megatron's globals and the collection hold exactly this rank's replica and sync groups."""
    cfg = _cfg(replicas, ntp=True)
    dead = [(r % replicas, s) for r, s in DEAD]
    topology = make_topology(TP, replicas, cfg.unit_counts(), dead_slots=dead)
    assert topology.world_size == TP * replicas - len(dead)
    degraded_ranks = [r for i in (0, 5, replicas - 1) for r in topology.replica(i).ranks]
    proxy = max(degraded_ranks, key=lambda r: len(topology.member_blocks(r)))
    degraded = min(degraded_ranks, key=lambda r: len(topology.member_blocks(r)))
    healthy = topology.rank_of(1, 0)
    sync_groups = topology.sync_groups()
    assert len(topology.member_blocks(proxy)) >= 2 and len(topology.member_blocks(degraded)) == 1
    for rank in (healthy, proxy, degraded):
        world = fake_world(topology.world_size, rank)
        setup = ntp_parallel(cfg, JobTopology.one_stage(topology), rank)
        blocks = topology.member_blocks(rank)
        _check_calls(world, largest_allowed=replicas)
        replica = topology.replica_of(rank)
        assert ps.get_tensor_model_parallel_group().ranks == sorted(replica.ranks) == setup.pg.tp.ranks
        assert ps.get_tensor_model_parallel_world_size() == replica.width
        assert sorted(setup.groups.sync) == blocks
        for block, group in setup.groups.sync.items():
            assert group.ranks == sorted(sync_groups[block])
        dp = ps.get_data_parallel_group()
        assert dp is setup.pg.dp
        assert dp.ranks == (setup.groups.sync[blocks[0]].ranks if setup.groups.healthy else [rank])
        for role in ("pp", "cp", "ep", "embd", "pos_embd"):
            assert getattr(setup.pg, role).ranks == [rank], role


@pytest.mark.parametrize("replicas", [1280, 12800])
def test_plain_groups_do_not_grow_with_the_world(fake_world, replicas):
    """Uniform TP8 × ``replicas``: three calls per rank, each made by the group's members alone (its TP group,
    itself, its DP group as its part of the partition of the world into DP groups), laid out as upstream's grid
    (TP innermost)."""
    cfg = _cfg(replicas, ntp=False)
    world_size = TP * replicas
    for rank in (0, world_size // 2 + 3, world_size - 1):
        world = fake_world(world_size, rank)
        setup = uniform_parallel(cfg)
        assert len(world.calls) == 3 and all(c["local"] and rank in c["ranks"] and c["timeout"] for c in world.calls)
        replica, slot = divmod(rank, TP)
        assert (setup.replica, setup.tp_rank) == (replica, slot)
        assert setup.pg.tp.ranks == list(range(replica * TP, replica * TP + TP))
        assert setup.pg.dp.ranks == list(range(slot, world_size, TP))
        assert ps.get_data_parallel_group() is setup.pg.dp and ps.get_tensor_model_parallel_group() is setup.pg.tp
        assert ps.get_data_parallel_rank() == replica and ps.get_tensor_model_parallel_rank() == slot


@pytest.mark.parametrize("tp, dp, pp", [(2, 2, 2), (1, 3, 4), (4, 160, 3)])
def test_plain_pipeline_groups_are_megatrons(fake_world, tp, dp, pp):
    """Uniform TP × DP × PP: every group Megatron-Core's schedule, DDP, optimizer and finalize_model_grads read
    (explicit and global) is the one upstream's ``RankGenerator`` makes for this rank, at six calls per rank, all
    made by the members alone."""
    from megatron.core.parallel_state import RankGenerator

    cfg = load_job_config(None, ["ntp.enabled=false", f"parallel.tensor_model_parallel_size={tp}",
                                 f"parallel.data_parallel_size={dp}", f"parallel.pipeline_model_parallel_size={pp}",
                                 "training.micro_batch_size=1", f"training.global_batch_size={dp}",
                                 "model.num_attention_heads=16", "model.hidden_size=128", f"model.num_layers={pp}"])
    world_size = tp * dp * pp
    upstream = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for rank in sorted({0, tp, world_size // 2 + 1, world_size - 1}):
        mine = {mode: next(g for g in upstream.get_ranks(mode) if rank in g) for mode in ("tp", "dp", "pp", "tp-pp")}
        world = fake_world(world_size, rank)
        setup = uniform_parallel(cfg)
        assert len(world.calls) == 6 and all(c["local"] and rank in c["ranks"] and c["timeout"] for c in world.calls)
        pg, lane = setup.pg, mine["pp"]
        assert pg.tp.ranks == mine["tp"] and pg.dp.ranks == pg.dp_cp.ranks == mine["dp"]
        assert pg.pp.ranks == lane and pg.mp.ranks == pg.tp_ep_pp.ranks == mine["tp-pp"]
        stage = lane.index(rank)
        assert (setup.stage, setup.stages, setup.first_stage, setup.last_stage) == \
            (stage, pp, stage == 0, stage == pp - 1)
        assert (setup.replica, setup.tp_rank) == (mine["dp"].index(rank), mine["tp"].index(rank))
        ends = stage in (0, pp - 1)
        assert (pg.embd.ranks if ends else pg.embd) == ([lane[0], lane[-1]] if ends else None)
        assert (pg.pos_embd.ranks if stage == 0 else pg.pos_embd) == ([rank] if stage == 0 else None)
        assert ps.get_pipeline_model_parallel_group() is pg.pp and ps.get_model_parallel_group() is pg.mp
        assert ps.get_pipeline_model_parallel_rank() == stage
        assert ps.get_pipeline_model_parallel_world_size() == pp
        assert ps.is_pipeline_first_stage() == (stage == 0) and ps.is_pipeline_last_stage() == (stage == pp - 1)
        assert ps.is_rank_in_embedding_group() == ends
        assert ps.get_pipeline_model_parallel_next_rank() == lane[(stage + 1) % pp]


_UNITS = {"heads": 8, "ffn": 24, "vocab": 29}
PLANNED = {  # topology, dp, distributed-optimizer instances
    "healthy": (JobTopology.one_stage(make_topology(4, 3, _UNITS)), 3, 1),
    "dead slots": (JobTopology.one_stage(make_topology(4, 3, _UNITS, dead_slots=[(1, 3), (2, 0), (2, 1)])), 3, 1),
    "instances": (JobTopology.one_stage(make_topology(2, 4, _UNITS, dead_slots=[(1, 1)])), 4, 2),
    "pipeline": (stages.make_pipeline_topology(2, 2, 2, _UNITS, dead_slots=[(1, 1, 1)]), 2, 1),
}


@pytest.mark.parametrize("case", list(PLANNED))
def test_build_groups_makes_the_plans_groups_call_for_call(fake_world, case):
    """``core.groups.build_groups`` realises ``plan.group_plan.rank_group_calls`` on every rank: the same groups in
    the same order, made by their members alone exactly where the plan says, each with the job's timeout; with a
    pool, the groups it holds are the plan's member groups (``rank_group_keys``, what a re-formation offers), in
    order."""
    topology, dp, k = PLANNED[case]
    for rank in range(topology.world_size):
        world = fake_world(topology.world_size, rank)
        pool = GroupPool(topology.generation)
        build_groups(topology, rank, 60.0, dp=dp, instances=k, pool=pool)
        planned = rank_group_calls(topology, rank, dp, k)
        assert [(c["ranks"], c["local"]) for c in world.calls] == \
            [(list(p.ranks), p.how != "every_rank") for p in planned]
        assert all(c["timeout"] == timedelta(seconds=60) for c in world.calls)
        assert pool.made == list(pool.groups) == rank_group_keys(topology, rank, dp, k) and not pool.kept
