"""torch.distributed groups for an NTP topology, installed into Megatron-Core.

A rank holds only the groups it is a member of: its replica (its tensor-parallel group), the sync groups
of the blocks it serves, and itself alone for every trivial role (pipeline, context, expert, embedding).
Sync group ``s`` has one member per replica: the rank at slot ``s``, or the proxy of block ``s`` where that
slot is dead. Megatron-Core sees this rank's replica as its tensor- and model-parallel group. A rank of a
healthy replica also sees its sync group as its data-parallel group: its DDP buckets are exactly a
slot-``s`` rank's, so Megatron's own all-reduce does the sync at upstream's speed, with nothing added. A
rank of a degraded replica gets itself alone as its data-parallel group; :mod:`ntp_megatron.core.grad_sync` runs
its sync groups.

A rank makes ``tp_base + 2`` groups per generation, whatever the number of replicas (Megatron's dense
initializer at TP 1 made 112,646 per rank at 10,240 ranks), and at TP ≥ 2 no world-sized group exists
besides the default one: see :class:`GroupMaker` for how.

Which groups there are, and in which order they are made, is :func:`ntp_megatron.plan.group_plan.rank_group_calls`'
(pure, unit-tested); :func:`build_groups` makes that list call by call and decides nothing of it. Every group gets an
explicit timeout (``new_group`` without one waits 30 minutes). Everything is built from a topology object, so a
re-formation can call :func:`build_groups` again; given a :class:`GroupPool`, a group the
new generation shares with the one before (:mod:`ntp_megatron.plan.group_plan`) goes on as the same object where its
members agreed to keep it, and only the others are made.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from megatron.core.process_groups_config import ProcessGroupCollection

from ntp_megatron.plan import optimizer_shards
from ntp_megatron.plan.group_plan import GroupKey, PlannedGroup, rank_group_calls
from ntp_megatron.plan.grid import Grid
from ntp_megatron.plan.layout import Topology
from ntp_megatron.plan.stages import JobTopology
from ntp_megatron.patches import parallel_state as ps_patch
from ntp_megatron.patches import torch_distributed_c10d as c10d_patch
from ntp_megatron.sockets import SocketScope


@dataclass
class PooledGroup:
    """A group of this process that may go on into later generations, with what it takes to do so."""

    key: GroupKey
    group: dist.ProcessGroup
    made_in: int
    """The generation that made it (its incarnation: members keep it only if they hold the same one)."""
    sockets: dict[int, str]
    """Its gloo pairs (fd -> identity): shut down when it can be blocked on a dead member, or let go of."""
    pins: dict[int, str] = field(default_factory=dict)
    """The store client of the generation that made it, which its backend holds on to (open while it lives)."""
    detached: Optional[c10d_patch.Detached] = None
    """Set between two generations: taken out of torch's tables (:meth:`GroupPool.detach`)."""

    def issued(self) -> int:
        """Collectives issued on it so far by this process (torch's per-group sequence number)."""
        return self.group._get_sequence_number_for_group()


@dataclass
class GroupPool:
    """This process's groups of one generation (``made`` and ``kept``) and those offered to it from the one
    before (``offered``: those its members agreed to keep, :func:`ntp_megatron.plan.group_plan.keep_verdict`)."""

    generation: int
    store_sockets: dict[int, str] = field(default_factory=dict)
    """The generation's store client (every group made in it holds on to it)."""
    offered: dict[GroupKey, PooledGroup] = field(default_factory=dict)
    groups: dict[GroupKey, PooledGroup] = field(default_factory=dict)
    """Every group of this generation this process is a member of, made or kept."""
    made: list[GroupKey] = field(default_factory=list)
    kept: list[GroupKey] = field(default_factory=list)

    def detach(self, keep: "set[GroupKey] | frozenset[GroupKey]") -> dict[GroupKey, PooledGroup]:
        """Take the groups whose keys are in ``keep`` out of torch's tables (so that destroying the default group
        leaves them alone); returns them."""
        out = {}
        for k, pooled in self.groups.items():
            if k in keep:
                pooled.detached = c10d_patch.detach(pooled.group)
                out[k] = pooled
        return out


