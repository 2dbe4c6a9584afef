"""An emulated accelerator for CPU tests and benchmarks: a rank's compute as time it waits, not CPU it burns.

On this CPU machine the ranks of a job share two cores, so a rank that computes less (a smaller share of the units,
a sleeping slow rank) hands its CPU to the others and the job's step time hardly moves: nothing like GPUs, each of
which computes its own share while its peers wait. With ``ntp.emulated_device_ms`` set, every rank also "computes"
on an emulated device at each micro-batch of a training iteration: it sleeps its share of that many milliseconds
(the time a whole replica's forward and backward of one micro-batch take on one device), its share being the
fraction of the replica's tensor-parallel weights it holds (a TP4 rank of a healthy replica: 1/4; a rank holding
more units after a re-formation, or fewer after a rebalance, more or less). The sleep is compute for
:func:`ntp_megatron.phases.compute_clock`, so an injected slowdown stretches it, and step times then behave as on
devices. Runs that use it say so (``emulated_device_ms`` in the config and the run's records); nothing on a GPU uses
it.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional

import torch

from ntp_megatron import phases

TRAINING_PHASES = ("start", "forward", "backward")
"""Where a micro-batch of a training iteration begins (``forward`` from its first one's data read on; ``start`` kept
for a step run without :class:`ntp_megatron.training.steps.ForwardStep`)."""


class EmulatedDevice:
    """The pace of a rank on the emulated device: sleeps ``share * ms`` at every micro-batch of a training
    iteration (:func:`ntp_megatron.phases.install_pace`), ``speed`` times faster (the power-boost model)."""

    def __init__(self, ms: float, sleep: Callable[[float], None] = time.sleep) -> None:
        self.ms = ms
        self.share = 1.0
        """The fraction of its replica's tensor-parallel weights this rank holds (:func:`tp_share`)."""
        self.speed = 1.0
        self.sleep = sleep
        self.busy_s = 0.0
        """Seconds slept so far (the emulated compute)."""

    def __call__(self, kind: str) -> None:
        if kind != "micro_batch" or phases.current()[1] not in TRAINING_PHASES:
            return
        seconds = self.share * self.ms / 1e3 / self.speed
        self.sleep(seconds)
        self.busy_s += seconds


def tp_share(parameters: Iterable[torch.nn.Parameter], tp_size: int) -> float:
    """The fraction of the replica's tensor-parallel weights these parameters are: each TP-split one (tagged
    ``ntp_held_units`` with its units, under NTP) counts its share of the whole tensor; replicated ones do not count.
    Without NTP's tags (plain Megatron-Core layers split evenly): ``1 / tp_size``."""
    held = whole = 0.0
    for p in parameters:
        units = getattr(p, "ntp_held_units", None)
        if units is None or not units.units:
            continue
        held += p.numel()
        whole += p.numel() * units.num_units / len(units.units)
    return held / whole if whole else 1.0 / tp_size


_device: Optional[EmulatedDevice] = None


def install(device: Optional[EmulatedDevice]) -> None:
    """The rank's emulated device (None: none); its pace is installed by the caller."""
    global _device
    _device = device


def hold(parameters: Iterable[torch.nn.Parameter], tp_size: int) -> None:
    """The rank now trains these parameters (a new generation's layout): its share on the emulated device."""
    if _device is not None:
        _device.share = tp_share(parameters, tp_size)
