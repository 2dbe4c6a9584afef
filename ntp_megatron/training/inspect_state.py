"""Full (unsharded) parameters and optimizer state of one replica, for verification.

Every replica, whatever its layout, can rebuild each TP-split tensor in global unit order by gathering its
ranks' units; comparing those tensors (or their checksums) across replicas and across runs is how the
tests check that NTP computes the same model as uniform TP and TP1, and that replicas stay identical.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist

from ntp_megatron.layers import UnitShard
from ntp_megatron.ntp_gpt import family_geometry

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def shard_of(name: str, param: torch.nn.Parameter, tf_config, num_units: dict[str, int], tp_rank: int,
             tp_size: int) -> Optional[UnitShard]:
    """The NTP tag if the parameter has one; for a uniform Megatron model, rank ``tp_rank``'s contiguous block."""
    shard = getattr(param, "ntp_shard", None)
    if shard is not None or tp_size == 1:
        return shard
    geometry = family_geometry(name, tf_config)
    if geometry is None:
        return None
    family, outer, inner = geometry
    per_rank = num_units[family] // tp_size
    units = tuple(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))
    return UnitShard(family, num_units[family], units, outer, inner)


def _gather_full(local: torch.Tensor, shard: UnitShard, tp_group) -> torch.Tensor:
    parts: list = [None] * tp_group.size()
    dist.all_gather_object(parts, (shard.units, local.detach().cpu()), group=tp_group)
    full = torch.zeros(shard.outer, shard.num_units, shard.inner, dtype=local.dtype)
    for units, tensor in parts:
        full[:, list(units), :] = tensor.reshape(shard.outer, len(units), shard.inner)
    return full.reshape(-1)


def full_state(model, optimizer, tf_config, num_units: dict[str, int], tp_group, tp_rank: int) -> dict[str, torch.Tensor]:
    """``name`` → full parameter and ``name.exp_avg`` / ``name.exp_avg_sq`` → full Adam moments (all
    and flattened). Collective over the replica's TP group."""
    state = optimizer.optimizer.state
    out: dict[str, torch.Tensor] = {}
    for name, param in model.module.named_parameters():
        shard = shard_of(name, param, tf_config, num_units, tp_rank, tp_group.size())
        tensors = {name: param.data}
        for key in STATE_KEYS:
            if key in state.get(param, {}):
                tensors[f"{name}.{key}"] = state[param][key]
        for key, tensor in tensors.items():
            out[key] = tensor.detach().cpu().reshape(-1).clone() if shard is None else _gather_full(tensor, shard, tp_group)
    return out


def checksums(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {key: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16] for key, t in state.items()}
