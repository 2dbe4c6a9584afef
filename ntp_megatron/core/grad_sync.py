"""Cross-replica gradient sync under NTP: canonical blocks in Megatron's own flat buckets.

Every TP-split tensor is cut into ``tp_base`` canonical blocks of units (block ``s`` is what slot ``s`` of a
healthy replica holds). Gradients of block ``s`` are summed in sync group ``s``, which has one member per
replica (see :mod:`ntp_megatron.core.groups`):

* A rank of a **healthy** replica holds exactly block ``s``. Its DDP buckets are those of plain Megatron-Core
  at slot ``s``, its data-parallel group is sync group ``s``, and upstream's ``finalize_model_grads`` syncs
  it — same buckets, same collectives, same overlap. NTP adds nothing to its step.
* A rank of a **degraded** replica holds its own block plus units dealt from dead slots' blocks, so its own
  buckets line up with nobody's. For every block it is the sync-group member of (its slot's block, and each
  dead block it is the proxy of) it keeps a *shadow*: Megatron's own ``DistributedDataParallel`` built over
  meta-device parameters of the slot-``s`` shapes, whose flat buckets therefore match a healthy slot-``s``
  rank's byte for byte. After backward it copies its units into the shadows, gathers the pieces of dead
  blocks held by its replica peers (one packed message per peer and block, inside the replica), lets the
  shadow's upstream ``finish_grad_sync`` all-reduce bucket by bucket over the sync group in creation order,
  then copies the sums back and returns the peers' pieces. The cost lands where the failure is.

Rules every member of a group follows, whatever its own layout:

* Buckets go out in creation order (:mod:`ntp_megatron.patches.distributed_param_and_grad_buffer`); a rank
  in several sync groups serves them in ascending block order, which cannot deadlock.
* Every data-parallel collective is repeated in each group a rank is a member of (the bucket syncs, the
  token count, the loss for the log). The loss is per token, so gradients are divided by the token count of
  the global batch; no ``1/dp`` factor is involved.
* Replicated parameters (norms, row-parallel biases, position embeddings) sit in every block's buckets.
  When blocks are uneven (``units % tp_base != 0`` for some family), slots' buckets put them at different
  offsets, and an all-reduce's summation order follows the offset: slots would end with different bits.
  Their synced value is then taken from one place — block 0's member broadcasts it inside each replica.
* The grad norm (:meth:`GradSync.grad_norm`) is assembled from a float64 table of squared sums per
  (parameter, block), each cell computed on a slot-shaped buffer that is bitwise the same in every replica,
  summed over the replica (one non-zero entry per cell, so the sum is exact) and finished with ``fsum``:
  bit-identical on every rank of every replica, hence so are clipping and the update.

Under Megatron's distributed optimizer (``use_distributed_optimizer``) the same buckets are reduce-scattered over
the sync group (the group each buffer shards over: upstream's ``intra_distributed_optimizer_instance_group``), so
after the sync only this rank's shard of each bucket holds reduced gradients, and after the optimizer step only
that shard of the parameters is updated:

* The grad norm's table has a cell per (block, position in the group) for TP-split pieces, and one per position
  for replicated pieces (block 0's only, so each is counted once), filled from the shards of ``grad_data``
  (:func:`shard_square_sums`), summed over the replica and then over the group (again one non-zero entry per
  cell) and finished with ``fsum``.
* The optimizer's step is local (:func:`ntp_megatron.patches.optimizer_distrib_optimizer.defer_param_sync`); the
  parameter all-gather that makes every rank's parameters whole again is :meth:`GradSync.param_gather`, a step
  of its own after the optimizer's.
* A degraded rank's shadows hold real slot-shaped parameters in Megatron's parameter buffer, sharded like a
  healthy slot-``s`` rank's over the same groups (:meth:`ntp_megatron.core.groups.NTPGroups.with_sync_groups`), and its
  optimizer steps its shard of every shadow (its own DDP only accumulates). The shadows are filled from the model
  before the optimizer is built over them (its bf16 main params are copies taken then: the dead blocks' units
  come from the replica peers holding them). After the sync only the shards are valid, so nothing is copied
  back; :meth:`GradSync.param_gather` all-gathers each shadow (ascending blocks) and copies the units back into
  the model, a dead block's from its member to the peers holding them (in the model's dtype).
* With uneven blocks a broadcast of replicated gradients would overwrite the receiver's reduced shard with the
  sender's unreduced elements; instead block 0's member broadcasts the replicated *parameters* after the
  gather. With fp32 parameters the optimizer's shard is a view of them, so every slot then steps from block 0's
  values; the Adam moments (and bf16's fp32 main params) of replicated elements on other slots are summed in
  their own order and may differ from block 0's in the last bits, but never reach the model: block 0's copy is
  the state (:meth:`GradSync.replicated_state_source`). A sum of two terms is the same in either order, so with
  two replicas every slot's copy is exactly block 0's.
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

from ntp_megatron import phases
from ntp_megatron.core.groups import NTPGroups, rebind_process_groups
from ntp_megatron.core.layers import UnitShard
from ntp_megatron.plan.layout import Topology
from ntp_megatron.core.pipeline import tied_embedding_sync
from ntp_megatron.plan.optimizer_shards import Bucket, BufferLayout, ParamPlace, shard_pieces

# Attributes Megatron's DDP and optimizer read from a parameter; a shadow parameter carries them too.
_PARAM_ATTRS = ("allreduce", "shared_embedding", "tensor_model_parallel", "partition_dim", "partition_stride",
                "sequence_parallel")


def release_ddp(ddp: DistributedDataParallel, owner: object) -> None:
    """Break the reference cycle a Megatron DDP keeps through autograd: it holds each parameter's gradient
    accumulator, whose hook holds the DDP. The accumulator is a C++ object the garbage collector cannot see
    through, so without this a discarded DDP — its buffers and process groups with it — lives forever.

    Only by its ``owner``: a DDP newer objects adopted (:class:`_Shadow`, ``adopted``) is theirs now, and its
    old holder leaves it alone."""
    claimed = getattr(ddp, "ntp_owner", None)
    holder = claimed() if claimed is not None else None
    if holder is not None and holder is not owner:
        return
    ddp.grad_accs.clear()
    ddp.param_to_bucket_group.clear()


def abandon_collectives(ddp: DistributedDataParallel) -> None:
    """Forget what a Megatron DDP's bucket groups had in flight when a failure cut the iteration short: those
    collectives went with the old groups. Upstream's ``reset`` (at the next ``zero_grad_buffer``) keeps a
    dispatched group's handle, and ``start_grad_sync`` then refuses to dispatch again ("multiple communication
    calls outstanding"); in the first batch it would wait on the stale handle instead, and a half-counted first
    batch fails ``reset``'s check of the gradient counts. For kept objects, before the iteration is redone."""
    for group in [*ddp.bucket_groups, *ddp.expert_parallel_bucket_groups]:
        group.grad_reduce_handle = None
        group.param_gather_handle = None
        group.param_gather_dispatched = False
        group.per_param_grad_ready_counts = {}


