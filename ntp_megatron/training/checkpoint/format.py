"""What a checkpoint holds and what loading it restores, as plain data: the names on disk that are Megatron-LM's
(a ``release`` checkpoint, the distributed optimizer's formats and content metadata, the scheduler state's keys, an
optimizer piece's tensor names), :class:`LoadPlan` and :class:`Progress` with Megatron-LM's rules for what a load
restores (:func:`plan_load`), where a rank sits (:class:`ParallelCoords`), and :class:`CheckpointError`.

May import: the standard library and :mod:`ntp_megatron.elastic.errors`; no torch, no Megatron-Core, no other module
of this package (they all import this one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ntp_megatron.elastic.errors import OwnError


RELEASE = "release"
"""What Megatron-LM's tracker file holds for a checkpoint converter's output, and that checkpoint's directory."""
FULLY_RESHARDABLE, DP_RESHARDABLE = "fully_reshardable", "dp_reshardable"
"""The distributed optimizer's checkpoint formats (Megatron's ``distrib_optim_sharding_type``) read here; the first
is the one written (see the package docstring)."""
SCHEDULER_KEYS = ("scheduler", "opt_param_scheduler")
"""Where the scheduler state may be: ours, or Megatron-LM's name for it."""


class CheckpointError(OwnError):
    """A checkpoint that cannot be read or written; the message names it and, where that can be known, the file.
    Always the rank's own error (``echo``: only because another rank's part failed)."""


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


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


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
