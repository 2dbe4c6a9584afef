"""The sharded state dicts a save writes and a load requests, one description for both: the model under plain
Megatron-Core's ``GPTModel`` keys (under NTP a rank's units as fragments of them,
:mod:`ntp_megatron.core.checkpoint_map`), the optimizer (Megatron's own sharded state dict, or the distributed
optimizer's ``fully_reshardable`` pieces), the per-rank RNG objects, and the layout: ``common.pt``'s ``parallel``
entry with the NTP layout's digest and, under NTP, which replica writes what (:func:`_layout`, one collective).

May import: :mod:`.format`, Megatron-Core and :mod:`ntp_megatron.core`; not :mod:`.files`, :mod:`.load` or
:mod:`.save`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer

from ntp_megatron.core.adam_step import keeps_step_in_groups
from ntp_megatron.core.checkpoint_map import (
    ROLE_KEY,
    CheckpointRole,
    ModelPlace,
    UnitShardedTensorFactory,
    checkpoint_roles,
    model_place,
    piece_sharded_tensor,
    place_of_units,
)
from ntp_megatron.core.gpt import NTPGPTModel
from ntp_megatron.training.checkpoint.format import (
    ALIASES,
    DP_RESHARDABLE,
    FULLY_RESHARDABLE,
    STATE_NAMES,
    ParallelCoords,
    content_metadata,
)


@dataclass(frozen=True)
class _Layout:
    """What a save or load needs to know about the job's current layout."""

    parallel: dict            # the common ``parallel`` entry: equal iff the layouts are equal
    role: Optional[CheckpointRole] = None  # NTP only
    rank: int = 0
    world_size: int = 1


def _is_ntp(model) -> bool:
    return isinstance(model.module, NTPGPTModel)


def _layout(model, coords: ParallelCoords) -> _Layout:
    """Plain: the grid. NTP: every rank's replica, width, TP rank and units, gathered (one collective over
    the job's default group), from which each rank's :class:`CheckpointRole` follows."""
    if not _is_ntp(model):
        grid = {"tp": coords.tp_size, "dp": coords.dp_size}
        return _Layout(parallel=grid if coords.pp_size == 1 else {**grid, "pp": coords.pp_size})
    gpt = model.module
    tp = gpt.pg_collection.tp
    units = gpt.ntp_units
    mine = (coords.dp_rank, tp.size(), tp.rank(), (units.heads, units.ffn, units.vocab), coords.pp_rank)
    members: list = [None] * dist.get_world_size()
    dist.all_gather_object(members, mine)
    rank = dist.get_rank()
    # Each pipeline stage writes its own tensors (its layers; the embeddings in the first, the output layer in the
    # last): the writer replica of each piece is chosen among the replicas of its stage.
    ours = [r for r, m in enumerate(members) if m[4] == coords.pp_rank]
    roles = checkpoint_roles([members[r][:3] for r in ours], tp_base=coords.tp_size)
    widths = {(stage, replica): width for replica, width, _, _, stage in members}
    digest = hashlib.sha256(json.dumps(sorted(members)).encode()).hexdigest()[:16]
    per_replica = [[widths.get((p, r), 0) for p in range(coords.pp_size)] for r in range(coords.dp_size)]
    parallel = {"tp": coords.tp_size, "dp": coords.dp_size, "ntp": True,
                "tp_per_replica": [w[0] for w in per_replica] if coords.pp_size == 1 else per_replica,
                "ntp_layout": digest, **({"pp": coords.pp_size} if coords.pp_size > 1 else {})}
    return _Layout(parallel=parallel, role=roles[ours.index(rank)], rank=rank, world_size=len(members))


