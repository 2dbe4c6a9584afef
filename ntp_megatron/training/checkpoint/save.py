"""Writing a checkpoint: :func:`save_checkpoint`, collective over the job, synchronous or async.

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

May import: :mod:`.format`, :mod:`.files`, :mod:`.sharded`, Megatron-Core, :mod:`ntp_megatron.phases` and the
patches (the writer's death with its rank); not :mod:`.load`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ntp_megatron import phases
from ntp_megatron.patches.dist_checkpointing_filesystem_async import die_with_parent
from ntp_megatron.training.checkpoint.files import _prepare_dir, _write_latest, iteration_dir
from ntp_megatron.training.checkpoint.format import FULLY_RESHARDABLE, ParallelCoords, content_metadata
from ntp_megatron.training.checkpoint.sharded import _layout, _rng_object, _sharded_state, distributed_optimizer

logger = logging.getLogger(__package__)  # the package's name: log lines read as they did before the split


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
