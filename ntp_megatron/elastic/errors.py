"""A rank's own error versus a peer's failure (rank side), and the report of an own error.

The rule. An exception raised while a rank works in a generation is a *peer's failure*, absorbed by re-forming in
the next generation, when

1. it is a transport error — a collective or the store failed because a peer went away (torch's
   ``DistNetworkError``, gloo's and NCCL's connection errors, a wait given up because the generation ended) — or
   the controller's verdict (an aborted iteration, an incomplete formation); or
2. the generation is marked over (its abort key, or the job's stop key) within ``timing.peer_grace_s`` of the
   exception. This covers an error that a peer's death causes indirectly, e.g. a library that wraps the broken
   connection in an exception of its own, or a collective timed out: the controller marks the generation over as
   soon as the launcher reaps the dead process, well under a second after the death. Other torch.distributed
   errors are judged by this rule, not by their type: ``DistBackendError`` is also what a rank's own CUDA or NCCL
   failure raises, ``DistStoreError`` a store wait of ours that timed out. So are gloo's own timeouts (a collective
   or a connect that waited its whole timeout, and the other operations of its context, which gloo then closes),
   although their text names gloo's transport: a peer that is alive but makes no progress (hung, or stuck on
   another member) times a collective out as well as a dead one, and so does this rank's own late arrival.

Anything else is the rank's *own* error: a failed write, a full disk, out of memory, a bug of ours. No new
generation would come for it, so the rank does not wait for one: it writes ``keys.rank_error(launch_rank)`` with
the error's type and message, where it happened (iteration, phase: :mod:`ntp_megatron.phases`) and when, prints one
line naming it (with the traceback when it is a bug rather than a condition of the machine), and exits non-zero.
The controller then stops the job naming the error (:func:`reported_error`), instead of re-forming around it.

A rank that *gave up waiting on its peers* — an exception ended a wait of its main thread on them
(:data:`ntp_megatron.phases.WAITED_ON_PEERS`: a collective that timed out, no new generation within the timeout after
a peer's failure) — is a victim of what it waited on: it reports the same way, marked ``waited``, and the line, the
stop's reason and the ``job_stopped`` event say it gave up waiting, never that it failed with an error of its own (a
rank's real error in the same batch is named before it). The hang detection (:mod:`ntp_megatron.elastic.blame`)
should have fenced the rank it waited on long before; this is what is left when it could not (``ntp.progress_fence:
false``, a rank stuck outside an iteration's phases).

Running out of memory is never a peer's failure and is reported at once, without waiting out
``timing.peer_grace_s``: peers blocked in a collective with this rank are released by the controller's verdict,
which comes as soon as this rank has exited. Its report says ``out_of_memory``, so that the controller can take
it for a layout that does not fit (a degraded replica) rather than for a bug.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ntp_megatron import phases
from ntp_megatron.config import timing
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.commit import IterationAborted
from ntp_megatron.patches.torch_distributed_work import CollectiveAbandoned


EXIT_RANK_ERROR = 1
"""Exit code of a rank whose own code failed (after it reported the error)."""

_TRANSPORT_MARKERS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer", "Broken pipe",
                      "NCCL communicator was aborted", "remote process exited or there was a network error")
"""Transport errors a peer's death causes. A rank's own NCCL error ("unhandled cuda error", ...) is not one."""

GLOO_TIMEOUTS = ("Timed out waiting", "Connect timeout", "Application timeout caused pair closure")
"""gloo's own timeouts (torch 2.13's bundled gloo: ``unbound_buffer.cc``, ``pair.h``, ``context.cc``): their text starts
with the path of gloo's transport, but nothing in them says that a peer went away."""

_TIMEOUT_MARKERS = ("timed out", "Timed out", "timeout", "Timeout")
"""How torch's collectives and stores say a wait ran out of time (gloo: "Timed out waiting ...", NCCL's watchdog:
"... collective operation timeout", the store: "Socket Timeout", "wait timeout")."""

_CONDITIONS = (OSError, MemoryError, torch.OutOfMemoryError)
"""Errors of the machine's state (a write refused, a full disk, memory exhausted): the message says it all, as an
:class:`OwnError`'s does. Any other exception is a bug somewhere, and its traceback is printed too."""


OWN_OR_PEER = (Exception, CheckpointException)
"""What a rank's work can raise that is either kind. torch's ``CheckpointException`` (a checkpoint read or write
that failed on some rank) derives from ``BaseException``: an ``except Exception`` alone would let it end the
process with no report."""



class OwnError(RuntimeError):
    """An error this rank's code knows to be its own (e.g. a checkpoint it cannot read or write): never taken for a
    peer's failure, whatever its message quotes. ``echo``: raised here only because another rank's part failed;
    that rank's report names the cause."""

    echo: bool = False


class GenerationEnded(RuntimeError):
    """The controller's verdict ended the generation this rank was working in (e.g. its formation incomplete)."""


def is_transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective or store failing because a peer went away (its transport broke): a peer's
    failure at once (rule 1 of the module docstring). A gloo timeout is not one (:func:`is_collective_timeout`)."""
    if isinstance(exc, OwnError):  # its message may quote a transport error of its own (a broken pipe of a write)
        return False
    if is_collective_timeout(exc):
        return False
    return isinstance(exc, dist.DistNetworkError) or (
        isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _TRANSPORT_MARKERS))


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is one of gloo's own timeouts (:data:`GLOO_TIMEOUTS`)."""
    return isinstance(exc, RuntimeError) and not isinstance(exc, OwnError) and any(
        text in str(exc) for text in GLOO_TIMEOUTS)


