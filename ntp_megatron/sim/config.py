"""The simulator's YAML schema: one pydantic section per concern, checked strictly so typos fail loudly.

Times are in hours inside the simulator; the config uses the unit people think in for each knob
(days for run length, minutes for checkpoints, seconds for a reconfiguration pause, hours for repairs).
Cross-field rules (TP divides the domain, the job fits the cluster, ...) live in :func:`check_consistency`,
which raises :class:`ConfigError` with a one-line message naming the key, as pydantic does for single fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ntp_megatron.config.files import ConfigError, apply_override, load_config, validate
from ntp_megatron.plan.power_curve import Boost, PerfTable, check_curve_points

STRATEGY_NAMES = ("checkpoint_restart", "dp_drop", "hot_spares", "ntp", "ntp_boost")
StrategyName = Literal["checkpoint_restart", "dp_drop", "hot_spares", "ntp", "ntp_boost"]

# Llama 3 405B report: 419 unexpected interruptions in 54 days on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
LLAMA3_RATE_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every number of the simulator is finite


class Cluster(Section):
    """The machine and the job's parallel layout; DP defaults to as many replicas as fit beside the spares."""

    gpus: int = Field(32768, gt=0)
    domain_size: int = Field(32, gt=0, description="GPUs per scale-up (NVLink) domain")
    tp: int = Field(32, gt=0, description="healthy tensor-parallel degree; must divide domain_size")
    pp: int = Field(1, gt=0)
    dp: int | None = Field(None, gt=0, description="data-parallel replicas; null = as many as fit")
    spare_domains: int = Field(0, ge=0)


class FailureClass(Section):
    name: str
    share: float = Field(gt=0, le=1, description="fraction of failure events of this class")
    repair_hours: tuple[float, float] = Field(description="[min, max] of a uniform repair/recovery time")


def _llama3_classes() -> list[FailureClass]:
    return [
        FailureClass(name="hardware", share=0.78, repair_hours=(72.0, 120.0)),
        FailureClass(name="software", share=0.22, repair_hours=(3.0, 3.0)),
    ]


class Failures(Section):
    """Either a Poisson failure process over time, or a snapshot with a fixed fraction of GPUs down."""

    mode: Literal["poisson", "snapshot"] = "poisson"
    rate: Literal["llama3", "mtbf"] = "llama3"
    mtbf_hours: float | None = Field(None, gt=0, description="per-GPU MTBF, used when rate: mtbf")
    rate_multiplier: float = Field(1.0, gt=0)
    blast_radius: Literal["gpu", "node", "domain"] = "gpu"
    node_size: int = Field(4, gt=0, description="GPUs per node, for blast_radius: node")
    classes: list[FailureClass] = Field(default_factory=_llama3_classes, min_length=1)
    fraction: float = Field(0.001, ge=0, lt=1, description="snapshot mode: fraction of GPUs failed")


class Ntp(Section):
    min_tp: int = Field(1, gt=0, description="below this TP a replica drops out")
    allowed_tp: list[int] | None = Field(None, min_length=1, description="TP degrees a group may run at")


class DegradedSpeed(Section):
    """How fast a degraded replica contributes: the paper's integer local batch, or the continuous tp_eff/tp."""

    model: Literal["integer_batch", "continuous"] = "integer_batch"
    local_batch: int = Field(16, gt=0, description="samples per replica per iteration in the healthy job")


PlacementName = Literal["fixed", "packed", "packed_on_restart"]


class Placement(Section):
    """Which DP replica each TP group serves, per strategy (docs/simulator.md, "Placement": who may move domains,
    at what cost)."""

    checkpoint_restart: PlacementName = "packed"
    dp_drop: PlacementName = "packed_on_restart"
    hot_spares: PlacementName = "fixed"
    ntp: PlacementName = "packed_on_restart"
    ntp_boost: PlacementName = "packed_on_restart"


class Strategies(Section):
    enabled: list[StrategyName] = Field(default_factory=lambda: list(STRATEGY_NAMES), min_length=1)
    batch_policy: Literal["shrink", "fixed"] = "shrink"
    reconfigure_s: float = Field(0.0, ge=0, description="job-wide pause per failure for non-restart strategies")
    placement: Placement = Field(default_factory=Placement)
    restart_every_h: float | None = Field(
        None, gt=0, description="planned restarts that re-pack packed_on_restart strategies; null = none"
    )
    repack_pause_s: float | None = Field(
        None, ge=0, description="pause when domains move between replicas; null = checkpoint.restart_min"
    )
    degraded_speed: DegradedSpeed = Field(default_factory=DegradedSpeed)
    ntp: Ntp = Field(default_factory=Ntp)
    boost: Boost = Field(default_factory=Boost)


class Checkpoint(Section):
    interval_min: float = Field(30.0, gt=0)
    restart_min: float = Field(10.0, ge=0)


class Run(Section):
    duration_days: float = Field(15.0, gt=0)
    trials: int = Field(10, gt=0)
    seed: int = Field(0, ge=0)
    warm_start: bool = Field(True, description="start from the failure process's steady state, not all healthy")
    grid_points: int = Field(300, ge=2, le=100000)
    spares_percentile: float = Field(
        99.0, gt=0, le=100, description="also report the fewest spares that pause at most (100 - this) % of the time"
    )


