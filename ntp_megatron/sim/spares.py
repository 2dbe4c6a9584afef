"""Spare arithmetic: what spares a job needs, what they restore, and how many to hold when spares fail too.

Replicas tied to their TP groups (placement ``fixed``, or ``packed_on_restart`` between restarts) are counted
in *bins*: degraded replicas with the same deficit ``d`` (1 - speed) and the same number ``c`` of degraded TP
groups. Spare capacity is counted in TP groups (a spare domain holds ``domain_size / tp`` of them): a degraded
replica is restored by swapping its ``c`` bad groups, or ``k`` extra replicas of ``pp`` groups each absorb ``k``
replicas' worth of deficit (micro-batches are split in proportion to speed). All functions are vectorised over
rows of a time line; the bins' columns come in greedy order (most deficit restored per group first).

*Spares needed* is the fewest spare domains that keep a fixed minibatch at full speed now. Spare domains fail
too, so holding that many is not enough: taking spares in a fixed pool order, the job holding the first S pool
domains pauses at time t iff fewer than need_t of them are healthy. The fewest S with no pause is the fewest
spares that never pause; the fewest S paused at most a given share of the time bounds paused time. Both are
monotone in S and found by binary search (``spares_with_failures``).
"""

from __future__ import annotations

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
    """Failures of the spare pool: positions down at t = 0, then +1 (fails) / -1 (repaired) events in time order."""

    size: int  # spare domains whose failures are known (pool positions 0 .. size - 1)
    initial: np.ndarray  # positions down at t = 0
    times: np.ndarray  # event times, nondecreasing
    pos: np.ndarray
    sign: np.ndarray  # +1: the domain goes down, -1: it comes back


def pool_history(size: int, initial: np.ndarray, ev_t: np.ndarray, ev_pos: np.ndarray, ev_fail: np.ndarray):
    """The pool's events sorted by time (ties keep their order); each domain's down intervals must not overlap."""
    order = np.argsort(ev_t, kind="stable")
    sign = np.where(np.asarray(ev_fail, dtype=bool), 1, -1)[order]
    return PoolHistory(size, np.asarray(initial, dtype=np.int64), np.asarray(ev_t, dtype=float)[order],
                       np.asarray(ev_pos, dtype=np.int64)[order], sign.astype(np.int64))  # fmt: skip


def _smallest(lo: int, hi: int, ok) -> int | None:
    """Smallest s in lo..hi with ok(s), for a predicate monotone in s; None when even ok(hi) fails."""
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def spares_with_failures(
    rows_t: np.ndarray, need: np.ndarray, pool: PoolHistory, horizon: float, percentile: float
) -> tuple[int, int] | None:
    """(fewest spares that never pause, fewest that pause at most (100 - percentile) % of the time).

    Holding the first S pool domains, the job pauses whenever fewer than need_t of them are healthy, and that
    only gets rarer as S grows, so both answers are binary searches over S. Each probe counts the failed
    domains below S at every breakpoint with one cumulative sum over the pool's events (no per-event loop).
    None when the pool is too small to tell (the job would pause even holding all of it).
    """
    if horizon > 0:
        bt = np.union1d(rows_t, pool.times[pool.times <= horizon])
        dur = np.diff(np.append(bt, horizon))
        live = dur > 0  # a state that lasts no time pauses nothing
        bt, dur = bt[live], dur[live]
    else:  # a snapshot: one state
        bt, dur = np.zeros(1), np.ones(1)
    n = need[np.searchsorted(rows_t, bt, side="right") - 1]
    last = np.searchsorted(pool.times, bt, side="right") - 1  # events up to each breakpoint
    seen = last >= 0
    lastc = np.maximum(last, 0)

    def paused(s: int) -> np.ndarray:
        """Per breakpoint: fewer than need_t of the first ``s`` pool domains are healthy."""
        down = np.count_nonzero(pool.initial < s)
        if pool.times.size:
            down = down + np.where(seen, np.cumsum(np.where(pool.pos < s, pool.sign, 0))[lastc], 0)
        return s - down < n

    never = _smallest(0, pool.size, lambda s: not paused(s).any())
    if never is None:
        return None
    if horizon <= 0:
        return never, never
    allowed = (1 - percentile / 100.0) * horizon + 1e-12 * horizon
    at = _smallest(0, never, lambda s: float(dur[paused(s)].sum()) <= allowed)
    return never, at
