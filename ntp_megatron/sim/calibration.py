"""Measured inputs from ``scripts/bench.sh`` (and the live runtime): step-time ratios and the recovery pause.

Without calibration a group at reduced TP ``tp_eff`` takes the ideal ``tp / tp_eff`` times longer per step and a
live re-formation pauses the job for ``strategies.reconfigure_s``. The JSON (docs/simulator.md, "Calibration") may carry
either or both of::

    {"degraded_step_time_ratio": {"32": {"30": 1.08, "28": 1.17}},   # healthy TP -> reduced TP -> ratio
     "recovery_s": 42.0}                                            # measured pause per failure, seconds

Other top-level keys (hardware, model, dates ...) are ignored so the benchmark can record context.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ntp_megatron.config.files import ConfigError, format_validation_error

log = logging.getLogger(__name__)


class CalibrationFile(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # JSON's NaN and Infinity are rejected

    degraded_step_time_ratio: dict[int, dict[int, float]] | None = Field(None, min_length=1)
    recovery_s: float | None = Field(
        None, ge=0, description="measured job-wide pause per failure (live re-formation), one number in seconds"
    )

    @field_validator("degraded_step_time_ratio")
    @classmethod
    def _sane(cls, table: dict[int, dict[int, float]] | None) -> dict[int, dict[int, float]] | None:
        for base, row in (table or {}).items():
            for tp, ratio in row.items():
                if not 0 < tp < base:
                    raise ValueError(f"reduced TP {tp} must be in 1..{base - 1} for healthy TP {base}")
                if not ratio >= 1:
                    raise ValueError(
                        f"degraded_step_time_ratio.{base}.{tp} must be >= 1 (degraded / healthy step time), got {ratio}"
                    )
        return table


class StepTimeRatios:
    """Step-time ratio lookup that remembers which TP pairs fell back to the ideal, to say so in the output."""

    def __init__(
        self,
        measured: dict[int, dict[int, float]] | None = None,
        source: str | None = None,
        recovery_s: float | None = None,
    ):
        self.measured = measured or {}
        self.source = source
        self.recovery_s = recovery_s
        self.fallbacks: set[tuple[int, int]] = set()

    def reconfigure_s(self, configured: float) -> float:
        """The live re-formation pause: the measured one when the calibration has it, else the configured one."""
        return configured if self.recovery_s is None else self.recovery_s

    def ratio(self, tp_base: int, tp: int) -> float:
        if tp == tp_base:
            return 1.0
        measured = self.measured.get(tp_base, {}).get(tp)
        if measured is not None:
            return measured
        if self.source is not None and (tp_base, tp) not in self.fallbacks:
            log.warning(
                "calibration %s has no ratio for TP %d->%d; using ideal %d/%d", self.source, tp_base, tp, tp_base, tp
            )
        self.fallbacks.add((tp_base, tp))
        return tp_base / tp

    def notes(self) -> list[str]:
        if self.source is None:
            return ["no calibration file: degraded step times use the ideal ratio tp/tp_eff"]
        used = sorted(self.fallbacks)
        notes = []
        if self.measured:
            notes.append(f"calibration: step-time ratios from {self.source}")
        else:
            notes.append(f"calibration {self.source} has no step-time ratios: used the ideal ratio tp/tp_eff")
        if self.recovery_s is not None:
            notes.append(
                f"calibration: live re-formation pause {self.recovery_s:g} s per failure from {self.source} "
                "(replaces strategies.reconfigure_s)"
            )
        if used and self.measured:
            pairs = ", ".join(f"{a}->{b}" for a, b in used)
            notes.append(f"calibration has no entry for TP {pairs}: used the ideal ratio tp/tp_eff there")
        return notes


def load_calibration(path: str | Path | None) -> StepTimeRatios:
    if path is None:
        return StepTimeRatios()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"calibration file not found: {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be an object with 'degraded_step_time_ratio' and/or 'recovery_s'")
    try:
        parsed = CalibrationFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{p}: {format_validation_error(exc, CalibrationFile)}") from None
    if parsed.degraded_step_time_ratio is None and parsed.recovery_s is None:
        raise ConfigError(f"{p}: needs 'degraded_step_time_ratio' or 'recovery_s' (or both)")
    return StepTimeRatios(parsed.degraded_step_time_ratio, str(p), parsed.recovery_s)
