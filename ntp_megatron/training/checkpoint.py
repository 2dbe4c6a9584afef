"""Checkpoints with ``megatron.core.dist_checkpointing``: model, optimizer, scheduler, RNG, progress.

Layout on disk: ``<save>/iter_0000010/`` per checkpoint (torch_dist format) and
``<save>/latest_checkpointed_iteration.txt`` written last, so a crash mid-save never points at a partial
checkpoint. Progress is the number of completed iterations; data order is a function of it (see
:mod:`ntp_megatron.training.data`), so resuming neither skips nor repeats a sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ntp_megatron import faults

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


@dataclass(frozen=True)
class ParallelCoords:
    """Where this rank sits, for per-rank state (the RNG streams) in the checkpoint."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int


def _rng_object(coords: ParallelCoords, state: Any) -> ShardedObject:
    return ShardedObject(
        "rng_state", state, (coords.dp_size, coords.tp_size), (coords.dp_rank, coords.tp_rank), replica_id=0
    )


def _sharded_state(model, optimizer: MegatronOptimizer, is_loading: bool) -> dict[str, Any]:
    """Model keys are the GPTModel's own (no DDP ``module.`` prefix), as in Megatron's checkpoints."""
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def save_checkpoint(
    root: Path,
    iteration: int,
    model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    coords: ParallelCoords,
) -> Path:
    path = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state["scheduler"] = scheduler.state_dict()
    state["iteration"] = iteration
    state["parallel"] = {"tp": coords.tp_size, "dp": coords.dp_size}
    rng = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state["rng_state"] = _rng_object(coords, rng)
    faults.point("checkpoint")
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (root / LATEST_FILE).write_text(f"{iteration}\n")
    dist.barrier()
    logger.info("saved checkpoint at iteration %d to %s", iteration, path)
    return path


def resolve_load_dir(load: Path) -> Optional[Path]:
    """``load`` itself if it is an ``iter_*`` checkpoint, else its latest one; None if it holds none."""
    if (load / "metadata.json").is_file():
        return load
    latest = load / LATEST_FILE
    if latest.is_file():
        return iteration_dir(load, int(latest.read_text().strip()))
    return None


def load_checkpoint(
    load: Path,
    model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    coords: ParallelCoords,
) -> int:
    """Restore everything saved by :func:`save_checkpoint`; returns the completed iteration count."""
    path = resolve_load_dir(load)
    if path is None:
        raise SystemExit(f"checkpoint.load: no checkpoint in {load} (no {LATEST_FILE} and no metadata.json)")
    common = dist_checkpointing.load_common_state_dict(str(path))
    same_layout = common.get("parallel") == {"tp": coords.tp_size, "dp": coords.dp_size}
    request = _sharded_state(model, optimizer, is_loading=True)
    if same_layout:
        request["rng_state"] = _rng_object(coords, None)
    state = dist_checkpointing.load(request, str(path))
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if same_layout:
        rng = state["rng_state"]
        torch.set_rng_state(rng["cpu"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        logger.warning("checkpoint saved with %s, resuming with a different layout: RNG streams reseeded",
                       common.get("parallel"))
    iteration = int(state["iteration"])
    logger.info("loaded checkpoint %s (iteration %d)", path, iteration)
    return iteration
