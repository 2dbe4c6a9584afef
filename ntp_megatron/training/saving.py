"""The training loop's checkpoint saves (``checkpoint.save``, ``checkpoint.save_interval``, ``checkpoint.async_save``):
when one is due, the save itself (:func:`ntp_megatron.training.checkpoint.save_checkpoint`), the finalization of
async ones, and under NTP a save that a failure interrupted, written again in the re-formed job."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from torch.distributed.checkpoint.api import CheckpointException

from ntp_megatron import metrics, phases
from ntp_megatron.patches import dist_checkpointing_filesystem_async
from ntp_megatron.training import checkpoint
from ntp_megatron.training.loop_state import LoopState


class Checkpoints:
    def __init__(self, trainer: LoopState) -> None:
        self.trainer = trainer
        self.last_saved = 0
        """The iteration whose state is on disk: the last checkpoint saved, or the one this run started from. With
        ``checkpoint.async_save``, the last one whose save was started (its writer may still be writing)."""
        self.async_saves: Optional["AsyncCallsQueue"] = None
        """With ``checkpoint.async_save``: Megatron-Core's queue of saves not yet finalized."""
        self.pending: list[int] = []
        """Iterations of the async saves started and not yet finalized, oldest first."""

    def due(self) -> bool:
        ck = self.trainer.cfg.checkpoint
        return ck.save is not None and ck.save_interval is not None and self.trainer.iteration % ck.save_interval == 0

    def save(self) -> Path:
        """Checkpoint the state after the trainer's iteration (collective over the job, or its current generation).
        With ``checkpoint.async_save`` the earlier save is finalized first, and this one only started: it is
        finalized by a later :meth:`finalize`."""
        trainer = self.trainer
        p, session = trainer.parts, trainer.session
        iteration, started, clock = trainer.iteration, time.time(), time.perf_counter()
        phases.at_iteration(iteration)  # also when a re-formation moved this rank on before the save is redone
        phases.enter("checkpoint")
        queue = None
        if trainer.cfg.checkpoint.async_save:
            if self.async_saves is None:
                self.async_saves = AsyncCallsQueue(persistent=False)  # a forked writer per save
            self.finalize(blocking=True)
            queue = self.async_saves
            clock = time.perf_counter()  # the wait for the previous save is counted there

        def saved(path: Path) -> None:
            session.mark_saved(iteration)  # for peers that did not see the save complete (until_written)
            if session.reporting:
                how = "in the background, " if queue is not None else ""
                print(f" successfully saved checkpoint from iteration {iteration:>8d} to {path} "
                      f"({how}{time.time() - started:.2f} s)", flush=True)
                metrics.emit({"kind": "event", "event": "checkpoint_saved", "iteration": iteration,
                              "path": str(path), "generation": trainer.setup.generation,
                              "tp_per_replica": trainer.setup.tp_per_replica, "async": queue is not None,
                              "started": started, "time": time.time()}, sys.stdout)

        root = Path(trainer.cfg.checkpoint.save)
        try:
            path = checkpoint.save_checkpoint(root, iteration, p.model, p.optimizer, p.scheduler, trainer.coords,
                                              trainer.consumed_samples, async_queue=queue, on_finalized=saved,
                                              grad_sync=p.setup.grad_sync)
        except (OSError, CheckpointException) as exc:  # a write refused, a full disk: say which save
            raise _save_failure(exc, f"saving the checkpoint of iteration {iteration} to {root}") from None
        if queue is not None:
            self.pending.append(iteration)
        self._report_stall(iteration, "save", time.perf_counter() - clock)
        return path

    def _report_stall(self, iteration: int, phase: str, seconds: float) -> None:
        """Measurement: how long training waited on the save of ``iteration`` (``save``: the call; ``finalize``:
        checks and finalization of an async one), a ``checkpoint_stall`` record (``scripts/bench.sh``)."""
        if self.trainer.session.reporting:
            metrics.emit({"kind": "checkpoint_stall", "iteration": iteration, "phase": phase, "seconds": seconds},
                         sys.stdout)

    def finalize(self, blocking: bool = False) -> None:
        """Complete the async saves whose writers have finished on every rank (``blocking``: wait for all of
        them): upstream's metadata, then ``latest`` (collective; only while a save is pending, so the same on
        every rank)."""
        if self.async_saves is not None and self.async_saves.get_num_unfinalized_calls():
            now = phases.current()
            clock, oldest = time.perf_counter(), self.pending[0]
            phases.at_iteration(oldest)  # what is finalized is that save's: its checkpoint_write fires here
            phases.enter("checkpoint")
            try:
                done = self.async_saves.maybe_finalize_async_calls(blocking=blocking)
            except (OSError, CheckpointException) as exc:  # its writer's write failed
                root = self.trainer.cfg.checkpoint.save
                raise _save_failure(exc, f"saving the checkpoint of iteration {oldest} to {root}") from None
            phases.at_iteration(now[0])
            phases.enter(now[1])
            del self.pending[:len(done)]
            self._report_stall(oldest, "finalize", time.perf_counter() - clock)

    def until_written(self) -> None:
        """Save; under NTP a failure midway is absorbed like any other (``latest`` still names the previous
        checkpoint) and the re-formed job writes this iteration's checkpoint again, in its new layout.

        Whether the failed save had completed is read from the store once the re-formation is done: a rank that
        returned from a save marks it before it can take part in any later generation, so every rank of the new
        one decides alike (a death in the save's last barrier can let some ranks return and fail others)."""
        trainer = self.trainer
        while self.last_saved != trainer.iteration:
            if trainer.session.guarded(self.save) is not None or trainer.session.saved_elsewhere(trainer.iteration):
                self.last_saved = trainer.iteration


def _save_failure(exc: BaseException, what: str) -> Exception:
    """The error a failed save raises, named by ``what``: an ``OSError`` of this rank again, or for a save that
    failed in Megatron-Core's writers (its ``CheckpointException`` reaches every rank of the save) a
    :class:`~ntp_megatron.training.checkpoint.CheckpointError`: this rank's own failed write if it had one, else an
    ``echo`` that quotes what the exception carries (only the rank that gathered the results gets the failures).
    (``CheckpointException`` is a ``BaseException``: it would slip past every ``except Exception``.)"""
    if isinstance(exc, OSError):
        return _naming(exc, what)
    local = dist_checkpointing_filesystem_async.local_write_failure()
    if local is not None:
        return checkpoint.CheckpointError(f"{what}: this rank's write failed: {_first_line(local)}")
    failures = getattr(exc, "failures", None) or {}
    if failures:
        rank = min(failures)
        cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        error = checkpoint.CheckpointError(f"{what}: rank {rank} of the saving group failed: {_first_line(cause)}")
    else:
        error = checkpoint.CheckpointError(f"{what}: another rank of the saving group failed (its report names it)")
    error.echo = True
    return error


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def _naming(exc: OSError, what: str) -> OSError:
    """``exc`` again (same type and errno), its message prefixed with ``what``."""
    args = (f"{what}: {exc}",) if exc.errno is None else (exc.errno, f"{what}: {exc.strerror}", exc.filename)
    try:
        return type(exc)(*args)
    except TypeError:  # a subclass with a constructor of its own
        return OSError(*args)
