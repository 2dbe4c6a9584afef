"""Failure processes, turned into per-TP-group counts of failed GPUs that every strategy then reads.

Poisson mode: failure events arrive at ``rate x active GPUs`` per hour; each picks a GPU uniformly and takes
down its blast radius (the GPU, its node or its whole domain) for a repair time drawn from its class.
All event times, places, classes and repair times are sampled at once with numpy; the only Python loop is
over events (a few hundred per simulated fortnight at 32K GPUs), merging failures with repairs. A GPU hit
again while down stays down until the later repair ends. With ``warm_start`` the process starts one
maximum repair time before t=0, so the run begins in the failure process's steady state.

The same trace is replayed for every strategy (common random numbers), so strategies differ only by model.

Snapshot mode: exactly ``round(fraction x active GPUs)`` GPUs fail, uniformly at random without replacement.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ntp_megatron.sim.config import LLAMA3_RATE_PER_GPU_HOUR, Failures
from ntp_megatron.sim.layout import Layout


def rate_per_gpu_hour(f: Failures) -> float:
    base = LLAMA3_RATE_PER_GPU_HOUR if f.rate == "llama3" else 1.0 / f.mtbf_hours
    return base * f.rate_multiplier


def blast_width(f: Failures, layout: Layout) -> int:
    return {"gpu": 1, "node": f.node_size, "domain": layout.domain_size}[f.blast_radius]


@dataclass(frozen=True)
class Trace:
    """Changes of failed-GPU counts per TP group over (0, horizon]; step i changes groups[ptr[i]:ptr[i+1]]."""

    initial: np.ndarray  # failed GPUs per active TP group at t = 0
    times: np.ndarray  # hours, increasing
    is_failure: np.ndarray  # failure (True) or repair (False) step
    ptr: np.ndarray
    groups: np.ndarray
    deltas: np.ndarray
    u: np.ndarray  # a uniform draw per step (decides whether a spare domain that failed was in use)

    @property
    def steps(self) -> int:
        return len(self.times)


def poisson_trace(layout: Layout, f: Failures, horizon_h: float, warm_start: bool, rng: np.random.Generator) -> Trace:
    n_gpus = layout.active_gpus
    longest = max(k.repair_hours[1] for k in f.classes)
    t0 = -longest if warm_start else 0.0
    n = rng.poisson(rate_per_gpu_hour(f) * n_gpus * (horizon_h - t0))
    times = np.sort(rng.uniform(t0, horizon_h, n))
    width = blast_width(f, layout)
    start = rng.integers(0, n_gpus, n) // width * width
    shares = np.array([k.share for k in f.classes])
    cls = rng.choice(len(f.classes), n, p=shares / shares.sum())
    lo = np.array([k.repair_hours[0] for k in f.classes])[cls]
    hi = np.array([k.repair_hours[1] for k in f.classes])[cls]
    ends = times + lo + (hi - lo) * rng.random(n)

    tp = layout.tp
    n_groups = n_gpus // tp
    initial = np.zeros(n_groups, dtype=np.int64)
    down_until = np.full(n_gpus, -np.inf)
    repairs: list[tuple[float, int]] = []  # (end time, first GPU of the blast range)
    out_t: list[float] = []
    out_fail: list[bool] = []
    out_groups: list[np.ndarray] = []
    out_deltas: list[np.ndarray] = []

    def record(t: float, failed: bool, gpus: np.ndarray) -> None:
        g = gpus // tp  # sorted, so runs of equal values are the groups
        if g[0] == g[-1]:  # the usual case: one group
            groups, counts = g[:1], np.array([g.size])
        else:
            first = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1])))
            groups, counts = g[first], np.diff(np.append(first, g.size))
        if t <= 0:
            initial[groups] += counts if failed else -counts
            return
        out_t.append(t)
        out_fail.append(failed)
        out_groups.append(groups)
        out_deltas.append(counts if failed else -counts)

    def repair_until(t: float) -> None:
        while repairs and repairs[0][0] <= t:
            end, a = heapq.heappop(repairs)
            seg = down_until[a : a + width]
            back = np.flatnonzero(seg == end)  # not re-failed with a later repair in the meantime
            if back.size:
                record(end, False, a + back)

    for t, a, end in zip(times.tolist(), start.tolist(), ends.tolist()):
        repair_until(t)
        seg = down_until[a : a + width]
        newly = np.flatnonzero(seg <= t)
        longer = seg < end
        if longer.any():
            seg[longer] = end
            heapq.heappush(repairs, (end, a))
        if newly.size:
            record(t, True, a + newly)
    repair_until(horizon_h)

    sizes = np.array([len(g) for g in out_groups], dtype=np.int64)
    return Trace(
        initial=initial,
        times=np.array(out_t),
        is_failure=np.array(out_fail, dtype=bool),
        ptr=np.concatenate(([0], np.cumsum(sizes))),
        groups=np.concatenate(out_groups) if out_groups else np.zeros(0, dtype=np.int64),
        deltas=np.concatenate(out_deltas) if out_deltas else np.zeros(0, dtype=np.int64),
        u=rng.random(len(out_t)),
    )


def snapshot_counts(layout: Layout, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Failed GPUs per active TP group when round(fraction x GPUs) GPUs are down, uniformly at random."""
    n_gpus = layout.active_gpus
    failed = rng.choice(n_gpus, int(round(fraction * n_gpus)), replace=False)
    return np.bincount(failed // layout.tp, minlength=n_gpus // layout.tp)