def is_peer_failure(exc: BaseException) -> bool:
    """NTP off: whether ``exc`` echoes another rank's failure — its transport broke, or a collective with it timed
    out (a hung peer's collectives end so on every other rank); the launcher names the rank behind it."""
    return is_transport_failure(exc) or is_collective_timeout(exc)


STICKY_CUDA_ERRORS = ("illegal memory access", "an illegal instruction", "uncorrectable ECC error",
                      "unspecified launch failure", "misaligned address", "device-side assert")
"""CUDA errors after which the device's context is unusable until the device is reset."""


def is_device_lost(exc: BaseException) -> bool:
    """A CUDA error that sticks to the device: nothing in this process can use it again, so the rank counts as dead
    (it exits without an own-error report, and its replica re-forms without it) rather than stopping the job."""
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in STICKY_CUDA_ERRORS)


def is_out_of_memory(exc: BaseException) -> bool:
    """A device (``torch.OutOfMemoryError``) or the host (``MemoryError``) ran out of memory."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError))


def caused_by_peer(exc: BaseException, marked_over: Callable[[float], bool]) -> bool:
    """The rule of the module docstring. ``marked_over(within_s)``: whether the rank's generation is (or, within
    ``within_s`` seconds, becomes) marked over, or the job stopped."""
    if isinstance(exc, OwnError) or is_out_of_memory(exc):
        return False
    if isinstance(exc, (IterationAborted, GenerationEnded, CollectiveAbandoned)) or is_transport_failure(exc):
        return True
    return marked_over(timing.current().peer_grace_s)


def waited_on_peers(exc: BaseException) -> bool:
    """``exc`` is a wait of the rank on its peers that timed out (it ended a wait,
    :data:`ntp_megatron.phases.WAITED_ON_PEERS`, and says it timed out: a collective's timeout, no new generation
    after a peer's failure): the rank is a victim of what it waited on, never reported as failing with an error of its
    own. Anything else raised in a wait (an error of ours, of the machine, of its own device) still is one."""
    if isinstance(exc, OwnError) or is_out_of_memory(exc) or not getattr(exc, phases.WAITED_ON_PEERS, False):
        return False
    return isinstance(exc, TimeoutError) or any(marker in str(exc) for marker in _TIMEOUT_MARKERS)


def describe(exc: BaseException) -> str:
    """``<Type>: <message>`` (first 500 characters), the form of the report and of the controller's reason."""
    if isinstance(exc, SystemExit):  # our own clear stop, e.g. a checkpoint of another model
        return str(exc.code)[:500]
    return f"{type(exc).__name__}: {str(exc)[:500]}"


def report(store: Optional[dist.Store], launch_rank: int, exc: BaseException) -> int:
    """Report this rank's own error: the store record the controller reads, one line on stderr (and the traceback
    of a bug); returns the exit code."""
    iteration, phase = phases.current()
    error = describe(exc)
    if store is not None:
        try:
            keys.record_error(store, launch_rank, {
                "error": error, "iteration": iteration, "phase": phase, "time": time.time(),
                "echo": isinstance(exc, OwnError) and exc.echo, "out_of_memory": is_out_of_memory(exc),
                "waited": waited_on_peers(exc)})
        except Exception:  # noqa: BLE001 - the launcher's store is gone too: the exit code still tells
            pass
    if not isinstance(exc, (SystemExit, OwnError, *_CONDITIONS)):
        traceback.print_exception(exc, file=sys.stderr)
    what = "gave up waiting on its peers" if waited_on_peers(exc) else "error"
    print(f"{what}: launch rank {launch_rank}, iteration {iteration}, phase {phase}: {error}", file=sys.stderr,
          flush=True)
    return EXIT_RANK_ERROR


def reported_error(store: dist.Store, launch_rank: int, pid: Optional[int] = None) -> Optional[dict]:
    """Controller side: what a dead rank (process ``pid``, when known) reported of its own error (:func:`report`), if
    it did. ``echo``: the error only echoes another rank's (e.g. a checkpoint write that failed there), whose report
    names the cause."""
    try:
        return keys.error_record(store, launch_rank, pid)
    except Exception:  # noqa: BLE001 - unreadable: treat as not reported
        pass
    return None


def cause_behind_echoes(store: dist.Store, launch_ranks: list[int]) -> Optional[tuple[int, dict]]:
    """Launcher side, when every reported error at hand is an echo: the first of ``launch_ranks`` to report an
    error that is not, within ``timing.echo_wait_s``; None if none does (the echoes are all there is)."""
    deadline = time.monotonic() + timing.current().echo_wait_s
    while True:
        for launch_rank in launch_ranks:
            report = reported_error(store, launch_rank)
            if report is not None and not report.get("echo"):
                return launch_rank, report
        if time.monotonic() >= deadline:
            return None
        time.sleep(timing.current().echo_poll_s)


def own_error_cause(report: dict) -> str:
    """How a death whose rank reported an error of its own (:func:`report`) is described: a rank that gave up waiting
    on its peers is said to have done so, not to have failed."""
    what = "gave up waiting on its peers" if report.get("waited") else "failed with an error of its own"
    return f"{what} (iteration {report['iteration']}, phase {report['phase']}): {report['error']}"
