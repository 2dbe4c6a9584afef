"""The results queue of checkpoint writes, without a spawned interpreter (upstream:
``megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue``). CPU only.

At a process's first save, upstream creates a ``multiprocessing`` Manager with the *spawn* start method: a new
interpreter that re-imports the process's main module. For a rank forked from ``ntp-launch`` (or the test
zygote) that module imports torch and Megatron-Core, so every rank pays seconds of imports at its first
save, all ranks at once (measured here: 30 s for a 7-rank save on 2 cores, against under a second). The
Manager only relays write results; Megatron forks its writer processes from the same rank a moment later,
so on CPU the Manager is forked too, and it dies with its rank (``PR_SET_PDEATHSIG``; upstream's outlives a
killed rank). Processes with CUDA keep upstream's spawn (never applied there).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import signal
from multiprocessing.managers import SyncManager
from typing import Optional

from megatron.core.dist_checkpointing.strategies import filesystem_async as upstream

_manager: Optional[SyncManager] = None


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux
        pass


def _get_write_results_queue():
    global _manager
    if upstream._results_queue is None:
        _manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        _manager.start(initializer=_die_with_parent)
        upstream._results_queue = _manager.Queue()
    return upstream._results_queue


def apply() -> None:
    if not callable(getattr(upstream, "_get_write_results_queue", None)) or not hasattr(upstream, "_results_queue"):
        raise RuntimeError("dist_checkpointing_filesystem_async: upstream changed; patch written for 0.16.x")
    upstream._get_write_results_queue = _get_write_results_queue
