"""Where a rank is in its work, as named points, and the one hook that failure injection plugs into.

The training loop, the gradient sync, checkpoint saving and the re-formation call :func:`point` where a failure
may be injected (the phases of ``--inject-failure``, :data:`ntp_megatron.faults.PHASES`), and :func:`enter`
where an activity begins that has no such point at its start. Neither knows who listens: a rank with injected
failures installs one hook (:func:`install`, done by :mod:`ntp_megatron.faults`): the modules that compute
(training loop, gradient sync, checkpoints, re-formation) never import the injection code; only the processes'
entry points (the rank's start, the launcher and its agent) do. :func:`current` tells a report of the rank's own
error where it happened. :func:`tick` marks progress inside a phase (every micro-batch); :func:`progress` counts
the marks and phase changes, which the heartbeat reports so that the launcher can tell a rank that works from one
that is stuck with its heartbeat alive (:mod:`ntp_megatron.elastic.agent`).

Pure Python, no imports of the package: any module may call it (the patch of ``Work.wait`` marks every
collective wait with :class:`waiting`).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, Optional, Protocol

ITERATION = ("start", "forward", "backward", "grad_sync", "optimizer", "param_gather")
"""The phases of an iteration's work, from its ``start`` mark to the distributed optimizer's parameter all-gather,
where a rank makes progress at a bounded pace (micro-batches, collectives): one that makes none there while its
peers wait on it is stuck (elsewhere long work without either is normal: a checkpoint write, building a dataset
index, which happen in :data:`SETUP` or phases of their own)."""

SETUP = "setup"
"""A rank's phase from its process start until its first mark (building the model, the datasets, loading a
checkpoint): not ``start``, which is an iteration's and where a rank that makes no progress is suspect."""

Hook = Callable[[str, int], None]
"""Called with (phase, 1-based iteration) at every :func:`point`."""

_hook: Optional[Hook] = None
_paces: tuple[Callable[[str], None], ...] = ()
_wait_listener: Optional["WaitListener"] = None
_iteration = 0
_phase = SETUP
_ticks = 0
_waiting_since: Optional[float] = None
_wait_began = 0.0
_waited = 0.0
_computed: list[tuple[int, float]] = []
_point_to_point: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_passes_done: Optional[float] = None
COMPUTED_KEPT = 16
"""How many iterations' compute times :func:`computed` keeps (the heartbeat sends them all)."""


def install(hook: Optional[Hook]) -> None:
    """Make ``hook`` the one :func:`point` calls (None: no hook). One per rank process."""
    global _hook
    _hook = hook


def install_pace(*paces: Callable[[str], None]) -> None:
    """Make ``paces`` the ones called, in order, at every :func:`tick` (with "micro_batch" where a micro-batch begins,
    else "tick") and :func:`point` (with "point"), before the hook (none: no pace): an emulated device computes there
    (:class:`ntp_megatron.speed.device_model.EmulatedDevice`), and an injected slowdown stretches the rank's compute
    (:class:`ntp_megatron.faults.Slowdown`)."""
    global _paces
    _paces = paces


class WaitListener(Protocol):
    def wait_began(self) -> None: ...

    def wait_ended(self) -> None: ...


def install_wait_listener(listener: Optional[WaitListener]) -> None:
    """Tell ``listener`` when the main thread's waits on its peers begin and end (the device clock records events on
    its stream there: :class:`ntp_megatron.speed.compute_time.DeviceClock`); None: nobody."""
    global _wait_listener
    _wait_listener = listener


def compute_clock() -> float:
    """Seconds of this rank's main thread spent on anything but waiting on its peers (:class:`waiting`), on a
    monotonic clock: the difference over an iteration is its compute time, whatever its peers did meanwhile."""
    return time.perf_counter() - _waited


def passes_done(since: float) -> float:
    """The compute clock when the forward and backward passes that began at ``since`` ended: at the gradient sync's
    point (under NTP), else now."""
    return _passes_done if _passes_done is not None and _passes_done > since else compute_clock()


def record_compute(iteration: int, seconds: float) -> None:
    """The compute time of ``iteration`` (its forward and backward passes, waits excluded)."""
    _computed.append((iteration, seconds))
    del _computed[:-COMPUTED_KEPT]


