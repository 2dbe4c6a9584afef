"""Checkpoints with ``megatron.core.dist_checkpointing``: model, optimizer, scheduler, RNG, progress — for
plain Megatron (NTP off) and for NTP runs under any topology, degraded ones included.

On disk (one format for both)::

    <save>/iter_0000010/                     one checkpoint, Megatron's torch_dist format (PyTorch DCP):
        metadata.json                        written last by dist_checkpointing: the directory is complete
        .metadata, __<rank>_<n>.distcp       tensors: global shapes and chunks (DCP metadata), data
        common.pt                            what every rank holds alike (below)
    <save>/latest_checkpointed_iteration.txt the newest complete checkpoint's iteration

``checkpoint.load`` also reads Megatron-LM's other layouts: ``latest_checkpointed_iteration.txt`` holding
``release`` and a ``release/`` directory (what checkpoint converters write), and a path straight to one
checkpoint directory (``iter_*``, ``release``, or any directory with ``metadata.json``).

Tensors, under the keys of plain Megatron-Core's ``GPTModel`` and optimizer (global shapes and element order
those of a TP1 model, as uniform TP writes them):

- ``model``: ``embedding.word_embeddings.weight``, ``decoder.layers.<param>`` with the layer as a leading
  axis, ``decoder.final_layernorm.*``, ``output_layer.weight`` when untied;
- ``optimizer``: ``optimizer.state.exp_avg.<model key>`` and ``optimizer.state.exp_avg_sq.<model key>``
  (fp32, the model tensor's shape), Adam's step as ``common_step`` and the parameter groups in ``common.pt``;
  with the distributed optimizer Megatron's ``fully_reshardable`` format: the same moments, the fp32 main
  parameters as ``optimizer.state.param.<model key>``, the step in the parameter groups, and Megatron-LM's content
  metadata naming the format. Each rank writes the pieces of its shard as boxes of those tensors, without
  gathering (:func:`_distributed_optimizer_state`; a degraded NTP rank the pieces of its shadows' shards); a load reads them into any optimizer, the distributed one or
  not, and plain Megatron-LM's ``dp_reshardable`` (bucket space) into a distributed-optimizer run of its layout
  (``docs/checkpoints.md``, "The distributed optimizer");
- ``scheduler`` (OptimizerParamScheduler state), ``iteration`` (completed iterations; the data order is a
  function of it), ``consumed_samples`` and ``parallel`` (``tp``, ``dp``; under NTP also the TP width of every
  replica and a digest of the unit layout) in ``common.pt``;
- ``rng_state``: one object per rank, restored only when the layout is the same as at save time.

What a load restores is Megatron-LM's choice (:class:`LoadPlan`): always the model weights; the iteration and
consumed samples unless ``checkpoint.finetune`` or the checkpoint has none (a model-only or ``release``
checkpoint: the run starts at iteration 0); optimizer and scheduler state only with the iteration, unless
``checkpoint.no_load_optim`` or the checkpoint has none (both start fresh); the RNG streams likewise, unless
``checkpoint.no_load_rng``. The launcher decides it once from the checkpoint's ``common.pt`` and metadata, says
it in one line, and pins it into the config the ranks read (:func:`read_progress`).

Under NTP each rank describes its units as fragments of the global tensors and exactly one replica writes
each piece (:mod:`ntp_megatron.core.checkpoint_map`), so what is on disk does not depend on the topology that wrote it:
any topology — another ``tp_base``, other dead slots, NTP off at any uniform TP, plain Megatron-Core code —
reads it, and NTP reads what plain Megatron-Core writes.

Crash safety: a checkpoint is written into its ``iter_*`` directory; only when every rank has finished does
rank 0 replace ``latest_checkpointed_iteration.txt`` atomically (temporary file, ``os.replace``). A kill
during a save leaves the previous latest checkpoint as it was.

Async saves (``checkpoint.async_save``, NTP off): :func:`save_checkpoint` with an ``AsyncCallsQueue`` does
everything the sync save does up to the tensor data (directory, ``common.pt``, the RNG objects, the DCP plan)
and hands the data write to Megatron-Core's queue, whose ``TemporalAsyncCaller`` forks a writer process. On
CPU the plan holds references to the live parameters and Adam moments (``FileSystemWriterAsync`` clones only
views and ``preload_tensors`` is a no-op for CPU tensors), so the fork itself is the snapshot: the writer sees
the state at the save iteration by copy-on-write, whatever the trainer does to its tensors afterwards. Nothing
may change them between :func:`save_checkpoint`'s plan and its fork (they are one call here). ``.metadata``,
``metadata.json`` and then ``latest`` are written by the finalize functions, which run on every rank only
once every rank's writer has finished (``maybe_finalize_async_calls``, collective). The writer and its
workers die with their rank (``PR_SET_PDEATHSIG``), so a killed job leaves no process writing into a
directory a restarted job may rewrite.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from ntp_megatron import phases
from ntp_megatron.core.adam_step import keeps_step_in_groups
from ntp_megatron.core.gpt import NTPGPTModel
from ntp_megatron.elastic.errors import OwnError
from ntp_megatron.patches.dist_checkpointing_filesystem_async import die_with_parent
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

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
"""What Megatron-LM's tracker file holds for a checkpoint converter's output, and that checkpoint's directory."""
FULLY_RESHARDABLE, DP_RESHARDABLE = "fully_reshardable", "dp_reshardable"
"""The distributed optimizer's checkpoint formats (Megatron's ``distrib_optim_sharding_type``) read here; the first
is the one written (see the module docstring)."""
SCHEDULER_KEYS = ("scheduler", "opt_param_scheduler")
"""Where the scheduler state may be: ours, or Megatron-LM's name for it."""