def slot_shape(param: torch.nn.Parameter, shard: UnitShard, num_units: int) -> torch.Size:
    """The shape ``param`` has on a rank that holds ``num_units`` units of its family (any layout)."""
    dim = param.partition_dim
    shape = list(param.shape)
    per_unit, rest = divmod(shape[dim], len(shard.units))
    assert rest == 0, f"dimension {dim} of {tuple(param.shape)} is not a multiple of {len(shard.units)} units"
    shape[dim] = per_unit * num_units
    return torch.Size(shape)


def shadow_module(module: torch.nn.Module, topology: Topology, block: int,
                  device: Optional[torch.device] = None) -> torch.nn.Module:
    """A module whose parameters have the names, order, dtypes and attributes of ``module``'s at the shapes a
    healthy rank at slot ``block`` has (a TP-split one tagged with the block's units, ``ntp_shard``). Megatron's
    DDP lays buckets out from exactly those properties, so a DDP over this module has a slot-``block`` rank's
    buckets.

    ``device`` None: on the meta device (gradient buckets only). Otherwise real tensors on ``device`` for a DDP
    with the distributed optimizer's parameter buffer, which copies each ``param.data`` into itself and then
    points ``param.data`` at its part: until then every parameter is an expanded single element (stride 0, no
    ``_base``), so building a shadow allocates nothing but its buffers; the caller fills them."""
    root = torch.nn.Module()
    for name, param in module.named_parameters():
        shard: Optional[UnitShard] = getattr(param, "ntp_shard", None)
        units = None if shard is None else tuple(topology.block(shard.family, block))
        shape = param.shape if shard is None else slot_shape(param, shard, len(units))
        if device is None:
            data = torch.empty(shape, dtype=param.dtype, device="meta")
        else:
            data = torch.empty_strided(shape, (0,) * len(shape), dtype=param.dtype, device=device)
        shadow = torch.nn.Parameter(data, requires_grad=param.requires_grad)
        for attr in _PARAM_ATTRS:
            if hasattr(param, attr):
                setattr(shadow, attr, getattr(param, attr))
        if shard is not None:
            shadow.ntp_shard = UnitShard(shard.family, shard.num_units, units, shard.outer, shard.inner)
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, shadow)
    names = [n for n, _ in root.named_parameters()]
    assert names == [n for n, _ in module.named_parameters()], "shadow parameters must keep the model's order"
    return root


