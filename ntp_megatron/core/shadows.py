"""A degraded rank's slot-shaped shadow of one block: Megatron's own DDP over a module with a healthy slot-``s``
rank's parameter shapes, so its flat buckets (and, under the distributed optimizer, its shards) match that rank's byte
for byte (:mod:`ntp_megatron.core.grad_sync` says why). Also the pieces of a block a rank holds (:class:`Piece`), and
a DDP's lifecycle across re-formations: adopted by a new layout's shadow, handed back, released."""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.distributed import DistributedDataParallel

from ntp_megatron.core.groups import NTPGroups, rebind_process_groups
from ntp_megatron.core.layers import HeldUnits
from ntp_megatron.plan.layout import Topology

# Attributes Megatron's DDP and optimizer read from a parameter; a shadow parameter carries them too.
_PARAM_ATTRS = ("allreduce", "shared_embedding", "tensor_model_parallel", "partition_dim", "partition_stride",
                "sequence_parallel")


def release_ddp(ddp: DistributedDataParallel, owner: object) -> None:
    """Break the reference cycle a Megatron DDP keeps through autograd: it holds each parameter's gradient
    accumulator, whose hook holds the DDP. The accumulator is a C++ object the garbage collector cannot see
    through, so without this a discarded DDP — its buffers and process groups with it — lives forever.

    Only by its ``owner``: a DDP newer objects adopted (:class:`Shadow`, ``adopted``) is theirs now, and its
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


def slot_shape(param: torch.nn.Parameter, held: HeldUnits, num_units: int) -> torch.Size:
    """The shape ``param`` has on a rank that holds ``num_units`` units of its family (any layout)."""
    dim = param.partition_dim
    shape = list(param.shape)
    per_unit, rest = divmod(shape[dim], len(held.units))
    assert rest == 0, f"dimension {dim} of {tuple(param.shape)} is not a multiple of {len(held.units)} units"
    shape[dim] = per_unit * num_units
    return torch.Size(shape)


def shadow_module(module: torch.nn.Module, topology: Topology, block: int,
                  device: Optional[torch.device] = None) -> torch.nn.Module:
    """A module whose parameters have the names, order, dtypes and attributes of ``module``'s at the shapes a
    healthy rank at slot ``block`` has (a TP-split one tagged with the block's units, ``ntp_held_units``). Megatron's
    DDP lays buckets out from exactly those properties, so a DDP over this module has a slot-``block`` rank's
    buckets.

    ``device`` None: on the meta device (gradient buckets only). Otherwise real tensors on ``device`` for a DDP
    with the distributed optimizer's parameter buffer, which copies each ``param.data`` into itself and then
    points ``param.data`` at its part: until then every parameter is an expanded single element (stride 0, no
    ``_base``), so building a shadow allocates nothing but its buffers; the caller fills them."""
    root = torch.nn.Module()
    for name, param in module.named_parameters():
        held: Optional[HeldUnits] = getattr(param, "ntp_held_units", None)
        units = None if held is None else tuple(topology.block(held.family, block))
        shape = param.shape if held is None else slot_shape(param, held, len(units))
        if device is None:
            data = torch.empty(shape, dtype=param.dtype, device="meta")
        else:
            data = torch.empty_strided(shape, (0,) * len(shape), dtype=param.dtype, device=device)
        shadow = torch.nn.Parameter(data, requires_grad=param.requires_grad)
        for attr in _PARAM_ATTRS:
            if hasattr(param, attr):
                setattr(shadow, attr, getattr(param, attr))
        if held is not None:
            shadow.ntp_held_units = HeldUnits(held.family, held.num_units, units, held.outer, held.inner)
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
class Piece:
    """Some units of one block of one TP-split parameter, on one rank: where they sit locally (positions in
    that rank's unit list) and in the block (positions in the block's unit list)."""

    name: str
    held: HeldUnits
    local: torch.Tensor
    in_block: torch.Tensor

    @property
    def numel(self) -> int:
        return self.held.outer * len(self.local) * self.held.inner


def block_pieces(topology: Topology, rank: int, block: int, split: list[tuple[str, HeldUnits]],
            device: torch.device) -> list[Piece]:
    """Every unit of ``block`` that ``rank`` holds, per TP-split parameter, in parameter order."""
    out = []
    for name, held in split:
        rank_units = topology.units_of(rank, held.family)
        block_units = topology.block(held.family, block)
        start = block_units[0]
        mine = [(i, u - start) for i, u in enumerate(rank_units) if start <= u <= block_units[-1]]
        if mine:
            local, in_block = zip(*mine)
            out.append(Piece(name, held, torch.tensor(local, device=device), torch.tensor(in_block, device=device)))
    return out


def unit_view(tensor: torch.Tensor, held: HeldUnits, units: int) -> torch.Tensor:
    return tensor.view(held.outer, units, held.inner)


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


class Shadow:
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

    def region(self, piece: Piece, what: str = "grad") -> torch.Tensor:
        """The block's units of ``piece``'s parameter, as ``[outer, units, inner]``: of its gradient (``grad``) or
        of its value (``param``; real shadows only)."""
        tensor = self.grads[piece.name] if what == "grad" else self.params[piece.name].data
        return unit_view(tensor, piece.held, self.block_units[piece.held.family])

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
