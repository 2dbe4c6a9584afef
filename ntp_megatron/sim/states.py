"""Time lines of one rate table under one placement: replica speeds, spares needed and used, interruptions.

Two models, one interface (``evaluate``):

* ``PackedState`` (placement ``packed``): the job is re-packed whenever a step changes its packed optimum
  (capacity, or spares needed under a fixed minibatch), so only the histogram of TP groups per speed level
  matters (placement.py); such a step moves domains, which takes a restart (``Evaluation.repack``);
* ``MapState`` (``fixed``, and ``packed_on_restart`` between restarts): every replica keeps its TP groups; its
  speed is that of its slowest group, and degraded replicas are counted in (level, bad groups) bins (spares.py).
  ``packed_on_restart`` re-packs the map at t = 0 and at each planned restart (a new *segment*).

Rows are breakpoints of the time line: t = 0, every trace step, and (MapState) every planned restart. Every
array is computed for all rows at once; the only loop is over segments.

An interrupting failure is one that newly fails a GPU the job is running on. It is judged on the state before
the step, and never while the job stands still for want of spares. Which replica a group serves is known
exactly with a map; under packing groups of one level are interchangeable and spares in use are any of the
healthy ones, and when spares restore only part of a bin of tied replicas (greedy swaps, or the swaps the
spares-needed choice makes under a fixed minibatch) any of its replicas may be the swapped ones. There the
chance is computed and the trace's uniform draw for the step decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_megatron.sim.placement import levels, pack_order, packed_capacity, packed_need, running_fraction
from ntp_megatron.sim.spares import greedy_need, greedy_order, greedy_restore
from ntp_megatron.sim.strategies import Strategy
from ntp_megatron.sim.trace_view import TraceView

EPS = 1e-9


@dataclass(frozen=True)
class Evaluation:
    rows_t: np.ndarray  # breakpoints (hours)
    capacity: np.ndarray  # per row: throughput as a fraction of ideal (0 = paused for want of spares)
    need: np.ndarray  # per row: spare domains a fixed minibatch needs
    used: np.ndarray  # per row: spare domains in use
    interrupt_p: np.ndarray  # per step: chance the step interrupts the job (0 for repairs)
    restarts: np.ndarray  # planned restart times
    repack: np.ndarray | None = None  # per step: the job re-packs (moves domains) there; None = never


def _max_per_step(view: TraceView, subs: np.ndarray, p: np.ndarray, out: np.ndarray) -> None:
    np.maximum.at(out, view.sub_step[subs], p)


def _spare_interrupts(view: TraceView, rows_before: np.ndarray, used: np.ndarray, h: np.ndarray, out: np.ndarray):
    """A healthy spare domain that fails is one in use with probability used / healthy (spares are alike)."""
    fail_sub = view.trace.is_failure[view.sub_step]
    subs = np.flatnonzero(fail_sub & view.spare_healthy_before)
    r = rows_before(subs)
    _max_per_step(view, subs, used[r] / np.maximum(h[r], 1), out)


class PackedState:
    """Placement ``packed``: per row, how many job groups sit at each speed level; the rest is placement.py."""

    def __init__(self, view: TraceView, rate: np.ndarray):
        lay = view.layout
        self.view = view
        self.level, self.speeds = levels(rate)
        n_lev = self.speeds.size
        lb, la = self.level[view.cnt_before], self.level[view.cnt_after]
        moved = np.flatnonzero(view.is_job & (lb != la))
        delta = np.zeros((view.n_steps + 1, n_lev), dtype=np.int64)
        delta[0] = np.bincount(self.level[view.initial[: lay.job_groups]], minlength=n_lev)
        np.add.at(delta, (view.sub_step[moved] + 1, lb[moved]), -1)
        np.add.at(delta, (view.sub_step[moved] + 1, la[moved]), 1)
        self.hist = np.cumsum(delta, axis=0)
        self.hist_step = np.zeros(view.n_steps, dtype=bool)  # steps that change the job's level histogram
        self.hist_step[view.sub_step[moved]] = True

    def evaluate(self, strategy: Strategy, policy: str) -> Evaluation:
        view, lay = self.view, self.view.layout
        pp, g, dp = lay.pp, lay.groups_per_domain, lay.dp
        h = view.h_rows
        need = packed_need(self.hist, self.speeds, pp, g, dp)
        paused = np.zeros(h.size, dtype=bool)
        if policy == "fixed":
            paused = need > h
            cap = np.where(paused, 0.0, 1.0)
            used = np.where(paused, 0, need)
            replicas = (lay.job_groups + used * g) // pp
        elif strategy.covers_with_spares:
            used = np.minimum(h, need)
            cap = np.minimum(dp, packed_capacity(self.hist, self.speeds, pp, used * g)) / dp
            replicas = np.full(h.size, dp)
        else:
            used = np.zeros(h.size, dtype=np.int64)
            cap = packed_capacity(self.hist, self.speeds, pp) / dp
            replicas = np.full(h.size, dp)
        p = np.zeros(view.n_steps)
        fail_sub = view.trace.is_failure[view.sub_step]
        jobs = np.flatnonzero(fail_sub & view.is_job)
        r = view.sub_step[jobs]  # the row before step i is row i
        lvl = self.level[view.cnt_before[jobs]]
        frac = running_fraction(self.hist[r], self.speeds, pp, lvl, used[r] * g, replicas[r])
        _max_per_step(view, jobs, np.where(paused[r], 0.0, frac), p)
        _spare_interrupts(view, lambda subs: view.sub_step[subs], used, h, p)
        # the packed optimum (capacity, or spares needed under a fixed minibatch) moves only at job steps
        opt = need.astype(float) if policy == "fixed" else cap
        repack = self.hist_step & (np.abs(np.diff(opt)) > EPS)
        repack &= ~(paused[:-1] & paused[1:])  # a job standing still for want of spares has nothing to restart
        return Evaluation(view.rows_t, cap, need, used, p, np.zeros(0), repack)


def _replica_changes(
    view: TraceView, level: np.ndarray, perm: np.ndarray, start: tuple[np.ndarray, np.ndarray], subs: np.ndarray, pp: int
):
    """(class, bad groups) of the replica each job sub-step touches, before and after it, under map ``perm``.

    A replica's class is its slowest group's level; its groups' counts right after each sub-step come from
    as-of look-ups, and "before" is the previous sub-step on the same replica (or the segment's start).
    """
    cls0, cost0 = start
    slot = np.empty(perm.size, dtype=np.int64)
    slot[perm] = np.arange(perm.size)
    r = slot[view.grp[subs]] // pp
    sl = level[view.count_at(perm[(r * pp)[:, None] + np.arange(pp)], subs[:, None])]
    cls_a, cost_a = sl.max(axis=1), (sl > 0).sum(axis=1)
    o = np.lexsort((subs, r))
    first = np.ones(o.size, dtype=bool)
    first[1:] = r[o][1:] != r[o][:-1]
    cls_b, cost_b = np.empty_like(cls_a), np.empty_like(cost_a)
    cls_b[o] = np.where(first, cls0[r[o]], np.roll(cls_a[o], 1))
    cost_b[o] = np.where(first, cost0[r[o]], np.roll(cost_a[o], 1))
    return cls_b, cost_b, cls_a, cost_a


class MapState:
    """Replicas tied to their groups between (re-)packings: per row, capacity and degraded replicas per bin."""

    def __init__(self, view: TraceView, rate: np.ndarray, pack: bool, restart_every_h: float | None):
        self.view = view
        self.level, self.speeds = levels(rate)
        seg_t = np.zeros(1)
        if restart_every_h is not None:
            # the job starts at t = 0 and restarts every restart_every_h before the horizon (a snapshot: only starts)
            seg_t = np.arange(max(1, int(np.ceil(view.horizon / restart_every_h)))) * restart_every_h
        seg_of_step = np.searchsorted(seg_t, view.step_t, side="right") - 1
        self.seg_row = np.searchsorted(view.step_t, seg_t, side="left") + np.arange(seg_t.size)
        self.step_row = np.arange(view.n_steps) + 1 + seg_of_step
        self.rows_t = np.empty(view.n_steps + seg_t.size)
        self.rows_t[self.seg_row], self.rows_t[self.step_row] = seg_t, view.step_t
        self.restarts = seg_t[1:]
        self._build(pack, seg_t, seg_of_step[view.sub_step])

    def _build(self, pack: bool, seg_t: np.ndarray, sub_seg: np.ndarray) -> None:
        """Per segment: (re-)pack the map, then every job sub-step's replica change; all rows at the end.

        Each segment's start row replaces what the previous segment ended with, so the running sums of capacity
        and of the bin histogram are reset there by adding the difference.
        """
        view, lay = self.view, self.view.layout
        pp, dp, jg = lay.pp, lay.dp, lay.job_groups
        cap_delta = np.zeros(self.rows_t.size)
        pm: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (row, bin id, +-count) changes of the histogram
        subs_l, cls_l, cost_l, lev_l = [], [], [], []
        end_cap, end_bins = 0.0, np.zeros(0, dtype=np.int64)  # state at the previous segment's end
        counts, applied = view.initial.copy(), 0
        for k, t in enumerate(seg_t):
            upto = view.trace.ptr[np.searchsorted(view.step_t, t, side="right")]
            np.add.at(counts, view.grp[applied:upto], view.delta[applied:upto])
            applied = upto
            lev0 = self.level[counts[:jg]]
            perm = pack_order(lev0) if pack else np.arange(jg)
            rep = lev0[perm].reshape(dp, pp)
            cls0, cost0 = rep.max(axis=1), (rep > 0).sum(axis=1)
            row0 = self.seg_row[k]
            start_cap = self.speeds[cls0].sum() / dp
            cap_delta[row0] += start_cap - end_cap
            start_bins = (cls0 * (pp + 1) + cost0)[cls0 > 0]
            pm.append((np.full(end_bins.size, row0), end_bins, -np.ones(end_bins.size, dtype=np.int64)))
            pm.append((np.full(start_bins.size, row0), start_bins, np.ones(start_bins.size, dtype=np.int64)))
            end_cap, end_bins = start_cap, start_bins
            subs = np.flatnonzero(view.is_job & (sub_seg == k))
            if subs.size == 0:
                continue
            cls_b, cost_b, cls_a, cost_a = _replica_changes(view, self.level, perm, (cls0, cost0), subs, pp)
            row = self.step_row[view.sub_step[subs]]
            dcap = (self.speeds[cls_a] - self.speeds[cls_b]) / dp
            np.add.at(cap_delta, row, dcap)
            end_cap += dcap.sum()
            b_before, b_after = cls_b * (pp + 1) + cost_b, cls_a * (pp + 1) + cost_a
            moved = b_before != b_after
            out, into = moved & (cls_b > 0), moved & (cls_a > 0)
            pm.append((row[out], b_before[out], -np.ones(out.sum(), dtype=np.int64)))
            pm.append((row[into], b_after[into], np.ones(into.sum(), dtype=np.int64)))
            end_bins = _multiset_update(end_bins, b_before[out], b_after[into])
            subs_l.append(subs), cls_l.append(cls_b), cost_l.append(cost_b)
            lev_l.append(self.level[view.cnt_before[subs]])

        self.capacity_plain = np.cumsum(cap_delta)
        rows, ids, signs = (np.concatenate(x) for x in zip(*pm))
        uniq = np.unique(ids)
        cls_u, cost_u = uniq // (pp + 1), (uniq % (pp + 1)).astype(float)
        order = greedy_order(1.0 - self.speeds[cls_u], cost_u)
        self.deficit, self.cost = 1.0 - self.speeds[cls_u][order], cost_u[order]
        col = np.empty(uniq.size, dtype=np.int64)
        col[order] = np.arange(uniq.size)
        delta = np.zeros((self.rows_t.size, uniq.size), dtype=np.int64)
        np.add.at(delta, (rows, col[np.searchsorted(uniq, ids)]), signs)
        self.hist = np.cumsum(delta, axis=0)
        self._uniq, self._col = uniq, col
        empty = np.zeros(0, dtype=np.int64)
        self.j_subs, self.j_cls, self.j_cost, self.j_lev = (
            np.concatenate(x) if x else empty for x in (subs_l, cls_l, cost_l, lev_l)
        )

    def _col_of(self, b: np.ndarray) -> np.ndarray:
        """Column of bin ids ``b`` in the histogram, -1 for bins never degraded."""
        if self._uniq.size == 0:
            return np.full(b.shape, -1)
        pos = np.clip(np.searchsorted(self._uniq, b), 0, self._uniq.size - 1)
        return np.where(self._uniq[pos] == b, self._col[pos], -1)

    def evaluate(self, strategy: Strategy, policy: str) -> Evaluation:
        view, lay = self.view, self.view.layout
        pp, g, dp = lay.pp, lay.groups_per_domain, lay.dp
        h = view.healthy_spares_at(self.rows_t)
        need_groups, swapped = greedy_need(self.hist, self.deficit, self.cost, pp)
        need = -(-need_groups // g)
        paused = np.zeros(h.size, dtype=bool)
        share = None
        if policy == "fixed":
            paused = need > h
            cap = np.where(paused, 0.0, 1.0)
            used = np.where(paused, 0, need)
            share = swapped
        elif strategy.covers_with_spares:
            recovered, used_groups, share = greedy_restore(self.hist, self.deficit, self.cost, h * g)
            cap = self.capacity_plain + recovered / dp
            used = -(-used_groups.astype(np.int64) // g)
        else:
            cap = self.capacity_plain
            used = np.zeros(h.size, dtype=np.int64)

        p = np.zeros(view.n_steps)
        fails = view.trace.is_failure[view.sub_step[self.j_subs]]
        subs, cls_b, cost_b, lev_j = (a[fails] for a in (self.j_subs, self.j_cls, self.j_cost, self.j_lev))
        r = self.step_row[view.sub_step[subs]] - 1
        runs = self.speeds[cls_b] > EPS
        if share is not None:  # a swapped replica runs on its healthy groups and spares, the others on their own
            colb = self._col_of(cls_b * (pp + 1) + cost_b)
            rho = np.where(colb >= 0, share[r, np.maximum(colb, 0)], 0.0) if share.shape[1] else np.zeros(r.size)
            pj = np.where(paused[r], 0.0, rho * (lev_j == 0) + (1 - rho) * runs)
        else:
            pj = runs.astype(float)
        _max_per_step(view, subs, pj, p)
        _spare_interrupts(view, lambda s: self.step_row[view.sub_step[s]] - 1, used, h, p)
        return Evaluation(self.rows_t, cap, need, used, p, self.restarts)


def _multiset_update(items: np.ndarray, removed: np.ndarray, added: np.ndarray) -> np.ndarray:
    """``items`` as a multiset, minus ``removed`` (each present) plus ``added``."""
    vals = np.unique(np.concatenate((items, removed, added)))
    tally = sum(sign * np.bincount(np.searchsorted(vals, x), minlength=vals.size)
                for sign, x in ((1, items), (-1, removed), (1, added)))  # fmt: skip
    return np.repeat(vals, tally)


def build_state(view: TraceView, strategy: Strategy) -> PackedState | MapState:
    if strategy.placement == "packed":
        return PackedState(view, strategy.table.rate)
    pack = strategy.placement == "packed_on_restart"
    return MapState(view, strategy.table.rate, pack, strategy.restart_every_h if pack else None)
