"""How one rank's NTP state maps onto Megatron-Core's global tensors, for ``dist_checkpointing``.

A TP-split tensor of an NTP rank holds an explicit, possibly uneven and non-contiguous, list of units
(:class:`ntp_megatron.core.layers.HeldUnits`): a degraded rank may hold query groups {0, 1, 6}. Megatron describes a
rank's part of a global tensor with ``ShardedTensor`` boxes (a global offset and a local shape per axis), so
each maximal run of consecutive units becomes one box, *a fragment*, with an explicit global offset and no
regular grid (``axis_fragmentations=None``). One local tensor maps to several fragments, so it is wrapped in a
``ShardedTensorFactory`` whose build cuts the fragments out of the local tensor and whose merge puts the
loaded fragments back in local unit order; the same factory then describes the optimizer state of the
parameter (Megatron applies a parameter's factory to its Adam moments).

The global tensors are exactly plain Megatron-Core's: same keys, same global shapes, same element order.
Along the split axis a tensor is ``blocks`` consecutive blocks (2 for a gated fc1: every gate row, then every
up row — what Megatron's swiglu factory writes; 1 otherwise), and block ``k`` holds unit ``u`` at rows
``[(k·N + u)·L, (k·N + u + 1)·L)`` for ``N`` units of ``L`` rows (or columns) each. That is the layout a TP1
model has, and the one uniform TP ``t`` writes as ``t`` contiguous pieces per block.

Who writes (``replica_id``): every replica holds every unit once, so exactly one replica — the *writer* —
marks its pieces as the main replica: the lowest-index healthy replica if there is one (its fragments are
whole canonical blocks, the fewest pieces), else the lowest-index replica. A TP-split fragment gets
``(0, 0, r)`` and a replicated tensor (norms, row-parallel biases, position embeddings, extra state)
``(0, tp_rank, r)``, where ``r`` is 0 for the writer and 1, 2, ... for the other replicas: so the writer's
fragments and the writer's TP rank 0's replicated tensors are main, whatever replicas are degraded or gone.

Everything here except the torch-level builders is plain data, so coverage properties can be checked for any
topology without processes (``tests/jobs/checkpoint/test_ntp_checkpoint.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import (
    ReplicaId,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

ROLE_KEY = "ntp_role"
"""Key of the :class:`CheckpointRole` in the ``metadata`` passed to ``NTPGPTModel.sharded_state_dict``."""


# ---------------------------------------------------------------------------------------------------------------
# Geometry: plain data


def unit_runs(units: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive units as ``(first unit, its local position, length)``.

    ``unit_runs([0, 1, 6]) == [(0, 0, 2), (6, 2, 1)]``. Units are a rank's, ascending and distinct."""
    runs: list[tuple[int, int, int]] = []
    for position, unit in enumerate(units):
        if position and unit <= units[position - 1]:
            raise ValueError(f"units must be ascending and distinct, got {list(units)}")
        if runs and runs[-1][0] + runs[-1][2] == unit:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((unit, position, 1))
    return runs


@dataclass(frozen=True)
class UnitAxis:
    """Where a family's units lie in a tensor: along ``axis``, ``blocks`` consecutive blocks each holding every
    unit in order, ``unit_len`` rows (or columns) per unit per block, ``num_units`` units in all."""

    axis: int
    blocks: int
    unit_len: int
    num_units: int

    @property
    def global_length(self) -> int:
        return self.blocks * self.num_units * self.unit_len

    @classmethod
    def of(cls, local_shape: Sequence[int], axis: int, num_units: int, num_local: int, outer: int,
           inner: int) -> "UnitAxis":
        """From a parameter's ``[outer, units, inner]`` folding (:class:`ntp_megatron.core.layers.HeldUnits`) and its
        local shape: the axes before ``axis`` fold into ``outer`` (what is left of it is ``blocks``), the axes
        after it into ``inner`` (what is left of it is ``unit_len``)."""
        shape = tuple(local_shape)
        if not 0 <= axis < len(shape):
            raise ValueError(f"split axis {axis} out of range for a tensor of shape {shape}")
        before, after = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
        blocks, unit_len = outer // before, inner // after
        if blocks * before != outer or unit_len * after != inner or shape[axis] != blocks * num_local * unit_len:
            raise ValueError(f"a tensor of shape {shape} split on axis {axis} does not fold as "
                             f"[outer={outer}, {num_local} units, inner={inner}]")
        return cls(axis=axis, blocks=blocks, unit_len=unit_len, num_units=num_units)


