"""Failure processes, turned into per-TP-group counts of failed GPUs that every strategy then reads.

Poisson mode: failure events arrive at ``rate x active GPUs`` per hour; each picks a GPU uniformly and takes
down its blast unit (the GPU, its node or its whole domain) for a repair time drawn from its class. A unit hit
again while down stays down until the later repair ends, so a unit's down time is the union of its events'
intervals. Everything is sampled and merged with numpy (no per-event Python loop): events are sorted by unit
and time, and a running maximum of repair ends splits them into down intervals. With ``warm_start`` the process
starts one maximum repair time before t=0, so the run begins in the failure process's steady state.

The same trace is replayed for every strategy (common random numbers), so strategies differ only by model.

Snapshot mode: exactly ``round(fraction x active GPUs)`` GPUs fail, uniformly at random without replacement.

The *virtual spare pool* answers "how many spares would never pause": spare domains beyond the configured
ones fail like any other domain, block by block from their own seeds, so the first S of them are the same
whatever the pool's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_megatron.sim.config import LLAMA3_RATE_PER_GPU_HOUR, Failures
from ntp_megatron.sim.layout import Layout

POOL_BLOCK = 64  # virtual spare domains drawn per seed


def rate_per_gpu_hour(f: Failures) -> float:
    base = LLAMA3_RATE_PER_GPU_HOUR if f.rate == "llama3" else 1.0 / f.mtbf_hours
    return base * f.rate_multiplier


def blast_width(f: Failures, layout: Layout) -> int:
    return {"gpu": 1, "node": f.node_size, "domain": layout.domain_size}[f.blast_radius]


@dataclass(frozen=True)
class Trace:
    """Changes of failed-GPU counts per TP group over (0, horizon]; step i changes groups[ptr[i]:ptr[i+1]]."""

    initial: np.ndarray  # failed GPUs per active TP group at t = 0
    times: np.ndarray  # hours, nondecreasing
    is_failure: np.ndarray  # failure (True) or repair (False) step
    ptr: np.ndarray
    groups: np.ndarray
    deltas: np.ndarray
    u: np.ndarray  # a uniform draw per step (decides interruptions that are known only in probability)

    @property
    def steps(self) -> int:
        return len(self.times)


def _events(f: Failures, units: int, width: int, t0: float, horizon: float, rng: np.random.Generator):
    """Raw events on ``units`` blast units of ``width`` GPUs: (unit, start, end), sorted by time."""
    n = rng.poisson(rate_per_gpu_hour(f) * units * width * (horizon - t0))
    times = np.sort(rng.uniform(t0, horizon, n))
    unit = rng.integers(0, units, n)
    shares = np.array([k.share for k in f.classes])
    cls = rng.choice(len(f.classes), n, p=shares / shares.sum())
    lo = np.array([k.repair_hours[0] for k in f.classes])[cls]
    hi = np.array([k.repair_hours[1] for k in f.classes])[cls]
    return unit, times, times + lo + (hi - lo) * rng.random(n)


def merge_down_intervals(unit: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Union of each unit's [start, end) intervals: (unit, start, end) of the merged intervals.

    Keys ``unit * span + time`` keep units apart, so one running maximum over all events gives, per event, the
    latest repair end among the earlier events of its unit; an event starts a new interval iff it comes after it.
    """
    if unit.size == 0:
        return unit, start, end
    order = np.lexsort((start, unit))
    u, s, e = unit[order], start[order], end[order]
    base = min(float(s.min()), 0.0)
    span = float(e.max()) - base + 1.0
    key_end = u * span + (e - base)
    prev = np.concatenate(([-np.inf], np.maximum.accumulate(key_end)[:-1]))
    new = u * span + (s - base) > prev
    first = np.flatnonzero(new)
    return u[first], s[first], np.maximum.reduceat(e, first)


