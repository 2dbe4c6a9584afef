"""Spare arithmetic: what spares a job needs, what they restore, and how many to hold when spares fail too.

Replicas tied to their TP groups (placement ``fixed``, or ``packed_on_restart`` between restarts) are counted
in *bins*: degraded replicas with the same deficit ``d`` (1 - speed) and the same number ``c`` of degraded TP
groups. Spare capacity is counted in TP groups (a spare domain holds ``domain_size / tp`` of them): a degraded
replica is restored by swapping its ``c`` bad groups, or ``k`` extra replicas of ``pp`` groups each absorb ``k``
replicas' worth of deficit (micro-batches are split in proportion to speed). All functions are vectorised over
rows of a time line; the bins' columns come in greedy order (most deficit restored per group first).

*Spares needed* is the fewest spare domains that keep a fixed minibatch at full speed now. Spare domains fail
too, so holding that many is not enough: with spare domains taken in a fixed order, the job needs, at time t,
``S_t = need_t + #{j : f_j - j < need_t}`` of them, where ``f_0 < f_1 < ...`` are the failed ones' positions
(the need_t-th healthy spare sits after every failed one that has fewer than need_t healthy ones before it).
``max_t S_t`` is the fewest spares that never pause; a time-weighted percentile of ``S_t`` bounds paused time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

EPS = 1e-9


def greedy_order(deficit: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Bins by deficit restored per group, highest first (ties: cheaper first)."""
    return np.lexsort((cost, -deficit / cost))


def greedy_need_groups(n: np.ndarray, deficit: np.ndarray, cost: np.ndarray, pp: int) -> np.ndarray:
    """Fewest spare TP groups restoring full capacity: min over k of k*pp + (greedy swaps leaving <= k deficit)."""
    return greedy_need(n, deficit, cost, pp)[0]


def greedy_need(n: np.ndarray, deficit: np.ndarray, cost: np.ndarray, pp: int) -> tuple[np.ndarray, np.ndarray]:
    """(fewest spare TP groups restoring full capacity, share of each bin's replicas swapped in that choice).

    The choice is ``k`` extra replicas of ``pp`` groups plus swaps in greedy order that leave at most ``k``
    replicas' worth of deficit. ``n`` is (rows, bins) in greedy order. For k in a range where the swaps stop
    inside bin b, the cost is ``k*pp + A_b + c_b * ceil((total - k - P_b) / d_b)``, monotone in k when c_b = 1
    (pp and 1/d_b's rounding steps are integers), so the ends of each bin's range suffice: exact when every
    degraded replica has one bad group, an upper bound on the best choice otherwise. Ties go to extra replicas
    only, then to the first candidate in (range start, range end) x bin order.
    """
    rows, bins = n.shape
    rest, spend = n * deficit, n * cost
    before_rest = np.cumsum(rest, axis=1) - rest  # P_b
    before_cost = np.cumsum(spend, axis=1) - spend  # A_b
    total = rest.sum(axis=1, keepdims=True)
    extra_only = np.ceil(total[:, 0] - EPS) * pp
    if bins == 0:
        return extra_only.astype(np.int64), np.zeros((rows, 0))
    lo = np.maximum(np.ceil(total - before_rest - rest - EPS), 0)
    hi = np.ceil(total - before_rest - EPS) - 1
    valid = (n > 0) & (lo <= hi)
    cands, swaps = [], []
    for k in (lo, hi):
        j = np.clip(np.ceil((total - k - before_rest) / deficit - EPS), 0, n)
        cands.append(np.where(valid, k * pp + before_cost + j * cost, np.inf))
        swaps.append(j)
    cand = np.concatenate(cands, axis=1)  # (rows, 2 * bins): k = lo for every bin, then k = hi
    pick = cand.argmin(axis=1)
    r = np.arange(rows)
    best = cand[r, pick]
    extra = extra_only <= best
    b = pick % bins
    j = np.concatenate(swaps, axis=1)[r, pick]
    share = (np.arange(bins)[None, :] < b[:, None]).astype(float)
    share[r, b] = j / np.maximum(n[r, b], 1)
    share[extra] = 0.0
    return np.where(extra, extra_only, best).astype(np.int64), share


def greedy_restore(n: np.ndarray, deficit: np.ndarray, cost: np.ndarray, budget: np.ndarray):
    """Swap spares into degraded replicas in greedy order while ``budget`` groups last (rows,).

    Returns (deficit recovered, groups used, share of each bin's replicas restored).
    """
    before_cost = np.cumsum(n * cost, axis=1) - n * cost
    j = np.clip(np.floor((budget[:, None] - before_cost) / cost + EPS), 0, n)
    return (j * deficit).sum(axis=1), (j * cost).sum(axis=1), j / np.maximum(n, 1)


@dataclass(frozen=True)
class PoolHistory:
    """Failed spare domains over time, as sorted ``f_j - j`` rows (padded with ``pad``) from ``times[v]`` on."""

    times: np.ndarray
    gaps: np.ndarray  # (versions, width) int64; padding = size, which no real f_j - j reaches
    size: int  # spare domains whose failures are known (pool positions 0 .. size - 1)


def pool_history(size: int, initial: np.ndarray, ev_t: np.ndarray, ev_pos: np.ndarray, ev_fail: np.ndarray):
    """Versions of the failed set after each event (events need not be sorted; ties keep their order)."""
    order = np.argsort(ev_t, kind="stable")
    failed = sorted(int(i) for i in initial)
    rows, times = [list(failed)], [0.0]
    for t, pos, fail in zip(ev_t[order].tolist(), ev_pos[order].tolist(), ev_fail[order].tolist()):
        i = bisect.bisect_left(failed, pos)
        if fail:
            failed.insert(i, pos)
        elif i < len(failed) and failed[i] == pos:
            del failed[i]
        rows.append(list(failed))
        times.append(t)
    width = max(1, max(len(r) for r in rows))
    gaps = np.full((len(rows), width), size, dtype=np.int64)
    for v, r in enumerate(rows):
        gaps[v, : len(r)] = np.asarray(r, dtype=np.int64) - np.arange(len(r))
    return PoolHistory(np.asarray(times), gaps, size)


def spares_with_failures(
    rows_t: np.ndarray, need: np.ndarray, pool: PoolHistory, horizon: float, percentile: float
) -> tuple[int, int] | None:
    """(fewest spares that never pause, fewest that pause at most (100 - percentile) % of the time).

    None when the pool is too small to tell (some S_t lies beyond its known positions).
    """
    bt = np.union1d(rows_t, pool.times[pool.times <= horizon]) if horizon > 0 else np.zeros(1)
    n = need[np.searchsorted(rows_t, bt, side="right") - 1]
    v = np.searchsorted(pool.times, bt, side="right") - 1
    width = pool.gaps.shape[1]
    big = int(max(pool.size, n.max(initial=0))) + 1
    flat = (np.arange(pool.gaps.shape[0])[:, None] * big + pool.gaps).ravel()
    failed_before = np.searchsorted(flat, v * big + n, side="left") - v * width
    s = np.where(n > 0, n + failed_before, 0)
    if s.max(initial=0) > pool.size:
        return None
    if horizon <= 0:  # a snapshot: one state
        return int(s.max(initial=0)), int(s.max(initial=0))
    dur = np.diff(np.append(bt, horizon))
    order = np.argsort(s, kind="stable")
    cum = np.cumsum(dur[order])
    at = np.searchsorted(cum, percentile / 100.0 * horizon * (1 - 1e-12), side="left")
    return int(s.max()), int(s[order][min(at, s.size - 1)])
