"""Spare arithmetic against brute force: spares needed, spares restoring replicas, spares that fail."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.sim.calibration import StepTimeRatios
from ntp_megatron.sim.failures import _events, poisson_trace
from ntp_megatron.sim.layout import build_layout
from ntp_megatron.sim.spares import (
    greedy_need,
    greedy_need_groups,
    greedy_order,
    greedy_restore,
    pool_history,
    spares_with_failures,
)
from ntp_megatron.sim.states import build_state
from ntp_megatron.sim.strategies import build_strategies
from ntp_megatron.sim.trace_view import TraceView

from .sim_helpers import config, run_point


def _bins(replicas: list[tuple[float, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(counts as one row, deficits, costs) of the replicas' (deficit, bad groups) bins, in greedy order."""
    keys = sorted(set(replicas))
    d = np.array([k[0] for k in keys])
    c = np.array([float(k[1]) for k in keys])
    n = np.array([[replicas.count(k) for k in keys]], dtype=float)
    o = greedy_order(d, c)
    return n[:, o], d[o], c[o]


def brute_need(replicas: list[tuple[float, int]], pp: int) -> int:
    """Every set of replicas to swap, plus enough extra replicas (pp groups each) for the deficit left."""
    best = None
    for mask in range(1 << len(replicas)):
        swapped = [r for i, r in enumerate(replicas) if mask >> i & 1]
        left = sum(d for d, _ in replicas) - sum(d for d, _ in swapped)
        total = max(0, math.ceil(left - 1e-9)) * pp + sum(c for _, c in swapped)
        best = total if best is None else min(best, total)
    return best


def test_dropped_replicas_are_restored_by_swapping_their_bad_groups():
    n, d, c = _bins([(1.0, 1)] * 3)
    assert greedy_need_groups(n, d, c, pp=8)[0] == 3


def test_small_deficits_are_cheaper_to_absorb_with_an_extra_replica():
    # 10 replicas at TP30 (deficit 1/16): swap 10 groups, or add 1 replica of 8 groups -> 8
    assert greedy_need_groups(*_bins([(1 / 16, 1)] * 10), pp=8)[0] == 8
    # 20 of them (1.25 replicas of deficit): 1 extra replica + 4 swaps = 12 beats 20 swaps or 2 replicas
    assert greedy_need_groups(*_bins([(1 / 16, 1)] * 20), pp=8)[0] == 12


@settings(max_examples=120, deadline=None)
@given(
    deficits=st.lists(st.sampled_from([1.0, 0.5, 0.25, 0.125, 1 / 16, 0.3, 0.0741]), min_size=1, max_size=9),
    costs=st.lists(st.integers(1, 3), min_size=9, max_size=9),
    pp=st.sampled_from([1, 2, 4, 8]),
)
def test_need_is_optimal_with_one_bad_group_per_replica_and_an_upper_bound_otherwise(deficits, costs, pp):
    ones = [(d, 1) for d in deficits]
    assert greedy_need_groups(*_bins(ones), pp=pp)[0] == brute_need(ones, pp)
    mixed = [(d, c) for d, c in zip(deficits, costs)]
    assert greedy_need_groups(*_bins(mixed), pp=pp)[0] >= brute_need(mixed, pp)


@settings(max_examples=80, deadline=None)
@given(
    replicas=st.lists(st.tuples(st.sampled_from([1.0, 0.5, 0.25, 1 / 16, 0.3]), st.integers(1, 3)), min_size=1, max_size=8),
    pp=st.sampled_from([1, 2, 4, 8]),
)
def test_the_swaps_chosen_add_up_to_the_need(replicas, pp):
    # the share of each bin swapped is a choice: whole replicas, and with the extra replicas for the deficit
    # left it costs exactly the need; with one bad group per replica it is one of the best choices
    n, d, c = _bins(replicas)
    need, share = greedy_need(n, d, c, pp)
    swapped = share * n
    assert np.allclose(swapped, np.round(swapped)) and np.all((share >= 0) & (share <= 1))
    left = float(((1 - share) * n * d).sum())
    assert need[0] == round(float((swapped * c).sum())) + pp * max(0, math.ceil(left - 1e-9))
    if all(cc == 1 for _, cc in replicas):
        assert need[0] == brute_need(replicas, pp)


def test_need_rows_are_independent():
    n, d, c = _bins([(1 / 16, 1)] * 20)
    rows = np.concatenate((n, n * 0, n / 2))
    assert greedy_need_groups(rows, d, c, pp=8).tolist() == [12, 0, 8]