@dataclass(frozen=True)
class _Piece:
    """Some units of one block of one TP-split parameter, on one rank: where they sit locally (positions in
    that rank's unit list) and in the block (positions in the block's unit list)."""

    name: str
    shard: UnitShard
    local: torch.Tensor
    in_block: torch.Tensor

    @property
    def numel(self) -> int:
        return self.shard.outer * len(self.local) * self.shard.inner


def _pieces(topology: Topology, rank: int, block: int, split: list[tuple[str, UnitShard]],
            device: torch.device) -> list[_Piece]:
    """Every unit of ``block`` that ``rank`` holds, per TP-split parameter, in parameter order."""
    out = []
    for name, shard in split:
        held = topology.units_of(rank, shard.family)
        block_units = topology.block(shard.family, block)
        start = block_units[0]
        mine = [(i, u - start) for i, u in enumerate(held) if start <= u <= block_units[-1]]
        if mine:
            local, in_block = zip(*mine)
            out.append(_Piece(name, shard, torch.tensor(local, device=device), torch.tensor(in_block, device=device)))
    return out


def _unit_view(tensor: torch.Tensor, shard: UnitShard, units: int) -> torch.Tensor:
    return tensor.view(shard.outer, units, shard.inner)


def buffer_layout_of(buffer) -> tuple[BufferLayout, dict[str, torch.nn.Parameter]]:
    """The geometry of one of Megatron's ``_ParamAndGradBuffer`` objects as :mod:`ntp_megatron.plan.optimizer_shards`
    describes it (parameters named by their place in the buffer), and those names' parameters."""
    order = sorted(buffer.param_index_map.items(), key=lambda item: item[1][0])
    params = {f"{start}": param for param, (start, _, _) in order}
    places = tuple(ParamPlace(f"{start}", start, end, bucket) for _, (start, end, bucket) in order)
    buckets = tuple(Bucket(b.offset, b.grad_data.numel(), b.numel_unpadded) for b in buffer.buckets)
    return BufferLayout(places, buckets), params