@dataclass(frozen=True)
class Fragment:
    """One box of a global tensor held by a rank: ``global_offset`` / ``shape`` in the tensor's own axes (no
    prepended axes), and where it sits in the local tensor along the split axis."""

    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_start: int


def global_shape(local_shape: Sequence[int], split: UnitAxis) -> tuple[int, ...]:
    shape = list(local_shape)
    shape[split.axis] = split.global_length
    return tuple(shape)


def fragments(local_shape: Sequence[int], split: UnitAxis, units: Sequence[int]) -> list[Fragment]:
    """The boxes of a rank holding ``units`` (ascending) of a tensor with this local shape: one per block and
    run of consecutive units, in local order (so their lengths along the split axis add up to the local
    tensor's)."""
    runs = unit_runs(units)
    out = []
    for block in range(split.blocks):
        for first, position, length in runs:
            offset = [0] * len(local_shape)
            offset[split.axis] = (block * split.num_units + first) * split.unit_len
            shape = list(local_shape)
            shape[split.axis] = length * split.unit_len
            local_start = (block * len(units) + position) * split.unit_len
            out.append(Fragment(tuple(offset), tuple(shape), local_start))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Who writes: plain data


@dataclass(frozen=True)
class CheckpointRole:
    """Which copy of the model state a rank stands for in a checkpoint (see the module docstring)."""

    replica_rank: int
    """0 for the writer replica, 1, 2, ... for the other replicas (ascending index)."""
    tp_rank: int
    """The rank's position in its replica."""

    @property
    def split_replica_id(self) -> tuple[int, int, int]:
        """For a fragment of a TP-split tensor: main on every rank of the writer replica."""
        return (0, 0, self.replica_rank)

    @property
    def replicated_replica_id(self) -> tuple[int, int, int]:
        """For a tensor every rank holds whole: main on the writer replica's TP rank 0 only."""
        return (0, self.tp_rank, self.replica_rank)


def writer_replica(widths: Mapping[int, int], tp_base: int) -> int:
    """The replica whose pieces are written: the lowest-index healthy one (width ``tp_base``) if any, else the
    lowest index. ``widths``: live replica index -> its TP width."""
    if not widths:
        raise ValueError("no replica to write a checkpoint from")
    healthy = [index for index, width in widths.items() if width == tp_base]
    return min(healthy) if healthy else min(widths)


def checkpoint_roles(members: Sequence[tuple[int, int, int]], tp_base: int) -> list[CheckpointRole]:
    """Every rank's role, from ``members[rank] = (replica index, replica width, tp rank)`` of all ranks.

    Raises ValueError if the members do not describe whole replicas (each replica's TP ranks are exactly
    0..width-1): a rank would otherwise be missing from the writer and the checkpoint would have holes."""
    widths: dict[int, int] = {}
    seen: dict[int, set[int]] = {}
    for rank, (replica, width, tp_rank) in enumerate(members):
        if widths.setdefault(replica, width) != width:
            raise ValueError(f"rank {rank}: replica {replica} has width {width} here and {widths[replica]} elsewhere")
        seen.setdefault(replica, set()).add(tp_rank)
    for replica, tp_ranks in seen.items():
        if tp_ranks != set(range(widths[replica])):
            raise ValueError(f"replica {replica} of width {widths[replica]} has TP ranks {sorted(tp_ranks)}")
    writer = writer_replica(widths, tp_base)
    order = [writer] + sorted(index for index in widths if index != writer)
    position = {index: i for i, index in enumerate(order)}
    return [CheckpointRole(position[replica], tp_rank) for replica, _, tp_rank in members]


