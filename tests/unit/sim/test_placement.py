"""Packing against exhaustive enumeration: every way to cut TP groups into replicas, on small clusters."""

from __future__ import annotations

import itertools
from collections import Counter
from functools import lru_cache
from math import comb

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.sim.layout import build_layout
from ntp_megatron.sim.placement import levels, pack_order, packed_capacity, packed_need, running_fraction
from ntp_megatron.sim.rates import RateTable
from ntp_megatron.sim.run import _empty_trace
from ntp_megatron.sim.states import MapState, PackedState
from ntp_megatron.sim.strategies import Strategy
from ntp_megatron.sim.trace_view import TraceView

from .sim_helpers import config, run_point, within


def best_replicas(speeds: tuple[float, ...], pp: int, max_replicas: int | None = None) -> float:
    """Brute force: the largest summed speed of disjoint replicas of ``pp`` groups (a replica runs at its slowest)."""

    @lru_cache(maxsize=None)
    def go(rest: tuple[int, ...], left: int) -> float:
        if len(rest) < pp or left == 0:
            return 0.0
        first, others = rest[0], rest[1:]
        best = go(others, left)  # group `first` idles
        for mates in itertools.combinations(range(len(others)), pp - 1):
            chosen = [speeds[first]] + [speeds[others[i]] for i in mates]
            remain = tuple(g for i, g in enumerate(others) if i not in mates)
            best = max(best, min(chosen) + go(remain, left - 1))
        return best

    return go(tuple(range(len(speeds))), len(speeds) if max_replicas is None else max_replicas)


def hist_of(speeds: list[float], table: np.ndarray) -> np.ndarray:
    return np.array([[sum(1 for s in speeds if s == v) for v in table]])


SPEED_SET = [1.0, 0.875, 0.75, 0.5, 0.0]


@settings(max_examples=80, deadline=None)
@given(pp=st.sampled_from([1, 2, 3, 4]), reps=st.integers(1, 3), data=st.data())
def test_sorted_chunks_are_the_best_partition(pp, reps, data):
    speeds = data.draw(st.lists(st.sampled_from(SPEED_SET), min_size=pp * reps, max_size=pp * reps))
    table = np.array(SPEED_SET)
    got = packed_capacity(hist_of(speeds, table), table, pp)[0]
    assert got == pytest.approx(best_replicas(tuple(speeds), pp))


@settings(max_examples=25, deadline=None)  # a brute-force search per example; fresh draws every run
@given(pp=st.sampled_from([1, 2, 3]), per_domain=st.sampled_from([1, 2, 3]), reps=st.integers(1, 3), data=st.data())
def test_packed_need_is_the_fewest_spare_domains_by_brute_force(pp, per_domain, reps, data):
    speeds = data.draw(st.lists(st.sampled_from(SPEED_SET), min_size=pp * reps, max_size=pp * reps))
    table = np.array(SPEED_SET)
    brute = next(
        s for s in range(pp * reps + 2)
        if best_replicas(tuple(speeds + [1.0] * (s * per_domain)), pp) >= reps - 1e-9
    )  # fmt: skip
    assert packed_need(hist_of(speeds, table), table, pp, per_domain, reps)[0] == brute


@settings(max_examples=60, deadline=None)
@given(pp=st.sampled_from([1, 2, 3]), reps=st.integers(1, 4), front=st.integers(0, 4), data=st.data())
def test_running_fraction_counts_positions_inside_running_replicas(pp, reps, front, data):
    speeds = sorted(data.draw(st.lists(st.sampled_from(SPEED_SET), min_size=pp * reps, max_size=pp * reps)), reverse=True)
    used = data.draw(st.integers(0, reps + 2))
    table = np.array(SPEED_SET)
    pool = [1.0] * front + speeds  # spares first, then the job's groups, fastest first
    chunks = [pool[i : i + pp] for i in range(0, len(pool) - len(pool) % pp, pp)]
    running = set()
    for c, chunk in enumerate(chunks[:used]):
        if min(chunk) <= 0:
            break
        running.update(range(c * pp, (c + 1) * pp))
    hist = hist_of(speeds, table)
    for lvl, v in enumerate(SPEED_SET):
        pos = [front + i for i, s in enumerate(speeds) if s == v]
        if not pos:
            continue
        expected = sum(p in running for p in pos) / len(pos)
        got = running_fraction(hist, table, pp, np.array([lvl]), np.array([front]), np.array([used]))[0]
        assert got == pytest.approx(expected)


