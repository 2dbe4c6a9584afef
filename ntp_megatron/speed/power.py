"""Power boost: how much power a rank of a degraded or rebalanced replica needs to keep a healthy replica's pace,
and setting it through NVML (or, where that is not possible, recording what would be set).

NTP's other half (the paper's rack design): a replica that re-formed at a lower TP degree gives each survivor more
work, so the job would wait for it at every gradient sync; its GPUs may draw more power instead, within the
domain's cap. A rank's *load* is the work it holds over a healthy rank's (its share of the replica's TP-split
weights times ``tp_base``: 4/3 at TP4 -> 3) over its speed (its weight / 100 in a rebalanced replica: a slow GPU
holding fewer units still needs its share done in time). The power that load needs on the curve is worked out by
:mod:`ntp_megatron.plan.power_curve` (pure, shared with the goodput simulator); a healthy rank needs 1 (nominal:
the default limit restored). This module applies it.

Applying it (:class:`NvmlLimits`, ``pynvml``: ``nvmlDeviceSetPowerManagementLimit`` on the rank's device, the
default restored when its replica heals and at the end) needs the GPU extra and usually root. On CPU, without
pynvml, or when NVML refuses, :class:`DryRunLimits` records what it would set: the ``boost`` records say which
(``applied``, ``reason``). On the emulated device (:mod:`ntp_megatron.speed.device_model`) the chosen power speeds the
rank's emulated compute up by ``perf(power)``, which closes the loop on CPU.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

logger = logging.getLogger(__name__)


class PowerLimits(Protocol):
    def set(self, multiplier: float) -> dict[str, Any]:
        """Set this rank's device to ``multiplier`` x its default power limit; what was done (``applied``,
        ``watts``, ``reason``)."""

    def restore(self) -> dict[str, Any]:
        """Back to the default limit; what was done (as :meth:`set`)."""


class DryRunLimits:
    """Records what would be set (``reason``: why nothing is applied)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def set(self, multiplier: float) -> dict[str, Any]:
        return {"applied": False, "watts": None, "reason": self.reason}

    def restore(self) -> dict[str, Any]:
        return {"applied": False, "watts": None, "reason": self.reason}


class NvmlLimits:
    """The rank's device's power limit through NVML (``nvml``: the ``pynvml`` module, or a fake in tests), the device
    found by its UUID (NVML numbers devices its own way and ignores ``CUDA_VISIBLE_DEVICES``: an index could name
    another GPU). Limits are milliwatts in NVML; the target is clamped to the device's allowed range. A refusal (no
    permission, a device that does not support it) turns later raises into a dry run, saying why; a limit already
    raised is still restored."""

    def __init__(self, nvml: Any, device_uuid: str) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        self.handle = nvml.nvmlDeviceGetHandleByUUID(device_uuid)
        self.default_mw = nvml.nvmlDeviceGetPowerManagementDefaultLimit(self.handle)
        self.min_mw, self.max_mw = nvml.nvmlDeviceGetPowerManagementLimitConstraints(self.handle)
        self.refused: Optional[str] = None
        self.changed = False

    def set(self, multiplier: float) -> dict[str, Any]:
        target = int(round(min(max(self.default_mw * multiplier, self.min_mw), self.max_mw)))
        if self.refused is not None:
            return {"applied": False, "watts": target / 1e3, "reason": self.refused}
        try:
            self.nvml.nvmlDeviceSetPowerManagementLimit(self.handle, target)
        except self.nvml.NVMLError as exc:
            self.refused = f"NVML refused the power limit ({exc}): dry run from now on"
            logger.warning(self.refused)
            return {"applied": False, "watts": target / 1e3, "reason": self.refused}
        self.changed = target != self.default_mw
        clamped = "" if abs(target - self.default_mw * multiplier) < 1 else " (clamped to the device's range)"
        return {"applied": True, "watts": target / 1e3, "reason": f"set through NVML{clamped}"}

    def restore(self) -> dict[str, Any]:
        if not self.changed:
            return {"applied": self.refused is None, "watts": self.default_mw / 1e3,
                    "reason": "default limit restored" if self.refused is None else self.refused}
        try:
            self.nvml.nvmlDeviceSetPowerManagementLimit(self.handle, self.default_mw)
        except self.nvml.NVMLError as exc:
            logger.warning("could not restore the default power limit: %s", exc)
            return {"applied": False, "watts": self.default_mw / 1e3,
                    "reason": f"NVML refused to restore the default limit ({exc})"}
        self.changed = False
        return {"applied": True, "watts": self.default_mw / 1e3, "reason": "default limit restored"}


def open_limits(device_uuid: Optional[str], dry_run: bool) -> PowerLimits:
    """NVML on the CUDA device ``device_uuid`` (NVML's form, ``GPU-...``) when pynvml is installed and works; a dry
    run otherwise (and when asked)."""
    if dry_run:
        return DryRunLimits("ntp.boost_dry_run")
    if device_uuid is None:
        return DryRunLimits("no GPU (CPU run): dry run")
    try:
        import pynvml  # optional: the gpu extra; without it a dry run
    except ImportError:
        return DryRunLimits("pynvml is not installed (the gpu extra): dry run")
    try:
        return NvmlLimits(pynvml, device_uuid)
    except Exception as exc:  # noqa: BLE001 - any NVML failure means: do not touch the device
        return DryRunLimits(f"NVML unavailable ({exc}): dry run")
