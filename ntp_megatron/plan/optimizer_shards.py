"""Geometry of Megatron-Core's flat parameter/gradient buffers and of the distributed optimizer's shards.

Pure Python, no torch: every rank (and the controller, and a memory planner) can compute where a parameter sits in
a DDP buffer, how the buffer is cut into buckets, and which element range of each bucket a data-parallel position
owns under the distributed optimizer, without building a model. The rules mirror Megatron-Core 0.16.1:

- ``megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__`` (buffer and bucket layout);
- ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_gbuf_range`` and
  ``_build_model_gbuf_param_range_map`` (shards and the parameter pieces inside them).

``tests/unit/plan/test_optimizer_shards.py`` pins every function here to the real Megatron-Core objects.

With several distributed-optimizer instances, :func:`instances` says which replicas form each (Megatron's rule),
:func:`shard_holders` which ranks of an NTP topology hold a shard, and :func:`shard_plan` /
:func:`shard_lower_bound_bytes` what a re-formation must move so that every new sync-group member holds its shard.

One :class:`BufferLayout` describes one ``_ParamAndGradBuffer``: Megatron builds one per (param dtype, grad dtype)
pair, over the parameters with ``requires_grad`` in ``named_parameters()`` order, and keeps expert-parallel
parameters in separate buffers. ``dp_size`` below is the size of the buffer's data-parallel group, which is the
*intra-instance* data-parallel (× context-parallel) group: with several distributed-optimizer instances it is the
number of ranks one instance shards over, not the whole data-parallel size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ntp_megatron.plan.layout import survivor_ranks

PARAM_ALIGN = 64
"""Distributed optimizer only: parameter starts are padded to 64 elements (128-byte aligned at >= 16 bits)."""
BUCKET_ALIGN = 128
"""Distributed optimizer only: bucket ends are padded to lcm(dp_size, 128) (256-byte aligned at >= 16 bits)."""
HIGH_BUSBW_ALIGN = 2**16
"""With ``pad_buckets_for_high_nccl_busbw`` bucket ends are also padded to a multiple of 2**16."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a rank's DDP sees it (only the facts Megatron's buffer layout reads)."""

    name: str
    numel: int
    shared_embedding: bool = False
    """Megatron's ``param.shared_embedding`` (set on a tied word embedding when PP > 1): with the distributed
    optimizer it gets a bucket of its own, so first and last stages shard it alike."""


class ParamPlace(NamedTuple):
    """Where a parameter sits: ``[start, end)`` of the whole buffer, and its bucket (Megatron's
    ``param_index_map`` entry)."""

    name: str
    start: int
    end: int
    bucket: int


class Bucket(NamedTuple):
    """A bucket: its offset in the buffer, its (padded) number of elements, and the elements up to its last
    parameter's end (Megatron's ``numel_unpadded``; it includes the start padding between parameters)."""

    offset: int
    numel: int
    numel_unpadded: int


class ShardPiece(NamedTuple):
    """The part ``[start, end)`` of parameter ``name`` (flat, in its own elements) that one data-parallel
    position owns, and where that part begins in the buffer (``buffer_start``)."""

    name: str
    bucket: int
    start: int
    end: int
    buffer_start: int


@dataclass(frozen=True)
class BufferLayout:
    """One flat parameter/gradient buffer: parameters in buffer order (reverse of ``named_parameters()``)."""

    params: tuple[ParamPlace, ...]
    buckets: tuple[Bucket, ...]

    @property
    def numel(self) -> int:
        """Elements in the buffer, padding included (Megatron's ``_ParamAndGradBuffer.numel``)."""
        last = self.buckets[-1]
        return last.offset + last.numel


def ddp_bucket_size(configured: int | None, overlap_grad_reduce: bool, dp_size: int) -> int | None:
    """The bucket size a Megatron DDP gives its buffers: None (one bucket) without ``overlap_grad_reduce``, else the
    configured size, or Megatron's default for a data-parallel group of ``dp_size``."""
    if not overlap_grad_reduce:
        return None
    return configured if configured is not None else max(40_000_000, 1_000_000 * dp_size)


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def bucket_divisor(dp_size: int, pad_buckets_for_high_nccl_busbw: bool = False) -> int:
    """What a bucket's end is padded to with the distributed optimizer, so that it splits evenly over dp_size."""
    if pad_buckets_for_high_nccl_busbw:
        return math.lcm(dp_size, BUCKET_ALIGN, HIGH_BUSBW_ALIGN)
    return math.lcm(dp_size, BUCKET_ALIGN)


