"""Cross-replica gradient sync for replicas whose TP layouts differ, inside Megatron's DDP buckets.

For each TP-split parameter, sync partition ``i`` (contiguous unit block) is summed across replicas by the
ranks that are core ``i`` of every replica (one all-reduce per parameter and partition, on the sync group).
In a replica wider than the sync width, extra ranks first hand their units' gradients to the core of each
unit's partition (point-to-point inside the replica) and take the summed values back afterwards. Replicated
(non-TP) parameters hold identical gradients on every rank of a replica; they are pre-scaled by ``1/width``
and all-reduced over all ranks, so each replica counts once and every rank ends with the same bits.

Used only when replica widths differ (equal widths have identical layouts, and Megatron's own DDP
all-reduce over the sync groups does the job; see :mod:`ntp_megatron.groups`). Collectives are issued per
parameter in the same (registration) order on every rank, so replicas need not lay their DDP buckets out
alike; Megatron's bucket readiness decides when each bucket starts. Nothing blocks inside a backward hook:
a rank whose bucket is ready only posts its sends and receives (and the replicated all-reduce), because a
peer of the same replica may still be in backward, in a TP collective this rank has to join. The
sync-group all-reduces wait for ``finish_grad_sync``, where every core issues them in parameter order, so
each group sees the same collective order on all its members.
The grad norm is computed from per-unit sums so it is bit-identical on every replica (see
:meth:`NTPGradSync.grad_norm`), which keeps the replicas' updates bit-identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ntp_megatron.layers import UnitShard
from ntp_megatron.layout import Topology

@dataclass(frozen=True)
class FamilyRole:
    """This rank's part in syncing one unit family."""

    core_of: Optional[int]                      # partition index if this rank is a core
    partition_size: int = 0
    own_positions: tuple[int, ...] = ()         # positions of this rank's units inside the partition buffer
    from_extras: tuple[tuple[int, tuple[int, ...]], ...] = ()   # core: (extra rank, buffer positions)
    to_cores: tuple[tuple[int, tuple[int, ...]], ...] = ()      # extra: (core rank, local positions)

    @property
    def is_plain(self) -> bool:
        """A core that holds its whole partition and has no extras: all-reduce in place."""
        return self.core_of is not None and not self.from_extras and len(self.own_positions) == self.partition_size


def family_role(topology: Topology, rank: int, family: str) -> FamilyRole:
    replica = topology.replica_of(rank)
    local = topology.local_rank(rank)
    mine = topology.units_of(rank, family)
    m = topology.sync_width
    if local < m:
        holders = topology.partition_holders(family, replica.index, local)
        partition = sorted(u for _, units in holders for u in units)
        start = partition[0]
        return FamilyRole(
            core_of=local, partition_size=len(partition),
            own_positions=tuple(u - start for u in mine),
            from_extras=tuple((r, tuple(u - start for u in units)) for r, units in holders if r != rank),
        )
    position = {u: i for i, u in enumerate(mine)}
    to_cores = []
    for partition_index in range(m):
        holders = topology.partition_holders(family, replica.index, partition_index)
        core_rank = holders[0][0]
        for r, units in holders:
            if r == rank:
                to_cores.append((core_rank, tuple(position[u] for u in units)))
    return FamilyRole(core_of=None, to_cores=tuple(to_cores))