def _rng_object(coords: ParallelCoords, layout: _Layout, state: Any) -> ShardedObject:
    if layout.role is not None:  # NTP: replicas differ in width, so one object per rank of this layout
        return ShardedObject("rng_state", state, (layout.world_size,), (layout.rank,), replica_id=0)
    if coords.pp_size > 1:
        return ShardedObject("rng_state", state, (coords.pp_size, coords.dp_size, coords.tp_size),
                             (coords.pp_rank, coords.dp_rank, coords.tp_rank), replica_id=0)
    return ShardedObject(
        "rng_state", state, (coords.dp_size, coords.tp_size), (coords.dp_rank, coords.tp_rank), replica_id=0
    )


def distributed_optimizer(optimizer: Optional[MegatronOptimizer]) -> Optional[DistributedOptimizer]:
    """Megatron's ``DistributedOptimizer`` inside ``optimizer`` (``get_megatron_optimizer`` wraps even a single one
    in a ``ChainedOptimizer``), or None without the distributed optimizer."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part, DistributedOptimizer):
            return part
    return None


@dataclass
class _Pieces:
    """A distributed optimizer's shard described piece by piece, in the order of ``param_state``."""

    params: list = dataclasses.field(default_factory=list)    # the model parameter of each piece
    missing: set = dataclasses.field(default_factory=set)     # state names the checkpoint does not hold


def _model_entries(model_sd: dict) -> dict[int, Any]:
    """Model parameter (by id) -> its entry in the model's sharded state dict."""
    out = {}
    for value in nested_values(model_sd):
        if isinstance(value, (ShardedTensor, UnitShardedTensorFactory)) and isinstance(value.data, torch.Tensor):
            out.setdefault(id(value.data), value)
    return out


def _optimizer_places(model, model_sd: dict, grad_sync) -> Callable[[torch.nn.Parameter], tuple[ModelPlace, tuple]]:
    """Where a parameter the distributed optimizer steps lies in its checkpoint tensor, with the first two entries
    of its pieces' replica id (the third is the instance): a model parameter where the model's sharded state dict
    puts it; on a degraded NTP rank a shadow's (``grad_sync.shadows``: per block it serves, slot-shaped parameters
    holding the block's units, which the optimizer steps instead) at its block's units of the model parameter of
    its name. A replicated tensor is main in one block's pieces only: TP rank 0's (under NTP the healthy rank at
    slot 0, which serves block 0), or a shadow's of block 0."""
    entries = _model_entries(model_sd)
    shadows: dict[int, tuple[torch.nn.Parameter, int]] = {}  # shadow parameter -> (model parameter, block)
    if grad_sync is not None and grad_sync.shadows:
        by_name = dict(model.module.named_parameters())
        for block, shadow in grad_sync.shadows.items():
            for name, param in shadow.module.named_parameters():
                shadows[id(param)] = (by_name[name], block)

    def place_of(param: torch.nn.Parameter) -> tuple[ModelPlace, tuple]:
        if id(param) in shadows:
            model_param, block = shadows[id(param)]
            place = place_of_units(model_place(entries[id(model_param)]), param)
            return place, ((0, 0) if hasattr(param, "ntp_held_units") else (0, block))
        place = model_place(entries[id(param)])
        rid = place.replica_id
        return place, ((rid[0], rid[1]) if isinstance(rid, tuple) else (0, 0))

    return place_of