def buffer_layout(
    specs: Sequence[ParamSpec],
    bucket_size: int | None,
    dp_size: int,
    use_distributed_optimizer: bool,
    pad_buckets_for_high_nccl_busbw: bool = False,
) -> BufferLayout:
    """The layout Megatron's ``_ParamAndGradBuffer`` gives ``specs`` (in ``named_parameters()`` order).

    ``bucket_size`` is the value the buffer receives, not the config field: DDP passes ``None`` (one bucket)
    when ``overlap_grad_reduce`` is off, on pipeline stages after the first, and with ``disable_bucketing``;
    and it fills a ``None`` config field with ``max(40_000_000, 1_000_000 * dp group size)`` first.

    The rules, as upstream applies them while walking the parameters in reverse order:
    - with the distributed optimizer, each parameter's start is padded to a multiple of 64;
    - a bucket closes after the first parameter that brings it to ``bucket_size`` elements or more (measured
      from the bucket's offset, so padding counts);
    - with the distributed optimizer, a ``shared_embedding`` parameter closes the bucket before it (at its
      already padded start) and its own bucket after it;
    - with the distributed optimizer, a closed bucket's end is padded to :func:`bucket_divisor`, and the next
      bucket starts there; without it there is no padding at all.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if not specs:
        raise ValueError("a buffer needs at least one parameter (Megatron builds none for an empty dtype)")
    divisor = bucket_divisor(dp_size, pad_buckets_for_high_nccl_busbw)
    places: list[ParamPlace] = []
    buckets: list[Bucket] = []
    bucket_start = 0
    in_bucket = 0  # parameters placed in the open bucket

    def close(param_end: int) -> int:
        nonlocal bucket_start, in_bucket
        end = _pad(param_end, divisor) if use_distributed_optimizer else param_end
        buckets.append(Bucket(bucket_start, end - bucket_start, param_end - bucket_start))
        bucket_start, in_bucket = end, 0
        return end

    start = 0
    end = 0
    for spec in reversed(specs):  # reverse order roughly follows backprop, so buckets fill in that order
        if use_distributed_optimizer:
            start = _pad(start, PARAM_ALIGN)
        own_bucket = spec.shared_embedding and use_distributed_optimizer
        if own_bucket and in_bucket:
            start = close(start)
        end = start + spec.numel
        places.append(ParamPlace(spec.name, start, end, len(buckets)))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    return BufferLayout(tuple(places), tuple(buckets))


def shard_range(layout: BufferLayout, bucket: int, dp_size: int, j: int) -> tuple[int, int]:
    """Buffer range ``[start, end)`` of data-parallel position ``j``'s shard of one bucket: the j-th of
    ``dp_size`` equal contiguous parts, padding included (it ignores parameter boundaries)."""
    if not 0 <= j < dp_size:
        raise ValueError(f"position {j} is outside a data-parallel group of {dp_size}")
    b = layout.buckets[bucket]
    if b.numel % dp_size:
        raise ValueError(f"bucket {bucket} ({b.numel} elements) does not split over {dp_size} positions; "
                         "only a distributed-optimizer layout is padded for that")
    size = b.numel // dp_size
    return b.offset + j * size, b.offset + (j + 1) * size


def shard_pieces(layout: BufferLayout, dp_size: int, j: int) -> list[ShardPiece]:
    """Every parameter piece inside position ``j``'s shards, bucket by bucket and within a bucket in buffer
    order: the order of Megatron's ``gbuf_ranges[...][bucket]['param_map']``, hence of the optimizer's
    parameter groups and of its per-bucket checkpoint state."""
    pieces: list[ShardPiece] = []
    for bucket in range(len(layout.buckets)):
        lo, hi = shard_range(layout, bucket, dp_size, j)
        for place in layout.params:
            if place.bucket != bucket:
                continue
            start, end = max(place.start, lo), min(place.end, hi)
            if end > start:
                pieces.append(ShardPiece(place.name, bucket, start - place.start, end - place.start, start))
    return pieces


def shard_numel(layout: BufferLayout, dp_size: int, j: int) -> int:
    """Parameter elements in position ``j``'s shards: what its optimizer state covers (padding holds none)."""
    return sum(p.end - p.start for p in shard_pieces(layout, dp_size, j))


# -- distributed-optimizer instances ---------------------------------------------------------------------------
# With ``num_distributed_optimizer_instances`` = k, Megatron-Core cuts each data-parallel group into k instances
# of consecutive members (``parallel_state.initialize_model_parallel``: ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_
# WITH_CP``); each instance shards the optimizer over its dp/k members, and the members at one position of every
# instance (``_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP``: twins) all-reduce their shards' gradients, so each
# shard is held once per instance. Here the members are replica indices: the data-parallel order of the dense
# grid, and the launch replica indices of an NTP job (fixed for the job, so membership never changes).


def instances(dp: int, k: int) -> tuple[tuple[int, ...], ...]:
    """The replica indices of each of ``k`` instances, in position order: instance i is replicas
    ``[i·dp/k, (i+1)·dp/k)``."""
    if k < 1 or dp < 1 or dp % k:
        raise ValueError(f"{k} distributed-optimizer instances do not divide {dp} replicas")
    per = dp // k
    return tuple(tuple(range(i * per, (i + 1) * per)) for i in range(k))