# ---------------------------------------------------------------------------------------------------------------
# dist_checkpointing objects


@dataclass
class UnitShardedTensorFactory(ShardedTensorFactory):
    """A ``ShardedTensorFactory`` over the fragments of one NTP tensor (model parameter or optimizer state).

    ``global_shape`` is the full tensor's shape including prepended axes (what a checkpoint must hold under
    ``key``); the factory's ``replica_id`` is handed to every fragment it builds."""

    global_shape: tuple[int, ...] = field(default=())
    places: tuple[Fragment, ...] = field(default=())
    """The fragments placing the local tensor in the global one (prepended axes excluded), cut along ``axis``."""
    axis: int = 0
    prepend: tuple[int, ...] = field(default=())
    """Global offset of the prepended axes (a layer axis)."""


def _prepend(prepend_offsets: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global offset and shape of the axes Megatron prepends (a layer axis): ``(axis, offset, size)`` triples."""
    for i, (axis, _, _) in enumerate(prepend_offsets):
        if axis != i:
            raise ValueError(f"prepended offsets must name axes 0, 1, ... in order, got {list(prepend_offsets)}")
    return tuple(o for _, o, _ in prepend_offsets), tuple(s for _, _, s in prepend_offsets)


def unit_sharded_tensor(key: str, tensor: torch.Tensor, split: UnitAxis, units: Sequence[int],
                        prepend_offsets: Sequence[tuple[int, int, int]] = (), replica_id: ReplicaId = 0,
                        allow_shape_mismatch: bool = False) -> UnitShardedTensorFactory:
    """The factory describing ``tensor`` (this rank's ``units`` of a TP-split tensor) as fragments of the
    global tensor ``key``. ``prepend_offsets``: Megatron's ``sharded_offsets`` (the layer axis)."""
    units = tuple(units)
    local_shape = tuple(tensor.shape)
    boxes = fragments(local_shape, split, units)
    pre_offset, pre_shape = _prepend(prepend_offsets)
    full_shape = pre_shape + global_shape(local_shape, split)
    axis = split.axis

    @torch.no_grad()
    def build(key: str, data: torch.Tensor, replica_id: ReplicaId, flattened_range: Optional[slice]):
        if flattened_range is not None:
            raise ValueError(f"{key}: NTP fragments do not support flattened ranges (distributed optimizer)")
        if tuple(data.shape) != local_shape:
            raise ValueError(f"{key}: tensor of shape {tuple(data.shape)} where {local_shape} was described")
        return [
            ShardedTensor(key, data.narrow(axis, box.local_start, box.shape[axis]).contiguous(), data.dtype,
                          box.shape, full_shape, pre_offset + box.global_offset, None, replica_id,
                          len(pre_shape), allow_shape_mismatch)
            for box in boxes
        ]

    @torch.no_grad()
    def merge(parts: list[torch.Tensor]) -> torch.Tensor:
        if len(parts) != len(boxes):
            raise ValueError(f"{key}: {len(parts)} loaded fragments for {len(boxes)} described")
        out = torch.empty(local_shape, dtype=parts[0].dtype, device=parts[0].device)
        for box, part in zip(boxes, parts):
            out.narrow(axis, box.local_start, box.shape[axis]).copy_(part)
        return out

    return UnitShardedTensorFactory(key, tensor, build, merge, replica_id, global_shape=full_shape,
                                    places=tuple(boxes), axis=axis, prepend=pre_offset)


def unit_axis_of(param: torch.Tensor) -> tuple[UnitAxis, tuple[int, ...]]:
    """The :class:`UnitAxis` and units of a parameter tagged by the NTP layers (``ntp_held_units`` plus Megatron's
    ``partition_dim``)."""
    held = param.ntp_held_units
    axis = getattr(param, "partition_dim", None)
    if axis is None or axis < 0:
        raise ValueError(f"an NTP parameter of shape {tuple(param.shape)} has no partition_dim")
    split = UnitAxis.of(param.shape, axis, held.num_units, len(held.units), held.outer, held.inner)
    return split, held.units


def describe_parameter(key: str, param: torch.Tensor, prepend_offsets: Sequence[tuple[int, int, int]] = (),
                       allow_shape_mismatch: bool = False) -> UnitShardedTensorFactory:
    """:func:`unit_sharded_tensor` for an NTP-tagged parameter (replica id set later, by the model)."""
    split, units = unit_axis_of(param)
    return unit_sharded_tensor(key, param, split, units, prepend_offsets,
                               allow_shape_mismatch=allow_shape_mismatch)


def _prepend_offsets_of(sh_ten: ShardedTensor) -> tuple[tuple[int, int, int], ...]:
    n = sh_ten.prepend_axis_num
    return tuple((i, sh_ten.global_offset[i], sh_ten.global_shape[i]) for i in range(n))


def assign_replica_ids(sharded_state_dict: ShardedStateDict, role: CheckpointRole) -> ShardedStateDict:
    """Give every piece of an NTP model's sharded state dict its replica id under ``role`` (in place).

    An upstream ``ShardedTensor`` over an NTP-tagged parameter (the untied output layer, built by upstream's
    ColumnParallelLinear) is replaced by its fragments first. Anything else that claims to be split across
    TP ranks without an NTP description is an error: its pieces would not tile the global tensor."""

    def visit(value: Any) -> Any:
        if isinstance(value, UnitShardedTensorFactory):
            value.replica_id = role.split_replica_id
            return value
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and hasattr(value.data, "ntp_held_units"):
            if isinstance(value, ShardedTensorFactory):
                raise ValueError(f"{value.key}: an NTP parameter wrapped by a factory that knows nothing of its "
                                 "units (give its module an NTP sharded_state_dict)")
            factory = describe_parameter(value.key, value.data, _prepend_offsets_of(value),
                                         value.allow_shape_mismatch)
            factory.replica_id = role.split_replica_id
            return factory
        if isinstance(value, ShardedTensor):
            fragmentations = value.axis_fragmentations or ()
            if any(f != 1 for f in fragmentations[value.prepend_axis_num:]):
                raise ValueError(f"{value.key}: split across TP ranks ({fragmentations}) without an NTP "
                                 "description; its pieces would not tile the global tensor")
            value.replica_id = role.replicated_replica_id
        elif isinstance(value, ShardedObject):
            value.replica_id = role.replicated_replica_id
        elif isinstance(value, ShardedTensorFactory):
            raise ValueError(f"{value.key}: a factory over a tensor that is not an NTP parameter; NTP does not "
                             "know whether it is split")
        return value

    return dict_list_map_inplace(visit, sharded_state_dict)


def ntp_module_sharded_state_dict(module: torch.nn.Module, prefix: str = "",
                                  sharded_offsets: Sequence[tuple[int, int, int]] = (),
                                  metadata: Optional[dict] = None,
                                  allow_shape_mismatch: bool = False) -> ShardedStateDict:
    """The sharded state dict of one NTP layer: its NTP-tagged parameters as fragments, everything else
    (replicated tensors, extra state) as upstream describes it. Keys are upstream's."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    state = module.state_dict(prefix="", keep_vars=True)
    out: ShardedStateDict = {}
    rest = {}
    for name, value in state.items():
        if hasattr(value, "ntp_held_units"):
            out[f"{prefix}{name}"] = describe_parameter(f"{prefix}{name}", value, sharded_offsets,
                                                        allow_shape_mismatch)
        else:
            rest[name] = value
    out.update(make_sharded_tensors_for_checkpoint(rest, prefix, {}, sharded_offsets, tp_group=module.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"]))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Distributed-optimizer shards in model space: plain data
#
# Megatron's distributed optimizer keeps, for each parameter, the flat range of it that falls inside this rank's
# shard of a bucket (a *piece*: ``plan.optimizer_shards.shard_pieces``; upstream ``gbuf_ranges[...]['param_map'][param]
# ['param']``). Its checkpoint format ``fully_reshardable`` stores the fp32 main parameters and Adam moments in
# model space: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, each the model tensor's global shape.
# A piece is written as boxes of those tensors, without gathering: a flat range of a row-major tensor is at most
# 2·ndim − 1 boxes (a partial first row, whole rows, a partial last row, recursively), and each box is then cut by
# the fragments that place the local tensor in the global one (one for a regular TP grid, one per unit run and
# block under NTP).


@dataclass(frozen=True)
class Box:
    """``offset`` / ``shape`` of a box, in some tensor's own axes."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]


def flat_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes tiling flat elements ``[start, end)`` of a row-major tensor of ``shape``, in flat order (at most
    ``2·len(shape) − 1``; none for an empty range)."""
    shape = tuple(shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"flat range [{start}, {end}) outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) <= 1:
        return [Box((start,) * len(shape), (end - start,) * len(shape))]
    inner = numel // shape[0]
    first, head = divmod(start, inner)
    last, tail = divmod(end, inner)
    rest = shape[1:]

    def row(index: int, lo: int, hi: int) -> list[Box]:
        return [Box((index, *b.offset), (1, *b.shape)) for b in flat_boxes(rest, lo, hi)]

    if first == last:
        return row(first, head, tail)
    out = []
    if head:
        out += row(first, head, inner)
        first += 1
    if last > first:
        out.append(Box((first,) + (0,) * len(rest), (last - first, *rest)))
    if tail:
        out += row(last, 0, tail)
    return out


@dataclass(frozen=True)
class TensorBox:
    """One box of a piece in the global tensor: ``global_offset`` / ``shape`` in the tensor's own axes (no
    prepended axes), and where it sits in the local tensor (``local_offset``, same shape)."""

    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_offset: tuple[int, ...]


def shard_boxes(local_shape: Sequence[int], places: Sequence[Fragment], axis: int, start: int,
                end: int) -> list[TensorBox]:
    """The global boxes of flat elements ``[start, end)`` of a local tensor of ``local_shape`` whose place in the
    global tensor is ``places``: fragments that cut the local tensor along ``axis`` (each: its global offset,
    shape and ``local_start`` along ``axis``; :func:`fragments`, or one fragment for a regular grid). In flat
    order of the row-major boxes, then fragment order."""
    local_shape = tuple(local_shape)
    out = []
    for box in flat_boxes(local_shape, start, end):
        lo, hi = box.offset[axis], box.offset[axis] + box.shape[axis]
        for place in places:
            a, b = max(lo, place.local_start), min(hi, place.local_start + place.shape[axis])
            if a >= b:
                continue
            local = list(box.offset)
            local[axis] = a
            shape = list(box.shape)
            shape[axis] = b - a
            origin = [0] * len(local_shape)
            origin[axis] = place.local_start
            out.append(TensorBox(tuple(g + x - o for g, x, o in zip(place.global_offset, local, origin)),
                                tuple(shape), tuple(local)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Distributed-optimizer shards in model space: dist_checkpointing objects


@dataclass(frozen=True)
class ModelPlace:
    """Where a rank's local parameter tensor lies in its checkpoint tensor: the key, the global shape (prepended axes
    included), the prepended axes' offset, and the fragments cut along ``axis``."""

    key: str
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    prepend: tuple[int, ...]
    places: tuple[Fragment, ...]
    axis: int
    replica_id: ReplicaId