def _distributed_optimizer_state(dist_opt: DistributedOptimizer, place_of: Callable, is_loading: bool,
                                 stored: Optional[set[str]] = None) -> tuple[dict, _Pieces]:
    """The distributed optimizer's state in Megatron's ``fully_reshardable`` format, written and read piece by
    piece without gathering (see the package docstring): every piece of this rank's shard (Megatron's
    ``gbuf_ranges``) as boxes of ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, main on one rank per
    element (instance 0; a replicated tensor's block 0; ``place_of``: :func:`_optimizer_places`). Loading
    (``stored``: the checkpoint's keys), fresh tensors receive the pieces, under the names the checkpoint has
    (:data:`ALIASES`); without a main parameter (a checkpoint of the non-distributed fp32 optimizer) it comes from
    the model weights."""
    instance = dist_opt.distributed_optimizer_instance_id
    pieces, param_state = _Pieces(), {}
    for gbuf_range_maps in dist_opt.gbuf_ranges:
        for ranges in gbuf_range_maps.values():
            for bucket in ranges:
                for model_param, piece in bucket["param_map"].items():
                    place, rid = place_of(model_param)
                    start, end = piece["param"].start, piece["param"].end
                    replica_id = (*rid, instance)
                    live = None if is_loading else dist_opt._get_main_param_and_optimizer_states(model_param)
                    tensors = {}
                    for name in STATE_NAMES:
                        key = f"optimizer.state.{name}.{place.key}"
                        if stored is not None and key not in stored:
                            alias = f"optimizer.state.{ALIASES[name]}.{place.key}" if name in ALIASES else None
                            if alias in stored:
                                key = alias
                            elif name == "param":
                                pieces.missing.add(name)
                                continue
                        flat = torch.empty(end - start, dtype=torch.float32) if live is None else live[name].detach()
                        tensors[name] = piece_sharded_tensor(key, flat, place, start, end, replica_id)
                    param_state[len(pieces.params)] = tensors
                    pieces.params.append(model_param)
    if is_loading:
        return {"param_state": param_state}, pieces
    state = dist_opt.state_dict()
    state.update(param_state=param_state, param_state_sharding_type=FULLY_RESHARDABLE)
    return state, pieces


def _sharded_state(model, optimizer: Optional[MegatronOptimizer], layout: _Layout, is_loading: bool,
                   stored: Optional[set[str]] = None, sharding_type: str = FULLY_RESHARDABLE, grad_sync=None
                   ) -> tuple[dict[str, Any], Optional[_Pieces]]:
    """Model keys are the GPTModel's own (no DDP ``module.`` prefix), as in Megatron's checkpoints. Without
    ``optimizer`` the model's alone: asking a fresh optimizer for its sharded state dict to load into would give it
    state (Megatron's ``init_state_fn``) that is not a fresh optimizer's. With the distributed optimizer, its
    pieces too (:func:`_distributed_optimizer_state`, over the shadows of ``grad_sync`` on a degraded NTP rank;
    ``sharding_type`` :data:`DP_RESHARDABLE`: Megatron's own bucket-space request instead)."""
    metadata = {ROLE_KEY: layout.role} if layout.role is not None else None
    model_sd = model.module.sharded_state_dict(metadata=metadata)
    if optimizer is None:
        return {"model": model_sd}, None
    dist_opt = distributed_optimizer(optimizer)
    if dist_opt is None:
        return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}, None
    if len(getattr(optimizer, "chained_optimizers", [optimizer])) != 1:
        raise SystemExit("checkpoint: the distributed optimizer's checkpoints are written for one optimizer only "
                         "(no expert parameters)")
    if sharding_type == DP_RESHARDABLE:
        if is_loading:
            _start_adam_state(dist_opt)
        sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=content_metadata(DP_RESHARDABLE))
        return {"model": model_sd, "optimizer": sd}, None
    sd, pieces = _distributed_optimizer_state(dist_opt, _optimizer_places(model, model_sd, grad_sync), is_loading,
                                              stored)
    return {"model": model_sd, "optimizer": sd}, pieces


def _start_adam_state(dist_opt: DistributedOptimizer) -> None:
    """The state torch's Adam has only after a first step (zero moments, step 0), for a fresh distributed
    optimizer: Megatron's ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` reads every parameter's step
    (with Transformer Engine's or Apex's Adam the step lives in the parameter groups)."""
    torch_optimizer = dist_opt.optimizer
    if all(torch_optimizer.state[p] for group in torch_optimizer.param_groups for p in group["params"]):
        return
    dist_opt.init_state_fn(torch_optimizer, dist_opt.config)
    if keeps_step_in_groups(torch_optimizer):
        for group in torch_optimizer.param_groups:
            if group["params"]:
                group.setdefault("step", 0)
        return
    for state in torch_optimizer.state.values():
        state.setdefault("step", torch.tensor(0.0))
