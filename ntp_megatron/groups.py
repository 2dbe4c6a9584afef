"""torch.distributed groups for an NTP topology, installed into Megatron-Core.

Every rank creates every group of the topology in the same order (``new_group`` is collective over the
default group): one TP group per replica, then the ``tp_base`` sync groups. Sync group ``s`` has one member
per replica: the rank at slot ``s``, or the proxy of block ``s`` where that slot is dead. Megatron-Core sees
this rank's replica as its tensor- and model-parallel group. A rank of a healthy replica also sees its sync
group as its data-parallel group: its DDP buckets are exactly a slot-``s`` rank's, so Megatron's own
all-reduce does the sync at upstream's speed, with nothing added. A rank of a degraded replica gets itself
alone as its data-parallel group; :mod:`ntp_megatron.grad_sync` runs its sync groups.

Every group gets an explicit timeout (``new_group`` without one waits 30 minutes). Everything is rebuilt from
a topology object, so a re-formation can call :func:`build_groups` again.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import timedelta

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
    """This rank's replica."""
    sync: dict[int, dist.ProcessGroup]
    """Block -> sync group, for every block this rank is the sync-group member of (ascending)."""
    pg_collection: ProcessGroupCollection
    healthy: bool
    """This rank's replica has every slot live: Megatron's DDP syncs its one block over ``sync``."""

    def with_data_parallel(self, group: dist.ProcessGroup) -> ProcessGroupCollection:
        """This rank's collection with ``group`` as its data-parallel group (for a slot-shaped shadow DDP)."""
        pg = copy.copy(self.pg_collection)
        pg.dp = pg.dp_cp = pg.intra_dp_cp = group
        return pg


def build_groups(topology: Topology, rank: int, timeout_s: float) -> NTPGroups:
    timeout = timedelta(seconds=timeout_s)
    ps_patch.initialize_trivial_groups(timeout)
    tp_group = None
    for replica in topology.replicas:
        group = dist.new_group(list(replica.ranks), timeout=timeout)
        if rank in replica.ranks:
            tp_group = group
    if tp_group is None:
        raise RuntimeError(f"rank {rank} is in no replica of topology generation {topology.generation}")
    member_of = set(topology.member_blocks(rank))
    sync: dict[int, dist.ProcessGroup] = {}
    for block, ranks in enumerate(topology.sync_groups()):
        group = dist.new_group(list(ranks), timeout=timeout)
        if block in member_of:
            sync[block] = group
    replica = topology.replica_of(rank)
    healthy = topology.is_healthy(replica.index)
    ps_patch.install_tensor_parallel_group(tp_group, replica.ranks)
    if healthy:
        [(block, group)] = sync.items()
        ps_patch.install_data_parallel_group(group, topology.sync_groups()[block])
    else:
        alone = parallel_state.get_context_parallel_group()  # CP = 1: this rank by itself
        ps_patch.install_data_parallel_group(alone, [rank])
    pg = ProcessGroupCollection.use_mpu_process_groups()  # reads the groups just installed
    return NTPGroups(topology=topology, rank=rank, tp=tp_group, sync=dict(sorted(sync.items())),
                     pg_collection=pg, healthy=healthy)
