"""A rank's compute time per iteration, its waits on peers excluded: what the rebalance monitor compares.

On CPU (gloo) collectives block the host, so the host's clock less the time the main thread spent in collective
waits is the compute (:class:`HostClock`, :func:`ntp_megatron.phases.compute_clock`). On CUDA (NCCL) the host only
enqueues: kernels and waits run on streams, and the host's clock says nothing of them. :class:`DeviceClock` records
CUDA events on the current stream instead: one at the iteration's start and one where its passes end (the gradient
sync's point), and around every wait on a collective (:func:`ntp_megatron.phases.install_wait_listener`) one before
and one after the stream waits for it; the compute is the span less those stalls, read once the step's loss has
synchronised the device. The CUDA path never ran here (no GPU): it is tested over fake events.
"""

from __future__ import annotations

from typing import Any, Optional

from ntp_megatron import phases


class HostClock:
    """Compute time on the host's clock (CPU, gloo)."""

    def begin(self) -> None:
        self._since = phases.compute_clock()

    def seconds(self) -> float:
        return phases.passes_done(self._since) - self._since


class DeviceClock:
    """Compute time on the device's clock (CUDA): ``cuda`` is ``torch.cuda`` (a fake in tests). Installed as a pace
    (the gradient sync's point ends the passes) and as the wait listener."""

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        self._start: Any = None
        self._end: Any = None
        self._stalls: list[tuple[Any, Any]] = []
        self._open: Any = None

    def _event(self) -> Any:
        event = self.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self._start, self._end, self._stalls, self._open = self._event(), None, [], None

    def __call__(self, kind: str) -> None:
        """The pace: the gradient sync's point ends the iteration's passes."""
        if self._start is not None and self._end is None and kind == "point" and phases.current()[1] == "grad_sync":
            self._end = self._event()

    def wait_began(self) -> None:
        if self._start is not None and self._end is None:
            self._open = self._event()

    def wait_ended(self) -> None:
        if self._open is not None:
            self._stalls.append((self._open, self._event()))
            self._open = None

    def seconds(self) -> float:
        end = self._end if self._end is not None else self._event()  # NTP off: no gradient-sync point
        end.synchronize()
        span = self._start.elapsed_time(end)  # milliseconds
        stalled = sum(a.elapsed_time(b) for a, b in self._stalls)
        self._start = None
        return max(0.0, span - stalled) / 1e3


def clock_for(device_type: str, cuda: Optional[Any] = None) -> "HostClock | DeviceClock":
    """The clock for a rank's device (``"cuda"``: the device's, installed as its pace and wait listener)."""
    if device_type != "cuda":
        return HostClock()
    if cuda is None:
        import torch  # only on a CUDA rank: the host's clock needs no torch

        cuda = torch.cuda
    clock = DeviceClock(cuda)
    phases.install_wait_listener(clock)
    return clock


class DeviceSleep:
    """An injected slowdown on a GPU (NVIDIA Resiliency Extension's GPU_SLEEP is the model): a spin kernel on the
    current stream (``torch.cuda._sleep(cycles)``), so that the device, not the host, takes longer; the cycles per
    second are measured once with events."""

    CALIBRATION_CYCLES = 10_000_000

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        start.record()
        cuda._sleep(self.CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        self.cycles_per_s = self.CALIBRATION_CYCLES / max(start.elapsed_time(end) / 1e3, 1e-9)

    def __call__(self, seconds: float) -> None:
        self.cuda._sleep(round(seconds * self.cycles_per_s))
