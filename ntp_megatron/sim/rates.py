"""Rate tables: how fast a TP group with k failed GPUs contributes, as the NTP paper computes it.

A group that re-forms at ``tp_eff < tp`` takes ``ratio = step time at tp_eff / healthy step time`` longer
(ideally ``tp / tp_eff``, or measured: calibration). Data parallelism waits for its slowest replica, so a
degraded replica must finish its share of the minibatch in a healthy iteration time:

* ``integer_batch`` (the paper's rule, the default): it takes the largest integer local batch it can finish in
  a healthy iteration, ``floor(B / ratio) / B`` of its healthy batch of ``B`` samples;
* ``continuous``: it takes ``1 / ratio`` of it (the limit of large local batches).

With power boost a degraded group draws the least power ``p <= max_power`` with ``perf(p) >= ratio``, which
lets it keep its full batch; when even ``max_power`` is not enough it takes the largest batch it can finish at
``max_power``. ``rate[k]`` is the resulting fraction of a healthy replica's samples per iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ntp_megatron.sim.calibration import StepTimeRatios
from ntp_megatron.plan.power_curve import EPS, Boost, perf_at, power_for
from ntp_megatron.sim.config import DegradedSpeed



@dataclass(frozen=True)
class RateTable:
    """Per k = 0..tp failed GPUs in a TP group: its speed, the TP it runs at (0 = out) and the power it draws."""

    rate: np.ndarray
    tp_eff: np.ndarray
    power: np.ndarray

    def describe(self) -> list[dict[str, float]]:
        """Rows up to the first k at which the group is out (the rest repeat it)."""
        rows = []
        for k in range(self.rate.size):
            rows.append({"failed": k, "tp": int(self.tp_eff[k]), "speed": float(self.rate[k]), "power": float(self.power[k])})
            if self.rate[k] == 0:
                break
        return rows

    def line(self, max_runs: int = 6) -> str:
        """Runs of k with equal speed and power as text, e.g. ``k=1-2 TP30 0.875; k=3-4 TP28 0.875; k=5+ out``."""
        runs: list[list] = []  # [first k, last k, first TP, last TP, speed, power]
        for r in self.describe()[1:]:
            key = (r["speed"], round(r["power"], 2))
            if runs and (runs[-1][4], runs[-1][5]) == key:
                runs[-1][1], runs[-1][3] = r["failed"], r["tp"]
            else:
                runs.append([r["failed"], r["failed"], r["tp"], r["tp"], *key])
        parts = []
        for i, (lo, hi, tp_hi, tp_lo, speed, power) in enumerate(runs):
            if speed == 0:
                parts.append(f"k={lo}+ out")
                break
            if i == max_runs:
                parts.append("...")
                parts.append(f"k={runs[-1][0]}+ out" if runs[-1][4] == 0 else "")
                break
            ks = f"k={lo}" if lo == hi else f"k={lo}-{hi}"
            tps = f"TP{tp_hi}" if tp_hi == tp_lo else f"TP{tp_hi}-{tp_lo}"
            parts.append(f"{ks} {tps} {speed:.4g}" + (f" at {power:.3g}x power" if power != 1 else ""))
        return "; ".join(p for p in parts if p)


def reduced_tp(tp: int, min_tp: int = 1, allowed: list[int] | None = None) -> np.ndarray:
    """tp_eff[k]: the TP a group with k failed GPUs re-forms at, 0 when none is allowed (the replica drops)."""
    allowed_set = set(allowed) if allowed is not None else set(range(1, tp + 1))
    allowed_set = {a for a in allowed_set if min_tp <= a <= tp}
    out = np.zeros(tp + 1, dtype=np.int64)
    for k in range(tp + 1):
        fits = [a for a in allowed_set if a <= tp - k]
        out[k] = max(fits) if fits else 0
    return out


def keep_up(speed: float, speed_model: DegradedSpeed) -> float:
    """Share of its healthy batch a replica running at ``speed`` finishes in one healthy iteration time."""
    if speed >= 1.0 - EPS:
        return 1.0
    if speed_model.model == "continuous":
        return speed
    b = speed_model.local_batch
    return math.floor(b * speed + EPS) / b


def drop_table(tp: int) -> RateTable:
    """DP-drop, hot spares and checkpoint-restart: a group with any failed GPU stops its replica."""
    rate = np.zeros(tp + 1)
    rate[0] = 1.0
    tp_eff = np.zeros(tp + 1, dtype=np.int64)
    tp_eff[0] = tp
    return RateTable(rate, tp_eff, np.ones(tp + 1))


def ntp_table(tp: int, tp_eff: np.ndarray, ratios: StepTimeRatios, speed_model: DegradedSpeed) -> RateTable:
    rate = np.array([keep_up(1.0 / ratios.ratio(tp, int(e)), speed_model) if e > 0 else 0.0 for e in tp_eff])
    return RateTable(rate, tp_eff, np.ones(tp + 1))


def boost_table(
    tp: int, tp_eff: np.ndarray, ratios: StepTimeRatios, boost: Boost, speed_model: DegradedSpeed
) -> RateTable:
    """Full batch at the least power that keeps up; past ``max_power`` the largest batch it finishes there,
    drawing the least power that finishes that batch (an integer batch often needs less than ``max_power``)."""
    rate, power = np.zeros(tp + 1), np.ones(tp + 1)
    top = perf_at(boost, boost.max_power)
    for k, e in enumerate(tp_eff.tolist()):
        if e == 0:
            continue
        ratio = ratios.ratio(tp, e)
        needed = power_for(boost, ratio)
        if needed is not None:
            rate[k], power[k] = 1.0, needed
            continue
        rate[k] = keep_up(top / ratio, speed_model)
        least = power_for(boost, ratio * rate[k]) if rate[k] > 0 else 1.0
        power[k] = boost.max_power if least is None else least
    return RateTable(rate, tp_eff, power)