class GroupMaker:
    """This rank's groups of one generation, made at a cost that does not grow with the number of replicas.

    ``torch.distributed.new_group`` wants every rank of the world to call it for every group, in one order.
    With ``use_local_synchronization`` only the members call, but torch then names the group after its ranks
    *and the number of groups this process has already made*, and members that disagree on that number never
    meet. So the one group made that way is the first of the generation (every rank has made none besides
    the default group, and every rank is in exactly one such group: its replica), plus this rank alone (one
    member, nothing to agree on). The groups that cross replicas, ``tp_base`` of them, are made by every rank
    in one order: a call a rank is not a member of only records the group's ranks.

    With a :class:`GroupPool`, a group offered to it is not made but put back into torch's tables where it
    would have been made (:func:`ntp_megatron.patches.torch_distributed_c10d.attach`), counted as torch counts a
    group it makes, so the names of the groups made after it still agree between members.
    """

    def __init__(self, rank: int, timeout: timedelta, topology: Optional[JobTopology] = None,
                 pool: Optional[GroupPool] = None) -> None:
        self.rank = rank
        self.timeout = timeout
        self.topology = topology
        """The whole generation (to name groups by their members' identities); only needed with a pool."""
        self.pool = pool

    def realise(self, call: PlannedGroup) -> Optional[dist.ProcessGroup]:
        """The group of one call of the plan (:func:`ntp_megatron.plan.group_plan.rank_group_calls`), made the way
        the call says; None where this rank is not a member."""
        if call.how == "first":
            return self.first_local(call.ranks, call.key)
        if call.how == "alone":
            return self.alone(call.key)
        if call.how == "part":
            return self.partition(call.parts, call.key)
        if call.how == "every_rank":
            return self.every_rank(call.ranks, call.key)
        raise ValueError(f"unknown way to make a group: {call.how!r}")

    def first_local(self, ranks: Iterable[int], key: Optional[GroupKey] = None) -> dist.ProcessGroup:
        """The group of ``ranks`` (this rank among them, disjoint from every other rank's first group), made
        by its members only; before any other group of this generation."""
        ranks = sorted(ranks)
        # With a device bound to the default group, torch makes subgroups by an NCCL split that every rank of the
        # default group must join: members alone would wait for the others forever. Nothing binds one today.
        default = distributed_c10d.GroupMember.WORLD
        if default is not None and getattr(default, "bound_device_id", None) is not None:
            raise RuntimeError("groups made by their members alone need a default group without a bound device")
        if len(distributed_c10d._world.pg_names) > 1:
            raise RuntimeError("a group made by its members alone must be the first of its generation: torch "
                               "names it after the number of groups the process already has, which its peers "
                               f"must share (this process has {len(distributed_c10d._world.pg_names)})")
        return self._new(ranks, local=True, key=key)

    def alone(self, key: Optional[GroupKey] = None) -> dist.ProcessGroup:
        """This rank by itself (made locally: no peer to agree with on anything)."""
        return self._new([self.rank], local=True, key=key)

    def partition(self, parts: Iterable[Iterable[int]], key: Optional[GroupKey] = None) -> dist.ProcessGroup:
        """This rank's part of ``parts``, a partition of the world (every rank in exactly one part), made by each
        part's members alone. Every rank calls this with the same partition at the same point of its sequence,
        after calls that left every rank with the same number of groups (the first local group, ``alone``,
        ``every_rank`` groups of which each rank joins the same number, earlier partitions): torch then names
        each part alike on all its members."""
        parts = [sorted(part) for part in parts]
        members = sorted(r for part in parts for r in part)
        if members != list(range(dist.get_world_size())):
            raise ValueError(f"not a partition of the world: {parts[:4]}...")
        [mine] = [part for part in parts if self.rank in part]
        return self._new(mine, local=True, key=key)

    def every_rank(self, ranks: Iterable[int], key: Optional[GroupKey] = None) -> Optional[dist.ProcessGroup]:
        """The group of ``ranks``; every rank of the world calls this for the same groups in the same order.
        None where this rank is not a member."""
        ranks = sorted(ranks)
        if self.rank not in ranks:
            self._new(ranks, local=False, key=None)  # records the group's ranks, names nothing of this rank's
            return None
        return self._new(ranks, local=False, key=key)

    def _new(self, ranks: list[int], local: bool, key: Optional[GroupKey]) -> dist.ProcessGroup:
        pool = self.pool
        if pool is None or key is None:
            return dist.new_group(ranks, timeout=self.timeout, use_local_synchronization=local)
        if key in pool.offered:
            pooled = pool.offered.pop(key)
            c10d_patch.attach(pooled.detached, {self.topology.rank_of(*m): i for i, m in enumerate(key.members)},
                              counted=not local)
            pooled.detached = None
            pool.groups[key] = pooled
            pool.kept.append(key)
            return pooled.group
        with SocketScope() as scope:
            group = dist.new_group(ranks, timeout=self.timeout, use_local_synchronization=local)
        pool.groups[key] = PooledGroup(key=key, group=group, made_in=pool.generation, sockets=scope.sockets,
                                       pins=dict(pool.store_sockets))
        pool.made.append(key)
        return group


