"""Packing (the NTP paper's section 4.4): degraded TP groups grouped worst-first into as few DP replicas as possible.

A replica is ``pp`` TP groups and runs at the speed of its slowest one. Sorting the groups by speed and cutting
the sorted list into consecutive chunks of ``pp`` maximises the summed replica speed (an exchange argument: a
slower group never sits in a faster chunk's place). So a packed job's capacity depends only on how many groups
sit at each *level* (distinct speed, fastest first: level 0 is full speed), and every function here works on
that histogram, vectorised over the rows of a time line (one row per state of the cluster).

Spare domains, when the job may use them, join the pool as healthy groups at the front of the sorted list;
with more groups than the job needs, the slowest chunks are left idle (or, under a fixed minibatch, form extra
replicas that absorb degraded replicas' deficits, because micro-batches are split in proportion to speed).
"""

from __future__ import annotations

import math

import numpy as np

EPS = 1e-9


def levels(rate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(level of each k, speed of each level): levels are the distinct speeds, fastest first, level 0 = 1.0."""
    speeds = np.unique(rate)[::-1]
    return np.searchsorted(-speeds, -rate).astype(np.int64), speeds


def chunks_per_level(hist: np.ndarray, pp: int, front: np.ndarray | int = 0) -> np.ndarray:
    """Replicas whose slowest group is at each level, with ``front`` extra healthy groups ahead of the job's.

    ``hist`` is (rows, levels). The sorted list's positions of level l end at ``front + cumsum(hist)[l]``; a
    chunk's slowest group is its last, so chunks ending inside level l's positions are at level l.
    """
    ends = np.cumsum(hist, axis=1) + np.reshape(front, (-1, 1))
    starts = np.concatenate((np.zeros_like(ends[:, :1]), ends[:, :-1]), axis=1)
    return ends // pp - starts // pp


def packed_capacity(hist: np.ndarray, speeds: np.ndarray, pp: int, front: np.ndarray | int = 0) -> np.ndarray:
    """Summed speed of all replicas the packed pool forms, in replicas (rows,)."""
    return chunks_per_level(hist, pp, front) @ speeds


def packed_need(hist: np.ndarray, speeds: np.ndarray, pp: int, per_domain: int, dp: int) -> np.ndarray:
    """Fewest spare domains whose groups, packed with the job's, give at least ``dp`` replicas' worth of speed.

    Adding ``q / per_domain`` domains (q = lcm(pp, per_domain)) prepends ``q / pp`` healthy replicas and changes
    nothing else, so only the first ``q / per_domain`` counts need a capacity evaluation.
    """
    q = math.lcm(pp, per_domain)
    step_dom, step_rep = q // per_domain, q // pp
    best = np.full(hist.shape[0], np.inf)
    for r in range(step_dom):
        short = dp - packed_capacity(hist, speeds, pp, r * per_domain)
        best = np.minimum(best, r + step_dom * np.ceil(np.maximum(short - EPS, 0.0) / step_rep))
    return best.astype(np.int64)


def running_fraction(
    hist: np.ndarray, speeds: np.ndarray, pp: int, level: np.ndarray, front: np.ndarray, replicas: np.ndarray
) -> np.ndarray:
    """Chance that a random job group at ``level`` sits in a replica that is running.

    Per row: the first ``replicas`` chunks are in use, up to the first chunk holding a group that cannot run
    (speed 0). Groups at one level are interchangeable, so the chance is the share of that level's positions
    inside the running prefix.
    """
    rows = np.arange(hist.shape[0])
    ends = np.cumsum(hist, axis=1) + front[:, None]
    starts = np.concatenate((front[:, None], ends[:, :-1]), axis=1)
    run = replicas.astype(np.int64)
    dead = np.flatnonzero(speeds <= EPS)
    if dead.size:
        run = np.minimum(run, starts[:, dead[0]] // pp)
    lo, hi = starts[rows, level], ends[rows, level]
    return np.clip(run * pp - lo, 0, hi - lo) / np.maximum(hi - lo, 1)


def pack_order(group_levels: np.ndarray) -> np.ndarray:
    """Slot -> group: the worst groups fill the first replicas (ties keep group order)."""
    return np.argsort(-group_levels, kind="stable")