class Sweep(Section):
    """Run the config once per point; ``key``+``values`` is shorthand for points of one override each."""

    key: str | None = None
    values: list[Any] | None = None
    points: list[dict[str, Any]] | None = None


class SimConfig(Section):
    title: str | None = Field(None, description="shown on plots and in summary.md")
    cluster: Cluster = Field(default_factory=Cluster)
    failures: Failures = Field(default_factory=Failures)
    strategies: Strategies = Field(default_factory=Strategies)
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    run: Run = Field(default_factory=Run)
    calibration: str | None = Field(None, description="path to a scripts/bench.sh calibration JSON")
    sweep: Sweep | None = None


def check_consistency(cfg: SimConfig) -> None:
    """Rules spanning several keys; one-line ConfigError naming the key at fault."""
    c = cfg.cluster
    if c.domain_size % c.tp:
        raise ConfigError(f"cluster.tp={c.tp} must divide cluster.domain_size={c.domain_size}")
    if c.gpus % c.domain_size:
        raise ConfigError(f"cluster.gpus={c.gpus} must be a multiple of cluster.domain_size={c.domain_size}")
    domains = c.gpus // c.domain_size
    if c.spare_domains >= domains:
        raise ConfigError(f"cluster.spare_domains={c.spare_domains} leaves no domain for the job ({domains} domains)")
    if c.dp is not None and (c.dp * c.pp * c.tp) % c.domain_size:
        raise ConfigError(f"cluster.dp*pp*tp={c.dp * c.pp * c.tp} must fill whole domains of {c.domain_size} GPUs")
    if c.dp is not None and c.dp * c.pp * c.tp > (domains - c.spare_domains) * c.domain_size:
        raise ConfigError(
            f"cluster.dp={c.dp} needs {c.dp * c.pp * c.tp} GPUs but only "
            f"{(domains - c.spare_domains) * c.domain_size} are left beside the spares"
        )
    f = cfg.failures
    if f.rate == "mtbf" and f.mtbf_hours is None:
        raise ConfigError("failures.mtbf_hours is required when failures.rate is 'mtbf'")
    if f.blast_radius == "node" and c.domain_size % f.node_size:
        raise ConfigError(f"failures.node_size={f.node_size} must divide cluster.domain_size={c.domain_size}")
    if abs(sum(k.share for k in f.classes) - 1.0) > 1e-6:
        raise ConfigError(f"failures.classes: shares must add up to 1, got {sum(k.share for k in f.classes):g}")
    for i, k in enumerate(f.classes):
        lo, hi = k.repair_hours
        if not 0 <= lo <= hi:
            raise ConfigError(f"failures.classes.{i}.repair_hours must be [min, max] with 0 <= min <= max")
    n = cfg.strategies.ntp
    if n.min_tp > c.tp:
        raise ConfigError(f"strategies.ntp.min_tp={n.min_tp} exceeds cluster.tp={c.tp}")
    if n.allowed_tp is not None and any(not 0 < a <= c.tp for a in n.allowed_tp):
        raise ConfigError(f"strategies.ntp.allowed_tp: every entry must be in 1..cluster.tp={c.tp}")
    if n.allowed_tp is not None and c.tp not in n.allowed_tp:
        raise ConfigError(
            f"strategies.ntp.allowed_tp={n.allowed_tp} must include the healthy cluster.tp={c.tp} "
            "(healthy groups run at it)"
        )
    curve = cfg.strategies.boost.curve
    if isinstance(curve, PerfTable):
        check_curve_points(curve.points, "strategies.boost.curve.points")
    s = cfg.sweep
    if s is not None and (s.points is None) == (s.key is None or s.values is None):
        raise ConfigError("sweep: give either key and values, or points")


def sweep_points(cfg_data: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The sweep as (label, --set overrides) pairs; one unlabelled point when there is no sweep."""
    sweep = cfg_data.get("sweep")
    if not sweep:
        return [("", [])]
    if sweep.get("points") is not None:
        points = [dict(p) for p in sweep["points"]]
    else:
        points = [{sweep["key"]: v} for v in sweep["values"]]
    out = []
    for p in points:
        label = str(p.pop("label", ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in p.items())))
        # JSON is valid YAML, so lists and strings survive the --set round trip
        out.append((label, [f"{k}={json.dumps(v)}" for k, v in p.items()]))
    return out


def load(path: str | Path | None, overrides: Iterable[str] = ()) -> tuple[SimConfig, list[tuple[str, SimConfig]]]:
    """Load a config and expand its sweep: (base config, [(label, config of each point)])."""
    base = load_config(SimConfig, path, overrides)
    check_consistency(base)
    points = []
    for label, point_overrides in sweep_points(base.model_dump()):
        point_data = base.model_dump()
        point_data["sweep"] = None
        for o in point_overrides:
            try:
                apply_override(point_data, o)
            except ConfigError as exc:
                raise ConfigError(f"sweep point '{label}': {exc}") from None
        try:
            cfg = validate(SimConfig, point_data)
            check_consistency(cfg)
        except ConfigError as exc:
            raise ConfigError(f"sweep point '{label}': {exc}") from None
        points.append((label, cfg))
    return base, points