def _unit_groups(units: np.ndarray, width: int, tp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, group, GPUs) for each TP group a blast unit covers; row indexes ``units``."""
    if tp % width == 0:  # the unit lies in one group
        return np.arange(units.size), units * width // tp, np.full(units.size, width)
    gpus = units[:, None] * width + np.arange(width)
    g = gpus // tp
    first = np.ones_like(g, dtype=bool)
    first[:, 1:] = g[:, 1:] != g[:, :-1]
    rows, cols = np.nonzero(first)
    counts = np.diff(np.append(np.flatnonzero(first.ravel()), g.size))
    return rows, g[rows, cols], counts


def poisson_trace(layout: Layout, f: Failures, horizon_h: float, warm_start: bool, rng: np.random.Generator) -> Trace:
    width = blast_width(f, layout)
    t0 = -max(k.repair_hours[1] for k in f.classes) if warm_start else 0.0
    unit, start, end = merge_down_intervals(*_events(f, layout.active_gpus // width, width, t0, horizon_h, rng))
    tp = layout.tp
    initial = np.zeros(layout.active_gpus // tp, dtype=np.int64)
    up_at_0 = (start <= 0) & (end > 0)
    rows, grp, cnt = _unit_groups(unit[up_at_0], width, tp)
    np.add.at(initial, grp, cnt)

    fail = (start > 0) & (start <= horizon_h)
    back = (end > 0) & (end <= horizon_h)
    step_unit = np.concatenate((unit[fail], unit[back]))
    step_t = np.concatenate((start[fail], end[back]))
    step_fail = np.concatenate((np.ones(fail.sum(), bool), np.zeros(back.sum(), bool)))
    order = np.argsort(step_t, kind="stable")
    step_unit, step_t, step_fail = step_unit[order], step_t[order], step_fail[order]
    rows, grp, cnt = _unit_groups(step_unit, width, tp)
    sizes = np.bincount(rows, minlength=step_t.size)
    return Trace(
        initial=initial,
        times=step_t,
        is_failure=step_fail,
        ptr=np.concatenate(([0], np.cumsum(sizes))),
        groups=grp.astype(np.int64),
        deltas=np.where(step_fail[rows], cnt, -cnt).astype(np.int64),
        u=rng.random(step_t.size),
    )


def snapshot_counts(layout: Layout, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Failed GPUs per active TP group when round(fraction x GPUs) GPUs are down, uniformly at random."""
    n_gpus = layout.active_gpus
    failed = rng.choice(n_gpus, int(round(fraction * n_gpus)), replace=False)
    return np.bincount(failed // layout.tp, minlength=n_gpus // layout.tp)


@dataclass(frozen=True)
class PoolDowns:
    """Down intervals of virtual spare domains ``first .. first + count - 1`` (pool indices), clipped to [0, H]."""

    index: np.ndarray
    start: np.ndarray  # 0 when already down at t = 0
    end: np.ndarray  # np.inf when not repaired within the run


def virtual_pool_downs(
    layout: Layout, f: Failures, horizon_h: float, warm_start: bool, seed: list[int], first: int, count: int
) -> PoolDowns:
    """Poisson mode: each virtual spare domain fails like a job domain (any failed GPU makes it unusable)."""
    t0 = -max(k.repair_hours[1] for k in f.classes) if warm_start else 0.0
    parts = []
    for block in range(first // POOL_BLOCK, -(-(first + count) // POOL_BLOCK)):
        rng = np.random.default_rng([*seed, 0x5BA2E, block])
        unit, start, end = _events(f, POOL_BLOCK, layout.domain_size, t0, horizon_h, rng)
        unit, start, end = merge_down_intervals(unit + block * POOL_BLOCK, start, end)
        keep = (unit >= first) & (unit < first + count) & (end > 0) & (start <= horizon_h)
        parts.append((unit[keep], np.maximum(start[keep], 0.0), np.where(end[keep] > horizon_h, np.inf, end[keep])))
    return PoolDowns(*(np.concatenate(p) for p in zip(*parts))) if parts else PoolDowns(*(np.zeros(0),) * 3)


def virtual_pool_snapshot(layout: Layout, fraction: float, seed: list[int], first: int, count: int) -> np.ndarray:
    """Snapshot mode: pool indices of virtual spare domains with a failed GPU, each GPU failed w.p. ``fraction``."""
    out = []
    for block in range(first // POOL_BLOCK, -(-(first + count) // POOL_BLOCK)):
        rng = np.random.default_rng([*seed, 0x5BA2E, block])
        down = rng.random((POOL_BLOCK, layout.domain_size)) < fraction
        idx = np.flatnonzero(down.any(axis=1)) + block * POOL_BLOCK
        out.append(idx[(idx >= first) & (idx < first + count)])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