@settings(max_examples=60, deadline=None)
@given(
    replicas=st.lists(st.tuples(st.sampled_from([1.0, 0.5, 0.125]), st.integers(1, 3)), min_size=1, max_size=7),
    budget=st.integers(0, 12),
)
def test_restore_swaps_in_greedy_order_while_the_budget_lasts(replicas, budget):
    n, d, c = _bins(replicas)
    recovered, used, share = greedy_restore(n, d, c, np.array([float(budget)]))
    # reference: walk the replicas one by one in the same order, stop at the first that does not fit
    order = sorted(replicas, key=lambda r: (-r[0] / r[1], r[1]))
    spent, rec = 0, 0.0
    for dd, cc in order:
        if spent + cc > budget:
            break
        spent, rec = spent + cc, rec + dd
    assert used[0] == spent and recovered[0] == pytest.approx(rec)
    assert np.all((share >= 0) & (share <= 1))


def brute_spares(times: list[float], need: list[int], pool_down: list[list[tuple[float, float]]], horizon: float, pct: float):
    """For S = 0, 1, ...: paused time when only the first S pool domains may serve (a domain is down in its intervals)."""
    cuts = sorted({0.0, *times, *(x for d in pool_down for iv in d for x in iv if 0 <= x <= horizon)})
    # every quantity is a right-continuous step function that changes only at cuts: its value on a piece is
    # its value at the piece's start
    starts = cuts
    lens = [b - a for a, b in zip(cuts, cuts[1:] + [horizon])]

    def need_at(t):
        return need[max(i for i, x in enumerate(times) if x <= t)]

    pieces = [(t, ln, need_at(t)) for t, ln in zip(starts, lens) if ln > 0]
    # healthy_first[k][s]: healthy domains among the first s, on piece k
    healthy_first = []
    for t, _, _ in pieces:
        up = [not any(a <= t < b for a, b in d) for d in pool_down]
        healthy_first.append([sum(up[:s]) for s in range(len(pool_down) + 1)])
    paused = {}
    for s in range(len(pool_down) + 1):
        paused[s] = sum(ln for (_, ln, n), h in zip(pieces, healthy_first) if h[s] < n)
    if paused[len(pool_down)] > 0:
        return None  # even the whole pool pauses: the pool cannot tell
    no_pause = min(s for s, p in paused.items() if p == 0)
    at_pct = min(s for s, p in paused.items() if p <= (1 - pct / 100) * horizon + 1e-9)
    return no_pause, at_pct


@settings(max_examples=80, deadline=None)
@given(data=st.data(), pool_size=st.integers(4, 12), pct=st.sampled_from([50.0, 90.0, 99.0]))
def test_spares_with_failures_matches_brute_force(data, pool_size, pct):
    horizon = 100.0
    n_rows = data.draw(st.integers(1, 6))
    times = [0.0] + sorted(data.draw(st.lists(st.floats(0.5, 99.5), min_size=n_rows - 1, max_size=n_rows - 1)))
    need = data.draw(st.lists(st.integers(0, 3), min_size=n_rows, max_size=n_rows))
    downs = []
    for _ in range(pool_size):
        k = data.draw(st.integers(0, 2))
        pts = sorted(data.draw(st.lists(st.floats(0.0, 120.0), min_size=2 * k, max_size=2 * k, unique=True)))
        downs.append([(pts[2 * i], pts[2 * i + 1]) for i in range(k)])
    initial = [j for j, d in enumerate(downs) if d and d[0][0] == 0.0]
    ev = [(a, j, True) for j, d in enumerate(downs) for a, _ in d if a > 0] + [
        (b, j, False) for j, d in enumerate(downs) for _, b in d if b <= horizon
    ]
    pool = pool_history(pool_size, np.array(initial, dtype=np.int64), *(np.array(x) for x in zip(*ev))) if ev else (
        pool_history(pool_size, np.array(initial, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool))
    )  # fmt: skip
    got = spares_with_failures(np.array(times), np.array(need), pool, horizon, pct)
    assert got == brute_spares(times, need, downs, horizon, pct)


def test_spares_with_failures_says_when_the_pool_is_too_small():
    pool = pool_history(3, np.array([0, 1]), np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool))
    assert spares_with_failures(np.array([0.0]), np.array([1]), pool, 10.0, 99.0) == (3, 3)
    assert spares_with_failures(np.array([0.0]), np.array([2]), pool, 10.0, 99.0) is None


def test_failed_spares_push_the_need_deeper_into_the_pool():
    # need 2 all the time; spare 0 is down during [10, 20): the job then needs spares 1 and 2 -> 3 held
    pool = pool_history(6, np.zeros(0, dtype=np.int64), np.array([10.0, 20.0]), np.array([0, 0]), np.array([True, False]))
    assert spares_with_failures(np.array([0.0]), np.array([2]), pool, 100.0, 100.0) == (3, 3)
    assert spares_with_failures(np.array([0.0]), np.array([2]), pool, 100.0, 85.0) == (3, 2)  # down 10 % of the time


