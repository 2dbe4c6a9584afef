"""Replays one failure trace under one strategy: piecewise-constant throughput, pauses, rollbacks, losses.

Between trace steps the job's capacity is constant, so work is integrated exactly, step by step. A failure
*interrupts* the job when it newly fails a GPU of a running replica (or a spare domain in use, decided by
the trace's uniform draw in proportion to spares in use). An interruption pauses the whole job for the
strategy's pause; a further interruption during a pause starts the pause again (a restart that fails is
restarted). For checkpoint-restart it also loses the work since the last checkpoint; checkpoints are taken
every ``interval`` of running time counted from the end of the last restart, and cost nothing.
Work done since the last checkpoint when the run ends counts as useful.

Losses add up exactly: ``1 - goodput = lost_capacity + lost_pause + lost_rollback`` where
lost_capacity = time-average of (1 - capacity), lost_pause = capacity that sat idle during pauses,
lost_rollback = work thrown away by rollbacks (all as fractions of the ideal work).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ntp_megatron.sim.failures import Trace
from ntp_megatron.sim.layout import Layout
from ntp_megatron.sim.strategies import EPS, ReplicaState, StateEval, Strategy, evaluate


@dataclass
class TrialResult:
    summary: dict[str, float]
    throughput: np.ndarray  # per time bin: average throughput (fraction of ideal) in the bin
    goodput: np.ndarray  # at each bin end: useful work so far / ideal work so far
    lost_work: np.ndarray  # at each bin end: ideal - useful work so far, in hours of the whole job
    spares_needed: np.ndarray  # per time bin: most spare domains needed at any moment in the bin


class _Run:
    """Mutable state of one replay; methods are the few things that happen to a job."""

    def __init__(self, cap: float, interval_h: float, rollback: bool):
        self.t = 0.0
        self.cap = cap
        self.interval = interval_h
        self.rollback = rollback
        self.pause_until = 0.0
        self.anchor = 0.0  # checkpoints happen at anchor + m * interval while running
        self.work = 0.0
        self.since_ckpt = 0.0
        self.lost_capacity = 0.0
        self.lost_pause = 0.0
        self.bp_t = [0.0]  # breakpoints of the effective (pause-aware) throughput
        self.bp_r = [cap]
        self.rb_t: list[float] = []
        self.rb_w: list[float] = []

    def advance(self, t: float) -> None:
        dt = t - self.t
        self.lost_capacity += (1.0 - self.cap) * dt
        run_from = max(self.t, self.pause_until)
        if self.pause_until > self.t:
            self.lost_pause += self.cap * (min(self.pause_until, t) - self.t)
        if run_from < t:
            if self.pause_until > self.t:
                self._breakpoint(self.pause_until, self.cap)
            self.work += self.cap * (t - run_from)
            if self.rollback:
                last_ckpt = self.anchor + math.floor((t - self.anchor) / self.interval) * self.interval
                if last_ckpt > run_from:
                    self.since_ckpt = self.cap * (t - last_ckpt)
                else:
                    self.since_ckpt += self.cap * (t - run_from)
        self.t = t

    def interrupt(self, pause_h: float) -> None:
        if self.rollback and self.since_ckpt > 0:
            self.rb_t.append(self.t)
            self.rb_w.append(self.since_ckpt)
            self.since_ckpt = 0.0
        self.pause_until = self.t + pause_h
        self.anchor = self.pause_until

    def set_capacity(self, cap: float) -> None:
        self.cap = cap
        self._breakpoint(self.t, cap if self.t >= self.pause_until else 0.0)

    def _breakpoint(self, t: float, r: float) -> None:
        if t == self.bp_t[-1]:
            self.bp_r[-1] = r
        else:
            self.bp_t.append(t)
            self.bp_r.append(r)


def _interrupts(trace: Trace, i: int, ev: StateEval, counts: np.ndarray, lay: Layout, rate: np.ndarray) -> bool:
    """Does failure step ``i`` touch GPUs the job is running on (judged on the state before the step)?

    A job GPU counts when its replica runs, unless its domain is already bad and was swapped for a spare.
    A spare domain counts when it is in use: spares are interchangeable, so a healthy one is in use with
    probability used / healthy, decided by the trace's uniform draw for the step.
    """
    g = lay.groups_per_domain
    spare_hits = set()  # spare domains that were healthy before this step
    for j in trace.groups[trace.ptr[i] : trace.ptr[i + 1]].tolist():
        if j >= lay.job_groups:
            first = j - (j - lay.job_groups) % g
            if not counts[first : first + g].any():
                spare_hits.add(first)
            continue
        r = j // lay.pp
        if ev.running is not None and not ev.running[r]:
            continue
        d = j // g
        if ev.swapped is not None and ev.swapped[r] and (rate[counts[d * g : (d + 1) * g]] < 1.0 - EPS).any():
            continue
        return True
    if not spare_hits or ev.spares_used == 0:
        return False
    return trace.u[i] < 1.0 - (1.0 - ev.spares_used / ev.healthy_spares) ** len(spare_hits)


class _Tracked:
    """One strategy's replay: its run state, current evaluation and series of spares needed."""

    def __init__(self, strategy: Strategy, ev: StateEval, interval_h: float):
        self.strategy = strategy
        self.key = strategy.rate.tobytes()  # strategies with equal rate tables share a ReplicaState
        self.ev = ev
        self.run = _Run(ev.capacity, interval_h, strategy.rollback)
        self.need_t = [0.0]
        self.need_v = [ev.spares_needed]
        self.min_cap = ev.capacity
        self.interruptions = 0


