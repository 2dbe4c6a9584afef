"""The power-performance curve of a GPU and the boost a rank needs on it: one model, shared by the runtime's power
boost (:mod:`ntp_megatron.speed.power`) and the goodput simulator (:mod:`ntp_megatron.sim.rates`).

A curve is a power law (``perf = power ** alpha``) or a table of measured ``[power, performance]`` points (x
nominal), capped at ``max_power``. A rank's *load* is the work it holds over a healthy rank's (its share of the
replica's TP-split weights times ``tp_base``: 4/3 at TP4 -> 3) over its speed (its weight / 100 in a rebalanced
replica); it needs ``perf >= load``, i.e. the least power on the curve that gives it, capped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ntp_megatron.config.files import ConfigError

EPS = 1e-9

# NVIDIA's published peak dense FP8 throughput of one B200 at two power limits: 4.5 PFLOPS at 1,000 W (HGX B200)
# and 5.0 PFLOPS at 1,200 W (GB200). alpha = ln(5.0 / 4.5) / ln(1.2) = 0.578 (docs/simulator.md, "Power boost").
B200_ALPHA = 0.58


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every number of the curve is finite


class PowerLaw(_Section):
    kind: Literal["power_law"] = "power_law"
    alpha: float = Field(B200_ALPHA, gt=0, le=1, description="performance = power ** alpha")


class PerfTable(_Section):
    kind: Literal["table"]
    points: list[tuple[float, float]] = Field(min_length=2, description="[power, performance] pairs")


def check_curve_points(points: Iterable[Iterable[float]], key: str) -> None:
    """A measured power-performance table (``[power, performance]`` pairs, x nominal) must be increasing in both,
    start at power <= 1 and give performance 1 at power 1; ConfigError naming ``key`` otherwise."""
    pairs = [tuple(p) for p in points]
    if len(pairs) < 2 or any(len(p) != 2 for p in pairs):
        raise ConfigError(f"{key} must be at least two [power, performance] pairs")
    pw = [p for p, _ in pairs]
    perf = [q for _, q in pairs]
    if pw != sorted(pw) or len(set(pw)) != len(pw) or perf != sorted(perf) or pw[0] > 1:
        raise ConfigError(f"{key} must be increasing in power and performance, starting at power <= 1")
    at_nominal = float(np.interp(1.0, pw, perf))
    if abs(at_nominal - 1.0) > 1e-9:
        raise ConfigError(f"{key} must give performance 1 at power 1 (nominal), got {at_nominal:g}")


class Boost(_Section):
    max_power: float = Field(1.3, ge=1, le=3, description="power cap of a degraded domain, x nominal")
    curve: Annotated[PowerLaw | PerfTable, Field(discriminator="kind")] = Field(default_factory=PowerLaw)

    @field_validator("curve", mode="before")
    @classmethod
    def _default_kind(cls, value: Any) -> Any:
        """``--set strategies.boost.curve.alpha=0.5`` alone means a power law; ``points`` alone, a table."""
        if isinstance(value, dict) and "kind" not in value:
            return {"kind": "table" if "points" in value else "power_law", **value}
        return value


def boost_model(max_power: float, alpha: float, points: Optional[list[list[float]]]) -> Boost:
    """The curve and cap from the job's ``ntp.boost_*`` keys (validated there: a table must be increasing and give
    performance 1 at nominal power)."""
    curve = PerfTable(kind="table", points=[tuple(p) for p in points]) if points else PowerLaw(alpha=alpha)
    return Boost(max_power=max_power, curve=curve)


def perf_at(boost: Boost, power: float) -> float:
    """Performance multiplier at ``power`` x nominal power (a table is interpolated and held past its ends)."""
    curve = boost.curve
    if isinstance(curve, PerfTable):
        pw, perf = zip(*curve.points)
        return float(np.interp(power, pw, perf))
    return float(power**curve.alpha)


def power_for(boost: Boost, perf: float) -> float | None:
    """Least power (x nominal, at least 1) with ``perf_at >= perf``; None when ``max_power`` is not enough."""
    if perf <= 1.0 + EPS:
        return 1.0
    if perf_at(boost, boost.max_power) < perf - EPS:
        return None
    curve = boost.curve
    if isinstance(curve, PerfTable):
        pw, pf = (np.array(v, dtype=float) for v in zip(*curve.points))
        i = int(np.searchsorted(pf, perf - EPS, side="left"))  # first point at or above perf (pf is increasing)
        if i == 0:
            return max(1.0, float(pw[0]))
        p = pw[i - 1] + (perf - pf[i - 1]) * (pw[i] - pw[i - 1]) / (pf[i] - pf[i - 1])
        return max(1.0, float(p))
    return max(1.0, perf ** (1.0 / curve.alpha))


@dataclass(frozen=True)
class BoostPlan:
    """One rank's boost: the performance its load needs, the power it draws for it (x nominal), and what that
    power gives (``perf(power)``: less than needed when the cap is reached)."""

    load: float
    power: float
    perf: float

    @property
    def short(self) -> bool:
        """The cap does not give the performance the load needs."""
        return self.perf < self.load - 1e-9


def plan(boost: Boost, share: float, tp_base: int, weight: int = 100) -> BoostPlan:
    """The boost of a rank holding ``share`` of its replica's TP-split weights, at speed ``weight`` / 100."""
    load = share * tp_base / (weight / 100)
    if load <= 1.0 + EPS:
        return BoostPlan(load, 1.0, 1.0)
    power = power_for(boost, load)
    if power is None:
        power = boost.max_power
    return BoostPlan(load, power, perf_at(boost, power))
