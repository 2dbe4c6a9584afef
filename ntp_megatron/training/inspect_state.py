"""Full (unsharded) parameters and optimizer state of one replica, for verification.

Every replica, whatever its layout, can rebuild each TP-split tensor in global unit order by gathering its
ranks' units; comparing those tensors (or their checksums) across replicas and across runs is how the
tests check that NTP computes the same model as uniform TP and TP1, and that replicas stay identical.

Under Megatron's distributed optimizer a rank holds its shard of each bucket's optimizer state only: each
bucket's state is first all-gathered over the group the buffer shards over (one bucket at a time), which gives
every rank its slot's whole tensors, then gathered over TP as without it.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from ntp_megatron.core.init import global_name
from ntp_megatron.core.layers import HeldUnits
from ntp_megatron.core.gpt import family_geometry
from ntp_megatron.core.unit_moves import main_param_of, optimizer_param, state_keys


class UncoveredState(RuntimeError):
    """A tensor the verification must cover cannot be read in unit order (or is missing): never skipped."""


def held_units_of(name: str, param: torch.Tensor, tf_config, num_units: dict[str, int], tp_rank: int,
                  tp_size: int) -> Optional[HeldUnits]:
    """The NTP tag if the tensor has one; for a uniform Megatron model, rank ``tp_rank``'s contiguous block."""
    held = getattr(param, "ntp_held_units", None)
    if held is not None or tp_size == 1:
        return held
    geometry = family_geometry(name, tf_config)
    if geometry is None:
        return None
    family, outer, inner = geometry
    per_rank = num_units[family] // tp_size
    units = tuple(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))
    return HeldUnits(family, num_units[family], units, outer, inner)


def _gather_full(tensors: dict[str, tuple[torch.Tensor, HeldUnits]], tp_group) -> dict[str, torch.Tensor]:
    """Each tensor whole, in global unit order, from every TP rank's units: one ``all_gather_object`` for all of
    them (one per tensor cost a checked run's ranks about a quarter of their time)."""
    mine = {key: (held.units, _as_bytes(tensor)) for key, (tensor, held) in tensors.items()}
    parts: list = [None] * tp_group.size()
    dist.all_gather_object(parts, mine, group=tp_group)
    out = {}
    for key, (tensor, held) in tensors.items():
        full = torch.zeros(held.outer, held.num_units, held.inner, dtype=tensor.dtype)
        for theirs in parts:
            units, piece = theirs[key]
            piece = torch.from_numpy(piece).view(tensor.dtype)
            full[:, list(units), :] = piece.reshape(held.outer, len(units), held.inner)
        out[key] = full.reshape(-1)
    return out


def _as_bytes(tensor: torch.Tensor):
    """A copy of a tensor's bits as a numpy byte array: pickled as raw bytes (a pickled tensor is a ``torch.save``
    archive each, which cost more than the gather). A copy: numpy over the tensor's own storage would make that
    storage non-resizable, and a re-formation frees parameters by resizing theirs."""
    return tensor.detach().reshape(-1).to("cpu", copy=True).view(torch.uint8).numpy()


def covered_tensors(model, optimizer) -> dict[str, tuple[str, torch.Tensor, torch.Tensor]]:
    """``key`` → (parameter name, tensor, the tensor whose ``ntp_held_units`` describes it) for every tensor of the
    replica state: each parameter ``name``; under bf16 / fp16 its fp32 main param ``name.main_param``; and
    ``name.<key>`` for each per-element optimizer state tensor (Adam's moments, SGD's momentum), which belong to
    the main param.

    Raises :class:`UncoveredState` where a tensor would otherwise go unreported: a parameter the optimizer does
    not step, a main param without the parameter's NTP tag, or, once the optimizer holds any state, a parameter
    without all of it."""
    keys = state_keys(optimizer.config.optimizer)
    state = optimizer.optimizer.state
    stepped = {id(p) for group in optimizer.optimizer.param_groups for p in group["params"]}
    has_state = any(state.get(p) for group in optimizer.optimizer.param_groups for p in group["params"])
    out: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}
    for name, param in model.module.named_parameters():
        out[name] = (name, param.data, param)
        if not param.requires_grad:
            continue
        main = optimizer_param(param)
        if id(main) not in stepped:
            raise UncoveredState(f"{name}: the optimizer does not step this parameter (or its main param)")
        if main is not param:
            if hasattr(param, "ntp_held_units") and getattr(main, "ntp_held_units", None) != param.ntp_held_units:
                raise UncoveredState(f"{name}: its fp32 main param lacks the parameter's ntp_held_units")
            out[f"{name}.main_param"] = (name, main.data, main)
        if not has_state:
            continue  # before the first step (or a load) no parameter has state yet
        for key in keys:
            if key not in state.get(main, {}):
                raise UncoveredState(f"{name}: optimizer state {key!r} missing")
            if state[main][key] is not None:  # SGD without momentum keeps None
                out[f"{name}.{key}"] = (name, state[main][key], main)
    return out


