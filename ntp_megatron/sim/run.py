"""Runs a loaded config: every sweep point x trial x strategy, then aggregates trials into summaries and series.

Trial ``i`` draws from ``default_rng([seed, i])`` at every sweep point, so points of a sweep share random
numbers and a result depends only on the config (determinism under a seed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ntp_megatron.sim.calibration import load_calibration
from ntp_megatron.sim.config import SimConfig
from ntp_megatron.sim.engine import TrialResult, replay
from ntp_megatron.sim.failures import poisson_trace, rate_per_gpu_hour, snapshot_counts
from ntp_megatron.sim.layout import Layout, build_layout
from ntp_megatron.sim.strategies import ReplicaState, Strategy, build_strategies, evaluate

log = logging.getLogger(__name__)

SNAPSHOT_SKIPS = ("checkpoint_restart",)  # a snapshot has no time, so rollbacks and restarts do not exist


@dataclass
class PointResult:
    label: str
    config: SimConfig
    layout: Layout
    summaries: dict[str, dict[str, dict[str, float]]]  # strategy -> metric -> statistic -> value
    series: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # strategy -> name -> values
    hours: list[float] = field(default_factory=list)  # bin centres of the series
    extra: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if a.size > 1 else 0.0,
        "min": float(a.min()),
        "p95": float(np.percentile(a, 95)),
        "max": float(a.max()),
    }


def _aggregate(per_trial: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {k: _stats([t[k] for t in per_trial]) for k in per_trial[0]}


def run_snapshot(cfg: SimConfig, layout: Layout, strategies: list[Strategy], tick: Callable[[], None]) -> PointResult:
    policy = cfg.strategies.batch_policy
    states = {s.name: ReplicaState(layout, s.rate) for s in strategies}
    per_trial: dict[str, list[dict[str, float]]] = {s.name: [] for s in strategies}
    domains_hit = []
    for trial in range(cfg.run.trials):
        rng = np.random.default_rng([cfg.run.seed, trial])
        counts = snapshot_counts(layout, cfg.failures.fraction, rng)
        per_domain = counts[: layout.job_groups].reshape(layout.job_domains, layout.groups_per_domain).sum(axis=1)
        domains_hit.append(float(np.count_nonzero(per_domain) / layout.job_domains))
        for s in strategies:
            e = evaluate(states[s.name].reset(counts), s, policy)
            per_trial[s.name].append(
                {"capacity": e.capacity, "throughput_loss": 1.0 - e.capacity, "spares_needed": float(e.spares_needed)}
            )
        tick()
    return PointResult(
        label="",
        config=cfg,
        layout=layout,
        summaries={name: _aggregate(rows) for name, rows in per_trial.items()},
        extra={
            "domains_hit_fraction": _stats(domains_hit),
            "failed_gpus": int(round(cfg.failures.fraction * layout.active_gpus)),
        },
    )


def run_poisson(cfg: SimConfig, layout: Layout, strategies: list[Strategy], tick: Callable[[], None]) -> PointResult:
    horizon = cfg.run.duration_days * 24.0
    bins = cfg.run.grid_points
    interval = cfg.checkpoint.interval_min / 60.0
    results: dict[str, list[TrialResult]] = {s.name: [] for s in strategies}
    steps = []
    for trial in range(cfg.run.trials):
        rng = np.random.default_rng([cfg.run.seed, trial])
        trace = poisson_trace(layout, cfg.failures, horizon, cfg.run.warm_start, rng)
        steps.append(trace.steps)
        replayed = replay(trace, layout, strategies, cfg.strategies.batch_policy, horizon, interval, bins)
        for name, r in replayed.items():
            results[name].append(r)
        tick()
    series = {}
    for name, trials in results.items():
        s = {}
        for key in ("throughput", "goodput", "lost_work", "spares_needed"):
            m = np.stack([getattr(t, key) for t in trials])
            s[f"{key}_mean"] = m.mean(axis=0).tolist()
            s[f"{key}_p5"] = np.percentile(m, 5, axis=0).tolist()
            s[f"{key}_p95"] = np.percentile(m, 95, axis=0).tolist()
        series[name] = s
    return PointResult(
        label="",
        config=cfg,
        layout=layout,
        summaries={name: _aggregate([t.summary for t in trials]) for name, trials in results.items()},
        series=series,
        hours=((np.arange(bins) + 0.5) * horizon / bins).tolist(),
        extra={
            "failure_rate_per_gpu_hour": rate_per_gpu_hour(cfg.failures),
            "trace_steps_mean": float(np.mean(steps)),
        },
    )


def simulate(points: list[tuple[str, SimConfig]], progress: bool = False) -> tuple[list[PointResult], list[str]]:
    """Run every sweep point; returns the results and notes to show the user (calibration fallbacks etc.)."""
    from tqdm import tqdm

    total = sum(cfg.run.trials for _, cfg in points)
    notes: list[str] = []
    out = []
    with tqdm(total=total, disable=not progress, unit="trial", leave=False) as bar:
        for label, cfg in points:
            started = time.perf_counter()
            layout = build_layout(cfg.cluster)
            ratios = load_calibration(cfg.calibration)
            strategies = build_strategies(cfg, ratios)
            if cfg.failures.mode == "snapshot":
                skipped = [s.name for s in strategies if s.name in SNAPSHOT_SKIPS]
                strategies = [s for s in strategies if s.name not in SNAPSHOT_SKIPS]
                if skipped:
                    _note(notes, f"snapshot mode has no time: skipped {', '.join(skipped)}")
                point = run_snapshot(cfg, layout, strategies, bar.update)
            else:
                point = run_poisson(cfg, layout, strategies, bar.update)
            point.label = label
            point.elapsed_s = time.perf_counter() - started
            for n in ratios.notes():
                _note(notes, n)
            log.info("point %r done in %.2fs", label, point.elapsed_s)
            out.append(point)
    return out, notes


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)
