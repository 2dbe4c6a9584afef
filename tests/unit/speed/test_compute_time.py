"""A rank's compute time per iteration on the device's clock (CUDA, never run here): CUDA events over a fake
timeline; the span from the iteration's start to the end of its passes less the stream's stalls on collectives.
And a slow rank on a GPU: a spin kernel of calibrated length, the previous iteration's compute less what was slept."""

from __future__ import annotations

import pytest

from ntp_megatron import faults, phases
from ntp_megatron.speed.compute_time import DeviceClock, DeviceSleep, HostClock, clock_for

pytestmark = pytest.mark.unit


class FakeCuda:
    """Events stamped with the stream's time when recorded (``now``, in ms, moved by the test and by spin
    kernels at ``cycles_per_ms``)."""

    def __init__(self, cycles_per_ms: float = 1000.0) -> None:
        self.now, self.cycles_per_ms, self.slept = 0.0, cycles_per_ms, []
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at = None

            def record(self) -> None:
                self.at = cuda.now

            def synchronize(self) -> None:
                assert self.at is not None

            def elapsed_time(self, other: "Event") -> float:
                return other.at - self.at

        self.Event = Event

    def _sleep(self, cycles: int) -> None:
        self.slept.append(cycles)
        self.now += cycles / self.cycles_per_ms


@pytest.fixture
def where(monkeypatch):
    state = {"at": (1, "start")}
    monkeypatch.setattr(phases, "current", lambda: state["at"])
    yield state
    phases.install_wait_listener(None)


def test_device_clock_is_the_span_of_the_passes_less_the_stalls(where):
    cuda = FakeCuda()
    clock = clock_for("cuda", cuda)
    assert isinstance(clock, DeviceClock)
    clock.begin()
    cuda.now += 10.0                     # forward
    with phases.waiting():               # a TP all-reduce the stream waits 4 ms for (a slow peer)
        cuda.now += 4.0
    cuda.now += 6.0                      # backward
    where["at"] = (1, "grad_sync")
    clock("point")                       # the passes end here
    with phases.waiting():               # the gradient sync after the passes: not in the span
        cuda.now += 50.0
    assert clock.seconds() == pytest.approx(0.016)


def test_without_a_gradient_sync_point_the_passes_end_when_read(where):
    cuda = FakeCuda()
    clock = DeviceClock(cuda)
    clock.begin()
    cuda.now += 7.0
    assert clock.seconds() == pytest.approx(0.007)


def test_the_host_clock_on_cpu():
    assert isinstance(clock_for("cpu"), HostClock)


def test_device_slowdown_sleeps_on_the_device_for_the_last_iterations_compute(where, monkeypatch):
    cuda = FakeCuda(cycles_per_ms=2000.0)
    sleep = DeviceSleep(cuda)
    assert sleep.cycles_per_s == pytest.approx(2e6)
    slow = faults.DeviceSlowdown(1, [faults.SlowRank(1, 3.0, 2)], sleep)
    computed = []
    monkeypatch.setattr(phases, "computed", lambda: list(computed))

    def iteration(k: int, passes_ms: float) -> float:
        where["at"] = (k, "start")
        slow("point")
        begin = cuda.now
        where["at"] = (k, "forward")
        slow("tick")
        cuda.now += passes_ms
        where["at"] = (k, "grad_sync")
        slow("point")                    # the end of the passes: the sleep goes on the stream here
        computed.append((k, (cuda.now - begin) / 1e3))
        return cuda.now - begin

    assert iteration(1, 10.0) == pytest.approx(10.0)   # factor 1
    assert iteration(2, 10.0) == pytest.approx(30.0)   # 2 x the last iteration's 10 ms slept
    assert iteration(3, 10.0) == pytest.approx(30.0)   # the last one's 30 ms less its 20 ms slept: 10 ms base
    assert slow.slept == pytest.approx(0.04)
