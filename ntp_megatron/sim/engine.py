"""Integrates one strategy's time line: work done, pauses, rollbacks and losses, all with numpy.

Between breakpoints the job's capacity is constant, so work is integrated exactly. An interrupting failure
pauses the whole job for the strategy's pause; a further interruption during a pause starts it again, so the
paused time is the union of the intervals ``[t, t + pause]`` (a running maximum over sorted events). Planned
re-packing restarts, and (placement ``packed``) the restarts that re-pack the job at a repair or another step
that does not interrupt it, pause the job the same way but save a checkpoint first. For checkpoint-restart a pause
that begins while the job runs also throws away the work since the last checkpoint; checkpoints are taken
every ``interval`` of running time counted from the end of the last pause, and cost nothing. Work done since
the last checkpoint when the run ends counts as useful.

Losses add up exactly: ``1 - goodput = lost_capacity + lost_pause + lost_rollback`` where
lost_capacity = time-average of (1 - capacity), lost_pause = capacity that sat idle during pauses,
lost_rollback = work thrown away by rollbacks (all as fractions of the ideal work).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_megatron.sim.states import Evaluation
from ntp_megatron.sim.strategies import Strategy


@dataclass
class TrialResult:
    summary: dict[str, float]
    throughput: np.ndarray  # per time bin: average throughput (fraction of ideal) in the bin
    goodput: np.ndarray  # at each bin end: useful work so far / ideal work so far
    lost_work: np.ndarray  # at each bin end: ideal - useful work so far, in hours of the whole job
    spares_needed: np.ndarray  # per time bin: most spare domains needed at any moment in the bin


class StepIntegral:
    """F(x) = integral from 0 to x of a step function that takes ``value[i]`` from ``t[i]`` on."""

    def __init__(self, t: np.ndarray, value: np.ndarray):
        self.t, self.value = t, value
        self.cum = np.concatenate(([0.0], np.cumsum(value[:-1] * np.diff(t))))

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        i = np.maximum(np.searchsorted(self.t, x, side="right") - 1, 0)
        return self.cum[i] + self.value[i] * (np.asarray(x) - self.t[i])


def pause_clusters(times: np.ndarray, pauses: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Union of [times, times + pauses] (times sorted): (start, end, index of the first event) per cluster."""
    ends = times + pauses
    before = np.concatenate(([-np.inf], np.maximum.accumulate(ends)[:-1]))
    first = np.flatnonzero(times >= before)
    return times[first], np.maximum.reduceat(ends, first) if first.size else ends[:0], first


def integrate(
    ev: Evaluation, strategy: Strategy, step_t: np.ndarray, interrupts: np.ndarray, horizon: float,
    interval_h: float, bins: int,
) -> TrialResult:  # fmt: skip
    f = StepIntegral(ev.rows_t, ev.capacity)
    repack = np.zeros(step_t.size, dtype=bool) if ev.repack is None else ev.repack & ~interrupts
    events = interrupts | repack
    times = np.concatenate((step_t[events], ev.restarts))
    pauses = np.concatenate((
        np.where(interrupts[events], strategy.failure_pause_h, strategy.repack_pause_h),
        np.full(ev.restarts.size, strategy.repack_pause_h),
    ))  # fmt: skip
    rolls = np.concatenate((interrupts[events] & strategy.rollback, np.zeros(ev.restarts.size, dtype=bool)))
    order = np.argsort(times, kind="stable")
    a, b, first = pause_clusters(times[order], pauses[order])
    b = np.minimum(b, horizon)
    paused = f(b) - f(a)
    # checkpoint-restart: a pause that starts while the job runs loses the work since the last checkpoint
    anchor = np.concatenate(([0.0], b[:-1]))
    last_ckpt = anchor + np.floor((a - anchor) / interval_h) * interval_h
    rolled = np.where(rolls[order][first], f(a) - f(last_ckpt), 0.0)

    total = float(f(horizon))
    work = total - paused.sum()
    edges = np.linspace(0.0, horizon, bins + 1)
    paused_cum = np.concatenate(([0.0], np.cumsum(paused)))
    done_clusters = np.searchsorted(b, edges, side="right")
    partial = np.zeros(edges.size)
    if a.size:  # the pause under way at an edge counts up to the edge
        nxt = np.minimum(done_clusters, a.size - 1)
        partial = np.where((done_clusters < a.size) & (a[nxt] < edges), f(edges) - f(a[nxt]), 0.0)
    done = f(edges) - paused_cum[done_clusters] - partial
    rolled_by = np.concatenate(([0.0], np.cumsum(rolled)))[np.searchsorted(a, edges, side="right")]
    useful = done - rolled_by

    rows_t, need = ev.rows_t, ev.need.astype(float)
    need_bins = need[np.searchsorted(rows_t, edges[:-1], side="right") - 1]
    inside = rows_t > 0
    np.maximum.at(need_bins, np.minimum((rows_t[inside] / horizon * bins).astype(np.int64), bins - 1), need[inside])
    summary = {
        "goodput": (work - rolled.sum()) / horizon,
        "throughput": work / horizon,
        "lost_capacity": (horizon - total) / horizon,
        "lost_pause": paused.sum() / horizon,
        "lost_rollback": rolled.sum() / horizon,
        "max_throughput_loss": 1.0 - float(ev.capacity[rows_t <= horizon].min()),
        "interruptions_per_day": interrupts.sum() / horizon * 24.0,
        "repacks_per_day": (repack.sum() + ev.restarts.size) / horizon * 24.0,
        "spares_needed_max": float(need.max()),
        "spares_needed_mean": float(StepIntegral(rows_t, need)(horizon)) / horizon,
    }
    return TrialResult(
        summary=summary,
        throughput=np.diff(done) / np.diff(edges),
        goodput=useful[1:] / edges[1:],
        lost_work=edges[1:] - useful[1:],
        spares_needed=need_bins,
    )
