"""torch.distributed groups for an NTP topology, installed into Megatron-Core.

Every rank creates every group of the topology in the same order (``new_group`` is collective over the
default group): one TP group per replica, one sync group per sync partition. Megatron-Core then sees this
rank's replica as its tensor- and model-parallel group. Its data-parallel group depends on the topology:
when every replica has the same width, all replicas hold identical layouts, Megatron's flat DDP buckets
line up, and the sync group *is* the data-parallel group — upstream's own all-reduce does the sync at
upstream's speed. Otherwise DP is this rank alone and :mod:`ntp_megatron.grad_sync` does the cross-replica
work. Everything is rebuilt from a topology object, so a re-formation can call :func:`build_groups` again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from ntp_megatron.layout import Topology
from ntp_megatron.patches import parallel_state as ps_patch


@dataclass
class NTPGroups:
    topology: Topology
    rank: int
    tp: dist.ProcessGroup
    sync: Optional[dist.ProcessGroup]       # None on extra ranks
    pg_collection: ProcessGroupCollection
    megatron_dp_sync: bool                  # uniform widths: Megatron's DDP syncs over the sync group


def build_groups(topology: Topology, rank: int) -> NTPGroups:
    ps_patch.initialize_trivial_groups()
    tp_group = None
    for replica in topology.replicas:
        group = dist.new_group(list(replica.ranks))
        if rank in replica.ranks:
            tp_group = group
    sync_group = None
    for ranks in topology.sync_groups():
        group = dist.new_group(list(ranks))
        if rank in ranks:
            sync_group = group
    if tp_group is None:
        raise RuntimeError(f"rank {rank} is in no replica of topology generation {topology.generation}")
    replica = topology.replica_of(rank)
    ps_patch.install_tensor_parallel_group(tp_group, replica.ranks)
    uniform = all(r.width == topology.sync_width for r in topology.replicas)
    if uniform:
        sync_ranks = next(ranks for ranks in topology.sync_groups() if rank in ranks)
        ps_patch.install_data_parallel_group(sync_group, sync_ranks)
    else:
        alone = parallel_state.get_context_parallel_group()  # CP = 1: this rank by itself
        ps_patch.install_data_parallel_group(alone, [rank])
    pg = ProcessGroupCollection.use_mpu_process_groups()  # reads the groups just installed
    return NTPGroups(topology=topology, rank=rank, tp=tp_group, sync=sync_group, pg_collection=pg,
                     megatron_dp_sync=uniform)