def replay(
    trace: Trace,
    layout: Layout,
    strategies: list[Strategy],
    batch_policy: str,
    horizon_h: float,
    interval_h: float,
    bins: int,
) -> dict[str, TrialResult]:
    """Replay the trace under every strategy in one pass; strategies sharing a rate table share its state."""
    counts = trace.initial.copy()
    states = {s.rate.tobytes(): ReplicaState(layout, s.rate) for s in strategies}
    degr = {key: st.reset(counts) for key, st in states.items()}
    tracked = [_Tracked(s, evaluate(degr[s.rate.tobytes()], s, batch_policy), interval_h) for s in strategies]
    times, is_failure, ptr = trace.times.tolist(), trace.is_failure.tolist(), trace.ptr
    for i, t in enumerate(times):
        hits = [is_failure[i] and _interrupts(trace, i, tr.ev, counts, layout, tr.strategy.rate) for tr in tracked]
        groups, deltas = trace.groups[ptr[i] : ptr[i + 1]], trace.deltas[ptr[i] : ptr[i + 1]]
        counts[groups] += deltas
        degr = {key: st.update(counts, groups, deltas) for key, st in states.items()}
        for tr, hit in zip(tracked, hits):
            tr.run.advance(t)
            tr.ev = evaluate(degr[tr.key], tr.strategy, batch_policy)
            if hit:
                tr.interruptions += 1
                tr.run.interrupt(tr.strategy.pause_h)
            tr.run.set_capacity(tr.ev.capacity)
            tr.min_cap = min(tr.min_cap, tr.ev.capacity)
            tr.need_t.append(t)
            tr.need_v.append(tr.ev.spares_needed)
    out = {}
    for tr in tracked:
        tr.run.advance(horizon_h)
        out[tr.strategy.name] = _summarise(tr, horizon_h, bins)
    return out


def _piecewise_integral(bt: np.ndarray, br: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Integral from 0 to each of ``at`` of the step function taking value br[i] on [bt[i], bt[i+1])."""
    cum = np.concatenate(([0.0], np.cumsum(br[:-1] * np.diff(bt))))
    idx = np.searchsorted(bt, at, side="right") - 1
    return cum[idx] + br[idx] * (at - bt[idx])


def _summarise(tr: _Tracked, horizon: float, bins: int) -> TrialResult:
    run, min_cap, interruptions = tr.run, tr.min_cap, tr.interruptions
    need_t, need_v = np.array(tr.need_t), np.array(tr.need_v, dtype=float)
    edges = np.linspace(0.0, horizon, bins + 1)
    done = _piecewise_integral(np.array(run.bp_t), np.array(run.bp_r), edges)
    rb_t, rb_w = np.array(run.rb_t), np.array(run.rb_w)
    rolled = np.concatenate(([0.0], np.cumsum(rb_w)))[np.searchsorted(rb_t, edges, side="right")]
    useful = done - rolled
    need_bins = need_v[np.searchsorted(need_t, edges[:-1], side="right") - 1]
    in_bin = np.minimum((need_t[1:] / horizon * bins).astype(np.int64), bins - 1)
    np.maximum.at(need_bins, in_bin, need_v[1:])
    lost_rollback = float(rb_w.sum())
    summary = {
        "goodput": (run.work - lost_rollback) / horizon,
        "throughput": run.work / horizon,
        "lost_capacity": run.lost_capacity / horizon,
        "lost_pause": run.lost_pause / horizon,
        "lost_rollback": lost_rollback / horizon,
        "max_throughput_loss": 1.0 - min_cap,
        "interruptions_per_day": interruptions / horizon * 24.0,
        "spares_needed_max": float(need_v.max()),
        "spares_needed_mean": float(_piecewise_integral(need_t, need_v, np.array([horizon]))[0] / horizon),
    }
    return TrialResult(
        summary=summary,
        throughput=np.diff(done) / np.diff(edges),
        goodput=useful[1:] / edges[1:],
        lost_work=edges[1:] - useful[1:],
        spares_needed=need_bins,
    )
