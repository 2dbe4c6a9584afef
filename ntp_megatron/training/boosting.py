"""The rank's side of power boost (``ntp.boost``, :mod:`ntp_megatron.speed.power`): in every generation it trains in, the
power its layout needs, set on its device (or recorded), and a ``boost`` record when that changes."""

from __future__ import annotations

import sys
import time
from typing import Optional

from ntp_megatron import metrics

from ntp_megatron.speed import device_model
from ntp_megatron.plan.power_curve import Boost, plan
from ntp_megatron.speed.power import PowerLimits


class Booster:
    def __init__(self, boost: Boost, limits: PowerLimits, launch_rank: int,
                 device: Optional[device_model.EmulatedDevice] = None) -> None:
        self.boost, self.limits, self.launch_rank, self.device = boost, limits, launch_rank, device
        self.power = 1.0

    def layout(self, parts, setup) -> None:
        """The rank trains ``parts`` in ``setup``'s generation from now on: draw the power its load needs."""
        tp_size = setup.pg.tp.size()
        share = device_model.tp_share(parts.model.parameters(), tp_size)
        tp_base, weight = tp_size, 100
        topology = setup.topology
        if topology is not None:
            tp_base = topology.tp_base  # this rank's stage's (the setup's topology)
            replica, slot = topology.slot_of(setup.rank)
            weight = topology.replica(replica).weights.get(slot, 100)
        chosen = plan(self.boost, share, tp_base, weight)
        if self.device is not None:
            self.device.speed = chosen.perf
        if chosen.power == self.power:
            return
        self.power = chosen.power
        outcome = self.limits.restore() if chosen.power == 1.0 else self.limits.set(chosen.power)
        metrics.emit({"kind": "event", "event": "boost", "launch_rank": self.launch_rank, "replica": setup.replica,
                      "tp_rank": setup.tp_rank, "generation": setup.generation, "load": round(chosen.load, 4),
                      "power": round(chosen.power, 4), "perf": round(chosen.perf, 4), "short": chosen.short,
                      "emulated": self.device is not None, **outcome, "time": time.time()}, sys.stdout)
        watts = f" ({outcome['watts']:.0f} W)" if outcome.get("watts") else ""
        print(f"boost | generation {setup.generation} | load {chosen.load:.3f} | power {chosen.power:.3f}x{watts} "
              f"-> performance {chosen.perf:.3f}" + (" (capped: short of the load)" if chosen.short else "")
              + f" | {'applied' if outcome['applied'] else 'not applied'}: {outcome['reason']} |", flush=True)

    def close(self) -> None:
        """The rank ends, however (:func:`ntp_megatron.training.pretrain.main`): the device's default limit again
        (idempotent). A SIGKILLed rank cannot: its limit stays until the device's next reset."""
        self.limits.restore()
