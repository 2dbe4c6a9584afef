"""Runs a loaded config: every sweep point x trial x strategy, then aggregates trials into summaries and series.

Trial ``i`` draws from ``default_rng([seed, i])`` at every sweep point, so points of a sweep share random
numbers and a result depends only on the config (determinism under a seed). Strategies with the same rate
table and placement share one time line (states.py).
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
from ntp_megatron.sim.engine import StepIntegral, TrialResult, integrate
from ntp_megatron.sim.failures import (
    Trace,
    poisson_trace,
    rate_per_gpu_hour,
    snapshot_counts,
    virtual_pool_downs,
    virtual_pool_snapshot,
)
from ntp_megatron.sim.layout import Layout, build_layout
from ntp_megatron.sim.spares import PoolHistory, pool_history, spares_with_failures
from ntp_megatron.sim.states import Evaluation, build_state
from ntp_megatron.sim.strategies import Strategy, build_strategies
from ntp_megatron.sim.trace_view import TraceView

log = logging.getLogger(__name__)

SNAPSHOT_SKIPS = ("checkpoint_restart",)  # a snapshot has no time, so rollbacks and restarts do not exist
MAX_POOL = 1 << 16  # spare domains the virtual pool may grow to


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
    with np.errstate(invalid="ignore"):  # spares can be infinite (docs/simulator.md, "Spares")
        return _describe(a)


def _describe(a: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if a.size > 1 else 0.0,
        "min": float(a.min()),
        "p95": float(np.percentile(a, 95)),
        "max": float(a.max()),
    }


def _aggregate(per_trial: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {k: _stats([t[k] for t in per_trial]) for k in per_trial[0]}


def _evaluate_all(view: TraceView, strategies: list[Strategy], policy: str) -> dict[str, Evaluation]:
    states: dict[tuple, Any] = {}
    out = {}
    for s in strategies:
        key = s.state_key()
        if key not in states:
            states[key] = build_state(view, s)
        out[s.name] = states[key].evaluate(s, policy)
    return out


def _pool(cfg: SimConfig, layout: Layout, view: TraceView, seed: list[int], size: int, horizon: float) -> PoolHistory:
    """The configured spare domains (from the trace) followed by virtual ones, ``size`` in all."""
    first, extra = layout.spare_domains, max(0, size - layout.spare_domains)
    initial = [view.spare_initial_failed]
    flips = np.flatnonzero(view.spare_flip != 0)
    ev_t, ev_pos, ev_fail = [view.step_t[view.sub_step[flips]]], [view.spare_dom[flips]], [view.spare_flip[flips] < 0]
    if extra and horizon > 0:
        d = virtual_pool_downs(layout, cfg.failures, horizon, cfg.run.warm_start, seed, first, extra)
        initial.append(d.index[d.start <= 0])
        later = d.start > 0
        back = np.isfinite(d.end)
        ev_t += [d.start[later], d.end[back]]
        ev_pos += [d.index[later], d.index[back]]
        ev_fail += [np.ones(later.sum(), bool), np.zeros(back.sum(), bool)]
    elif extra:
        initial.append(virtual_pool_snapshot(layout, cfg.failures.fraction, seed, first, extra))
    cat = np.concatenate
    return pool_history(max(size, first), cat(initial).astype(np.int64), cat(ev_t), cat(ev_pos).astype(np.int64), cat(ev_fail))


def _spares_with_failures(
    cfg: SimConfig, layout: Layout, view: TraceView, seed: list[int], evals: dict[str, Evaluation], horizon: float
) -> dict[str, tuple[float, float]]:
    """Per strategy: fewest spares never pausing, and at the percentile; the pool grows until it can tell.

    When spare domains are almost never healthy (failure rates far beyond any real cluster) no pool of up to
    ``MAX_POOL`` domains suffices, and the answer is infinite.
    """
    size = max(layout.spare_domains, int(1.5 * max(int(e.need.max()) for e in evals.values())) + 64)
    out: dict[str, tuple[float, float]] = {}
    while len(out) < len(evals):
        pool = _pool(cfg, layout, view, seed, size, horizon)
        for name, ev in evals.items():
            if name not in out:
                got = spares_with_failures(ev.rows_t, ev.need, pool, horizon, cfg.run.spares_percentile)
                if got is not None:
                    out[name] = got
                elif size >= MAX_POOL:
                    out[name] = (float("inf"), float("inf"))
        size = min(2 * size, MAX_POOL)
    return out


def _empty_trace(counts: np.ndarray) -> Trace:
    z = np.zeros(0, dtype=np.int64)
    return Trace(counts, np.zeros(0), np.zeros(0, dtype=bool), np.zeros(1, dtype=np.int64), z, z, np.zeros(0))


def run_snapshot(cfg: SimConfig, layout: Layout, strategies: list[Strategy], tick: Callable[[], None]) -> PointResult:
    per_trial: dict[str, list[dict[str, float]]] = {s.name: [] for s in strategies}
    domains_hit = []
    for trial in range(cfg.run.trials):
        seed = [cfg.run.seed, trial]
        counts = snapshot_counts(layout, cfg.failures.fraction, np.random.default_rng(seed))
        per_domain = counts[: layout.job_groups].reshape(layout.job_domains, layout.groups_per_domain).sum(axis=1)
        domains_hit.append(float(np.count_nonzero(per_domain) / layout.job_domains))
        view = TraceView(_empty_trace(counts), layout, 0.0)
        evals = _evaluate_all(view, strategies, cfg.strategies.batch_policy)
        held = _spares_with_failures(cfg, layout, view, seed, evals, 0.0)
        for name, e in evals.items():
            per_trial[name].append({
                "capacity": float(e.capacity[0]), "throughput_loss": 1.0 - float(e.capacity[0]),
                "spares_needed": float(e.need[0]), "spares_no_pause": float(held[name][0]),
            })  # fmt: skip
        tick()
    return PointResult(
        label="",
        config=cfg,
        layout=layout,
        summaries={name: _aggregate(rows) for name, rows in per_trial.items()},
        extra={
            "domains_hit_fraction": _stats(domains_hit),
            "failed_gpus": int(round(cfg.failures.fraction * layout.active_gpus)),
            "rate_tables": {s.name: s.table.describe() for s in strategies},
        },
    )


def run_poisson(cfg: SimConfig, layout: Layout, strategies: list[Strategy], tick: Callable[[], None]) -> PointResult:
    horizon = cfg.run.duration_days * 24.0
    bins = cfg.run.grid_points
    interval = cfg.checkpoint.interval_min / 60.0
    results: dict[str, list[TrialResult]] = {s.name: [] for s in strategies}
    steps, healthy = [], []
    for trial in range(cfg.run.trials):
        seed = [cfg.run.seed, trial]
        trace = poisson_trace(layout, cfg.failures, horizon, cfg.run.warm_start, np.random.default_rng(seed))
        steps.append(trace.steps)
        view = TraceView(trace, layout, horizon)
        healthy.append(float(StepIntegral(view.rows_t, view.h_rows.astype(float))(horizon)) / horizon)
        evals = _evaluate_all(view, strategies, cfg.strategies.batch_policy)
        held = _spares_with_failures(cfg, layout, view, seed, evals, horizon)
        for s in strategies:
            interrupts = trace.is_failure & (trace.u < evals[s.name].interrupt_p)
            r = integrate(evals[s.name], s, trace.times, interrupts, horizon, interval, bins)
            r.summary["spares_no_pause"], r.summary["spares_at_percentile"] = map(float, held[s.name])
            results[s.name].append(r)
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
            "healthy_spares": _stats(healthy),  # time-average of healthy spare domains (spares fail too)
            "rate_tables": {s.name: s.table.describe() for s in strategies},
        },
    )


def simulate(points: list[tuple[str, SimConfig]], progress: bool = False) -> tuple[list[PointResult], list[str]]:
    """Run every sweep point; returns the results and notes to show the user (calibration fallbacks etc.)."""
    from tqdm import tqdm  # only for a progress bar: the simulator's library use needs none

    total = sum(cfg.run.trials for _, cfg in points)
    notes: list[str] = []
    rate_lines: dict[str, list[tuple[str, str]]] = {}  # strategy -> (point label, rate table line)
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
            for s in strategies:
                if s.name in ("ntp", "ntp_boost"):
                    rate_lines.setdefault(s.name, []).append((label, s.table.line()))
            log.info("point %r done in %.2fs", label, point.elapsed_s)
            out.append(point)
    for name, lines in rate_lines.items():  # one line when every point has the same table
        same = len({line for _, line in lines}) == 1
        for label, line in lines[:1] if same else lines:
            where = "" if same or not label else f" at {label}"
            _note(notes, f"{name}{where}: speed with k failed GPUs in a TP group: {line}")
    return out, notes


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)
