"""The results queue of checkpoint writes, without a spawned interpreter (upstream:
``megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue``). CPU only.

At a process's first save, upstream creates a ``multiprocessing`` Manager with the *spawn* start method: a new
interpreter that re-imports the process's main module. For a rank forked from ``ntp-launch`` (or the test
zygote) that module imports torch and Megatron-Core, so every rank pays seconds of imports at its first
save, all ranks at once (measured here: 30 s for a 7-rank save on 2 cores, against under a second). The
Manager only relays write results; Megatron forks its writer processes from the same rank a moment later,
so on CPU the Manager is forked too, and it dies with its rank (``PR_SET_PDEATHSIG``; upstream's outlives a
killed rank). Processes with CUDA keep upstream's spawn (never applied there).

Also ``FileSystemWriterAsync.write_preloaded_data``, the worker processes that write a rank's files (forked by
the rank in a sync save, by its async writer in an async one): they die with the process that forked them.
Upstream's outlive a killed rank and can go on writing into a checkpoint directory that a restarted job
removes and writes again.

On every device (:func:`apply_write_point`): ``FileSystemWriterAsync.retrieve_write_results``, where a rank
collects its writers' results, names the phase ``checkpoint_write`` (:mod:`ntp_megatron.phases`). An injected
error there becomes a failed write the way upstream reports a writer's own (a wrapped exception in place of the
results), so it goes through upstream's gather and every rank's save raises, as with a full disk.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
from multiprocessing.managers import SyncManager
from typing import Optional

from megatron.core.dist_checkpointing.strategies import filesystem_async as upstream
from torch.distributed.checkpoint.api import _is_wrapped_exception, _wrap_exception

from ntp_megatron import phases

_manager: Optional[SyncManager] = None


def die_with_parent() -> None:
    """This process gets SIGKILL when the thread that forked it ends (Linux; elsewhere nothing). If that
    already happened, exit now. Also used for the async save's writer (``ntp_megatron.training.checkpoint.save``)."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux
        return
    if os.getppid() != parent or parent == 1:  # the parent died before the prctl
        os._exit(1)


_upstream_write_preloaded_data = upstream.FileSystemWriterAsync.write_preloaded_data


@functools.wraps(_upstream_write_preloaded_data)
def _write_preloaded_data(*args, **kwargs):
    die_with_parent()
    return _upstream_write_preloaded_data(*args, **kwargs)


def _get_write_results_queue():
    global _manager
    if upstream._results_queue is None:
        _manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        _manager.start(initializer=die_with_parent)
        upstream._results_queue = _manager.Queue()
    return upstream._results_queue


_upstream_retrieve_write_results = upstream.FileSystemWriterAsync.retrieve_write_results
_local_write_failure: Optional[BaseException] = None


@functools.wraps(_upstream_retrieve_write_results)
def _retrieve_write_results(self):
    global _local_write_failure
    results = _upstream_retrieve_write_results(self)
    try:
        phases.point("checkpoint_write")
    except Exception as exc:  # noqa: BLE001 - an injected failed write, reported as upstream reports a writer's
        results = _wrap_exception(exc)
    phases.enter("checkpoint")  # the rest of the save (gather, metadata) is the save's
    _local_write_failure = results[0] if _is_wrapped_exception(results) else None
    return results


def local_write_failure() -> Optional[BaseException]:
    """Why this rank's own writes failed in its last checkpoint save, if they did. Upstream raises the failure
    only on the rank that gathers every rank's results (and a bare ``CheckpointException`` on the others), so the
    rank whose write failed learns it here."""
    return _local_write_failure


def apply_write_point() -> None:
    if not callable(getattr(upstream.FileSystemWriterAsync, "retrieve_write_results", None)):
        raise RuntimeError("dist_checkpointing_filesystem_async: upstream changed; patch written for 0.16.x")
    upstream.FileSystemWriterAsync.retrieve_write_results = _retrieve_write_results


def apply() -> None:
    if not callable(getattr(upstream, "_get_write_results_queue", None)) or not hasattr(upstream, "_results_queue"):
        raise RuntimeError("dist_checkpointing_filesystem_async: upstream changed; patch written for 0.16.x")
    upstream._get_write_results_queue = _get_write_results_queue
    upstream.FileSystemWriterAsync.write_preloaded_data = staticmethod(_write_preloaded_data)
