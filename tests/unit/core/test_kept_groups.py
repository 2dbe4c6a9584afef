"""A process group that goes on into the next generation (patches/torch_distributed_c10d.py, ntp_megatron.core.groups'
GroupPool and GroupMaker), on a real one-process gloo world: taken out of torch's tables it survives
``destroy_process_group()`` of the default group and still runs collectives; put back under the next default group
where the maker would have made it, torch knows it again (its ranks, its name, its tags), collectives through
torch.distributed's functions run on it, and the groups made after it get the names they would have had."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from ntp_megatron.plan.group_plan import GroupKey
from ntp_megatron.core.groups import GroupMaker, GroupPool
from ntp_megatron.patches import torch_distributed_c10d as c10d_patch
from ntp_megatron.plan.layout import make_topology
from datetime import timedelta

pytestmark = pytest.mark.skipif(not c10d_patch.supported(), reason="written for torch 2.13's private tables")

TOPOLOGY = make_topology(1, 1, {"heads": 2, "ffn": 4, "vocab": 8})
KEYS = [GroupKey("tp", (0,), ((0, 0),)), GroupKey("alone", (), ((0, 0),)), GroupKey("sync", (0, 0), ((0, 0),))]


@pytest.fixture
def store():
    store = dist.HashStore()
    yield store
    if dist.is_initialized():
        dist.destroy_process_group()


def join(store, generation: int) -> None:
    distributed_c10d._world.group_count = 0
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.PrefixStore(f"gen{generation}/", store))


def make(pool: GroupPool) -> tuple[list[dist.ProcessGroup], str]:
    """The maker's sequence (a first local group, the rank alone, a group every rank makes), then one more group
    made by every rank: returns the three and the name torch gave the last one."""
    maker = GroupMaker(0, timedelta(seconds=30), TOPOLOGY, pool)
    groups = [maker.first_local([0], KEYS[0]), maker.alone(KEYS[1]), maker.every_rank([0], KEYS[2])]
    after = maker.every_rank([0])
    return groups, distributed_c10d._world.pg_names[after]


def summed(group: dist.ProcessGroup) -> float:
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    return float(t.sum())


def test_a_group_goes_on_under_the_next_default_group(store):
    join(store, 0)
    pool = GroupPool(0)
    groups, name_after = make(pool)
    assert pool.made == KEYS and all(summed(g) == 3.0 for g in groups)
    issued = {k: pool.groups[k].issued() for k in KEYS}
    assert all(n >= 1 for n in issued.values())
    names = {k: distributed_c10d._world.pg_names[pool.groups[k].group] for k in KEYS}
    carried = pool.detach(set(KEYS))
    dist.destroy_process_group()  # the default group and every group still in torch's tables
    for pooled in carried.values():  # not shut down: collectives through the group itself still run
        t = torch.ones(2)
        pooled.group.allreduce([t]).wait()
        assert float(t.sum()) == 2.0

    join(store, 1)
    pool = GroupPool(1, offered=dict(carried))
    again, name_after_again = make(pool)
    assert pool.kept == KEYS and pool.made == [] and pool.offered == {}
    assert [g is carried[k].group for g, k in zip(again, KEYS)] == [True] * 3
    assert name_after_again == name_after  # the groups made after a kept one are named as they would have been
    for k, g in zip(KEYS, again):
        assert dist.get_process_group_ranks(g) == [0]
        assert distributed_c10d._resolve_process_group(names[k]) is g
        assert g in distributed_c10d._world.tags_to_pg[""] and distributed_c10d._world.pg_to_tag[g] == f"ptd:{names[k]}"
        assert summed(g) == 3.0
        assert pool.groups[k].made_in == 0 and pool.groups[k].issued() > issued[k]


def test_a_group_attached_twice_or_not_detached_is_refused(store):
    join(store, 0)
    pool = GroupPool(0)
    make(pool)
    [pooled] = pool.detach({KEYS[0]}).values()
    c10d_patch.attach(pooled.detached, {0: 0}, counted=False)
    with pytest.raises(RuntimeError, match="attached already"):
        c10d_patch.attach(pooled.detached, {0: 0}, counted=False)