def dense_groups(tp_size: int, rank: int, world_size: int, timeout: timedelta, distributed_optimizer: bool = False,
                 instances: int = 1, pp_size: int = 1) -> ps_patch.RankGroups:
    """``rank``'s groups in Megatron's dense grid at CP = 1 (upstream's rank order, :class:`ntp_megatron.plan.grid.Grid`):
    its TP group, its data-parallel group and, with ``pp_size`` stages, its pipeline lane, its replica's
    model-parallel group and the embedding groups.

    With the distributed optimizer, its grad-norm group: the world with one instance (the default group, not a
    copy); with ``instances`` k > 1 (Megatron's ``num_distributed_optimizer_instances``) the ranks of this
    rank's instance (every stage of it), together with the intra-instance part of its data-parallel group and its
    twins' inter-instance group, by Megatron's rule (:func:`ntp_megatron.plan.optimizer_shards.instances`). Every group but
    the first is a partition of the world made by its members alone: a few calls per rank, whatever the world."""
    grid = Grid.of_world(tp_size, pp_size, world_size)
    if instances > 1 and not distributed_optimizer:
        raise ValueError(f"{instances} distributed-optimizer instances need the distributed optimizer")
    stage, replica, slot = grid.coords(rank)
    make = GroupMaker(rank, timeout)
    tp_ranks = grid.tp_ranks(stage, replica)
    tp = make.first_local(tp_ranks)
    alone = make.alone()
    dp_ranks = grid.dp_ranks(stage, slot)
    dp = make.partition(grid.partition(lambda p, r, s: (p, s)))
    pipeline = None
    if grid.pp > 1:
        lane = make.partition(grid.partition(lambda p, r, s: (r, s)))
        mp = make.partition(grid.partition(lambda p, r, s: r))
        # The first and last stage of each lane; a middle stage's rank is in no embedding group (a part of its own).
        ends = (0, grid.pp - 1)
        embd = make.partition(grid.partition(lambda p, r, s: (r, s) if p in ends else ("alone", p, r, s)))
        pipeline = ps_patch.PipelineGroups(
            lane=lane, lane_ranks=grid.lane(replica, slot), mp=mp, mp_ranks=grid.mp_ranks(replica),
            embd=embd if stage in ends else None, embd_ranks=grid.embedding_ranks(replica, slot) if stage in ends else (),
            pos_embd=alone if stage == 0 else None, pos_embd_ranks=(rank,) if stage == 0 else ())
    grad_stats = dist.group.WORLD if distributed_optimizer else None
    intra_dp = inter = None
    if instances > 1:
        def place(r: int) -> tuple[int, int]:  # (instance, position) of replica r
            return optimizer_shards.instance_of(r, grid.dp, instances)

        intra_dp = make.partition(grid.partition(lambda p, r, s: (p, s, place(r)[0])))
        inter = make.partition(grid.partition(lambda p, r, s: (p, s, place(r)[1])))
        grad_stats = make.partition(grid.partition(lambda p, r, s: place(r)[0]))
    return ps_patch.RankGroups(tp=tp, tp_ranks=tp_ranks, dp=dp, dp_ranks=dp_ranks, alone=alone, rank=rank,
                               grad_stats=grad_stats, intra_dp=intra_dp, inter_dist_opt=inter, pipeline=pipeline)


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
    instances: int = 1
    """Distributed-optimizer instances (Megatron's ``num_distributed_optimizer_instances``), fixed for the job."""
    instance: int = 0
    """This rank's replica's instance (its ``distributed_optimizer_instance_id``: its rank in every ``inter``)."""
    position: int = 0
    """This rank's replica's position in its instance: its shard of every block is the position-th (its rank in
    every ``intra``)."""
    intra: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    """Block -> the members of sync group ``block`` in this rank's instance (what the distributed optimizer
    shards over and DDP reduce-scatters in), for every block in ``sync``. With one instance: ``sync`` itself."""
    inter: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    """Block -> the holders of this rank's shard of ``block``, one per instance (twins: DDP all-reduces the
    shard across them), for every block in ``sync``; empty with one instance."""
    job: Optional[JobTopology] = None
    """The whole generation (``topology`` is this rank's stage of it)."""
    mp: Optional[dist.ProcessGroup] = None
    """With pipeline stages: every rank of this rank's replica, all stages (Megatron's model-parallel group)."""
    pool: Optional[GroupPool] = None
    """With a pool (an elastic job): which groups were made and which kept, by key."""

    @property
    def staged(self) -> bool:
        """Whether the job runs pipeline stages (two or more)."""
        return self.job is not None and self.job.num_stages > 1

    @property
    def last_stage_rank(self) -> Optional[int]:
        """With pipeline stages: the rank of this rank's replica that speaks for its last stage (its TP rank 0)."""
        if not self.staged:
            return None
        return self.job.stages[-1].replica(self.topology.replica_of(self.rank).index).ranks[0]

    def with_data_parallel(self, group: dist.ProcessGroup) -> ProcessGroupCollection:
        """This rank's collection with ``group`` as its data-parallel group (for a slot-shaped shadow DDP)."""
        pg = copy.copy(self.pg_collection)
        pg.dp = pg.dp_cp = pg.intra_dp_cp = pg.expt_dp = pg.intra_expt_dp = group
        return pg

    def with_sync_groups(self, block: int) -> ProcessGroupCollection:
        """This rank's collection for a DDP and distributed optimizer over block ``block``'s buckets (its own
        block on a healthy rank, a shadow's on a degraded one): data parallelism over sync group ``block``, the
        optimizer sharded over its intra-instance part and all-reduced across the twins with k > 1 instances
        (give Megatron's DDP config the same ``num_distributed_optimizer_instances``). ``intra_dist_opt`` (the
        grad-norm group) is left as the collection has it: NTP's norm does not reduce over it."""
        pg = self.with_data_parallel(self.sync[block])
        pg.intra_dp_cp = pg.intra_expt_dp = self.intra[block]
        pg.inter_dist_opt = self.inter.get(block)
        return pg