class CheckpointError(OwnError):
    """A checkpoint that cannot be read or written; the message names it and, where that can be known, the file.
    Always the rank's own error (``echo``: only because another rank's part failed)."""


READ_FAILURES = (CheckpointException, CheckpointingException, OSError, EOFError, pickle.UnpicklingError)
"""How reading a checkpoint fails (torch DCP gathers every rank's read failure into a ``CheckpointException``);
not a peer's death in the load's collectives, which a rank must take for what it is."""


def iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


@dataclass(frozen=True)
class LoadPlan:
    """What a load restores besides the model weights, as Megatron-LM's ``load_checkpoint`` decides it."""

    progress: bool = True
    """The iteration and consumed samples; else the run starts at iteration 0 (``--finetune``)."""
    optimizer: bool = True
    """Optimizer and scheduler state; else both start fresh (``--no-load-optim``). Never without ``progress``."""
    rng: bool = True
    """The RNG streams (still only into the layout that saved them); else they start from the seed
    (``--no-load-rng``). Never without ``progress``."""

    @classmethod
    def of(cls, section) -> "LoadPlan":
        """What the config's ``checkpoint`` section asks for (the launcher pins what the checkpoint allows)."""
        progress = not section.finetune
        return cls(progress, progress and not section.no_load_optim, progress and not section.no_load_rng)

    def pin(self, section) -> None:
        """Write this plan into the ``checkpoint`` section, for the ranks (:meth:`of` reads it back)."""
        section.finetune = not self.progress
        section.no_load_optim = not self.optimizer
        section.no_load_rng = not self.rng


FULL = LoadPlan()


@dataclass(frozen=True)
class Progress:
    """Where a checkpoint's run stood: completed iterations and samples consumed by them (0 when the load does
    not restore them), and what the load restores."""

    path: Path
    iteration: int
    consumed_samples: Optional[int]
    """None in a checkpoint that does not record it (plain Megatron-Core's)."""
    plan: LoadPlan = FULL
    notice: Optional[str] = None
    """One line for the user when the load restores less than everything."""

    def samples(self, global_batch_size: int) -> int:
        """Samples consumed; without a record, a full global batch per iteration."""
        return self.consumed_samples if self.consumed_samples is not None else self.iteration * global_batch_size


@dataclass(frozen=True)
class ParallelCoords:
    """Where this rank sits, for per-rank state (the RNG streams) in the checkpoint. Under NTP ``tp_size``
    is tp_base and ``dp_rank`` the replica index (stable across re-formations); the TP rank and width that
    count are read from the model's TP group at save time."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int = 0
    pp_size: int = 1

    @classmethod
    def of(cls, setup, parallel) -> "ParallelCoords":
        """From a :class:`ntp_megatron.training.parallel.ParallelSetup` and the config's ``parallel`` section."""
        return cls(setup.tp_rank, parallel.tensor_model_parallel_size, setup.replica, parallel.data_parallel_size,
                   setup.stage, parallel.pipeline_model_parallel_size)


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


def content_metadata(sharding_type: Optional[str]) -> dict[str, Any]:
    """What Megatron-LM's ``_build_sharded_state_dict_metadata`` passes to ``sharded_state_dict`` and stores in
    the checkpoint (``content_metadata``): ``sharding_type`` is the distributed optimizer's format, None without
    it. The process groups it also passes are not stored."""
    metadata: dict[str, Any] = {}
    if sharding_type is not None:
        metadata["distrib_optim_sharding_type"] = sharding_type
        if sharding_type == FULLY_RESHARDABLE:
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata.update(singleton_local_shards=False, chained_optim_avoid_prefix=True)
    return metadata