def model_place(entry: Any) -> ModelPlace:
    """The :class:`ModelPlace` of a model sharded state dict entry: an NTP :class:`UnitShardedTensorFactory`, or a
    regular ``ShardedTensor`` (one fragment: the whole local tensor at its global offset)."""
    if isinstance(entry, UnitShardedTensorFactory):
        return ModelPlace(entry.key, tuple(entry.data.shape), tuple(entry.global_shape), tuple(entry.prepend),
                          tuple(entry.places), entry.axis, entry.replica_id)
    if isinstance(entry, ShardedTensor) and entry.flattened_range is None:
        n = entry.prepend_axis_num
        local = tuple(entry.local_shape)
        place = Fragment(tuple(entry.global_offset[n:]), local, 0)
        return ModelPlace(entry.key, local, tuple(entry.global_shape), tuple(entry.global_offset[:n]), (place,), 0,
                          entry.replica_id)
    raise ValueError(f"{getattr(entry, 'key', entry)}: the distributed optimizer's checkpoint describes model "
                     f"tensors given as a ShardedTensor or NTP fragments, not as {type(entry).__name__}")


def place_of_units(place: ModelPlace, param: torch.Tensor) -> ModelPlace:
    """``place`` (a model parameter's) for another tensor of the same checkpoint tensor: ``param``, holding the
    units its ``ntp_held_units`` names (a degraded rank's slot-shaped shadow of a block: the block's units, where the
    model parameter holds the rank's own). A tensor without units (replicated) must have the model's shape and
    lies where it does."""
    if not hasattr(param, "ntp_held_units"):
        if tuple(param.shape) != place.local_shape:
            raise ValueError(f"{place.key}: a replicated tensor of shape {tuple(param.shape)} where the model's is "
                             f"{place.local_shape}")
        return place
    split, units = unit_axis_of(param)
    full = tuple(place.global_shape[len(place.prepend):])
    if global_shape(param.shape, split) != full or split.axis != place.axis:
        raise ValueError(f"{place.key}: units {list(units)} of shape {tuple(param.shape)} do not lie in the global "
                         f"tensor {full} along axis {place.axis}")
    return ModelPlace(place.key, tuple(param.shape), place.global_shape, place.prepend,
                      tuple(fragments(param.shape, split, units)), split.axis, place.replica_id)


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(tuple(shape)):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def _box_view(flat: torch.Tensor, strides: tuple[int, ...], start: int, box: TensorBox) -> torch.Tensor:
    """The elements of ``box`` (local coordinates) in ``flat``, the contiguous elements ``[start, ...)`` of the
    local tensor."""
    first = sum(o * s for o, s in zip(box.local_offset, strides)) - start
    return flat.as_strided(box.shape, strides[:len(box.shape)], flat.storage_offset() + first)


