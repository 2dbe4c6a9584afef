"""Time lines of each placement against a brute-force replay of the trace, step by step in plain Python."""

from __future__ import annotations

import numpy as np
import pytest

from ntp_megatron.sim.calibration import StepTimeRatios
from ntp_megatron.sim.failures import poisson_trace
from ntp_megatron.sim.layout import build_layout
from ntp_megatron.sim.rates import drop_table, ntp_table, reduced_tp
from ntp_megatron.sim.states import MapState, PackedState
from ntp_megatron.sim.strategies import Strategy
from ntp_megatron.sim.trace_view import TraceView

from .sim_helpers import config
from .test_spares import brute_need

HORIZON = 300.0


def _setup(gpus=128, domain=8, tp=8, pp=2, spares=4, mtbf=800.0, seed=0, blast="gpu", node=4):
    cfg = config(
        f"cluster.gpus={gpus}", f"cluster.domain_size={domain}", f"cluster.tp={tp}", f"cluster.pp={pp}",
        f"cluster.spare_domains={spares}", "failures.rate=mtbf", f"failures.mtbf_hours={mtbf}",
        f"failures.blast_radius={blast}", f"failures.node_size={node}",
        "failures.classes=[{name: x, share: 1.0, repair_hours: [20, 60]}]",
    )  # fmt: skip
    lay = build_layout(cfg.cluster)
    trace = poisson_trace(lay, cfg.failures, HORIZON, True, np.random.default_rng(seed))
    return lay, trace, TraceView(trace, lay, HORIZON)


def replay(trace) -> list[np.ndarray]:
    """Counts per group at t = 0 and after every step."""
    counts = trace.initial.copy()
    out = [counts.copy()]
    for i in range(trace.steps):
        for j in range(trace.ptr[i], trace.ptr[i + 1]):
            counts[trace.groups[j]] += trace.deltas[j]
        out.append(counts.copy())
    return out


def _strategy(table, covers=False, placement="fixed", every=None) -> Strategy:
    return Strategy("x", table, covers, 0.0, False, placement, 0.0, every)


def _replica_speeds(counts, rate, order, lay):
    g = rate[counts[: lay.job_groups][order]].reshape(lay.dp, lay.pp)
    return g.min(axis=1)


NTP8 = ntp_table(8, reduced_tp(8), StepTimeRatios(), config().strategies.degraded_speed)


@pytest.mark.parametrize("table", [drop_table(8), NTP8], ids=["drop", "ntp"])
def test_fixed_map_capacity_need_and_interruptions_match_a_replay(table):
    lay, trace, view = _setup()
    ev = MapState(view, table.rate, pack=False, restart_every_h=None).evaluate(_strategy(table), "shrink")
    states = replay(trace)
    ident = np.arange(lay.job_groups)
    for row, counts in enumerate(states):
        speeds = _replica_speeds(counts, table.rate, ident, lay)
        assert ev.capacity[row] == pytest.approx(speeds.mean())
        bad = (table.rate[counts[: lay.job_groups]] < 1).reshape(lay.dp, lay.pp).sum(axis=1)
        replicas = [(1 - s, int(c)) for s, c in zip(speeds, bad) if s < 1]
        brute = brute_need(replicas, lay.pp)
        assert ev.need[row] >= brute and (ev.need[row] == brute or any(c > 1 for _, c in replicas))
    for i in range(trace.steps):
        before = states[i]
        hit = trace.groups[trace.ptr[i] : trace.ptr[i + 1]]
        running = [g < lay.job_groups and _replica_speeds(before, table.rate, ident, lay)[g // lay.pp] > 0 for g in hit]
        assert ev.interrupt_p[i] == float(trace.is_failure[i] and any(running))


def test_packed_capacity_is_the_sorted_chunking_at_every_row_and_beats_fixed():
    lay, trace, view = _setup(pp=4)
    ev = PackedState(view, NTP8.rate).evaluate(_strategy(NTP8, placement="packed"), "shrink")
    fixed = MapState(view, NTP8.rate, pack=False, restart_every_h=None).evaluate(_strategy(NTP8), "shrink")
    for row, counts in enumerate(replay(trace)):
        s = np.sort(NTP8.rate[counts[: lay.job_groups]])[::-1].reshape(lay.dp, lay.pp)
        assert ev.capacity[row] == pytest.approx(s.min(axis=1).mean())
    assert np.all(ev.capacity >= fixed.capacity - 1e-12)


def test_packed_on_restart_re_packs_at_each_planned_restart_and_holds_between():
    lay, trace, view = _setup(pp=4, mtbf=400.0)
    every = 50.0
    ev = MapState(view, NTP8.rate, pack=True, restart_every_h=every).evaluate(_strategy(NTP8, every=every), "shrink")
    assert ev.restarts.tolist() == [50.0, 100.0, 150.0, 200.0, 250.0]
    states = replay(trace)
    times = np.concatenate(([0.0], trace.times))
    for row, t in enumerate(ev.rows_t):
        counts = states[np.searchsorted(times, t, side="right") - 1]
        start = np.floor(t / every) * every  # the last (re)start at or before t
        at_start = states[np.searchsorted(times, start, side="right") - 1]
        order = np.argsort(NTP8.rate[at_start[: lay.job_groups]], kind="stable")  # slowest groups first
        assert ev.capacity[row] == pytest.approx(_replica_speeds(counts, NTP8.rate, order, lay).mean()), t


def test_healthy_spares_follow_the_replay():
    lay, trace, view = _setup(gpus=256, domain=16, tp=8, pp=2, spares=6, mtbf=300.0)
    for row, counts in enumerate(replay(trace)):
        spare = counts[lay.job_groups :].reshape(lay.spare_domains, lay.groups_per_domain).sum(axis=1)
        assert view.h_rows[row] == int((spare == 0).sum())


def test_hot_spares_with_plenty_interrupt_only_on_healthy_groups():
    lay, trace, view = _setup(gpus=256, spares=16, mtbf=2000.0)
    drop = drop_table(8)
    ev = MapState(view, drop.rate, pack=False, restart_every_h=None).evaluate(_strategy(drop, covers=True), "shrink")
    states = replay(trace)
    assert np.all(ev.capacity[view.h_rows >= 8] == 1.0)
    for i in np.flatnonzero(trace.is_failure):
        g = trace.groups[trace.ptr[i]]
        if g < lay.job_groups and view.h_rows[i] >= 8:  # every degraded replica is swapped before the step
            assert ev.interrupt_p[i] == float(states[i][g] == 0)


@pytest.mark.parametrize("blast", ["node", "domain"])
def test_multi_group_blasts_follow_the_replay(blast):
    lay, trace, view = _setup(gpus=256, domain=16, tp=4, pp=3, spares=4, mtbf=1500.0, blast=blast, node=8)
    table = ntp_table(4, reduced_tp(4), StepTimeRatios(), config().strategies.degraded_speed)
    rate = table.rate
    ev = MapState(view, rate, pack=False, restart_every_h=None).evaluate(_strategy(table), "shrink")
    assert trace.ptr.size > 1 and np.diff(trace.ptr).max() > 1  # some steps change several groups
    for row, counts in enumerate(replay(trace)):
        assert ev.capacity[row] == pytest.approx(_replica_speeds(counts, rate, np.arange(lay.job_groups), lay).mean())