def sum_over_replicas(value: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """Sum, in place over all ranks, a quantity every rank of a replica holds identically: each replica once."""
    if tp_rank != 0:
        value.zero_()
    dist.all_reduce(value)
    return value


@dataclass
class _Pending:
    """Communication of one parameter still in flight between ``start`` and ``wait``."""

    grad: torch.Tensor                           # the parameter's main_grad, viewed [outer, units, inner]
    role: Optional[FamilyRole]
    tag: int
    work: list = field(default_factory=list)     # works to wait for before finishing
    buffer: Optional[torch.Tensor] = None         # core: the partition buffer, all-reduced in finish
    incoming: list = field(default_factory=list)  # core: (buffer positions, receive buffer, work) per extra
    keep: list = field(default_factory=list)      # send buffers that must outlive their isend


class _Handle:
    def __init__(self, sync: "NTPGradSync", pending: list[_Pending]) -> None:
        self._sync, self._pending = sync, pending

    def wait(self) -> None:
        self._sync._finish(self._pending)


class NTPGradSync:
    """The grad syncer of one rank for one topology; attach it to a Megatron DDP model."""

    def __init__(self, topology: Topology, rank: int, tp_group: dist.ProcessGroup,
                 sync_group: Optional[dist.ProcessGroup]) -> None:
        self.tp_group = tp_group
        self.sync_group = sync_group
        self.width = topology.replica_of(rank).width
        self.local_rank = topology.local_rank(rank)
        self.roles = {family: family_role(topology, rank, family) for family in topology.units}
        self._order: dict[torch.nn.Parameter, int] = {}
        self._params: list[torch.nn.Parameter] = []

    def attach(self, ddp_model) -> None:
        """Route every bucket group of ``ddp_model`` through this syncer (see patches/)."""
        if ddp_model.config.sequence_parallel:
            raise ValueError("NTP grad sync does not all-reduce sequence-parallel norm gradients")
        self._params = [p for p in ddp_model.module.parameters() if p.requires_grad]
        for name, param in ddp_model.module.named_parameters():
            if getattr(param, "tensor_model_parallel", False) and not hasattr(param, "ntp_shard"):
                raise ValueError(f"TP-split parameter {name} has no unit shard: it would be synced as replicated")
        self._order = {p: i for i, p in enumerate(self._params)}
        for group in list(ddp_model.bucket_groups) + list(ddp_model.expert_parallel_bucket_groups):
            group.grad_syncer = self

    # -- bucket communication ----------------------------------------------------------------------
    def start(self, bucket_group, async_op: bool = True) -> _Handle:
        """Post this bucket group's communication (never blocks); the handle's ``wait`` completes it."""
        pending = []
        for bucket in bucket_group.buckets:
            for param in bucket.params_list:
                pending.append(self._start_param(param))
        return _Handle(self, pending)

    def _start_param(self, param: torch.nn.Parameter) -> _Pending:
        tag = 2 * self._order[param]
        shard: Optional[UnitShard] = getattr(param, "ntp_shard", None)
        if shard is None:
            grad = param.main_grad
            if self.width > 1:
                grad.mul_(1.0 / self.width)
            return _Pending(grad, None, tag, [dist.all_reduce(grad, async_op=True)])
        grad = shard.view(param.main_grad)
        role = self.roles[shard.family]
        p = _Pending(grad, role, tag)
        if role.core_of is None:
            for core, positions in role.to_cores:
                payload = grad[:, list(positions), :].contiguous()
                p.keep.append(payload)
                p.work.append(dist.isend(payload, dst=core, tag=tag))
            return p
        for extra, positions in role.from_extras:
            incoming = grad.new_empty(grad.shape[0], len(positions), grad.shape[2])
            p.incoming.append((positions, incoming, dist.irecv(incoming, src=extra, tag=tag)))
        return p

    def _reduce_partition(self, p: _Pending) -> None:
        """Core: gather the partition from this rank and its extras, all-reduce it across replicas."""
        role = p.role
        if role.is_plain:
            p.buffer = p.grad
        else:
            p.buffer = p.grad.new_empty(p.grad.shape[0], role.partition_size, p.grad.shape[2])
            p.buffer[:, list(role.own_positions), :] = p.grad
            for positions, incoming, work in p.incoming:
                work.wait()
                p.buffer[:, list(positions), :] = incoming
        dist.all_reduce(p.buffer, group=self.sync_group)

    def _finish(self, pending: list[_Pending]) -> None:
        sends = []
        for p in pending:
            for work in p.work:
                work.wait()
            role = p.role
            if role is None:
                continue
            if role.core_of is not None:
                self._reduce_partition(p)
                if not role.is_plain:
                    p.grad.copy_(p.buffer[:, list(role.own_positions), :])
                    for extra, positions in role.from_extras:
                        payload = p.buffer[:, list(positions), :].contiguous()
                        sends.append((payload, dist.isend(payload, dst=extra, tag=p.tag + 1)))
            else:
                for core, positions in role.to_cores:
                    incoming = p.grad.new_empty(p.grad.shape[0], len(positions), p.grad.shape[2])
                    dist.irecv(incoming, src=core, tag=p.tag + 1).wait()
                    p.grad[:, list(positions), :] = incoming
        for _, work in sends:
            work.wait()

    # -- after the sync: token normalisation and the grad norm ------------------------------------
    def finalize_model_grads(self, model, num_tokens: Optional[torch.Tensor] = None, pg_collection=None,
                             force_all_reduce: bool = False) -> None:
        """Megatron's ``finalize_model_grads`` for NTP: finish the bucket syncs, then divide by the number of
        tokens in the global batch (each replica's count taken once, from its TP rank 0)."""
        for chunk in model:
            chunk.finish_grad_sync()
        if num_tokens is not None:
            tokens = sum_over_replicas(num_tokens.clone(), self.local_rank)
            if tokens > 0:
                for chunk in model:
                    chunk.scale_gradients(1.0 / tokens)

    @torch.no_grad()
    def grad_norm(self, *_args, **_kwargs) -> float:
        """The global L2 norm of the synced gradients, bit-identical on every rank of every replica.

        Per-unit squared sums (each unit lives on exactly one rank of a replica, so the TP all-reduce of
        vectors that are zero elsewhere is exact), then one sum in unit order; replicated parameters are
        identical everywhere and summed in parameter order.
        """
        unit_sums = []
        device = self._params[0].main_grad.device
        replicated = torch.zeros((), dtype=torch.float64, device=device)
        for param in self._params:
            grad = param.main_grad
            shard: Optional[UnitShard] = getattr(param, "ntp_shard", None)
            if shard is None:
                replicated += grad.double().pow(2).sum()
                continue
            per_unit = shard.view(grad).permute(1, 0, 2).reshape(len(shard.units), -1).double().pow(2).sum(dim=1)
            full = torch.zeros(shard.num_units, dtype=torch.float64, device=device)
            full[list(shard.units)] = per_unit
            unit_sums.append(full)
        total = replicated
        if unit_sums:
            units = torch.cat(unit_sums)
            dist.all_reduce(units, group=self.tp_group)
            total = total + units.sum()
        return math.sqrt(float(total))
