"""Time lines of one rate table under one placement: replica speeds, spares needed and used, interruptions.

Two models, one interface (``evaluate``):

* ``PackedState`` (placement ``packed``): the job is re-packed at every change, so only the histogram of TP
  groups per speed level matters (placement.py);
* ``MapState`` (``fixed``, and ``packed_on_restart`` between restarts): every replica keeps its TP groups; its
  speed is that of its slowest group, and degraded replicas are counted in (level, bad groups) bins (spares.py).
  ``packed_on_restart`` re-packs the map at t = 0 and at each planned restart (a new *segment*).

Rows are breakpoints of the time line: t = 0, every trace step, and (MapState) every planned restart. Every
array is computed for all rows at once; the only loop is over segments.

An interrupting failure is one that newly fails a GPU the job is running on. It is judged on the state before
the step. Which replica a group serves is known exactly with a map; under packing groups of one level are
interchangeable and spares in use are any of the healthy ones, so there the chance is exact and the trace's
uniform draw for the step decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_megatron.sim.placement import levels, pack_order, packed_capacity, packed_need, running_fraction
from ntp_megatron.sim.spares import greedy_need_groups, greedy_order, greedy_restore
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


def _max_per_step(view: TraceView, subs: np.ndarray, p: np.ndarray, out: np.ndarray) -> None:
    np.maximum.at(out, view.sub_step[subs], p)


def _spare_interrupts(view: TraceView, rows_before: np.ndarray, used: np.ndarray, h: np.ndarray, out: np.ndarray):
    """A healthy spare domain that fails is one in use with probability used / healthy (spares are alike)."""
    fail_sub = view.trace.is_failure[view.sub_step]
    subs = np.flatnonzero(fail_sub & view.spare_healthy_before)
    r = rows_before(subs)
    _max_per_step(view, subs, used[r] / np.maximum(h[r], 1), out)


class PackedState:
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
        return Evaluation(view.rows_t, cap, need, used, p, np.zeros(0))


class MapState:
    def __init__(self, view: TraceView, rate: np.ndarray, pack: bool, restart_every_h: float | None):
        lay = view.layout
        self.view = view
        self.level, self.speeds = levels(rate)
        pp, dp, jg = lay.pp, lay.dp, lay.job_groups
        seg_t = [0.0]
        if restart_every_h is not None:
            seg_t += list(np.arange(1, int(np.ceil(view.horizon / restart_every_h))) * restart_every_h)
        seg_t = np.asarray(seg_t, dtype=float)
        n_seg = seg_t.size
        seg_of_step = np.searchsorted(seg_t, view.step_t, side="right") - 1
        self.seg_row = np.searchsorted(view.step_t, seg_t, side="left") + np.arange(n_seg)
        self.step_row = np.arange(view.n_steps) + 1 + seg_of_step
        self.rows_t = np.empty(view.n_steps + n_seg)
        self.rows_t[self.seg_row], self.rows_t[self.step_row] = seg_t, view.step_t
        self.restarts = seg_t[1:]

        sub_seg = seg_of_step[view.sub_step]
        cap_delta = np.zeros(self.rows_t.size)
        bins_pm: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (row, bin, +1/-1)
        self.j_subs, self.j_cls, self.j_cost, self.j_lev = [], [], [], []
        prev_cap, prev_bins = 0.0, (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        counts, applied = view.initial.copy(), 0  # counts at the segment's start, advanced segment by segment
        for k in range(n_seg):
            upto = view.trace.ptr[np.searchsorted(view.step_t, seg_t[k], side="right")]
            np.add.at(counts, view.grp[applied:upto], view.delta[applied:upto])
            applied = upto
            lev0 = self.level[counts[:jg]]
            perm = pack_order(lev0) if pack else np.arange(jg)
            slot = np.empty(jg, dtype=np.int64)
            slot[perm] = np.arange(jg)
            rep = lev0[perm].reshape(dp, pp)
            cls0, cost0 = rep.max(axis=1), (rep > 0).sum(axis=1)
            # the segment's start row replaces whatever the previous segment ended with
            start_cap = self.speeds[cls0].sum() / dp
            row0 = self.seg_row[k]
            cap_delta[row0] += start_cap - prev_cap
            bad = cls0 > 0
            start_bins = cls0[bad] * (pp + 1) + cost0[bad]
            bins_pm.append((np.full(prev_bins[0].size, row0), prev_bins[0], -prev_bins[1]))
            ub, uc = np.unique(start_bins, return_counts=True)
            bins_pm.append((np.full(ub.size, row0), ub, uc))
            net_cap, net_bins = start_cap, {int(b): int(c) for b, c in zip(ub, uc)}

            subs = np.flatnonzero(view.is_job & (sub_seg == k))
            if subs.size:
                r = slot[view.grp[subs]] // pp
                sib = perm[(r * pp)[:, None] + np.arange(pp)]
                sl = self.level[view.count_at(sib, subs[:, None])]
                cls_a, cost_a = sl.max(axis=1), (sl > 0).sum(axis=1)
                o = np.lexsort((subs, r))
                first = np.ones(o.size, dtype=bool)
                first[1:] = r[o][1:] != r[o][:-1]
                cls_b, cost_b = np.empty_like(cls_a), np.empty_like(cost_a)
                cls_b[o] = np.where(first, cls0[r[o]], np.roll(cls_a[o], 1))
                cost_b[o] = np.where(first, cost0[r[o]], np.roll(cost_a[o], 1))
                row = self.step_row[view.sub_step[subs]]
                dcap = (self.speeds[cls_a] - self.speeds[cls_b]) / dp
                np.add.at(cap_delta, row, dcap)
                net_cap += dcap.sum()
                b_before, b_after = cls_b * (pp + 1) + cost_b, cls_a * (pp + 1) + cost_a
                for sign, b, cl in ((-1, b_before, cls_b), (1, b_after, cls_a)):
                    keep = (cl > 0) & (b_before != b_after)
                    bins_pm.append((row[keep], b[keep], np.full(keep.sum(), sign)))
                    for bb, cc in zip(*np.unique(b[keep], return_counts=True)):
                        net_bins[int(bb)] = net_bins.get(int(bb), 0) + sign * int(cc)
                self.j_subs.append(subs)
                self.j_cls.append(cls_b)
                self.j_cost.append(cost_b)
                self.j_lev.append(self.level[view.cnt_before[subs]])
            prev_cap = net_cap
            nz = {b: c for b, c in net_bins.items() if c}
            prev_bins = (np.array(list(nz), dtype=np.int64), np.array(list(nz.values()), dtype=np.int64))

        self.capacity_plain = np.cumsum(cap_delta)
        rows, ids, signs = (np.concatenate(x) for x in zip(*bins_pm))
        uniq = np.unique(ids)
        cls_u, cost_u = uniq // (pp + 1), uniq % (pp + 1)
        self.deficit_u = 1.0 - self.speeds[cls_u]
        order = greedy_order(self.deficit_u, cost_u.astype(float))
        self.bin_ids, self.deficit, self.cost = uniq[order], self.deficit_u[order], cost_u[order].astype(float)
        col = np.empty(uniq.size, dtype=np.int64)
        col[order] = np.arange(uniq.size)
        delta = np.zeros((self.rows_t.size, uniq.size), dtype=np.int64)
        np.add.at(delta, (rows, col[np.searchsorted(uniq, ids)]), signs)
        self.hist = np.cumsum(delta, axis=0)
        self._uniq, self._col = uniq, col
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64))
        self.j_subs, self.j_cls, self.j_cost, self.j_lev = (cat(x) for x in (self.j_subs, self.j_cls, self.j_cost, self.j_lev))

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
        need = -(-greedy_need_groups(self.hist, self.deficit, self.cost, pp) // g)
        paused = np.zeros(h.size, dtype=bool)
        share = None
        if policy == "fixed":
            paused = need > h
            cap = np.where(paused, 0.0, 1.0)
            used = np.where(paused, 0, need)
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
        if policy == "fixed":  # replicas that cannot run have their bad groups swapped for spares
            pj = np.where(paused[r], False, np.where(runs, True, lev_j == 0)).astype(float)
        elif share is not None:
            colb = self._col_of(cls_b * (pp + 1) + cost_b)
            rho = np.where(colb >= 0, share[r, np.maximum(colb, 0)], 0.0)
            pj = rho * (lev_j == 0) + (1 - rho) * runs
        else:
            pj = runs.astype(float)
        _max_per_step(view, subs, pj, p)
        _spare_interrupts(view, lambda s: self.step_row[view.sub_step[s]] - 1, used, h, p)
        return Evaluation(self.rows_t, cap, need, used, p, self.restarts)


def build_state(view: TraceView, strategy: Strategy) -> PackedState | MapState:
    if strategy.placement == "packed":
        return PackedState(view, strategy.table.rate)
    pack = strategy.placement == "packed_on_restart"
    return MapState(view, strategy.table.rate, pack, strategy.restart_every_h if pack else None)
