"""What the launcher checks before any rank starts, so a mistake costs one line and exit code 2, not a rank
start, eight copies of a traceback and exit code 1: data prefixes that do not exist, a CUDA config on a machine
without CUDA, a checkpoint directory that does not exist or a checkpoint with a missing or truncated file, a save
directory that cannot be written, a resume with nothing left to train.

Paths mean what they mean in the user's shell: relative ones are relative to the current directory.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import torch

from ntp_megatron.config.files import ConfigError
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.training import runtime


def check_data(cfg: JobConfig) -> None:
    """Indexed data exists and its split has what evaluation reads (:func:`ntp_megatron.training.data.check_data`)."""
    if cfg.data.mock:
        return
    from ntp_megatron.training import data  # Megatron-Core's datasets: loaded only when real data is read

    try:
        data.check_data(cfg)
    except SystemExit as exc:
        raise ConfigError(str(exc)) from None


def check_device(cfg: JobConfig) -> None:
    """A config that asks for CUDA (``training.device: cuda`` or ``parallel.backend: nccl``) on a machine where
    torch sees no CUDA device, or ``auto`` on a GPU machine whose CUDA is broken (the environment or the driver
    names GPUs, torch sees none): one line here instead of one per rank. Creates no CUDA context."""
    wants = [f"{key} is {value!r}" for key, value in (("training.device", cfg.training.device),
                                                       ("parallel.backend", cfg.parallel.backend))
             if value in ("cuda", "nccl")]
    expected = runtime.expected_gpus() if not wants and cfg.training.device == "auto" else None
    if not wants and expected is None:
        return
    try:
        available = torch.cuda.is_available()
    except Exception as exc:  # noqa: BLE001 - the check itself failing means a broken CUDA
        raise ConfigError(f"training.device: CUDA is unusable: torch.cuda.is_available() failed ({exc}); fix the "
                          "CUDA setup, or set training.device: cpu") from None
    if available:
        return
    if expected is not None:
        raise ConfigError(f"training.device is 'auto' and {expected}, but torch sees no CUDA device (torch "
                          f"{torch.__version__}, CUDA build {torch.version.cuda}); fix the CUDA setup, or set "
                          "training.device: cpu to train on CPU")
    raise ConfigError(f"{' and '.join(wants)}, but torch sees no CUDA device on this machine "
                      f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use training.device: auto "
                      "or cpu and parallel.backend: auto or gloo")


def check_checkpoint_save(cfg: JobConfig) -> None:
    """``checkpoint.save`` is a directory this process can write into, or one it can create: refused here, not
    at the first save (where every rank would fail at once, after the work of the iterations before it). Creates
    nothing: a directory that does not exist yet is made by the first save."""
    if not cfg.checkpoint.save:
        return
    save = Path(cfg.checkpoint.save)
    where = save.resolve()
    existing = where
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == where and not where.is_dir():
        raise ConfigError(f"checkpoint.save: {where} is not a directory (a file is there)")
    if not existing.is_dir():
        raise ConfigError(f"checkpoint.save: {where} cannot be created: {existing} is not a directory")
    try:  # whether this process may write there (permissions, a read-only mount, ...): try it
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if existing == where:
            raise ConfigError(f"checkpoint.save: {where} is not writable ({reason})") from None
        raise ConfigError(f"checkpoint.save: {where} cannot be created: {existing} is not writable ({reason})") \
            from None


def resume_point(cfg: JobConfig):
    """Where the run starts: None (iteration 0) or the checkpoint ``checkpoint.load`` names, as
    :class:`ntp_megatron.training.checkpoint.Progress`, with ``checkpoint.load`` pinned to it
    (:func:`pin_checkpoint_load`). Returns ``(progress, note)``; ``note`` is a line for the user or None.

    Megatron's habit of giving ``--save`` and ``--load`` the same directory works from the first run: with no
    checkpoint there yet the run starts fresh and says so, and the next run resumes from what it saved. A
    ``load`` directory that is not the save directory must exist and hold a checkpoint."""
    runtime.quiet_optional_dependency_warnings()
    # Megatron-Core (seconds to import) loads only where a checkpoint is read, after its warnings are quieted
    from ntp_megatron.training.checkpoint import resolve_load_dir

    ck = cfg.checkpoint
    if not ck.load:
        return None, None
    load = Path(ck.load)
    same = ck.save is not None and Path(ck.save).resolve() == load.resolve()
    if same and (not load.is_dir() or resolve_load_dir(load) is None):
        cfg.checkpoint.load = None
        return None, (f"no checkpoint in {load} yet: starting from iteration 0; checkpoints are saved there and "
                      "the next run with the same --load resumes from the latest")
    if not load.exists():
        raise ConfigError(f"checkpoint.load: no such directory: {load.resolve()}")
    return pin_checkpoint_load(cfg), None


def pin_checkpoint_load(cfg: JobConfig):
    """The checkpoint ``checkpoint.load`` names, as :class:`ntp_megatron.training.checkpoint.Progress`, with
    ``checkpoint.load`` pinned to its directory (so every rank, at any time, reads that one whatever a save does to
    ``latest``) and ``checkpoint.finetune`` / ``no_load_optim`` / ``no_load_rng`` to what loading it restores (so
    every rank loads the same parts of it; ``Progress.notice`` says why when not everything); None without
    ``checkpoint.load``. ConfigError if it names no complete checkpoint, one with a file missing, truncated or
    unreadable (:func:`ntp_megatron.training.checkpoint.verify_checkpoint`), or one that cannot be loaded as asked
    (:func:`ntp_megatron.training.checkpoint.plan_load`)."""
    if not cfg.checkpoint.load:
        return None
    runtime.quiet_optional_dependency_warnings()
    # Megatron-Core (seconds to import) loads only where a checkpoint is read, after its warnings are quieted
    from ntp_megatron.training import checkpoint

    try:  # verifies its files too
        progress = checkpoint.read_progress(Path(cfg.checkpoint.load), checkpoint.LoadPlan.of(cfg.checkpoint))
    except (SystemExit, checkpoint.CheckpointError) as exc:
        raise ConfigError(str(exc)) from None
    cfg.checkpoint.load = str(progress.path.resolve())
    progress.plan.pin(cfg.checkpoint)
    return progress


def nothing_to_do(cfg: JobConfig, start) -> Optional[str]:
    """The line to print when the checkpoint the run resumes from has done every iteration already."""
    if start is None or start.iteration < cfg.training.train_iters:
        return None
    relation = "=" if start.iteration == cfg.training.train_iters else ">"
    return (f"nothing to do: checkpoint {Path(start.path).resolve()} is at iteration {start.iteration} {relation} "
            f"training.train_iters ({cfg.training.train_iters}); raise --train-iters to train further")
