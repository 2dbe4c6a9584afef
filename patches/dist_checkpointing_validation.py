"""Exactly-once coverage for uneven shardings (upstream: ``megatron.core.dist_checkpointing.validation``,
``_validate_sharding_for_key``).

Before a save (and a load) Megatron checks on global rank 0 that the main replicas of every tensor's shards
cover it exactly once — but only for regular grids: for ``axis_fragmentations=None`` it "defers the
validation to DCP", and Megatron's save planner runs DCP without its global plan check (decentralized
planning). An uneven tensor with a hole or an overlap would be written silently (a hole loads as
uninitialised memory). This adds the check for uneven shardings: main-replica boxes lie inside the tensor,
do not overlap, and their volumes add up to the tensor's. Regular grids keep upstream's check.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from megatron.core.dist_checkpointing import validation as upstream
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

_upstream_validate = upstream._validate_sharding_for_key


def box_of(sharding: ShardedTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, size) of a shard in the global tensor, prepended axes included."""
    return tuple(sharding.global_offset), (1,) * sharding.prepend_axis_num + tuple(sharding.local_shape)


def coverage_error(global_shape: Sequence[int], boxes: Sequence[tuple[int, tuple, tuple]]) -> str | None:
    """Why ``boxes`` (``(rank, offset, size)``) do not tile ``global_shape`` exactly once, or None if they do."""
    if not boxes:
        return "no main replica holds any part of it"
    shape = np.array(global_shape, dtype=np.int64)
    starts = np.array([offset for _, offset, _ in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    ends = starts + np.array([size for _, _, size in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    outside = np.nonzero((starts < 0).any(axis=1) | (ends > shape).any(axis=1))[0]
    if len(outside):
        rank, offset, size = boxes[outside[0]]
        return f"rank {rank}'s shard at {offset} of size {size} lies outside the tensor"
    for i in range(len(boxes) - 1):
        hits = np.nonzero(((starts[i] < ends[i + 1:]) & (starts[i + 1:] < ends[i])).all(axis=1))[0]
        if len(hits):
            j = i + 1 + hits[0]
            return (f"main replicas overlap: rank {boxes[i][0]} at {boxes[i][1]} (size {boxes[i][2]}) and "
                    f"rank {boxes[j][0]} at {boxes[j][1]} (size {boxes[j][2]})")
    covered = int(np.prod(ends - starts, axis=1).sum())
    total = math.prod(global_shape)
    if covered != total:
        return f"main replicas cover {covered} of its {total} elements"
    return None


def _validate_sharding_for_key(rank_sharding: list[tuple[int, ShardedTensor]]) -> None:
    _upstream_validate(rank_sharding)  # consistency across ranks; the coverage check of regular grids
    some = rank_sharding[0][1]
    if some.has_regular_grid or some.flattened_range is not None:
        return
    boxes = [(rank, *box_of(s)) for rank, s in rank_sharding if is_main_replica(s.replica_id)]
    error = coverage_error(some.global_shape, boxes)
    if error:
        raise CheckpointingException(f"Invalid access pattern for {some.key} (global shape {some.global_shape}): "
                                     f"{error}")


def apply() -> None:
    upstream._validate_sharding_for_key = _validate_sharding_for_key
