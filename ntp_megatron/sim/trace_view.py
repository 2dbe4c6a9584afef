"""A failure trace unrolled into arrays every placement model reads: counts after each change, spare health.

A trace step (one failure or repair event) changes one or a few TP groups; each change is a *sub-step*. Rows of
a time line are "the state at t = 0" (row 0) and "the state after step i" (row i + 1). Counts of any group at
any sub-step come from one sorted key array, so whole time lines are computed with numpy and no Python loop.
"""

from __future__ import annotations

import numpy as np

from ntp_megatron.sim.failures import Trace
from ntp_megatron.sim.layout import Layout


def _groupwise_cumsum(keys: np.ndarray, values: np.ndarray, base: np.ndarray) -> np.ndarray:
    """base[key] + running sum of ``values`` over earlier-or-equal entries with the same key (entries in order)."""
    order = np.lexsort((np.arange(keys.size), keys))
    k, v = keys[order], values[order]
    cs = np.cumsum(v)
    first = np.ones(k.size, dtype=bool)
    first[1:] = k[1:] != k[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(k.size), 0))
    before = np.where(start > 0, cs[start - 1], 0)
    out = np.empty_like(cs)
    out[order] = base[k] + cs - before
    return out


class TraceView:
    def __init__(self, trace: Trace, layout: Layout, horizon_h: float):
        self.layout = layout
        self.horizon = horizon_h
        self.trace = trace
        self.n_steps = trace.steps
        self.step_t = trace.times
        self.rows_t = np.concatenate(([0.0], trace.times))
        self.sub_step = np.repeat(np.arange(self.n_steps), np.diff(trace.ptr))
        self.grp, self.delta = trace.groups, trace.deltas
        self.initial = trace.initial
        self.cnt_after = _groupwise_cumsum(self.grp, self.delta, self.initial)
        self.cnt_before = self.cnt_after - self.delta
        self.end_sub = trace.ptr[1:] - 1
        order = np.lexsort((np.arange(self.grp.size), self.grp))
        self._sorted_sub = order
        self._keys = self.grp[order] * (self.grp.size + 1) + order
        self.is_job = self.grp < layout.job_groups
        self._spares()

    def rows(self, base: float | np.ndarray, per_sub: np.ndarray) -> np.ndarray:
        """Row values: ``base`` at t = 0, then base + the changes of every sub-step up to each step's end."""
        cs = np.cumsum(per_sub, axis=0)
        head = np.asarray(base, dtype=cs.dtype if cs.size else float)[None, ...]
        return np.concatenate((head, head + cs[self.end_sub]), axis=0) if self.n_steps else head

    def count_at(self, groups: np.ndarray, sub: np.ndarray) -> np.ndarray:
        """Failed GPUs of ``groups`` right after sub-step ``sub`` (-1: at t = 0); arrays broadcast."""
        groups, sub = np.broadcast_arrays(groups, sub)
        if self.grp.size == 0:
            return self.initial[groups]
        q = groups * (self.grp.size + 1) + sub
        pos = np.searchsorted(self._keys, q, side="right") - 1
        hit = self._sorted_sub[np.maximum(pos, 0)]
        ok = (pos >= 0) & (self.grp[hit] == groups)
        return np.where(ok, self.cnt_after[hit], self.initial[groups])

    def _spares(self) -> None:
        """Health of spare domains: per sub-step whether a spare domain broke (-1) or came back (+1)."""
        lay = self.layout
        g = lay.groups_per_domain
        dom0 = self.initial[lay.job_groups :].reshape(lay.spare_domains, g).sum(axis=1)
        self.spare_initial_failed = np.flatnonzero(dom0 > 0)
        spare = ~self.is_job
        self.spare_dom = np.where(spare, (self.grp - lay.job_groups) // g, -1)
        after = np.zeros(self.grp.size, dtype=np.int64)
        if spare.any():
            after[spare] = _groupwise_cumsum(self.spare_dom[spare], self.delta[spare], dom0)
        before = after - np.where(spare, self.delta, 0)
        self.spare_healthy_before = spare & (before == 0)
        self.spare_flip = np.where(spare & (before == 0) & (after > 0), -1, 0) + np.where(
            spare & (before > 0) & (after == 0), 1, 0
        )
        self.h_rows = self.rows(lay.spare_domains - self.spare_initial_failed.size, self.spare_flip)

    def healthy_spares_at(self, t: np.ndarray) -> np.ndarray:
        return self.h_rows[np.searchsorted(self.rows_t, t, side="right") - 1]
