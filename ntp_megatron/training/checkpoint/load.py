"""Reading a checkpoint: :func:`read_progress` (the launcher, before any rank starts: which checkpoint, what of it a
load restores, where the run starts) and :func:`load_checkpoint` (every rank, collective over the job), with their
checks (the files, global shapes, the optimizer's format) and the optimizer state loaded across optimizer families
(distributed, mixed precision, fp32). A read that fails names the damaged file where one is (:func:`_read_failure`).

May import: :mod:`.format`, :mod:`.files`, :mod:`.sharded`, Megatron-Core and :mod:`ntp_megatron.core`; not
:mod:`.save`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import pickle
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from ntp_megatron.core.adam_step import keeps_step_in_groups
from ntp_megatron.core.checkpoint_map import UnitShardedTensorFactory
from ntp_megatron.training.checkpoint.files import LATEST_FILE, _latest_entry, resolve_load_dir, verify_checkpoint
from ntp_megatron.training.checkpoint.format import (
    ALIASES,
    DP_RESHARDABLE,
    FULL,
    FULLY_RESHARDABLE,
    RELEASE,
    SCHEDULER_KEYS,
    CheckpointError,
    LoadPlan,
    ParallelCoords,
    Progress,
    _and,
    plan_load,
)
from ntp_megatron.training.checkpoint.sharded import (
    _layout,
    _Pieces,
    _rng_object,
    _sharded_state,
    distributed_optimizer,
)

logger = logging.getLogger(__package__)  # the package's name: log lines read as they did before the split


READ_FAILURES = (CheckpointException, CheckpointingException, OSError, EOFError, pickle.UnpicklingError)
"""How reading a checkpoint fails (torch DCP gathers every rank's read failure into a ``CheckpointException``);
not a peer's death in the load's collectives, which a rank must take for what it is."""


def read_progress(load: Path, asked: LoadPlan = FULL) -> Progress:
    """The complete checkpoint ``load`` names (a root: its latest; or one checkpoint directory), what loading it
    restores (``asked``: what ``checkpoint.finetune`` / ``no_load_optim`` / ``no_load_rng`` leave, narrowed to
    what the checkpoint holds, :func:`plan_load`) and where the run starts. SystemExit with one line if there is
    no checkpoint or it cannot be loaded as asked, :class:`CheckpointError` if a file of it is missing or damaged
    (:func:`verify_checkpoint`). Read by the launcher before any rank starts, so every rank loads the same
    directory whatever a later save does to ``latest``, and the same parts of it."""
    path = resolve_load_dir(load)
    if path is not None and (path / "metadata.json").is_file():
        verify_checkpoint(path)
    path, common = _open(load)
    plan, reason = plan_load(path, common, _stored_keys(path), asked)
    iteration = int(common["iteration"]) if plan.progress else 0
    consumed = common.get("consumed_samples") if plan.progress else 0
    progress = Progress(path, iteration, int(consumed) if consumed is not None else None, plan)
    if reason is None:
        return progress
    fresh = ([] if plan.optimizer else ["optimizer", "scheduler"]) + ([] if plan.rng else ["RNG"])
    kept = " and its optimizer and scheduler state" if plan.optimizer else ""
    notice = f"{reason}: starting at iteration {iteration} from its model weights{kept}, with fresh {_and(fresh)} state"
    return dataclasses.replace(progress, notice=notice)


def _stored_keys(path: Path) -> set[str]:
    """The keys of every tensor and object the checkpoint in ``path`` holds, from its metadata (torch_dist: DCP's
    own, where an object's key is ``<key>/shard_...``)."""
    try:
        if json.loads((path / "metadata.json").read_text()).get("sharded_backend") == "torch_dist":
            return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        return set(load_sharded_metadata(str(path)))
    except Exception as exc:  # noqa: BLE001 - local reading only: any failure means the checkpoint
        raise _read_failure(path, exc) from exc


def _open(load: Path) -> tuple[Path, dict]:
    """The complete checkpoint ``load`` names and its common state dict, or SystemExit with one line."""
    path = resolve_load_dir(load)
    if path is None:
        entry = _latest_entry(load)
        if entry is not None:
            raise SystemExit(f"checkpoint.load: {load / LATEST_FILE} holds {entry[:40]!r}, neither an iteration "
                             f"nor {RELEASE!r}")
        raise SystemExit(f"checkpoint.load: no checkpoint in {load} (no {LATEST_FILE} and no metadata.json)")
    if not (path / "metadata.json").is_file():
        raise SystemExit(f"checkpoint.load: {path} is not a complete checkpoint (no metadata.json)")
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except Exception as exc:  # noqa: BLE001 - local reading only: any failure means the checkpoint
        raise _read_failure(path, exc) from exc
    return path, common


def _read_failure(path: Path, exc: BaseException) -> CheckpointError:
    """What a rank raises when reading the checkpoint failed: the damaged file if :func:`verify_checkpoint` finds
    one, else (bytes changed inside an item, ...) the checkpoint and the first line of the first failure (torch
    DCP's ``CheckpointException`` carries every rank's own). Only on failure: a load that works pays nothing."""
    try:
        verify_checkpoint(path)
    except CheckpointError as found:
        return found
    failures = getattr(exc, "failures", None)
    cause: BaseException = exc
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        cause = first[0] if isinstance(first, tuple) else first
    lines = str(cause).strip().splitlines()
    return CheckpointError(f"checkpoint.load: cannot read {path.resolve()}: {type(cause).__name__}: "
                           f"{lines[0][:200] if lines else ''}")


def _requested_shapes(request: dict) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor a load request reads, by checkpoint key."""
    out: dict[str, tuple[int, ...]] = {}
    for value in nested_values(request):
        if isinstance(value, UnitShardedTensorFactory):
            out[value.key] = tuple(value.global_shape)
        elif isinstance(value, ShardedTensor):
            out[value.key] = tuple(value.global_shape)
    return out


def check_shapes(request: dict, path: Path) -> None:
    """One clear line (SystemExit) if the checkpoint lacks a tensor this model reads or holds it with another
    global shape (a checkpoint of a different model)."""
    stored = dist_checkpointing.load_tensors_metadata(str(path))
    for key, shape in sorted(_requested_shapes(request).items()):
        if key not in stored:
            if key.startswith("optimizer."):
                raise SystemExit(f"checkpoint.load: {path} has no tensor {key!r}, which this run's optimizer reads "
                                 "(another optimizer's state?); --no-load-optim (checkpoint.no_load_optim) starts a "
                                 "fresh one")
            raise SystemExit(f"checkpoint.load: {path} has no tensor {key!r}, which this model reads "
                             "(a checkpoint of another model)")
        if tuple(stored[key].global_shape) != shape and key.startswith("optimizer.distributed."):
            raise SystemExit(f"checkpoint.load: {path} holds the distributed optimizer's state in Megatron's "
                             f"{DP_RESHARDABLE} format (bucket space) for buffers other than this run's ({key!r}: "
                             f"{tuple(stored[key].global_shape)} elements here, {shape} in this run: another TP, "
                             "bucket size or model); only a run of its layout reads it; re-save it with Megatron-LM's "
                             "--dist-ckpt-optim-fully-reshardable, or --no-load-optim (checkpoint.no_load_optim) "
                             "starts a fresh optimizer")
        if tuple(stored[key].global_shape) != shape:
            raise SystemExit(f"checkpoint.load: tensor {key!r} has global shape {tuple(stored[key].global_shape)}"
                             f" in {path} but {shape} in this model (a checkpoint of a different model shape)")


def _optimizer_format(path: Path, common: dict, optimizer) -> Optional[str]:
    """The distributed optimizer's format the checkpoint's optimizer state is in (Megatron-LM stores it in the
    content metadata), None for another optimizer's; SystemExit with one line if this run cannot read it."""
    stored = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if stored in (None, FULLY_RESHARDABLE):
        return stored
    hint = ("re-save it with Megatron-LM's --dist-ckpt-optim-fully-reshardable, or --no-load-optim "
            "(checkpoint.no_load_optim) starts a fresh optimizer")
    if stored == DP_RESHARDABLE:
        if distributed_optimizer(optimizer) is None or _is_ntp_optimizer(optimizer):
            raise SystemExit(f"checkpoint.load: {path} holds the distributed optimizer's state in Megatron's "
                             f"{DP_RESHARDABLE} format (bucket space), which only a distributed-optimizer run of its "
                             f"TP and bucket layout reads; {hint}")
        return stored
    raise SystemExit(f"checkpoint.load: {path} holds the distributed optimizer's state in the format {stored!r}, "
                     f"which is not read here ({FULLY_RESHARDABLE} and {DP_RESHARDABLE} are); {hint}")


def _alias_keys(request: dict, stored: set[str]) -> None:
    """Point a request's main-parameter tensors that the checkpoint lacks at their other name (:data:`ALIASES`):
    the mixed-precision optimizer's ``fp32_param`` is the distributed optimizer's ``param``."""
    prefix = "optimizer.state."
    for value in nested_values(request):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.key.startswith(prefix) \
                and value.key not in stored:
            name, _, rest = value.key[len(prefix):].partition(".")
            alias = f"{prefix}{ALIASES.get(name, name)}.{rest}"
            if alias in stored:
                value.key = alias


def _is_ntp_optimizer(optimizer) -> bool:
    """A distributed optimizer over NTP parameters: the model's, or a degraded rank's shadows (plain modules whose
    parameters carry units)."""
    dist_opt = distributed_optimizer(optimizer)
    return dist_opt is not None and any(hasattr(param, "ntp_held_units") for chunk in dist_opt.model_chunks
                                        for param in chunk.module.parameters())


def _inner(optimizer):
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(parts) != 1:
        raise SystemExit("checkpoint.load: an optimizer of several parts (expert parameters?) is not supported")
    return parts[0]


def _own_param_groups(optimizer) -> list[dict]:
    """This run's parameter groups as its torch optimizer saves them (``params`` as indices): what a load from
    another optimizer's state takes (the scheduler's own state then sets their learning rate and weight decay)."""
    inner = _inner(optimizer)
    return copy.deepcopy(inner.optimizer.state_dict()["param_groups"])


def _family(state: dict) -> str:
    """Which Megatron optimizer's state dict ``state`` is: ``distributed``, ``float16`` (mixed precision) or
    ``fp32``."""
    if "param_state_sharding_type" in state:
        return "distributed"
    return "float16" if "optimizer" in state else "fp32"


def _step(state: dict) -> Any:
    """Adam's step in an optimizer state dict of any family (:func:`_family`)."""
    family = _family(state)
    if family == "distributed":
        return state["optimizer"]["param_groups"][0]["step"]
    inner = state["optimizer"] if family == "float16" else state
    return inner["state"]["common_step"]


def _restore_steps(torch_optimizer) -> None:
    """Every parameter's Adam step, from the parameter groups a distributed-optimizer load restored (where Megatron
    keeps it). Upstream's ``DistributedOptimizer.load_state_dict`` (torch's Adam, without Apex or Transformer
    Engine) gives all parameters one shared step tensor, which torch's Adam would advance once per parameter and
    step (torch's ``load_state_dict`` copies no step), and ``dp_reshardable``'s parameter state then copies in the
    step the request was built with. (Transformer Engine's and Apex's Adam read the groups' step: nothing to do.)"""
    if keeps_step_in_groups(torch_optimizer):
        return
    for group in torch_optimizer.param_groups:
        for param in group["params"]:
            torch_optimizer.state[param]["step"] = torch.tensor(float(group["step"]))


@torch.no_grad()
def _load_optimizer(optimizer, loaded: dict, pieces: Optional[_Pieces], groups: list[dict]) -> None:
    """Load ``loaded`` (what ``dist_checkpointing.load`` gave for the optimizer's request) into ``optimizer``. The
    tensors are model-space in every family, so across families only the non-tensor part differs: then this run's
    parameter groups (``groups``) take the checkpoint's Adam step."""
    inner = _inner(optimizer)
    target, source = ("distributed" if isinstance(inner, DistributedOptimizer) else _family(inner.state_dict())), \
        _family(loaded)
    if isinstance(inner, DistributedOptimizer) and pieces is not None:
        if source == "distributed":
            common = {key: loaded[key] for key in ("optimizer", "grad_scaler") if key in loaded}
        else:
            step = _step(loaded)
            step = float(step.item() if isinstance(step, torch.Tensor) else step)
            common = {"optimizer": {"param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "step": step}
                                                     for g in groups]}}
        inner.load_state_dict(common)  # the parameter groups, the step; allocates the state tensors
        _restore_steps(inner.optimizer)
        if "param" in pieces.missing:  # the main parameters follow the loaded weights
            inner.reload_model_params()
        for index, model_param in enumerate(pieces.params):
            live = inner._get_main_param_and_optimizer_states(model_param)
            for name, tensor in loaded["param_state"][index].items():
                live[name].copy_(tensor)
        return
    if target == "distributed":  # Megatron's own dp_reshardable load
        inner.load_state_dict(loaded)
        _restore_steps(inner.optimizer)
        return
    if source == target:
        inner.load_state_dict(loaded)
        return
    step = _step(loaded)
    step = step.clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step))
    if target == "fp32":
        inner.load_state_dict({"state": {**loaded["state"], "common_step": step}, "param_groups": groups})
        return
    inner.load_state_dict({"optimizer": {"state": {**loaded["optimizer"]["state"], "common_step": step},
                                         "param_groups": groups},
                           "fp32_from_fp16_params": loaded["fp32_from_fp16_params"]})