def shard_square_sums(buffers, split: set[int], position: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 sums of squared gradients in position ``position``'s shard (of ``size``) of every bucket of
    ``buffers`` (Megatron's ``_ParamAndGradBuffer``): over the pieces of TP-split parameters (``split``: their
    ids) and over those of replicated ones. Bucket by bucket, pieces in buffer order: the same order on every rank
    that holds the same buffers."""
    device = buffers[0].grad_data.device
    sums = {True: torch.zeros((), dtype=torch.float64, device=device),
            False: torch.zeros((), dtype=torch.float64, device=device)}
    for buffer in buffers:
        layout, params = buffer_layout_of(buffer)
        for piece in shard_pieces(layout, size, position):
            grad = buffer.grad_data[piece.buffer_start:piece.buffer_start + piece.end - piece.start]
            sums[id(params[piece.name]) in split] += grad.double().pow(2).sum()
    return sums[True], sums[False]


@dataclass
class Adoptable:
    """A DDP of the objects a rank holds now that its objects for a new layout may take over as their shadow of
    ``block`` (under the distributed optimizer: a healthy rank's own DDP, or a degraded rank's shadow, whose buffers
    hold the block's slot-shaped buckets and this rank's shard of them), so the rank never holds the block twice."""

    block: int
    ddp: DistributedDataParallel
    groups: NTPGroups
    """The groups it is bound to now (it is pointed at the new ones, and back if the formation fails)."""
    previous_owner: object = None


class _Shadow:
    """Slot-shaped buckets of one block on a degraded rank: Megatron's DDP over a :func:`shadow_module`.

    Without the distributed optimizer, a meta module: gradient buckets only, all-reduced over sync group
    ``block``. With it (``distributed_optimizer``), real parameters in the DDP's parameter buffer and the buffers
    sharded like a healthy slot-``block`` rank's (:meth:`NTPGroups.with_sync_groups`): the distributed optimizer
    steps this rank's shard of them."""

    def __init__(self, module: torch.nn.Module, topology: Topology, block: int, groups: NTPGroups, tf_config,
                 ddp_config, distributed_optimizer: bool = False, adopted: Optional["Adoptable"] = None) -> None:
        self.block = block
        pg = (groups.with_sync_groups(block) if distributed_optimizer
              else groups.with_data_parallel(groups.sync[block]))
        self.adopted, self.groups = adopted, groups
        if adopted is not None:
            self._adopt(module, topology, groups, pg)
        else:
            device = next(module.parameters()).device if distributed_optimizer else None
            self.module = shadow_module(module, topology, block, device)
            self.ddp = DistributedDataParallel(tf_config, copy.deepcopy(ddp_config), self.module, pg_collection=pg)
        self.params = dict(self.module.named_parameters())
        self.grads = {name: p.main_grad for name, p in self.params.items()}
        self.block_units = {family: len(topology.block(family, block)) for family in topology.units}

    def region(self, piece: _Piece, what: str = "grad") -> torch.Tensor:
        """The block's units of ``piece``'s parameter, as ``[outer, units, inner]``: of its gradient (``grad``) or
        of its value (``param``; real shadows only)."""
        tensor = self.grads[piece.name] if what == "grad" else self.params[piece.name].data
        return _unit_view(tensor, piece.shard, self.block_units[piece.shard.family])

    def _adopt(self, module: torch.nn.Module, topology: Topology, groups: NTPGroups, pg) -> None:
        """Take over ``self.adopted``'s DDP (its buffers hold this block's slot-shaped buckets, with this rank's
        shard of them at the same position): pointed at ``groups``, with nothing in flight, and back in its first
        batch, as a DDP that never runs backward is (its sync is started by ``finish_grad_sync``)."""
        ddp, expected = self.adopted.ddp, shadow_module(module, topology, self.block)
        shapes = [(n, p.shape, p.dtype) for n, p in ddp.module.named_parameters()]
        if shapes != [(n, p.shape, p.dtype) for n, p in expected.named_parameters()]:
            raise RuntimeError(f"block {self.block}: the DDP to adopt does not hold the block's slot-shaped "
                               "parameters")
        abandon_collectives(ddp)
        rebind_process_groups([ddp], self.adopted.groups, groups)
        bound = {"dp_group": pg.dp, "dp_cp_group": pg.dp_cp, "intra_dp_cp_group": pg.intra_dp_cp, "tp_group": pg.tp,
                 "inter_dist_opt_group": getattr(pg, "inter_dist_opt", None)}
        wrong = [name for name, group in bound.items() if getattr(ddp, name, group) is not group]
        wrong += [f"buffer {i}" for i, b in enumerate(ddp.buffers) if b.data_parallel_group is not pg.intra_dp_cp]
        # Megatron keeps the group's size and this rank's place in it as numbers (they cut the buffers): the same
        # only where the block's group did not change in size or order (no replica is dropped live under the
        # distributed optimizer, and the caller checked the position).
        size, rank = pg.intra_dp_cp.size(), pg.intra_dp_cp.rank()
        wrong += [f"buffer {i} size" for i, b in enumerate(ddp.buffers) if b.data_parallel_world_size != size]
        wrong += [f"bucket group {i} place" for i, g in enumerate(ddp.bucket_groups)
                  if (g.intra_distributed_optimizer_instance_size, g.intra_distributed_optimizer_instance_rank)
                  != (size, rank)]
        if wrong:
            rebind_process_groups([ddp], groups, self.adopted.groups)  # not adopted: back as it was
            raise RuntimeError(f"block {self.block}: the adopted DDP is not bound to the new groups ({wrong})")
        for group in ddp.bucket_groups:  # (a hand-back leaves them so: handed-back objects never train again)
            group.is_first_batch = True
            group.golden_per_param_grad_ready_counts = {}
        self.adopted.previous_owner = getattr(ddp, "ntp_owner", None)
        # A weak reference: the rebinding walk follows attributes, and must not reach this generation's groups.
        ddp.ntp_owner = weakref.ref(self)
        self.ddp, self.module = ddp, ddp.module

    def settle(self) -> None:
        """The formation completed: the DDP is this shadow's for good; what a hand-back needed (the old groups,
        the old owner) goes, so that nothing keeps an ended generation alive."""
        self.adopted = None

    def close(self, hand_back: bool = False) -> None:
        """Release the DDP; ``hand_back`` (the formation these objects were built for did not complete): an
        adopted one goes back to the objects it came from, bound to their groups again."""
        if hand_back and self.adopted is not None:
            rebind_process_groups([self.ddp], self.groups, self.adopted.groups)
            if self.adopted.previous_owner is None:
                del self.ddp.ntp_owner
            else:
                self.ddp.ntp_owner = self.adopted.previous_owner
        else:
            release_ddp(self.ddp, self)
        self.ddp = self.module = None
        self.params, self.grads = {}, {}


@dataclass(frozen=True)
class _Transfer:
    """One packed message inside a degraded replica: the pieces of ``block`` held by ``holder`` (a rank that
    is not the block's sync-group member), in parameter order."""

    block: int
    holder: int
    member: int
    pieces: tuple[_Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


class GradSync:
    """One rank's part of the cross-replica sync for one topology. Register :meth:`finalize_model_grads` as
    the model config's ``finalize_model_grads_func`` and :meth:`grad_norm` as the grad-norm override."""

    def __init__(self, topology: Topology, rank: int, groups: NTPGroups, model: DistributedDataParallel,
                 tf_config, ddp_config, adopt: Optional[dict[int, Adoptable]] = None, fill: bool = True) -> None:
        """``ddp_config``: the job's DDP config as given to every healthy rank (before DDP mutated it). ``adopt``:
        block -> a DDP to take over as that block's shadow (a degraded rank under the distributed optimizer).
        ``fill``: the shadows' parameters from the model (not when the caller fills them: a re-formation gathers
        them from the optimizer's shards, a checkpoint load refills them)."""
        self.topology, self.rank, self.groups = topology, rank, groups
        replica = topology.replica_of(rank)
        self.replica = replica.index
        self.members = list(groups.sync)                  # blocks this rank serves, ascending
        self.block0_member = topology.sync_member(replica.index, 0)
        self.tp_base = topology.tp_base
        self.uneven = any(n % topology.tp_base for n in topology.units.values())
        self.params: list[tuple[str, torch.nn.Parameter]] = [
            (n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.split = [(n, p.ntp_shard) for n, p in self.params if hasattr(p, "ntp_shard")]
        self.replicated = [(n, p) for n, p in self.params if not hasattr(p, "ntp_shard")]
        for name, param in self.params:
            if getattr(param, "tensor_model_parallel", False) and not hasattr(param, "ntp_shard"):
                raise ValueError(f"TP-split parameter {name} has no unit shard: it would be synced as replicated")
        self._by_name = dict(self.params)
        self.ddp = model
        self.distributed_optimizer = bool(ddp_config.use_distributed_optimizer)
        if self.distributed_optimizer and ddp_config.overlap_param_gather:
            raise ValueError("the distributed optimizer under NTP does not support overlap_param_gather (its "
                             "gather runs in the next forward's pre-hooks, not after the optimizer step)")
        degraded = [rep.index for rep in topology.replicas if not topology.is_healthy(rep.index)]  # or rebalanced
        if (self.distributed_optimizer and ddp_config.overlap_grad_reduce and groups.instances > 1 and degraded
                and dist.get_backend() == "gloo"):
            # With several instances Megatron syncs each bucket synchronously inside the backward hook of a healthy
            # rank (on gloo the host waits there; NCCL would only enqueue it), between its TP collectives; a proxy
            # serves its blocks' shadows one after another after its backward: a healthy rank waits in a hook for
            # the proxy, which waits for a bucket that needs the healthy rank's TP peers, blocked in their own
            # hooks (seen: gloo's recv timeout at iteration 2).
            raise ValueError(
                f"parallel.overlap_grad_reduce with parallel.num_distributed_optimizer_instances {groups.instances} "
                f"deadlocks on gloo while a replica is degraded (replica {degraded[0]} at TP "
                f"{topology.replica(degraded[0]).width} of {topology.tp_base}): the gradient sync of a healthy rank "
                "waits in its backward hooks for the degraded replica's proxy; set "
                "parallel.overlap_grad_reduce: false")
        self._cached_norm: Optional[float] = None
        self.tied = tied_embedding_sync(groups.pipeline, rank, model.module)
        """Tied word embeddings across pipeline stages: the two copies' gradients summed before the sync."""
        self.shadows: dict[int, _Shadow] = {}
        self.own: dict[int, list[_Piece]] = {}
        self.incoming: list[_Transfer] = []
        self.outgoing: list[_Transfer] = []
        if not groups.healthy:
            try:
                self._plan_degraded(model, tf_config, ddp_config, adopt or {})
                if self.distributed_optimizer and fill:
                    self._fill_shadows()
            except BaseException:
                self.close(hand_back=True)  # what was adopted goes back before the error goes on
                raise

    # -- degraded replica: shadows and in-replica transfers ---------------------------------------------------
    def _plan_degraded(self, model, tf_config, ddp_config, adopt: dict[int, Adoptable]) -> None:
        topo, rank = self.topology, self.rank
        device = self.params[0][1].main_grad.device
        for block in self.members:
            self.shadows[block] = _Shadow(model.module, topo, block, self.groups, tf_config, ddp_config,
                                          distributed_optimizer=self.distributed_optimizer, adopted=adopt.get(block))
            self.own[block] = _pieces(topo, rank, block, self.split, device)
        replica = topo.replica(self.replica)
        for block in range(self.tp_base):
            member = topo.sync_member(self.replica, block)
            for holder in replica.ranks:
                if holder == member or (rank not in (holder, member)):
                    continue
                pieces = tuple(_pieces(topo, holder, block, self.split, device))
                if not pieces:
                    continue
                transfer = _Transfer(block, holder, member, pieces)
                (self.incoming if rank == member else self.outgoing).append(transfer)

    def _model_units(self, piece: _Piece, what: str) -> torch.Tensor:
        """This rank's units of ``piece``'s parameter as ``[outer, units, inner]``: gradient or value."""
        param = self._by_name[piece.name]
        return _unit_view(param.main_grad if what == "grad" else param.data, piece.shard, len(piece.shard.units))

    def _pack(self, transfer: _Transfer, from_shadow: bool, what: str) -> torch.Tensor:
        parts = []
        for piece in transfer.pieces:
            if from_shadow:
                source, index = self.shadows[transfer.block].region(piece, what), piece.in_block
            else:
                source, index = self._model_units(piece, what), piece.local
            parts.append(source.index_select(1, index).reshape(-1))
        return torch.cat(parts)

    def _unpack(self, transfer: _Transfer, buffer: torch.Tensor, into_shadow: bool, what: str) -> None:
        offset = 0
        for piece in transfer.pieces:
            chunk = buffer[offset:offset + piece.numel].view(piece.shard.outer, -1, piece.shard.inner)
            offset += piece.numel
            if into_shadow:
                self.shadows[transfer.block].region(piece, what).index_copy_(1, piece.in_block, chunk)
            else:
                self._model_units(piece, what).index_copy_(1, piece.local, chunk)

    def _exchange(self, receive: list[_Transfer], send: list[_Transfer], to_member: bool,
                  what: str = "grad") -> None:
        """Post every receive and send of one direction, then complete them: receives land in the shadows
        (towards members) or in the model (back to holders). ``what``: gradients (fp32, as the buffers hold
        them) or parameter values (in the model's dtype)."""
        tag_base = 0 if to_member else self.tp_base
        tp = self.groups.tp
        dtype = torch.float32 if what == "grad" else self.params[0][1].dtype
        works = []
        for t in receive:
            buffer = torch.empty(t.numel, dtype=dtype, device=self._device)
            peer = t.holder if to_member else t.member
            works.append((t, buffer, dist.irecv(buffer, src=peer, group=tp, tag=tag_base + t.block)))
        sends = []
        for t in send:
            buffer = self._pack(t, from_shadow=not to_member, what=what)
            peer = t.member if to_member else t.holder
            sends.append((buffer, dist.isend(buffer, dst=peer, group=tp, tag=tag_base + t.block)))
        for t, buffer, work in works:
            work.wait()
            self._unpack(t, buffer, into_shadow=to_member, what=what)
        for _, work in sends:
            work.wait()

    @property
    def _device(self) -> torch.device:
        return self.params[0][1].main_grad.device

    @torch.no_grad()
    def _fill_shadows(self) -> None:
        """Under the distributed optimizer, before it is built (under bf16 it clones its fp32 main params from
        the shadows at construction): every shadow's parameters from the model — this rank's units of the block,
        the replica peers' units of it (received in the model's dtype), the replicated parameters."""
        for block, shadow in self.shadows.items():
            for piece in self.own[block]:
                shadow.region(piece, "param").index_copy_(
                    1, piece.in_block, self._model_units(piece, "param").index_select(1, piece.local))
            for name, param in self.replicated:
                shadow.params[name].data.copy_(param.data)
        self._exchange(self.incoming, self.outgoing, to_member=True, what="param")

    def refill_shadows(self) -> None:
        """After the model's weights changed outside the optimizer (a checkpoint load), the shadows' parameters
        from the model again, as before the optimizer was built (under the distributed optimizer on a degraded
        rank; a collective over the replica). Nothing to do elsewhere."""
        if self.distributed_optimizer and self.shadows:
            self._fill_shadows()

    def _sync_degraded(self, num_tokens: Optional[torch.Tensor]) -> None:
        for block, shadow in self.shadows.items():
            shadow.ddp.zero_grad_buffer()
            for piece in self.own[block]:
                shadow.region(piece).index_copy_(
                    1, piece.in_block, self._model_units(piece, "grad").index_select(1, piece.local))
            for name, param in self.replicated:
                shadow.grads[name].copy_(param.main_grad)
        self._exchange(self.incoming, self.outgoing, to_member=True)
        for shadow in self.shadows.values():      # ascending block order on every rank
            shadow.ddp.finish_grad_sync()         # upstream: bucket by bucket over sync group `block`
        if num_tokens is not None:
            num_tokens.copy_(self.sum_over_replicas(num_tokens))
            if num_tokens > 0:
                scaling = 1.0 / num_tokens        # upstream's arithmetic, so the bits match healthy ranks
                for shadow in self.shadows.values():
                    shadow.ddp.scale_gradients(scaling)
        if self.distributed_optimizer:
            return  # only the shards are reduced: the optimizer steps them in the shadows; nothing goes back
        for block, shadow in self.shadows.items():
            for piece in self.own[block]:
                self._model_units(piece, "grad").index_copy_(
                    1, piece.local, shadow.region(piece).index_select(1, piece.in_block))
        if self.shadows:
            first = next(iter(self.shadows.values()))
            for name, param in self.replicated:
                param.main_grad.copy_(first.grads[name])
        self._exchange(self.outgoing, self.incoming, to_member=False)

    def _gather_degraded(self) -> None:
        """:meth:`param_gather` on a degraded rank: each shadow's all-gather, then the model's units from them."""
        for shadow in self.shadows.values():      # ascending block order on every rank
            shadow.ddp.start_param_sync(force_sync=True)
        for block, shadow in self.shadows.items():
            for piece in self.own[block]:
                self._model_units(piece, "param").index_copy_(
                    1, piece.local, shadow.region(piece, "param").index_select(1, piece.in_block))
        first = self.shadows[self.members[0]]
        for name, param in self.replicated:
            param.data.copy_(first.params[name].data)
        self._exchange(self.outgoing, self.incoming, to_member=False, what="param")

    def close(self, hand_back: bool = False) -> None:
        """Release the shadows (and, with them, this generation's sync groups); ``hand_back``: the formation did
        not complete, and the DDPs the shadows adopted go back to the objects they came from."""
        for shadow in self.shadows.values():
            shadow.close(hand_back)
        self.shadows = {}

    def adopted_blocks(self) -> dict[int, DistributedDataParallel]:
        """Block -> the DDP its shadow adopted (until :meth:`settle`)."""
        return {block: shadow.ddp for block, shadow in self.shadows.items() if shadow.adopted is not None}

    def settle(self) -> None:
        """The formation these objects were built for completed: the adopted DDPs are theirs for good."""
        for shadow in self.shadows.values():
            shadow.settle()

    # -- every rank ------------------------------------------------------------------------------------------
    def finalize_model_grads(self, model, num_tokens: Optional[torch.Tensor] = None, pg_collection=None,
                             force_all_reduce: bool = False) -> None:
        """Megatron's ``finalize_model_grads`` for NTP: upstream's on a healthy rank, the shadow sync on a
        degraded one; then, with uneven blocks, replicated gradients from block 0's member."""
        phases.point("grad_sync")
        if self.tied is not None:
            self.tied.exchange()
        if num_tokens is not None and self.groups.pipeline is not None:
            # Counted by the last stage only; upstream broadcasts it along a pipeline group, which NTP stages of
            # different widths do not have: from the last stage's first rank over the replica instead.
            dist.broadcast(num_tokens, src=self.groups.last_stage_rank, group=self.groups.mp)
        if self.groups.healthy and self.groups.pipeline is None:
            finalize_model_grads(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        elif self.groups.healthy:
            finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
            if num_tokens is not None:  # upstream's reduction and arithmetic (the sync group is the DP group)
                num_tokens.copy_(self.sum_over_replicas(num_tokens))
                if num_tokens > 0:
                    for chunk in model:
                        chunk.scale_gradients(1.0 / num_tokens)
        else:
            self._sync_degraded(num_tokens)
        if self._replicated_from_block0 and not self.distributed_optimizer:
            self._broadcast_from_block0([p.main_grad for _, p in self.replicated])

    @property
    def _replicated_from_block0(self) -> bool:
        return self.uneven and bool(self.replicated) and self.groups.tp.size() > 1

    def _broadcast_from_block0(self, tensors: list[torch.Tensor]) -> None:
        """Block 0's member's values of ``tensors`` (one per replicated parameter) on every rank of the replica."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=self.block0_member, group=self.groups.tp)
        offset = 0
        for tensor in tensors:
            tensor.view(-1).copy_(flat[offset:offset + tensor.numel()])
            offset += tensor.numel()

    @torch.no_grad()
    def param_gather(self) -> None:
        """Under the distributed optimizer, after the (local) optimizer step: every member's updated shard of each
        bucket to the other members of its group (upstream's synchronous all-gather, which the step left out),
        then, with uneven blocks, the replicated parameters from block 0's member. Idempotent given the shards;
        nothing to do without the distributed optimizer."""
        if not self.distributed_optimizer:
            return
        if self.groups.healthy:
            self.ddp.start_param_sync(force_sync=True)
        else:
            self._gather_degraded()
        if self._replicated_from_block0:
            self._broadcast_from_block0([p.data for _, p in self.replicated])
            for shadow in self.shadows.values():  # as a healthy slot's buffer holds them after the broadcast
                for name, param in self.replicated:
                    shadow.params[name].data.copy_(param.data)

    def replicated_state_source(self) -> Optional[int]:
        """The rank whose optimizer state of replicated parameters is the replica's, where slots' copies may
        differ in the last bits (uneven blocks under the distributed optimizer, more than two replicas: see the
        module docstring); None where every slot's copy is the same."""
        replicas = self.groups.sync[self.members[0]].size()
        if self._replicated_from_block0 and self.distributed_optimizer and replicas > 2:
            return self.block0_member
        return None

    def sum_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over replicas of a value every rank of a replica holds alike (each replica counted once):
        an all-reduce in each sync group this rank is a member of (the results are equal; the first is
        returned)."""
        result = None
        for group in self.groups.sync.values():
            reduced = value.clone()
            dist.all_reduce(reduced, group=group)
            result = reduced if result is None else result
        return result

    def grad_norm(self, *_args, **_kwargs) -> float:
        """Megatron's ``get_grad_norm_fp32`` under NTP: the norm :meth:`compute_grad_norm` computed before the
        commit point (the optimizer's step after it must not communicate), or, outside the training loop, a
        fresh one."""
        cached, self._cached_norm = self._cached_norm, None
        return cached if cached is not None else self._grad_norm()

    def compute_grad_norm(self) -> float:
        """Compute (a collective over the replica) and keep the grad norm the next optimizer step clips with."""
        self._cached_norm = self._grad_norm()
        return self._cached_norm

    @torch.no_grad()
    def _grad_norm(self) -> float:
        """The global L2 norm of the synced gradients, bit-identical on every rank of every replica."""
        if self.distributed_optimizer:
            return self._shard_grad_norm()
        n_split = len(self.split)
        table = torch.zeros(n_split * self.tp_base + len(self.replicated), dtype=torch.float64,
                            device=self._device)
        # The last stage's copy of tied embeddings is counted once, in the first stage (upstream's
        # param_is_not_shared): its cells stay zero.
        counted = [(i, name) for i, (name, _) in enumerate(self.split)
                   if not getattr(self._by_name[name], "shared", False)]
        if self.groups.healthy:
            [block] = self.members
            for i, name in counted:
                table[i * self.tp_base + block] = self._by_name[name].main_grad.double().pow(2).sum()
        else:
            for block, shadow in self.shadows.items():
                for i, name in counted:
                    table[i * self.tp_base + block] = shadow.grads[name].double().pow(2).sum()
        if self.rank == self.block0_member:
            for j, (_, param) in enumerate(self.replicated):
                table[n_split * self.tp_base + j] = param.main_grad.double().pow(2).sum()
        dist.all_reduce(table, group=self.groups.tp)
        return math.sqrt(self._over_stages(math.fsum(table.tolist())))

    def _over_stages(self, stage_sum: float) -> float:
        """The sum of squares of the replica from its stage's: one cell per stage, filled by the stage's TP rank 0,
        summed over the replica's model-parallel group (each cell has one contributor: exact, and the same bits in
        every replica). Without stages, the stage's own."""
        pipeline = self.groups.pipeline
        if pipeline is None:
            return stage_sum
        stage = self.topology.stage
        cells = torch.zeros(pipeline.num_stages, dtype=torch.float64, device=self._device)
        if self.topology.local_rank(self.rank) == 0:
            cells[stage] = stage_sum
        dist.all_reduce(cells, group=self.groups.mp)
        return math.fsum(cells.tolist())

    def shard_sources(self) -> list[tuple[int, list]]:
        """(block, Megatron buffers holding that block's reduced shards) for every block this rank serves."""
        if self.groups.healthy:
            return [(self.members[0], self.ddp.buffers)]
        return [(block, shadow.ddp.buffers) for block, shadow in self.shadows.items()]

    def optimizer_chunks(self) -> list[DistributedDataParallel]:
        """The DDPs whose buffers the optimizer steps: the model's, or under the distributed optimizer on a
        degraded rank the shadows' (ascending blocks)."""
        if self.distributed_optimizer and not self.groups.healthy:
            return [shadow.ddp for shadow in self.shadows.values()]
        return [self.ddp]

    def _shard_grad_norm(self) -> float:
        """The norm from the reduced shards (distributed optimizer): a cell per (block, position) of TP-split
        pieces, and per position of replicated pieces of block 0; each cell filled by the one rank that holds
        it, summed over the replica (TP group) and then over the sync group, which the buffers shard over."""
        sources = self.shard_sources()
        groups = [buffers[0].data_parallel_group for _, buffers in sources]
        size = groups[0].size()
        split = {id(param) for _, buffers in sources for buffer in buffers for param in buffer.param_index_map
                 if hasattr(param, "ntp_shard")}  # the model's or the shadows' (both tagged)
        table = torch.zeros(self.tp_base * size + size, dtype=torch.float64, device=self._device)
        for (block, buffers), group in zip(sources, groups):
            position = group.rank()
            split_sq, replicated_sq = shard_square_sums(buffers, split, position, size)
            table[block * size + position] = split_sq
            if block == 0:
                table[self.tp_base * size + position] = replicated_sq
        dist.all_reduce(table, group=self.groups.tp)
        summed = None
        for group in groups:  # one per sync group this rank is a member of; all sums are equal
            reduced = table.clone()
            dist.all_reduce(reduced, group=group)
            summed = reduced if summed is None else summed
        return math.sqrt(math.fsum(summed.tolist()))