def _distributed_part(optimizer) -> Optional[DistributedOptimizer]:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if not any(isinstance(part, DistributedOptimizer) for part in parts):
        return None
    if len(parts) != 1:
        raise UncoveredState("the state of a chain of distributed optimizers is not gathered")
    return parts[0]


def _shard_tensors(optimizer: DistributedOptimizer, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """This rank's shard of ``param``: the tensor the optimizer steps (``param``) and its state, read without
    adding an entry to the optimizer's state (upstream's ``_get_main_param_and_optimizer_states`` indexes the
    state's defaultdict)."""
    main = main_param_of(optimizer, param)
    return {"param": main, **optimizer.optimizer.state.get(main, {})}


def gathered_shard_state(model, optimizer: DistributedOptimizer, keys: tuple[str, ...]
                         ) -> dict[str, tuple[str, torch.Tensor, torch.Tensor]]:
    """What :func:`covered_tensors` returns, for Megatron's distributed optimizer: each parameter's optimizer
    tensors (``name.main_param`` for bf16 / fp16, and ``name.<key>``), every bucket's shards all-gathered over the
    group its buffer shards over (collective over that group, buffer by buffer in the optimizer's order).

    The optimizer steps ``model`` itself, or (a degraded NTP rank) the slot-shaped shadows of the blocks the rank
    serves, whose TP-split parameters carry their block's units (``ntp_held_units``): a parameter's tensors are then
    its blocks' side by side (units in block order), and a replicated parameter's are its first block's."""
    out: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}
    has_state = any(optimizer.optimizer.state.values())  # a defaultdict: entries can exist, empty
    names = {param: name for chunk in optimizer.model_chunks for name, param in chunk.module.named_parameters()}
    sharded = {names[param] for buffer in optimizer.buffers for param in buffer.param_index_map}
    for name, param in model.module.named_parameters():
        out[name] = (name, param.data, param)
        if param.requires_grad and name not in sharded:  # the shards of a buffer tile it: every position's
            raise UncoveredState(f"{name}: the optimizer does not step this parameter")
    blocks: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for gbuf_index, buffer in enumerate(optimizer.buffers):
        group = buffer.data_parallel_group
        size = group.size()
        ranges = optimizer.gbuf_ranges[gbuf_index][(buffer.param_dtype, buffer.grad_dtype)]
        main = buffer.param_dtype != torch.float32  # fp32: the optimizer steps views of the parameters themselves
        wanted = (("param",) if main else ()) + (keys if has_state else ())
        if not wanted:
            continue
        for bucket_index, bucket in enumerate(buffer.buckets):
            shard = bucket.grad_data.numel() // size
            local = torch.zeros(len(wanted), shard, dtype=torch.float32, device=bucket.grad_data.device)
            for param, where in ranges[bucket_index]["param_map"].items():
                tensors = _shard_tensors(optimizer, param)
                piece = where["gbuf_local"]
                for i, key in enumerate(wanted):
                    if key not in tensors:
                        raise UncoveredState(f"{names[param]}: optimizer state {key!r} missing")
                    local[i, piece.start:piece.end] = tensors[key].detach().reshape(-1)
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local, group=group)
            full = torch.cat(parts, dim=1)  # [key, bucket element]
            for param in bucket.params_list:
                start, end, _ = buffer.param_index_map[param]
                start, end = start - bucket.offset, end - bucket.offset
                name = names[param]
                for i, key in enumerate(wanted):
                    label = f"{name}.main_param" if key == "param" else f"{name}.{key}"
                    blocks.setdefault(label, []).append((name, full[i, start:end].reshape(param.shape), param))
    for label, tensors in blocks.items():
        out[label] = tensors[0] if len(tensors) == 1 else _side_by_side(tensors)
    return out


