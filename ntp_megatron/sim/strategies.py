"""Recovery strategies as small models: how fast a TP group runs with k failed GPUs, and what a failure costs.

Every strategy reduces to two things that are tested separately:

* a *rate table* ``rate[k]``: the speed of a TP group with ``k`` failed GPUs, as a fraction of a healthy group.
  A replica runs at the minimum over its TP groups (with PP every stage waits for the slowest one, and under
  NTP every stage of the replica re-shards to the narrowest surviving TP);
* an *interruption model*: what a failure that touches running GPUs costs the whole job
  (a pause, and for checkpoint-restart a rollback to the last checkpoint).

| strategy           | rate table                                 | spares (shrinking batch) | per failure   |
|--------------------|--------------------------------------------|--------------------------|---------------|
| checkpoint_restart | 1 if k == 0 else 0                         | swapped in on restart    | rollback + restart |
| dp_drop            | 1 if k == 0 else 0                         | unused                   | reconfigure pause |
| hot_spares         | 1 if k == 0 else 0                         | swapped in while they last | reconfigure pause |
| ntp                | 1 / ratio(tp, tp_eff), 0 if no tp_eff      | unused                   | reconfigure pause |
| ntp_boost          | min(1, perf(max_power) / ratio(tp, tp_eff)) | unused                  | reconfigure pause |

``tp_eff`` is the largest allowed TP not above ``tp - k``; ``ratio`` is the degraded step-time ratio,
ideally ``tp / tp_eff``, or measured (calibration).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_megatron.sim.calibration import StepTimeRatios
from ntp_megatron.sim.config import Boost, PerfTable, SimConfig
from ntp_megatron.sim.layout import Layout

EPS = 1e-9


@dataclass(frozen=True)
class Strategy:
    name: str
    rate: np.ndarray  # rate[k] for k = 0..tp failed GPUs in a TP group
    covers_with_spares: bool  # swaps spare domains in even when the minibatch may shrink
    pause_h: float  # job-wide pause per interrupting failure
    rollback: bool  # an interrupting failure loses the work since the last checkpoint


def dp_drop_rates(tp: int) -> np.ndarray:
    rate = np.zeros(tp + 1)
    rate[0] = 1.0
    return rate


def reduced_tp(tp: int, min_tp: int = 1, allowed: list[int] | None = None) -> np.ndarray:
    """tp_eff[k]: the TP a group with k failed GPUs re-forms at, 0 when none is allowed (the replica drops)."""
    allowed_set = set(allowed) if allowed is not None else set(range(1, tp + 1))
    allowed_set = {a for a in allowed_set if min_tp <= a <= tp}
    out = np.zeros(tp + 1, dtype=np.int64)
    for k in range(tp + 1):
        fits = [a for a in allowed_set if a <= tp - k]
        out[k] = max(fits) if fits else 0
    return out


def ntp_rates(tp: int, tp_eff: np.ndarray, ratios: StepTimeRatios) -> np.ndarray:
    return np.array([1.0 / ratios.ratio(tp, int(e)) if e > 0 else 0.0 for e in tp_eff])


def perf_at(boost: Boost, power: float) -> float:
    """Performance multiplier at ``power`` x nominal power (a table is interpolated and held past its ends)."""
    curve = boost.curve
    if isinstance(curve, PerfTable):
        pw, perf = zip(*curve.points)
        return float(np.interp(power, pw, perf))
    return float(power**curve.alpha)


def boost_rates(tp: int, tp_eff: np.ndarray, ratios: StepTimeRatios, boost: Boost) -> np.ndarray:
    """A degraded group runs at full speed while the speed-up it needs fits in the boost, else in proportion."""
    perf = perf_at(boost, boost.max_power)
    return np.minimum(1.0, perf * ntp_rates(tp, tp_eff, ratios))


def build_strategies(cfg: SimConfig, ratios: StepTimeRatios) -> list[Strategy]:
    tp = cfg.cluster.tp
    s = cfg.strategies
    tp_eff = reduced_tp(tp, s.ntp.min_tp, s.ntp.allowed_tp)
    reconf_h = s.reconfigure_s / 3600.0
    drop = dp_drop_rates(tp)
    table = {
        "checkpoint_restart": Strategy("checkpoint_restart", drop, True, cfg.checkpoint.restart_min / 60.0, True),
        "dp_drop": Strategy("dp_drop", drop, False, reconf_h, False),
        "hot_spares": Strategy("hot_spares", drop, True, reconf_h, False),
        "ntp": Strategy("ntp", ntp_rates(tp, tp_eff, ratios), False, reconf_h, False),
        "ntp_boost": Strategy("ntp_boost", boost_rates(tp, tp_eff, ratios, s.boost), False, reconf_h, False),
    }
    return [table[name] for name in s.enabled]


def spares_needed(deficit: np.ndarray, cost: np.ndarray, extra_domains: np.ndarray) -> int:
    """Fewest spare domains that bring the job back to full minibatch capacity.

    Spare domains can replace a degraded replica's bad domains (``cost`` domains restore its ``deficit``)
    or form ``k`` extra replicas, which absorb up to ``k`` replicas' worth of deficit because micro-batches are
    split in proportion to replica speed. For each k the replicas with the most deficit per domain are
    restored first (greedy; exact when each degraded replica has one bad domain).
    ``extra_domains[k]`` is the number of domains k extra replicas occupy.
    """
    if deficit.size == 0:
        return 0
    order = np.argsort(-(deficit / cost), kind="stable")
    restored = np.concatenate(([0.0], np.cumsum(deficit[order])))
    spent = np.concatenate(([0], np.cumsum(cost[order])))
    remaining = restored[-1] - restored
    k = np.arange(int(np.ceil(restored[-1] - EPS)) + 1)
    m = np.searchsorted(-remaining, -(k + EPS), side="left")
    return int(np.min(extra_domains[k] + spent[m]))


@dataclass(frozen=True)
class Degradation:
    """What the failures did to the replicas under one rate table, before any decision about spares."""

    rep: np.ndarray  # per replica: speed as a fraction of healthy (min over its TP groups)
    degraded: np.ndarray  # indices of replicas below full speed
    deficit: np.ndarray  # 1 - speed of each degraded replica
    cost: np.ndarray  # bad domains of each degraded replica (spares it takes to restore it)
    need: int  # spare domains needed to keep a fixed minibatch at full speed
    healthy_spares: int


class ReplicaState:
    """Per-replica speeds under one rate table, kept up to date from failed-GPU counts per TP group.

    ``reset`` computes everything from the counts; ``update`` refreshes only the replicas, domains and spares
    that contain changed groups, which keeps a replay step cheap at 100K GPUs. Strategies sharing a rate
    table (checkpoint-restart, DP-drop, hot spares) share one state.
    """

    def __init__(self, layout: Layout, rate: np.ndarray):
        self.layout = layout
        self.rate = rate
        self.rep_domains = layout.replica_domains()
        self.extra_domains = layout.domains_for_replicas(np.arange(layout.dp + 2))

    def reset(self, counts: np.ndarray) -> Degradation:
        lay = self.layout
        jg, g = lay.job_groups, lay.groups_per_domain
        group_rate = self.rate[counts[:jg]]
        self.rep = group_rate.reshape(lay.dp, lay.pp).min(axis=1)
        self.bad_domain = np.zeros(lay.job_domains + 1, dtype=bool)  # last slot: padding of rep_domains
        self.bad_domain[:-1] = (group_rate < 1.0 - EPS).reshape(lay.job_domains, g).any(axis=1)
        self.spare_failed = counts[jg:].reshape(lay.spare_domains, g).sum(axis=1)
        self._last = self._degradation()
        return self._last

    def update(self, counts: np.ndarray, groups: np.ndarray, deltas: np.ndarray) -> Degradation:
        """Refresh after a step whose ``deltas`` were already added to ``counts`` at ``groups``.

        A step touches one or a few groups, so a plain loop over slices beats fancy indexing here; when no
        replica speed, bad-domain flag or spare's health changed, the previous result is reused.
        """
        lay = self.layout
        jg, g, pp, rate = lay.job_groups, lay.groups_per_domain, lay.pp, self.rate
        changed = False
        for j, delta in zip(groups.tolist(), deltas.tolist()):
            if j < jg:
                r, d = j // pp, j // g
                speed = rate[counts[r * pp : (r + 1) * pp]].min()
                bad = bool((rate[counts[d * g : (d + 1) * g]] < 1.0 - EPS).any())
                changed |= speed != self.rep[r] or bad != self.bad_domain[d]
                self.rep[r], self.bad_domain[d] = speed, bad
            else:
                d = (j - jg) // g
                was_healthy = self.spare_failed[d] == 0
                self.spare_failed[d] += delta
                changed |= was_healthy != (self.spare_failed[d] == 0)
        if changed:
            self._last = self._degradation()
        return self._last

    def _degradation(self) -> Degradation:
        healthy = int(self.spare_failed.size - np.count_nonzero(self.spare_failed))
        degraded = np.flatnonzero(self.rep < 1.0 - EPS)
        if degraded.size == 0:
            return Degradation(self.rep, degraded, np.zeros(0), degraded, 0, healthy)
        cost = self.bad_domain[self.rep_domains[degraded]].sum(axis=1)
        deficit = 1.0 - self.rep[degraded]
        need = spares_needed(deficit, cost, self.extra_domains)
        return Degradation(self.rep, degraded, deficit, cost, need, healthy)


@dataclass(frozen=True)
class StateEval:
    capacity: float  # job throughput as a fraction of ideal (0 = paused for want of spares, fixed minibatch)
    spares_needed: int  # spare domains needed to keep a fixed minibatch at full speed
    spares_used: int
    healthy_spares: int
    running: np.ndarray | None  # per replica: doing work (so a new failure there interrupts); None = all
    swapped: np.ndarray | None  # per replica: its bad domains were replaced by spares; None = none


def evaluate(d: Degradation, strategy: Strategy, batch_policy: str) -> StateEval:
    """The job's throughput under ``strategy``; spares restore replicas (fixed minibatch: enough, or pause).

    Under a fixed minibatch, replicas that cannot run at all get their bad domains swapped, and degraded
    but running ones (NTP) keep their domains while extra replicas make up their deficit.
    """
    if d.degraded.size == 0:
        return StateEval(1.0, 0, 0, d.healthy_spares, None, None)
    if batch_policy == "fixed":
        if d.need <= d.healthy_spares:
            return StateEval(1.0, d.need, d.need, d.healthy_spares, None, d.rep == 0)
        return StateEval(0.0, d.need, 0, d.healthy_spares, np.zeros(d.rep.size, dtype=bool), None)
    lost = float(d.deficit.sum())
    if not strategy.covers_with_spares or d.healthy_spares == 0:
        return StateEval(1.0 - lost / d.rep.size, d.need, 0, d.healthy_spares, d.rep > 0, None)
    order = np.argsort(-(d.deficit / d.cost), kind="stable")
    spent = np.cumsum(d.cost[order])
    n_restored = int(np.searchsorted(spent, d.healthy_spares, side="right"))
    swapped = np.zeros(d.rep.size, dtype=bool)
    swapped[d.degraded[order[:n_restored]]] = True
    recovered = float(d.deficit[order[:n_restored]].sum())
    used = int(spent[n_restored - 1]) if n_restored else 0
    return StateEval(
        1.0 - (lost - recovered) / d.rep.size, d.need, used, d.healthy_spares, (d.rep > 0) | swapped, swapped
    )
