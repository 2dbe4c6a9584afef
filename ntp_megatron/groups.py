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

import torch
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


def group_mapping(old: NTPGroups, new: NTPGroups) -> dict[int, dist.ProcessGroup]:
    """``id(old group) -> new group`` for every role a group plays in both generations (the same fields of the
    process-group collection, the TP group, the sync groups of blocks served in both)."""
    mapping: dict[int, dist.ProcessGroup] = {id(old.tp): new.tp}
    for block, group in old.sync.items():
        if block in new.sync:
            mapping[id(group)] = new.sync[block]
    for name, value in vars(old.pg_collection).items():
        replacement = getattr(new.pg_collection, name, None)
        if isinstance(value, dist.ProcessGroup) and isinstance(replacement, dist.ProcessGroup):
            mapping.setdefault(id(value), replacement)
    return mapping


def _walk(obj, visit, seen: set[int]) -> None:
    """Every attribute slot, list/tuple entry and dict value reachable from ``obj`` through Megatron-Core,
    ntp-megatron and torch.nn objects: ``visit(container, key, value)`` for each."""
    if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    else:
        module = type(obj).__module__ or ""
        if not (isinstance(obj, torch.nn.Module) or module.startswith(("megatron.", "ntp_megatron."))):
            return
        try:
            items = list(vars(obj).items())
        except TypeError:
            return
    for key, value in items:
        visit(obj, key, value)
        _walk(value, visit, seen)


def rebind_process_groups(roots: list, old: NTPGroups, new: NTPGroups) -> int:
    """Point every reference to one of ``old``'s groups, found anywhere under ``roots`` (model, DDP, optimizer),
    at the matching group of ``new``. Returns how many references were replaced; raises if an old group is
    still referenced afterwards (a stale group would fail at its first collective, or worse)."""
    mapping = group_mapping(old, new)
    old_ids = {id(g) for g in (old.tp, *old.sync.values(), *vars(old.pg_collection).values())
               if isinstance(g, dist.ProcessGroup)}  # before the walk, which may rebind old.pg_collection itself
    replaced = 0

    def visit(container, key, value) -> None:
        nonlocal replaced
        if not isinstance(value, dist.ProcessGroup) or id(value) not in mapping:
            return
        if isinstance(container, tuple):
            raise RuntimeError(f"a process group inside a tuple ({type(container).__name__}) cannot be rebound")
        if isinstance(container, (dict, list)):
            container[key] = mapping[id(value)]
        else:
            setattr(container, key, mapping[id(value)])
        replaced += 1

    seen: set[int] = set()
    for root in roots:
        _walk(root, visit, seen)
    stale: list[str] = []

    def check(container, key, value) -> None:
        if isinstance(value, dist.ProcessGroup) and id(value) in old_ids:
            stale.append(f"{type(container).__name__}.{key}")

    seen = set()
    for root in roots:
        _walk(root, check, seen)
    if stale:
        raise RuntimeError(f"old process groups still referenced after rebinding: {stale[:5]}")
    return replaced