def piece_sharded_tensor(key: str, flat: torch.Tensor, place: ModelPlace, start: int, end: int,
                         replica_id: ReplicaId) -> UnitShardedTensorFactory:
    """The factory describing ``flat`` — elements ``[start, end)`` of a local tensor placed by ``place`` (one piece
    of a distributed-optimizer shard) — as boxes of the global tensor ``key`` (:func:`shard_boxes`). Its merge
    gives the piece back as one flat tensor."""
    if flat.dim() != 1 or flat.numel() != end - start or not flat.is_contiguous():
        raise ValueError(f"{key}: a piece of [{start}, {end}) must be a contiguous flat tensor, got "
                         f"{tuple(flat.shape)}")
    boxes = shard_boxes(place.local_shape, place.places, place.axis, start, end)
    strides = _strides(place.local_shape)
    n = len(place.prepend)

    @torch.no_grad()
    def build(key: str, data: torch.Tensor, replica_id: ReplicaId, flattened_range: Optional[slice]):
        if flattened_range is not None:
            raise ValueError(f"{key}: flattened ranges are not supported (Megatron-Core 0.16 refuses them)")
        return [ShardedTensor(key, _box_view(data, strides, start, box).contiguous(), data.dtype,
                              box.shape, place.global_shape, place.prepend + box.global_offset, None, replica_id, n)
                for box in boxes]

    @torch.no_grad()
    def merge(parts: list[torch.Tensor]) -> torch.Tensor:
        if len(parts) != len(boxes):
            raise ValueError(f"{key}: {len(parts)} loaded boxes for {len(boxes)} described")
        out = torch.empty(end - start, dtype=parts[0].dtype, device=parts[0].device)
        for box, part in zip(boxes, parts):
            _box_view(out, strides, start, box).copy_(part.reshape(box.shape))
        return out

    return UnitShardedTensorFactory(key, flat, build, merge, replica_id, global_shape=place.global_shape)