def build_groups(topology: JobTopology, rank: int, timeout_s: float, dp: Optional[int] = None,
                 instances: int = 1, pool: Optional[GroupPool] = None) -> NTPGroups:
    """``rank``'s groups in ``topology`` (the whole generation), installed into Megatron-Core's globals. Called by
    every rank of the generation right after it joined (see :class:`GroupMaker`).

    The groups are :func:`ntp_megatron.plan.group_plan.rank_group_calls`' list, made one by one in its order, each
    with ``timeout_s``: nothing here decides which groups there are. With pipeline stages (two or more) that is the
    TP group of ``rank``'s stage, the sync groups
    per (stage, block) — every rank makes every stage's, ``tp_base`` per stage — and its replica's model-parallel
    group (every stage of it: the grad norm, the token count and the loss cross stages in it).

    With ``instances`` k > 1 (over the ``dp`` launch replicas) it also makes, for every block, the intra-instance
    part of the sync group (k groups) and the twins' groups (dp/k): ``tp_base·(k + dp/k)`` more calls by every
    rank. They are exposed in :class:`NTPGroups` (``intra``, ``inter``, :meth:`NTPGroups.with_sync_groups`) and
    not installed: Megatron's globals and ``pg_collection`` keep one instance.

    With a ``pool`` (:class:`GroupPool`), the groups it offers are kept rather than made (a re-formation offers
    them from the same plan: :func:`ntp_megatron.plan.group_plan.rank_group_keys`), and it records what was made
    and kept."""
    make = GroupMaker(rank, timedelta(seconds=timeout_s), topology, pool)
    made: dict[GroupKey, tuple[tuple[int, ...], dist.ProcessGroup]] = {}
    for call in rank_group_calls(topology, rank, dp, instances):  # the plan's order: the same on every rank
        group = make.realise(call)
        if call.key is not None:
            made[call.key] = (call.ranks, group)
    if pool is not None and pool.offered:  # offered from a plan with other arguments: a caller's mistake
        raise RuntimeError(f"rank {rank}: groups offered that the plan does not have: "
                           f"{sorted(k.label() for k in pool.offered)}")
    return _assemble(topology, rank, made, dp, instances, pool)