def instance_of(replica: int, dp: int, k: int) -> tuple[int, int]:
    """(instance, position in it) of ``replica``: its shard of every bucket is the position-th of dp/k."""
    if not 0 <= replica < dp:
        raise ValueError(f"replica {replica} is outside 0..{dp - 1}")
    instances(dp, k)  # validates
    return divmod(replica, dp // k)


def twin_replicas(replica: int, dp: int, k: int) -> tuple[int, ...]:
    """The replicas at ``replica``'s position in every instance (itself included), ascending: its twins."""
    _, position = instance_of(replica, dp, k)
    return tuple(members[position] for members in instances(dp, k))


# -- which ranks hold which shard, and what a re-formation must move ------------------------------------------
# Under NTP, sync group b (one member per replica: the rank at slot b, or the proxy of block b) shards block b's
# canonical buckets; with k instances, shard (b, j) is position j's part and is held by the sync-group members of
# the j-th replica of every instance. ``dp`` is the launch data-parallel size (instances are fixed for the job);
# ranks are the generation's process-group ranks of ``ntp_megatron.plan.layout.Topology``.

ShardId = tuple[int, int]
"""(block, position in the instance)."""


class ShardMove(NamedTuple):
    """Shard ``shard`` goes from old-generation rank ``src`` to new-generation rank ``dst``."""

    shard: ShardId
    src: int
    dst: int


def shard_holders(topology, dp: int, k: int, shard: ShardId) -> list[int]:
    """The ranks holding ``shard`` in ``topology``, in instance order (one per instance whose replica is in it)."""
    block, position = shard
    present = {rep.index for rep in topology.replicas}
    return [topology.sync_member(members[position], block) for members in instances(dp, k)
            if members[position] in present]


def _all_shards(tp_base: int, dp: int, k: int) -> list[ShardId]:
    return [(block, position) for block in range(tp_base) for position in range(dp // k)]


def lost_shards(old, dead_ranks, dp: int, k: int) -> list[ShardId]:
    """Shards every holder of which is among ``dead_ranks`` (old-generation ranks): no surviving process has
    them, so only a checkpoint restores them. Sorted."""
    dead = set(dead_ranks)
    out = []
    for shard in _all_shards(old.tp_base, dp, k):
        holders = shard_holders(old, dp, k, shard)
        if holders and set(holders) <= dead:
            out.append(shard)
    return out


class ShardLostError(ValueError):
    """A shard a new sync member needs has no surviving holder."""

    def __init__(self, shards: list[ShardId]) -> None:
        super().__init__(f"optimizer shards (block, position) {shards} have no surviving holder")
        self.shards = shards


def shard_plan(old, new, dead_ranks, dp: int, k: int) -> list[ShardMove]:
    """Every new sync member that did not hold its shard in ``old`` gets it once, from a surviving holder: the
    process of its own replica that held it (a rejoin takes it back from the proxy), else its twin in another
    instance (a replica healthy in ``old`` first, then the lowest replica index). A process that keeps its role
    keeps its shard: no move. Sorted by (shard, dst). Raises :class:`ShardLostError` naming every needed shard
    without a surviving holder."""
    dead = set(dead_ranks)
    new_of = survivor_ranks(old, new, dead)
    old_present = {rep.index for rep in old.replicas}
    moves, lost = [], []
    for rep in new.replicas:
        _, position = instance_of(rep.index, dp, k)
        twins = twin_replicas(rep.index, dp, k)
        for block in range(new.tp_base):
            dst, shard = new.sync_member(rep.index, block), (block, position)
            if rep.index in old_present:
                held_by = old.sync_member(rep.index, block)
                if held_by not in dead and new_of.get(held_by) == dst:
                    continue  # kept
            candidates = [r for r in twins if r in old_present and old.sync_member(r, block) not in dead]
            if not candidates:
                lost.append(shard)
                continue
            best = min(candidates, key=lambda r: (r != rep.index, not old.is_healthy(r), r))
            moves.append(ShardMove(shard, old.sync_member(best, block), dst))
    if lost:
        raise ShardLostError(sorted(set(lost)))
    return sorted(moves, key=lambda m: (m.shard, m.dst))


STATE_BYTES = 12
"""Per shard element moved: the fp32 main parameter and Adam's two fp32 moments (the step follows from the
iteration)."""


def shard_lower_bound_bytes(moves: Sequence[ShardMove], layouts, dp: int, k: int,
                            state_bytes: int = STATE_BYTES) -> int:
    """Bytes the optimizer state of ``moves`` (a :func:`shard_plan`) takes: each move carries its shard's
    parameter elements (:func:`shard_numel` over block b's buffers, ``layouts[b]``, at dp/k positions) ×
    ``state_bytes``. Every move of a plan is necessary (its destination holds nothing of that shard), so this is
    a lower bound for any re-formation that ends with every shard in place."""
    per = dp // k
    return sum(state_bytes * sum(shard_numel(layout, per, m.shard[1]) for layout in layouts[m.shard[0]])
               for m in moves)