def _side_by_side(blocks: list[tuple[str, torch.Tensor, torch.Tensor]]) -> tuple[str, torch.Tensor, object]:
    """One tensor of a parameter from its blocks' (each tagged with its units): TP-split ones joined along the unit
    axis, under a tag naming all their units; a replicated one is the first block's."""
    name, first, owner = blocks[0]
    held_per_block = [getattr(p, "ntp_held_units", None) for _, _, p in blocks]
    if held_per_block[0] is None:
        return blocks[0]
    joined = torch.cat([held.view(tensor) for held, (_, tensor, _) in zip(held_per_block, blocks)], dim=1)
    held = held_per_block[0]
    units = tuple(u for s in held_per_block for u in s.units)
    return name, joined.reshape(-1), SimpleNamespace(ntp_held_units=HeldUnits(held.family, held.num_units, units,
                                                                                   held.outer, held.inner))


def full_state(model, optimizer, tf_config, num_units: dict[str, int], tp_group, tp_rank: int,
               replicated_state_source: Optional[int] = None, layer_offset: int = 0) -> dict[str, torch.Tensor]:
    """``name`` → full parameter, ``name.main_param`` → its full fp32 main param (bf16 / fp16), and
    ``name.exp_avg`` / ``name.exp_avg_sq`` → full Adam moments (all flattened). Collective over the replica's
    TP group (and, under the distributed optimizer, over each buffer's data-parallel group). One pipeline stage's
    tensors are named as in the whole model (:func:`ntp_megatron.core.init.global_name`: its first layer is
    ``layer_offset``; the last stage's copy of tied word embeddings is named as the first stage's original).
    ``replicated_state_source``: the rank of the TP group whose optimizer state of replicated parameters is the
    replica's (where slots' copies may differ: :meth:`ntp_megatron.core.grad_sync.GradSync.replicated_state_source`);
    the parameters themselves are always each rank's own."""
    distributed = _distributed_part(optimizer)
    if distributed is not None:
        tensors = gathered_shard_state(model, distributed, state_keys(optimizer.config.optimizer))
    else:
        tensors = covered_tensors(model, optimizer)
    out: dict[str, torch.Tensor] = {}
    split: dict[str, tuple[torch.Tensor, HeldUnits]] = {}
    for key, (name, tensor, owner) in tensors.items():
        key = global_name(key, layer_offset, tied_copy=getattr(owner, "shared_embedding", False))
        held = held_units_of(name, owner, tf_config, num_units, tp_rank, tp_group.size())
        if held is not None:
            split[key] = (tensor, held)
            out[key] = None  # filled in below, keeping the tensors' order
            continue
        flat = tensor.detach().reshape(-1).clone()
        if replicated_state_source is not None and key != name:
            dist.broadcast(flat, src=replicated_state_source, group=tp_group)
        out[key] = flat.cpu()
    out.update(_gather_full(split, tp_group))
    return out


def shard_checksums(optimizer, sources: list[tuple[int, list]]) -> Optional[list[dict]]:
    """Under Megatron's distributed optimizer, a checksum of this rank's shard of each buffer it steps — every
    piece's main param and optimizer state in Megatron's bucket order (``get_parameter_state_dp_reshardable``, no
    communication) — with the block the buffer holds (``sources``: block and buffers, as
    :meth:`ntp_megatron.core.grad_sync.GradSync.shard_sources` names them), its position in the group it shards over
    and the optimizer's instance: the two holders of a shard (twins: one block and position, one per instance)
    must report the same bits. None without the distributed optimizer."""
    distributed = _distributed_part(optimizer)
    if distributed is None:
        return None
    block_of = {id(buffer): block for block, buffers in sources for buffer in buffers}
    state = distributed.get_parameter_state_dp_reshardable()
    out = []
    for index, buffer in enumerate(distributed.buffers):
        digest = hashlib.sha256()
        for buckets in state[index].values():
            for bucket in buckets:
                for piece in bucket:
                    for key in sorted(k for k, v in piece.items() if isinstance(v, torch.Tensor)):
                        digest.update(_raw(piece[key].detach().cpu()))
        out.append({"block": block_of[id(buffer)], "position": buffer.data_parallel_group.rank(),
                    "instance": distributed.distributed_optimizer_instance_id, "checksum": digest.hexdigest()[:16]})
    return out


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes (16-bit tensors through an int16 view: numpy has no bf16)."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.element_size() == 2 else t).numpy().tobytes()


def checksums(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 prefix of each tensor's bytes."""
    return {key: hashlib.sha256(_raw(t)).hexdigest()[:16] for key, t in state.items()}
