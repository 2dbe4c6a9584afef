"""The grad norm under NTP, bit-identical on every rank of every replica: a float64 table of squared sums, one cell
per (TP-split parameter, canonical block) computed on slot-shaped buffers that are bitwise the same in every replica
(per (block, shard position) under the distributed optimizer), replicated parameters counted once, summed over the
replica (one non-zero entry per cell, so the sum is exact) and finished with ``fsum``
(:mod:`ntp_megatron.core.grad_sync` says why)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ntp_megatron.core.groups import NTPGroups
from ntp_megatron.plan.layout import Topology
from ntp_megatron.plan.optimizer_shards import Bucket, BufferLayout, ParamPlace, shard_pieces


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


def block_table_sum(grads: dict[int, dict[str, torch.Tensor]], counted: list[tuple[int, str]], n_split: int,
                    replicated: Optional[list[torch.Tensor]], n_replicated: int, tp_base: int, tp: dist.ProcessGroup,
                    device: torch.device) -> float:
    """The sum of squares of one stage of a replica (a collective over its TP group ``tp``): a cell per (TP-split
    parameter ``i`` of ``n_split``, block) for the ``counted`` (index, name) pairs, filled from ``grads`` (block ->
    name -> the block's slot-shaped gradient, for every block this rank serves), then a cell per replicated
    parameter, filled by one rank of the replica (the one passing ``replicated``)."""
    table = torch.zeros(n_split * tp_base + n_replicated, dtype=torch.float64, device=device)
    for block, by_name in grads.items():
        for i, name in counted:
            table[i * tp_base + block] = by_name[name].double().pow(2).sum()
    for j, grad in enumerate(replicated or ()):
        table[n_split * tp_base + j] = grad.double().pow(2).sum()
    dist.all_reduce(table, group=tp)
    return math.fsum(table.tolist())


def over_stages(stage_sum: float, topology: Topology, rank: int, groups: NTPGroups, device: torch.device) -> float:
    """The sum of squares of the replica from its stage's (``topology``, where ``rank`` is): one cell per stage,
    filled by the stage's TP rank 0, summed over the replica's model-parallel group (each cell has one contributor:
    exact, and the same bits in every replica). Without stages, the stage's own."""
    if not groups.staged:
        return stage_sum
    cells = torch.zeros(groups.job.num_stages, dtype=torch.float64, device=device)
    if topology.local_rank(rank) == 0:
        cells[topology.stage] = stage_sum
    dist.all_reduce(cells, group=groups.mp)
    return math.fsum(cells.tolist())


def shard_table_norm(sources: list[tuple[int, list]], tp_base: int, tp: dist.ProcessGroup,
                     device: torch.device) -> float:
    """The norm from the reduced shards (distributed optimizer; ``sources``: block -> the buffers holding its
    shards, for every block this rank serves): a cell per (block, position) of TP-split pieces, and per position of
    replicated pieces of block 0; each cell filled by the one rank that holds it, summed over the replica (TP group
    ``tp``) and then over the sync group, which the buffers shard over."""
    groups = [buffers[0].data_parallel_group for _, buffers in sources]
    size = groups[0].size()
    split = {id(param) for _, buffers in sources for buffer in buffers for param in buffer.param_index_map
             if hasattr(param, "ntp_held_units")}  # the model's or the shadows' (both tagged)
    table = torch.zeros(tp_base * size + size, dtype=torch.float64, device=device)
    for (block, buffers), group in zip(sources, groups):
        position = group.rank()
        split_sq, replicated_sq = shard_square_sums(buffers, split, position, size)
        table[block * size + position] = split_sq
        if block == 0:
            table[tp_base * size + position] = replicated_sq
    dist.all_reduce(table, group=tp)
    summed = None
    for group in groups:  # one per sync group this rank is a member of; all sums are equal
        reduced = table.clone()
        dist.all_reduce(reduced, group=group)
        summed = reduced if summed is None else summed
    return math.sqrt(math.fsum(summed.tolist()))