def load_checkpoint(
    load: Path,
    model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    coords: ParallelCoords,
    plan: LoadPlan = FULL,
    grad_sync=None,
) -> Progress:
    """Restore what ``plan`` says (the launcher's :func:`read_progress` decided it) of a checkpoint saved by
    :func:`.save.save_checkpoint` or by plain Megatron-Core (model, optimizer, scheduler, iteration; or the model
    alone), whatever layout wrote it; collective over the job. Returns where the run starts. The model part goes
    through the same sharded state dict whatever the plan, so a model-only checkpoint of one TP degree loads
    into any layout as a full one does. On a degraded NTP rank under the distributed optimizer (``grad_sync``'s
    shadows) the optimizer's pieces are the shadows' and the shadows' parameters are filled again from the
    loaded model before the optimizer state is (a fresh optimizer's main parameters follow them)."""
    path, common = _open(load)
    scheduler_key = next((k for k in SCHEDULER_KEYS if k in common), None)
    if plan.optimizer and scheduler_key is None:
        raise SystemExit(f"checkpoint.load: {path} has no scheduler state")
    layout = _layout(model, coords)
    restore_rng = plan.rng and common.get("parallel") == layout.parallel
    sharding_type = _optimizer_format(path, common, optimizer) if plan.optimizer else None
    stored = _stored_keys(path) if plan.optimizer else None
    groups = _own_param_groups(optimizer) if plan.optimizer else None
    request, pieces = _sharded_state(model, optimizer if plan.optimizer else None, layout, is_loading=True,
                                     stored=stored, sharding_type=sharding_type or FULLY_RESHARDABLE,
                                     grad_sync=grad_sync)
    if plan.optimizer and pieces is None:
        _alias_keys(request["optimizer"], stored)
    if restore_rng:
        request["rng_state"] = _rng_object(coords, layout, None)
    try:
        check_shapes(request, path)
        state = dist_checkpointing.load(request, str(path))
    except READ_FAILURES as exc:
        raise _read_failure(path, exc) from exc
    model.module.load_state_dict(state["model"])
    if grad_sync is not None:
        grad_sync.refill_shadows()  # a collective over a degraded replica; nothing elsewhere
    if plan.optimizer:
        _load_optimizer(optimizer, state["optimizer"], pieces, groups)
        scheduler.load_state_dict(state[scheduler_key])
    else:  # as Megatron-LM: a fresh optimizer's main parameters (fp16/bf16) follow the loaded weights
        optimizer.reload_model_params()
    if restore_rng:
        rng = state["rng_state"]
        torch.set_rng_state(rng["cpu"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    elif plan.rng and dist.get_rank() == 0:
        logger.warning("checkpoint saved with %s, resuming with %s: RNG streams not restored",
                       common.get("parallel"), layout.parallel)
    iteration = int(common["iteration"]) if plan.progress else 0
    logger.info("loaded checkpoint %s (iteration %d)", path, iteration)
    consumed = common.get("consumed_samples") if plan.progress else 0
    return Progress(path, iteration, int(consumed) if consumed is not None else None, plan)
