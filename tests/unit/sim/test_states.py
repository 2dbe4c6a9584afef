"""Time lines of each placement against a brute-force replay of the trace, step by step in plain Python."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ntp_megatron.sim.calibration import StepTimeRatios
from ntp_megatron.sim.failures import poisson_trace
from ntp_megatron.sim.layout import build_layout
from ntp_megatron.sim.rates import RateTable, drop_table, ntp_table, reduced_tp
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


# ---- packed placement: every row and every step against an explicit sorted list of the pool's TP groups ----


def _chunk_speeds(pool: list[float], pp: int) -> list[float]:
    """Replica speeds of a pool of groups listed fastest first, cut into consecutive chunks of ``pp``."""
    return [min(pool[i : i + pp]) for i in range(0, len(pool) - len(pool) % pp, pp)]


def _packed_brute(counts, h, rate, lay, covers, policy):
    """(capacity, spares needed, spares used, pool, running replicas) of the packed job, from its sorted groups."""
    g, pp, dp = lay.groups_per_domain, lay.pp, lay.dp
    job = sorted((float(rate[c]) for c in counts[: lay.job_groups]), reverse=True)
    need = next(s for s in range(10_000) if sum(_chunk_speeds([1.0] * (s * g) + job, pp)) >= dp - 1e-9)
    if policy == "fixed":
        paused = need > h
        used = 0 if paused else need
        cap = 0.0 if paused else 1.0
        replicas = 0 if paused else (lay.job_groups + used * g) // pp
    else:
        used = min(h, need) if covers else 0
        cap = min(dp, sum(_chunk_speeds([1.0] * (used * g) + job, pp))) / dp
        replicas = dp
    pool = [1.0] * (used * g) + job
    running = 0
    for speed in _chunk_speeds(pool, pp)[:replicas]:
        if speed <= 0:
            break
        running += 1
    return cap, need, used, pool, running


@pytest.mark.parametrize(
    "table, covers, policy",
    [(NTP4 := ntp_table(4, reduced_tp(4), StepTimeRatios(), config().strategies.degraded_speed), False, "shrink"),
     (drop_table(4), False, "shrink"), (drop_table(4), True, "shrink"), (NTP4, False, "fixed"),
     (drop_table(4), False, "fixed")],
    ids=["ntp-shrink", "drop-shrink", "drop-covers", "ntp-fixed", "drop-fixed"],
)  # fmt: skip
def test_packed_time_line_interruptions_and_repacks_match_the_sorted_pool(table, covers, policy):
    # two TP groups per domain, so spares count in groups, not domains; spares short now and then (pauses)
    lay, trace, view = _setup(gpus=192, domain=8, tp=4, pp=3, spares=3, mtbf=1200.0, seed=2)
    assert lay.groups_per_domain == 2
    ev = PackedState(view, table.rate).evaluate(_strategy(table, covers, "packed"), policy)
    states = replay(trace)
    spare_dom = [c[lay.job_groups :].reshape(lay.spare_domains, 2).sum(axis=1) for c in states]
    brute = [_packed_brute(c, int((d == 0).sum()), table.rate, lay, covers, policy) for c, d in zip(states, spare_dom)]
    for row, (cap, need, used, _, _) in enumerate(brute):
        assert (ev.capacity[row], ev.need[row], ev.used[row]) == (pytest.approx(cap), need, used), row
    kinds = set()
    for i in range(trace.steps):
        cap, need, used, pool, running = brute[i]  # the state before step i
        hit = trace.groups[trace.ptr[i] : trace.ptr[i + 1]]
        expected = 0.0
        if trace.is_failure[i]:
            for grp in hit:
                if grp < lay.job_groups:  # a job group: groups of one speed are interchangeable
                    speed = float(table.rate[states[i][grp]])
                    pos = [k for k, s in enumerate(pool) if s == speed and k >= used * 2]
                    expected = max(expected, sum(k < running * lay.pp for k in pos) / len(pos))
                    kinds.add("job")
                elif spare_dom[i][(grp - lay.job_groups) // 2] == 0:  # a healthy spare: in use w.p. used / healthy
                    expected = max(expected, used / max(1, int((spare_dom[i] == 0).sum())))
                    kinds.add("spare")
        assert ev.interrupt_p[i] == pytest.approx(expected), i
        # the job re-packs when a step changes its groups' speeds and with them the packed optimum
        before = sorted(table.rate[states[i][: lay.job_groups]])
        after = sorted(table.rate[states[i + 1][: lay.job_groups]])
        if policy == "fixed":  # ... unless it stands still for want of spares before and after the step
            h_before, h_after = (int((spare_dom[j] == 0).sum()) for j in (i, i + 1))
            standing = need > h_before and brute[i + 1][1] > h_after
            moved = before != after and brute[i + 1][1] != need and not standing
        else:
            moved = before != after and brute[i + 1][0] != pytest.approx(cap)
        assert ev.repack[i] == moved, i
    assert ev.repack.any() and (~trace.is_failure & ev.repack).any()  # repairs re-pack too
    assert kinds == {"job", "spare"}
    # some failures hit a speed level only partly inside running replicas (NTP shrinking: every group runs)
    assert ((ev.interrupt_p > 0) & (ev.interrupt_p < 1)).any() == (table is not NTP4 or policy == "fixed")
    if policy == "fixed":
        assert (ev.capacity == 0).any() and (ev.capacity == 1).any()


def _swap_choices(replicas: list[tuple[float, int]], pp: int) -> tuple[int, list[frozenset]]:
    """Fewest spare groups for a fixed minibatch and every set of replicas swapped in a choice that attains it."""
    best, sets = None, []
    for mask in range(1 << len(replicas)):
        swapped = frozenset(i for i in range(len(replicas)) if mask >> i & 1)
        left = sum(d for i, (d, _) in enumerate(replicas) if i not in swapped)
        total = max(0, math.ceil(left - 1e-9)) * pp + sum(replicas[i][1] for i in swapped)
        if best is None or total < best:
            best, sets = total, [swapped]
        elif total == best:
            sets.append(swapped)
    return best, sets


# a degraded group runs at half speed or a quarter: swapping a slow replica's bad group often beats extra replicas
HALVING = RateTable(np.array([1, 0.5, 0.5, 0.25, 0.25, 0, 0, 0, 0]), np.array([8, 7, 6, 5, 4, 0, 0, 0, 0]), np.ones(9))


@pytest.mark.parametrize("table", [drop_table(8), HALVING], ids=["drop", "halving"])
def test_fixed_minibatch_interruptions_with_replicas_tied_to_their_groups(table):
    # a fixed minibatch: every degraded replica either has its bad groups swapped for spares (then only its
    # healthy groups and the spares run) or keeps them and runs if it can, extra replicas absorbing its deficit
    lay, trace, view = _setup(gpus=256, pp=4, spares=8, mtbf=1200.0, seed=2)
    ev = MapState(view, table.rate, pack=False, restart_every_h=None).evaluate(_strategy(table), "fixed")
    states = replay(trace)
    seen = set()
    for i in np.flatnonzero(trace.is_failure):
        g = int(trace.groups[trace.ptr[i]])
        if g >= lay.job_groups:
            continue
        before = states[i]
        speeds = _replica_speeds(before, table.rate, np.arange(lay.job_groups), lay)
        bad = (table.rate[before[: lay.job_groups]] < 1).reshape(lay.dp, lay.pp).sum(axis=1)
        degraded = [r for r in range(lay.dp) if speeds[r] < 1]
        need, choices = _swap_choices([(1 - speeds[r], int(bad[r])) for r in degraded], lay.pp)
        if ev.need[i] != need:
            continue  # the greedy choice is only an upper bound here (a replica with several bad groups)
        r = g // lay.pp
        if need > view.h_rows[i]:
            case, expected = "paused", 0.0  # for want of spares
        elif r not in degraded:
            case, expected = "healthy replica", 1.0
        elif len({degraded.index(r) in c for c in choices}) == 1:  # every best choice agrees on this replica
            swapped = degraded.index(r) in choices[0]
            ok = before[g] == 0
            case = f"{'swapped' if swapped else 'kept'}, {'healthy' if ok else 'bad'} group"
            expected = float(ok) if swapped else float(speeds[r] > 0)
        else:
            continue
        assert ev.interrupt_p[i] == expected, (i, case)
        seen.add(case)
    assert {"paused", "healthy replica", "swapped, healthy group", "swapped, bad group"} <= seen
    if table is HALVING:
        assert "kept, bad group" in seen


@pytest.mark.parametrize("policy", ["fixed", "shrink"])
def test_tied_replicas_that_never_degrade(policy):
    # a group keeps full speed until all its GPUs fail (never here): no replica is ever degraded, every failure on
    # a job group hits a running replica, and a fixed minibatch needs no spares (this used to raise IndexError)
    lay, trace, view = _setup(mtbf=3000.0)
    table = RateTable(np.array([1.0] * 8 + [0.0]), np.arange(8, -1, -1), np.ones(9))
    ev = MapState(view, table.rate, pack=True, restart_every_h=None).evaluate(_strategy(table, covers=True), policy)
    job_fail = trace.is_failure & np.array([trace.groups[trace.ptr[i]] < lay.job_groups for i in range(trace.steps)])
    assert job_fail.any() and np.all(ev.interrupt_p[job_fail] == 1.0)
    assert np.all(ev.need == 0) and np.all(ev.capacity == 1.0)
