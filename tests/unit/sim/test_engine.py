"""The vectorised integration (pauses, rollbacks, losses, series) against a plain event-by-event reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.sim.engine import integrate, pause_clusters
from ntp_megatron.sim.rates import drop_table
from ntp_megatron.sim.states import Evaluation
from ntp_megatron.sim.strategies import Strategy


class Reference:
    """One job walked through time: capacity changes, interruptions (pause, maybe rollback) and checkpoints."""

    def __init__(self, cap: float, interval: float):
        self.t, self.cap, self.interval = 0.0, cap, interval
        self.pause_until = self.anchor = 0.0
        self.work = self.since_ckpt = self.lost_cap = self.lost_pause = self.rolled = 0.0

    def advance(self, t: float) -> None:
        self.lost_cap += (1 - self.cap) * (t - self.t)
        if self.pause_until > self.t:
            self.lost_pause += self.cap * (min(self.pause_until, t) - self.t)
        run_from = max(self.t, self.pause_until)
        if run_from < t:
            self.work += self.cap * (t - run_from)
            last = self.anchor + math.floor((t - self.anchor) / self.interval) * self.interval
            self.since_ckpt = self.cap * (t - last) if last > run_from else self.since_ckpt + self.cap * (t - run_from)
        self.t = t

    def pause(self, length: float, rollback: bool) -> None:
        if rollback:
            self.rolled += self.since_ckpt
        self.since_ckpt = 0.0  # rolled back, or (planned restart) saved first
        self.pause_until = max(self.pause_until, self.t + length)
        self.anchor = self.pause_until


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    pause=st.floats(0.0, 3.0),
    repack=st.floats(0.0, 3.0),
    rollback=st.booleans(),
    interval=st.floats(0.3, 5.0),
    packed=st.booleans(),
)
def test_integration_matches_the_event_by_event_reference(data, pause, repack, rollback, interval, packed):
    horizon = 50.0
    n = data.draw(st.integers(0, 25))
    step_t = np.sort(np.array(data.draw(st.lists(st.floats(0.01, 49.99), min_size=n, max_size=n))))
    restarts = np.sort(np.array(data.draw(st.lists(st.floats(0.01, 49.99), max_size=4))))
    rows_t = np.sort(np.concatenate(([0.0], step_t, restarts)))
    cap = np.array(data.draw(st.lists(st.floats(0.0, 1.0), min_size=rows_t.size, max_size=rows_t.size)))
    interrupts = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    need = np.array(data.draw(st.lists(st.integers(0, 9), min_size=rows_t.size, max_size=rows_t.size)))
    # placement packed: some steps that do not interrupt re-pack the job (a restart that saves first)
    repacks = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool) & packed
    if packed:
        restarts = restarts[:0]
        rows_t = np.concatenate(([0.0], step_t))
        cap, need = cap[: rows_t.size], need[: rows_t.size]
    ev = Evaluation(rows_t, cap, need, need * 0, np.zeros(n), restarts, repacks)
    placement = "packed" if packed else "packed_on_restart" if restarts.size else "fixed"
    strat = Strategy("x", drop_table(2), False, pause, rollback, placement, repack, 1.0)
    failure_pause = max(pause, repack) if packed else pause  # a packed job restarts to re-form
    got = integrate(ev, strat, step_t, interrupts, horizon, interval, bins=7)

    ref = Reference(cap[0], interval)
    events = sorted(
        [(t, 0, i) for i, t in enumerate(step_t)] + [(t, 1, i) for i, t in enumerate(restarts)]
    )  # a step and a restart at one time: the step first, as the rows are ordered
    row = 0
    edges = np.linspace(0, horizon, 8)
    done_at, rolled_at = [], []
    e = 0
    for t, kind, i in events + [(horizon + 1, 2, 0)]:
        while e < edges.size and edges[e] <= min(t, horizon):
            ref.advance(edges[e])
            done_at.append(ref.work)
            rolled_at.append(ref.rolled)
            e += 1
        if kind == 2:
            break
        ref.advance(t)
        row += 1
        if kind == 0 and interrupts[i]:
            ref.pause(failure_pause, rollback)
        elif kind == 0 and repacks[i]:
            ref.pause(repack, False)
        elif kind == 1:
            ref.pause(repack, False)
        ref.cap = cap[row]
    s = got.summary
    assert s["throughput"] == pytest.approx(ref.work / horizon, abs=1e-9)
    assert s["lost_capacity"] == pytest.approx(ref.lost_cap / horizon, abs=1e-9)
    assert s["lost_pause"] == pytest.approx(ref.lost_pause / horizon, abs=1e-9)
    assert s["lost_rollback"] == pytest.approx(ref.rolled / horizon, abs=1e-9)
    assert s["goodput"] == pytest.approx((ref.work - ref.rolled) / horizon, abs=1e-9)
    assert 1 - s["goodput"] == pytest.approx(s["lost_capacity"] + s["lost_pause"] + s["lost_rollback"], abs=1e-9)
    useful = np.array(done_at) - np.array(rolled_at)
    assert np.allclose(got.throughput, np.diff(done_at) / np.diff(edges), atol=1e-9)
    assert np.allclose(got.goodput, useful[1:] / edges[1:], atol=1e-9)
    assert s["spares_needed_max"] == need.max()
    assert s["repacks_per_day"] == pytest.approx(((repacks & ~interrupts).sum() + restarts.size) / horizon * 24)


def test_pause_clusters_merge_overlapping_pauses():
    a, b, first = pause_clusters(np.array([1.0, 1.5, 4.0, 4.05]), np.array([1.0, 1.0, 0.1, 1.0]))
    assert a.tolist() == [1.0, 4.0] and b.tolist() == [2.5, 5.05] and first.tolist() == [0, 2]