STATE_NAMES = ("param", "exp_avg", "exp_avg_sq")
"""A distributed-optimizer piece's tensors: the fp32 main parameter and Adam's moments."""
ALIASES = {"param": "fp32_param", "fp32_param": "param"}
"""The fp32 main parameter is ``param`` in the distributed optimizer's model-space formats and ``fp32_param`` in
the mixed-precision optimizer's (and the older ``fully_sharded_model_space``)."""


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
            return place, ((0, 0) if hasattr(param, "ntp_shard") else (0, block))
        place = model_place(entries[id(param)])
        rid = place.replica_id
        return place, ((rid[0], rid[1]) if isinstance(rid, tuple) else (0, 0))

    return place_of


def _distributed_optimizer_state(dist_opt: DistributedOptimizer, place_of: Callable, is_loading: bool,
                                 stored: Optional[set[str]] = None) -> tuple[dict, _Pieces]:
    """The distributed optimizer's state in Megatron's ``fully_reshardable`` format, written and read piece by
    piece without gathering (see the module docstring): every piece of this rank's shard (Megatron's
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


def _write_latest(root: Path, iteration: Optional[int]) -> None:
    """Point ``latest`` at ``iteration`` (None: remove it) atomically: readers see the old or the new file."""
    latest = root / LATEST_FILE
    if iteration is None:
        latest.unlink(missing_ok=True)
        return
    tmp = root / f".{LATEST_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, latest)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def _latest_entry(root: Path) -> Optional[str]:
    """What ``root``'s tracker file holds (stripped), None without one."""
    try:
        return (root / LATEST_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _latest_iteration(root: Path) -> Optional[int]:
    entry = _latest_entry(root)
    return int(entry) if entry is not None and entry.isdigit() else None


def _complete_iterations(root: Path) -> list[int]:
    out = []
    for path in root.glob("iter_*"):
        if (path / "metadata.json").is_file() and path.name[5:].isdigit():
            out.append(int(path.name[5:]))
    return sorted(out)


def _prepare_dir(root: Path, iteration: int) -> Path:
    """An empty ``iter_*`` directory (rank 0). A leftover of the same iteration (a save killed midway, or a
    run that went further before this one resumed from an older checkpoint) is removed first; if ``latest``
    names it, ``latest`` first moves to the newest other complete checkpoint, so it never points at a
    directory being rewritten."""
    path = iteration_dir(root, iteration)
    root.mkdir(parents=True, exist_ok=True)
    if path.exists():
        if _latest_iteration(root) == iteration:
            others = [i for i in _complete_iterations(root) if i != iteration]
            _write_latest(root, others[-1] if others else None)
        shutil.rmtree(path)
    path.mkdir()
    return path


class _WriterDiesWithRank:
    """The async request's writer function (run in the forked writer), made to die with its rank first."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        die_with_parent()
        return self.fn(*args, **kwargs)


def save_checkpoint(
    root: Path,
    iteration: int,
    model,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    coords: ParallelCoords,
    consumed_samples: Optional[int] = None,
    async_queue: Any = None,
    on_finalized: Optional[Callable[[Path], None]] = None,
    grad_sync=None,
) -> Path:
    """Save every rank's state as ``iter_<iteration>`` under ``root``; collective over the job (under NTP, the
    current generation). A rank that dies midway leaves ``latest`` where it was. ``grad_sync``: NTP's
    (:class:`ntp_megatron.core.grad_sync.GradSync`), whose shadows a degraded rank's distributed optimizer steps.

    With ``async_queue`` (Megatron-Core's ``AsyncCallsQueue``) the tensor data is written by a forked writer
    while training goes on, and the save completes — ``.metadata``, ``metadata.json``, ``latest``, then
    ``on_finalized(path)`` — when the queue finalizes it on every rank; the caller must finalize any earlier
    save first. Without it the save is complete on return (and ``on_finalized`` is called too)."""
    path = iteration_dir(root, iteration)
    layout = _layout(model, coords)
    if dist.get_rank() == 0:
        _prepare_dir(root, iteration)
    dist.barrier()
    state, _ = _sharded_state(model, optimizer, layout, is_loading=False, grad_sync=grad_sync)
    state["scheduler"] = scheduler.state_dict()
    state["iteration"] = iteration
    if consumed_samples is not None:
        state["consumed_samples"] = consumed_samples
    state["parallel"] = layout.parallel
    rng = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state["rng_state"] = _rng_object(coords, layout, rng)
    phases.point("checkpoint")

    def point_latest() -> None:
        dist.barrier()
        if dist.get_rank() == 0:
            _write_latest(root, iteration)
        dist.barrier()
        logger.debug("saved checkpoint at iteration %d to %s", iteration, path)
        if on_finalized is not None:
            on_finalized(path)

    content = content_metadata(FULLY_RESHARDABLE if distributed_optimizer(optimizer) is not None else None)
    if async_queue is None:
        dist_checkpointing.save(state, str(path), content_metadata=content)  # ends with metadata.json, a barrier
        point_latest()
        return path
    # Plan now, then fork the writer at once: the fork is the snapshot of the state (see the module docstring).
    request = dist_checkpointing.save(state, str(path), async_sharded_save=True, content_metadata=content)
    if request.async_fn is not None:
        request = request._replace(async_fn=_WriterDiesWithRank(request.async_fn))
    request.add_finalize_fn(point_latest)  # after upstream's .metadata and metadata.json
    async_queue.schedule_async_request(request)
    return path


def _is_checkpoint_name(name: str) -> bool:
    return name == RELEASE or (name.startswith("iter_") and name[5:].isdigit())


def restart_checkpoint(ck) -> Optional[Path]:
    """The one rule for where a restarted job resumes (every restart: NTP off, or ``ntp.on_unrecoverable: restart``):
    the run's own newest checkpoint (``checkpoint.save``), all of it, when it saved one; None: from
    ``checkpoint.load`` as the launcher pinned it at the start (or from the start). ``ck``: the config's
    ``checkpoint`` section."""
    return Path(ck.save) if ck.save and resolve_load_dir(Path(ck.save)) is not None else None


def resolve_load_dir(load: Path) -> Optional[Path]:
    """``load`` itself if it is one checkpoint (``metadata.json`` in it, or named ``iter_*`` or ``release``:
    complete or not, loading says which), else the one its ``latest_checkpointed_iteration.txt`` names (an
    iteration, or ``release`` as Megatron-LM's converters write); None if it names none."""
    if (load / "metadata.json").is_file() or _is_checkpoint_name(load.name):
        return load
    entry = _latest_entry(load)
    if entry == RELEASE:
        return load / RELEASE
    if entry is not None and entry.isdigit():
        return iteration_dir(load, int(entry))
    return None


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


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _stored_keys(path: Path) -> set[str]:
    """The keys of every tensor and object the checkpoint in ``path`` holds, from its metadata (torch_dist: DCP's
    own, where an object's key is ``<key>/shard_...``)."""
    try:
        if json.loads((path / "metadata.json").read_text()).get("sharded_backend") == "torch_dist":
            return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        return set(load_sharded_metadata(str(path)))
    except Exception as exc:  # noqa: BLE001 - local reading only: any failure means the checkpoint
        raise _read_failure(path, exc) from exc


def plan_load(path: Path, common: dict, stored: set[str], asked: LoadPlan = FULL) -> tuple[LoadPlan, Optional[str]]:
    """What loading the checkpoint in ``path`` restores, as Megatron-LM decides it, and why not everything (None:
    everything). Megatron-LM's rules: a ``release`` checkpoint, and ``--finetune``, restore the model weights only
    (iteration 0, fresh optimizer, scheduler and RNG); optimizer and scheduler state are read only with the
    iteration and not with ``--no-load-optim``, nor RNG states with ``--no-load-rng``. Where Megatron-LM stops
    (a checkpoint without an iteration; one without the optimizer or RNG state it would read, unless its
    saved arguments say ``--no-save-optim`` / ``--no-save-rng``), the plan takes what is there: the weights of a
    model-only checkpoint start a run at iteration 0, a missing optimizer or RNG state starts fresh. Refused
    (SystemExit, one line): optimizer state without the scheduler state saved with it."""
    has_iteration = "iteration" in common
    has_optimizer = "optimizer" in common or any(key.startswith("optimizer.") for key in stored)
    has_rng = any(key.split("/")[0] == "rng_state" for key in stored) or "rng_state" in common
    args = common.get("args")  # Megatron-LM's saved arguments, if any
    saved_optimizer = has_optimizer and not getattr(args, "no_save_optim", False)
    saved_rng = has_rng and not getattr(args, "no_save_rng", False)
    if path.name == RELEASE:
        return LoadPlan(False, False, False), f"checkpoint.load: {path} is a release checkpoint"
    if not asked.progress:
        return LoadPlan(False, False, False), f"checkpoint.load: --finetune (checkpoint.finetune) from {path}"
    if not has_iteration:
        return (LoadPlan(False, False, False),
                f"checkpoint.load: {path} holds no iteration (a model-only checkpoint)")
    if asked.optimizer and saved_optimizer and not any(key in common for key in SCHEDULER_KEYS):
        raise SystemExit(f"checkpoint.load: {path} holds optimizer state but no scheduler state; "
                         "--no-load-optim (checkpoint.no_load_optim) starts both fresh")
    plan = LoadPlan(True, asked.optimizer and saved_optimizer, asked.rng and saved_rng)
    reasons = []
    if not asked.optimizer:
        reasons.append("--no-load-optim (checkpoint.no_load_optim)")
    elif not saved_optimizer:
        reasons.append("it holds no optimizer state")
    if not asked.rng:
        reasons.append("--no-load-rng (checkpoint.no_load_rng)")
    elif not saved_rng:
        reasons.append("it holds no RNG state")
    if not reasons:
        return plan, None
    return plan, f"checkpoint.load: {path}: {_and(reasons)}"


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


def verify_checkpoint(path: Path) -> None:
    """That the checkpoint in ``path`` (an ``iter_*`` directory) is whole, without reading a tensor:
    ``metadata.json`` parses, ``common.pt`` is an intact archive (its records' CRCs), and under the torch_dist
    backend ``.metadata`` reads and every file it lists exists, can be opened, is as long as the items it holds
    there (a missing or truncated file is found by its length), and holds at each item's place what torch DCP
    writes there: a ``torch.save`` archive, which begins with a zip local header and ends with the end of its
    central directory (a file overwritten or swapped for another is found by two small reads per item).
    :class:`CheckpointError` naming the first file that is not. Run by the launcher before any rank starts
    (:func:`read_progress`), and by a rank whose load failed, to name the file (:func:`_read_failure`)."""
    def broken(name: str, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint.load: {path.resolve() / name}: {why}")

    try:
        backend = json.loads((path / "metadata.json").read_text()).get("sharded_backend")
    except FileNotFoundError:
        raise broken("metadata.json", "missing (not a complete checkpoint)") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise broken("metadata.json", f"unreadable ({type(exc).__name__}: {exc})") from None
    try:
        with zipfile.ZipFile(path / "common.pt") as archive:
            bad_record = archive.testzip()
    except FileNotFoundError:
        raise broken("common.pt", "missing") from None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise broken("common.pt", f"unreadable or truncated ({type(exc).__name__}: {exc})") from None
    if bad_record is not None:
        raise broken("common.pt", f"corrupt (record {bad_record!r} fails its CRC check)")
    if backend != "torch_dist":
        return  # another backend's files: the load itself names what it cannot read
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        raise broken(".metadata", "missing") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign pickle fails in many ways
        raise broken(".metadata", f"unreadable ({type(exc).__name__}: {exc})") from None
    items: dict[str, list] = {}
    for item in (getattr(metadata, "storage_data", None) or {}).values():
        items.setdefault(item.relative_path, []).append(item)
    for name, held in sorted(items.items()):
        length = max(item.offset + item.length for item in held)
        try:
            with open(path / name, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < length:
                    raise broken(name, f"truncated: {size} bytes, but the checkpoint's .metadata has data up to "
                                       f"byte {length}")
                for item in sorted(held, key=lambda item: item.offset):
                    if not item.transform_descriptors and not _is_archive(f, item.offset, item.length):
                        raise broken(name, f"corrupt: bytes {item.offset}..{item.offset + item.length} are not the "
                                           "archive the checkpoint's .metadata says is there")
        except FileNotFoundError:
            raise broken(name, "missing (the checkpoint's .metadata lists data in it)") from None
        except OSError as exc:
            raise broken(name, f"unreadable ({exc.strerror or type(exc).__name__})") from None


_ZIP_HEADER, _ZIP_END = b"PK\x03\x04", b"PK\x05\x06"
_ZIP_END_SIZE = 22
"""The end of central directory record: its signature and its size without a comment (torch.save writes none)."""


def _is_archive(f, offset: int, length: int) -> bool:
    if length < len(_ZIP_HEADER) + _ZIP_END_SIZE:
        return False
    f.seek(offset)
    head = f.read(len(_ZIP_HEADER))
    f.seek(offset + length - _ZIP_END_SIZE)
    return head == _ZIP_HEADER and f.read(len(_ZIP_END)) == _ZIP_END


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
    return dist_opt is not None and any(hasattr(param, "ntp_shard") for chunk in dist_opt.model_chunks
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
    :func:`save_checkpoint` or by plain Megatron-Core (model, optimizer, scheduler, iteration; or the model
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