def test_pack_order_puts_the_worst_groups_in_the_first_replicas():
    lev = np.array([0, 2, 0, 1, 0, 2])
    assert pack_order(lev).tolist() == [1, 5, 3, 0, 2, 4]


def test_levels_are_distinct_speeds_fastest_first():
    lev, speeds = levels(np.array([1.0, 0.75, 0.75, 0.5, 0.0]))
    assert lev.tolist() == [0, 1, 1, 2, 3] and speeds.tolist() == [1.0, 0.75, 0.5, 0.0]


# 16 GPUs in 8 two-GPU domains, TP2 x PP2: 4 replicas. Three GPUs fail; all C(16, 3) = 560 placements enumerated.
TINY = ("cluster.gpus=16", "cluster.domain_size=2", "cluster.tp=2", "cluster.pp=2")
TINY_RATES = (("dp_drop", [1.0, 0.0, 0.0]), ("ntp", [1.0, 0.5, 0.0]))


@pytest.mark.parametrize("name, rate", TINY_RATES, ids=[n for n, _ in TINY_RATES])
def test_packed_capacity_of_every_placement_of_three_failed_gpus(name, rate):
    # every one of the 560 placements, through the simulator's packed and packed-at-start models, against the
    # best partition of the 8 groups into 4 replicas found by brute force
    lay = build_layout(config(*TINY).cluster)
    table = np.array(rate)
    strat = Strategy(name, RateTable(table, np.array([2, 1, 0]), np.ones(3)), False, 0.0, False, "packed", 0.0, None)
    placements = list(itertools.combinations(range(16), 3))
    assert len(placements) == comb(16, 3) == 560
    # What the models see of a placement is its failed-GPU count per domain: the 560 placements give 112 distinct
    # counts (56 with three hit domains, each from 8 placements; 56 with a domain hit twice, each from 2), each
    # checked once and counted with its placements in the mean.
    by_counts = Counter(tuple(np.bincount(np.array(failed) // 2, minlength=8)) for failed in placements)
    assert len(by_counts) == 112 and sum(by_counts.values()) == 560
    total = 0.0
    for counts, placements_of_counts in by_counts.items():
        view = TraceView(_empty_trace(np.array(counts)), lay, 0.0)
        best = best_replicas(tuple(rate[k] for k in counts), 2) / 4
        assert PackedState(view, table).evaluate(strat, "shrink").capacity[0] == pytest.approx(best), counts
        assert MapState(view, table, True, None).evaluate(strat, "shrink").capacity[0] == pytest.approx(best), counts
        total += best * placements_of_counts
    # and the snapshot runs draw placements uniformly: their mean is the exact average over all 560
    trials = 1000
    p = run_point(
        *TINY, "failures.mode=snapshot", "failures.fraction=0.1875", f"run.trials={trials}",
        f"strategies.enabled=[{name}]", "strategies.degraded_speed.model=continuous", f"strategies.placement.{name}=packed",
    )  # fmt: skip
    assert p.extra["failed_gpus"] == 3
    cap = p.summaries[name]["capacity"]
    assert within(cap["mean"], total / 560, cap["std"] / np.sqrt(trials)), (cap["mean"], total / 560)


def test_packed_on_restart_is_packed_in_a_snapshot_and_fixed_is_not():
    common = (*TINY, "failures.mode=snapshot", "failures.fraction=0.1875", "run.trials=200", "strategies.enabled=[dp_drop]")
    packed = run_point(*common, "strategies.placement.dp_drop=packed")
    on_restart = run_point(*common, "strategies.placement.dp_drop=packed_on_restart")
    fixed = run_point(*common, "strategies.placement.dp_drop=fixed")
    assert on_restart.summaries["dp_drop"]["capacity"] == packed.summaries["dp_drop"]["capacity"]
    assert fixed.summaries["dp_drop"]["capacity"]["mean"] < packed.summaries["dp_drop"]["capacity"]["mean"]