def computed() -> list[tuple[int, float]]:
    """The last :data:`COMPUTED_KEPT` iterations' compute times, oldest first. Read from other threads."""
    return list(_computed)


def at_iteration(iteration: int) -> None:
    """The 1-based iteration in progress (an evaluation after iteration k counts as k; a re-formation counts as
    the iteration it resumes at: k after a failure in k that aborted it, k + 1 for a process that joins after the
    committed iteration k)."""
    global _iteration
    _iteration = iteration


def enter(phase: str) -> None:
    """An activity begins (a checkpoint save, an evaluation, a re-formation): where the rank is, for a report."""
    global _phase, _ticks
    _phase = phase
    _ticks += 1


def tick(micro_batch: bool = False) -> None:
    """Some work of the current phase was done (a micro-batch begins, with ``micro_batch``; a layer's forward or
    backward): the rank is making progress."""
    global _ticks
    _ticks += 1
    for pace in _paces:
        pace("micro_batch" if micro_batch else "tick")


WAITED_ON_PEERS = "ntp_waited_on_peers"
"""Set (True) on an exception raised inside a :class:`waiting` block of the main thread: a wait on the rank's peers
failed (a collective timed out, no new generation came), so the rank is a victim, not the cause
(:func:`ntp_megatron.elastic.errors.waited_on_peers`)."""


class waiting:
    """``with waiting():`` the main thread waits on its peers (a collective, the commit decision, the controller's
    verdict on an error): what :func:`wait_state` reports, and a progress mark when the wait ends. Nested waits and
    other threads' leave the outer one's state as it is. An exception that ends the outer wait is marked
    (:data:`WAITED_ON_PEERS`)."""

    def __enter__(self) -> "waiting":
        global _waiting_since, _wait_began
        self._outer = threading.current_thread() is threading.main_thread() and _waiting_since is None
        if self._outer:
            _waiting_since = time.monotonic()
            _wait_began = time.perf_counter()
            if _wait_listener is not None:
                _wait_listener.wait_began()
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        global _waiting_since, _ticks, _waited
        if self._outer and isinstance(error, BaseException):
            try:  # raised while the rank waited on its peers: its report must not call it an error of its own
                setattr(error, WAITED_ON_PEERS, True)
            except AttributeError:  # an exception type without a __dict__
                pass
        if self._outer:
            if _wait_listener is not None:
                _wait_listener.wait_ended()
            _waited += time.perf_counter() - _wait_began
            _waiting_since = None
            _ticks += 1


def wait_state() -> Optional[float]:
    """When the main thread began its current wait on its peers (``time.monotonic``), None if it is not waiting.
    Read from other threads (the heartbeat)."""
    return _waiting_since


def posted_point_to_point(group: Any, messages: int = 1) -> None:
    """This rank posted ``messages`` point-to-point sends or receives on ``group`` (a process group). torch's
    per-group sequence number counts each of them, so members' counts differ by design where some post more than
    others (a degraded replica's proxy gathering dead blocks); the hang detection's count of collectives is torch's
    less these (:mod:`ntp_megatron.elastic.sequences`). Weakly keyed: a group let go of is forgotten."""
    _point_to_point[group] = _point_to_point.get(group, 0) + messages


def point_to_point(group: Any) -> int:
    """Point-to-point messages posted on ``group`` (:func:`posted_point_to_point`). Read from other threads."""
    return _point_to_point.get(group, 0)


def progress() -> int:
    """How many progress marks (:func:`tick`, :func:`enter`, :func:`point`, finished :class:`waiting`) the rank has
    made: it grows while the rank works. Read from other threads (the heartbeat): one integer, no lock needed."""
    return _ticks


def point(phase: str) -> None:
    """The rank reached ``phase`` of the iteration in progress: the installed hook may fail it here."""
    global _passes_done
    enter(phase)
    for pace in _paces:
        pace("point")
    if phase == "grad_sync":
        _passes_done = compute_clock()
    if _hook is not None:
        _hook(phase, _iteration)


def current() -> tuple[int, str]:
    """(iteration, phase): the last iteration set and the last phase entered or reached."""
    return _iteration, _phase