# ---- the whole pipeline: trace -> configured spares + virtual pool -> spares that never pause, per trial ----


def _configured_spare_downs(trace, lay) -> list[list[tuple[float, float]]]:
    """Down intervals of each configured spare domain, replaying the trace (-1: down at t = 0, inf: not repaired)."""
    counts = trace.initial.copy()
    per_dom = lambda: counts[lay.job_groups :].reshape(lay.spare_domains, lay.groups_per_domain).sum(axis=1)  # noqa: E731
    down_since = [-1.0 if c > 0 else None for c in per_dom()]
    out: list[list[tuple[float, float]]] = [[] for _ in range(lay.spare_domains)]
    for i in range(trace.steps):
        np.add.at(counts, trace.groups[trace.ptr[i] : trace.ptr[i + 1]], trace.deltas[trace.ptr[i] : trace.ptr[i + 1]])
        for d, c in enumerate(per_dom()):
            if c > 0 and down_since[d] is None:
                down_since[d] = float(trace.times[i])
            elif c == 0 and down_since[d] is not None:
                out[d].append((down_since[d], float(trace.times[i])))
                down_since[d] = None
    for d, since in enumerate(down_since):
        if since is not None:
            out[d].append((since, math.inf))
    return out


def _virtual_domain_downs(cfg, lay, seed: list[int], position: int, warm: bool) -> list[tuple[float, float]]:
    """Pool position >= the configured spares: a domain failing like any other, from the pool's own seed.

    Its raw events are the ones ``_events`` draws for its block of 64 positions (seed [*seed, 0x5BA2E, block]),
    started one longest repair before t = 0 when warm; a domain is down in the union of its events' intervals.
    """
    t0 = -max(k.repair_hours[1] for k in cfg.failures.classes) if warm else 0.0
    rng = np.random.default_rng([*seed, 0x5BA2E, position // 64])
    unit, start, end = _events(cfg.failures, 64, lay.domain_size, t0, HORIZON_E2E, rng)
    mine = sorted((s, e) for u, s, e in zip(unit.tolist(), start.tolist(), end.tolist()) if u == position % 64)
    merged: list[list[float]] = []
    for s, e in mine:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


HORIZON_E2E = 240.0


@pytest.mark.parametrize("warm", [True, False])
def test_spares_that_never_pause_from_the_whole_pipeline_match_a_brute_force(warm):
    overrides = (
        "cluster.gpus=160", "cluster.domain_size=8", "cluster.tp=8", "cluster.pp=2", "cluster.spare_domains=3",
        "failures.rate=mtbf", "failures.mtbf_hours=700", "failures.classes=[{name: x, share: 1.0, repair_hours: [30, 80]}]",
        f"run.duration_days={HORIZON_E2E / 24}", "run.trials=3", "run.seed=11", f"run.warm_start={warm}",
        "run.spares_percentile=80", "strategies.enabled=[dp_drop, ntp]", "strategies.batch_policy=fixed",
    )  # fmt: skip
    p = run_point(*overrides)
    cfg = config(*overrides)
    lay = build_layout(cfg.cluster)
    strategies = build_strategies(cfg, StepTimeRatios())
    brute: dict[str, list[tuple[int, int]]] = {s.name: [] for s in strategies}
    initially_down = 0
    for trial in range(3):
        seed = [11, trial]
        trace = poisson_trace(lay, cfg.failures, HORIZON_E2E, warm, np.random.default_rng(seed))
        view = TraceView(trace, lay, HORIZON_E2E)
        downs = _configured_spare_downs(trace, lay)
        downs += [_virtual_domain_downs(cfg, lay, seed, pos, warm) for pos in range(lay.spare_domains, 48)]
        initially_down += sum(any(a <= 0 < b for a, b in d) for d in downs)
        for s in strategies:
            ev = build_state(view, s).evaluate(s, "fixed")
            brute[s.name].append(brute_spares(ev.rows_t.tolist(), ev.need.tolist(), downs, HORIZON_E2E, 80.0))
    for name, per_trial in brute.items():
        never, at_pct = zip(*per_trial)
        got = p.summaries[name]
        assert (got["spares_no_pause"]["min"], got["spares_no_pause"]["max"]) == (min(never), max(never)), name
        assert (got["spares_at_percentile"]["min"], got["spares_at_percentile"]["max"]) == (min(at_pct), max(at_pct))
        assert max(never) > lay.spare_domains and never != at_pct  # the virtual pool and the percentile matter
    assert (initially_down > 0) == warm
