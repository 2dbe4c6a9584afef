"""A wait on a collective that an ended generation can cut short (upstream: ``torch.distributed``'s c10d
``Work.wait``; written against torch 2.13 and its bundled gloo).

Shutting a generation's sockets down gets a gloo collective out at once in almost every case, but not all:
gloo's tcp pair, when it fails, wakes the buffers of pending and posted operations except an unbound buffer
whose message is in mid-transfer — partly written (the send queue ``tx_``) or partly read (``rx_``). The
collective thread waiting on that buffer sleeps until the collective timeout (measured: a 4-rank all-reduce
of 16 MB whose sockets are shut down mid-run stays blocked for the whole timeout in about 1 run of 8). Nothing
in torch 2.13 wakes it: gloo's ``abort()`` does nothing, and the process group's destructor joins that thread.

So a rank must not wait on it. With an :class:`Escape` installed (the elastic layer installs one per gloo
generation), an untimed ``Work.wait()`` from Python waits in short slices and, between slices, asks the escape
whether the generation is over; if so it raises :class:`CollectiveAbandoned` and hands the escape what it
abandoned (whose process groups must outlive the blocked thread; see ``ElasticRank.leave``). A collective's slices
are waits on a Python event that the work's future sets when it completes: the caller never blocks in C++, where
even a timed wait of 50 ms on a coalesced gradient all-reduce whose sockets were shut down stayed until the
collective timeout (measured: 60 s). A point-to-point wait runs in the caller and, on a timeout, closes every pair
of the group — so it is waited on by a helper thread instead (as is a work without a future). Without an
escape (NCCL, no elastic job), ``wait`` is upstream's.

Every wait is also marked as one (:class:`ntp_megatron.phases.waiting`): the heartbeat reports since when the
rank's main thread waits and counts finished waits as progress, so that the launcher can tell a rank that waits on
a peer from the peer that makes none (:mod:`ntp_megatron.elastic.agent`).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Optional, Protocol

from torch._C._distributed_c10d import OpType, Work

from ntp_megatron.phases import waiting

SLICE = timedelta(milliseconds=50)
NO_TIMEOUT = timedelta(0)
_POINT_TO_POINT = frozenset(int(op) for op in (OpType.SEND, OpType.RECV, OpType.RECVANYSOURCE))
"""``Work._get_op_type()`` answers with the enum's integer value."""

_original_wait = Work.wait
_escape: Optional["Escape"] = None


class CollectiveAbandoned(RuntimeError):
    """A wait given up because the generation the collective belongs to is over."""


class AbandonedWait:
    """A wait a rank walked away from: finished once the collective (or the helper thread waiting on it) is
    done, i.e. once no thread of the process is blocked in its process group any more."""

    def __init__(self, work: Optional[Work], helper: Optional[threading.Thread] = None,
                 what: str = "a collective") -> None:
        """``work`` may be None when ``helper`` is given (a wait that is not a collective's: a group's connect)."""
        self.work, self.helper, self.what = work, helper, what

    def finished(self) -> bool:
        if self.helper is not None:
            return not self.helper.is_alive()
        return self.work.is_completed()


class Escape(Protocol):
    def reason(self) -> Optional[str]:
        """Why waits must end now (the generation is over, its grace out), or None."""

    def abandoned(self, wait: AbandonedWait) -> None:
        """A wait was given up (called before :class:`CollectiveAbandoned` is raised)."""


def set_escape(escape: Optional[Escape]) -> None:
    """Install (or, with None, remove) the escape every untimed wait consults."""
    global _escape
    _escape = escape


def current_escape() -> Optional[Escape]:
    """The escape installed (None: waits are upstream's)."""
    return _escape


def _wait(self: Work, timeout: timedelta = NO_TIMEOUT) -> bool:
    with waiting():
        return _wait_for(self, timeout)


def _wait_for(self: Work, timeout: timedelta) -> bool:
    escape = _escape
    if escape is None or timeout != NO_TIMEOUT:
        return _original_wait(self, timeout)
    if int(self._get_op_type()) in _POINT_TO_POINT:
        return _wait_in_helper(self, escape)
    done = threading.Event()
    try:
        self.get_future().add_done_callback(lambda _: done.set())  # run by gloo's thread, or at once if done
    except RuntimeError:  # a work without a future: waited on by a helper thread
        return _wait_in_helper(self, escape)
    while not done.wait(SLICE.total_seconds()):
        _give_up_if_over(escape, AbandonedWait(self))
    return _original_wait(self)  # its outcome (a result, or the collective's error)


def _wait_in_helper(work: Work, escape: Escape) -> bool:
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            outcome["result"] = _original_wait(work)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc

    helper = threading.Thread(target=wait, name="ntp-p2p-wait", daemon=True)
    helper.start()
    while True:
        helper.join(SLICE.total_seconds())
        if not helper.is_alive():
            break
        _give_up_if_over(escape, AbandonedWait(work, helper))
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _give_up_if_over(escape: Escape, wait: AbandonedWait) -> None:
    reason = escape.reason()
    if reason is not None:
        escape.abandoned(wait)
        raise CollectiveAbandoned(reason)


def apply() -> None:
    Work.wait = _wait