def _assemble(whole: JobTopology, rank: int,
              made: dict[GroupKey, tuple[tuple[int, ...], dist.ProcessGroup]], dp: Optional[int], instances: int,
              pool: Optional[GroupPool]) -> NTPGroups:
    """The groups ``rank`` made (key -> its ranks and group), by role, installed into Megatron-Core's globals."""
    def role(name: str) -> dict[tuple[int, ...], tuple[tuple[int, ...], dist.ProcessGroup]]:
        return {k.place: value for k, value in made.items() if k.role == name}  # in the plan's order

    topology = whole.stage_of(rank)
    replica = topology.replica_of(rank)
    [(tp_ranks, tp_group)] = role("tp").values()
    [(_, alone)] = role("alone").values()
    mp = next((group for _, group in role("mp").values()), None)
    sync_made = {place[1]: value for place, value in role("sync").items()}  # this rank's stage: ascending blocks
    sync = {block: group for block, (_, group) in sync_made.items()}
    intra = dict(sync) if instances == 1 else {place[0]: group for place, (_, group) in role("intra").items()}
    inter = {place[0]: group for place, (_, group) in role("inter").items()}
    if dp is None:  # one instance (the plan refuses more without dp): only the replica index matters
        dp = max(rep.index for rep in topology.replicas) + 1
    instance, position = optimizer_shards.instance_of(replica.index, dp, instances)
    healthy = topology.is_healthy(replica.index)
    if healthy:
        [(dp_ranks, dp_group)] = sync_made.values()
    else:
        dp_group, dp_ranks = alone, (rank,)
    pipe = None
    if whole.num_stages > 1:
        mp_ranks = tuple(whole.replica_ranks(replica.index))
        first = topology.stage == 0
        pipe = ps_patch.PipelineGroups(
            lane=ps_patch.PipelinePosition(topology.stage, whole.num_stages), lane_ranks=(), mp=mp,
            mp_ranks=mp_ranks, embd=None, embd_ranks=(),  # tied embeddings: ntp_megatron.core.pipeline.TiedEmbeddingSync
            pos_embd=alone if first else None, pos_embd_ranks=(rank,) if first else ())
    pg = ps_patch.install(ps_patch.RankGroups(tp=tp_group, tp_ranks=tp_ranks, dp=dp_group, dp_ranks=dp_ranks,
                                              alone=alone, rank=rank, pipeline=pipe))
    return NTPGroups(topology=topology, rank=rank, tp=tp_group, sync=sync, pg_collection=pg, healthy=healthy,
                     instances=instances, instance=instance, position=position, intra=intra, inter=inter,
                     job=whole, mp=mp, pool=pool)


def group_mapping(old: NTPGroups, new: NTPGroups) -> dict[int, dist.ProcessGroup]:
    """``id(old group) -> new group`` for every role a group plays in both generations (the same fields of the
    process-group collection, the TP group, the sync groups of blocks served in both)."""
    mapping: dict[int, dist.ProcessGroup] = {id(old.tp): new.tp}
    for role in ("sync", "intra", "inter"):  # intra is sync itself with one instance: the same mapping
        for block, group in getattr(old, role).items():
            if block in getattr(new, role):
                mapping.setdefault(id(group), getattr(new, role)[block])
    for name, value in vars(old.pg_collection).items():
        replacement = getattr(new.pg_collection, name, None)
        if isinstance(value, dist.ProcessGroup) and isinstance(replacement, dist.ProcessGroup):
            mapping.setdefault(id(value), replacement)
    return mapping


def _groups_of(groups: NTPGroups) -> list[dist.ProcessGroup]:
    return [g for g in (groups.tp, groups.mp, *groups.sync.values(), *groups.intra.values(), *groups.inter.values(),
                        *vars(groups.pg_collection).values()) if isinstance(g, dist.ProcessGroup)]


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
    for name, value in items:
        visit(obj, name, value)
        _walk(value, visit, seen)


def references_to(roots: list, group: dist.ProcessGroup) -> int:
    """How many references to ``group`` (this very object) there are anywhere under ``roots``."""
    found = 0

    def visit(container, key, value) -> None:
        nonlocal found
        found += value is group

    seen: set[int] = set()
    for root in roots:
        _walk(root, visit, seen)
    return found


def rebind_process_groups(roots: list, old: NTPGroups, new: NTPGroups) -> int:
    """Point every reference to one of ``old``'s groups, found anywhere under ``roots`` (model, DDP, optimizer),
    at the matching group of ``new`` (a group kept into ``new`` is left as it is). Returns how many references
    were replaced; raises if an old group is still referenced afterwards (a stale group would fail at its first
    collective, or worse)."""
    mapping = group_mapping(old, new)
    # Before the walk, which may rebind old.pg_collection itself. A group kept (the same object in both) is not old.
    old_ids = {id(g) for g in _groups_of(old)} - {id(g) for g in _groups_of(new)}
    replaced = 0

    def visit(container, key, value) -> None:
        nonlocal replaced
        if not isinstance(value, dist.ProcessGroup) or id(value) not in mapping or mapping[id(value)] is value:
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
