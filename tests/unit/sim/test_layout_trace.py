"""Cluster layout (GPUs -> TP groups -> domains -> replicas) and failure-trace invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.sim.failures import _events, merge_down_intervals, poisson_trace, snapshot_counts
from ntp_megatron.sim.layout import build_layout

from .sim_helpers import config


def test_default_dp_fills_the_cluster_beside_the_spares():
    lay = build_layout(
        config("cluster.gpus=32768", "cluster.tp=32", "cluster.pp=8", "cluster.spare_domains=32").cluster
    )
    assert (lay.dp, lay.job_domains, lay.spare_domains, lay.idle_domains) == (124, 992, 32, 0)
    assert lay.active_gpus == 32768


def test_explicit_dp_leaves_idle_domains_out_of_the_simulation():
    lay = build_layout(config("cluster.gpus=1024", "cluster.domain_size=8", "cluster.tp=8", "cluster.dp=16").cluster)
    assert (lay.job_domains, lay.idle_domains, lay.active_gpus) == (16, 112, 128)


def test_snapshot_fails_exactly_the_requested_gpus():
    lay = build_layout(config("cluster.gpus=4096", "cluster.tp=32").cluster)
    counts = snapshot_counts(lay, 0.01, np.random.default_rng(0))
    assert counts.sum() == 41 and counts.max() <= 32


@settings(max_examples=25, deadline=None)
@given(
    tp=st.sampled_from([2, 4, 8]),
    groups_per_domain=st.sampled_from([1, 2]),
    blast=st.sampled_from(["gpu", "node", "domain"]),
    spares=st.integers(0, 3),
    mtbf=st.floats(50, 2000),
    repair=st.floats(0.5, 100),
    seed=st.integers(0, 10_000),
    warm=st.booleans(),
)
def test_trace_counts_stay_in_range_and_follow_the_blast_radius(
    tp, groups_per_domain, blast, spares, mtbf, repair, seed, warm
):
    domain = tp * groups_per_domain
    cfg = config(
        f"cluster.gpus={domain * (8 + spares)}", f"cluster.domain_size={domain}", f"cluster.tp={tp}",
        f"cluster.spare_domains={spares}", "failures.rate=mtbf", f"failures.mtbf_hours={mtbf}",
        f"failures.blast_radius={blast}", "failures.node_size=2",
        f"failures.classes=[{{name: x, share: 1.0, repair_hours: [{repair}, {2 * repair}]}}]",
    )  # fmt: skip
    lay = build_layout(cfg.cluster)
    trace = poisson_trace(lay, cfg.failures, 200.0, warm, np.random.default_rng(seed))
    unit = {"gpu": 1, "node": 2, "domain": tp}[blast]
    counts = trace.initial.copy()
    assert np.all(counts % unit == 0) and (warm or counts.sum() == 0)
    assert np.all(np.diff(trace.times) >= 0) and np.all((trace.times > 0) & (trace.times <= 200.0))
    for i in range(trace.steps):
        sl = slice(trace.ptr[i], trace.ptr[i + 1])
        deltas = trace.deltas[sl]
        assert np.all(deltas > 0) if trace.is_failure[i] else np.all(deltas < 0)
        counts[trace.groups[sl]] += deltas
        assert counts.min() >= 0 and counts.max() <= tp
        assert np.all(counts % unit == 0)


def _brute_union(unit, start, end):
    """Per unit, walk its events in time order and merge overlapping [start, end) intervals."""
    out = {}
    for u, s, e in sorted(zip(unit.tolist(), start.tolist(), end.tolist())):
        ivs = out.setdefault(u, [])
        if ivs and s <= ivs[-1][1]:
            ivs[-1][1] = max(ivs[-1][1], e)
        else:
            ivs.append([s, e])
    return out


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 60), units=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_merged_down_intervals_match_a_sequential_merge(n, units, seed):
    rng = np.random.default_rng(seed)
    unit = rng.integers(0, units, n)
    start = rng.uniform(-5, 50, n)
    end = start + rng.uniform(0, 10, n)
    u, s, e = merge_down_intervals(unit, start, end)
    got = {}
    for a, b, c in zip(u.tolist(), s.tolist(), e.tolist()):
        got.setdefault(a, []).append([b, c])
    assert got == _brute_union(unit, start, end)


@pytest.mark.parametrize("blast, node", [("gpu", 2), ("node", 2), ("node", 8), ("domain", 2)])
def test_trace_counts_are_the_union_of_the_raw_events(blast, node):
    # the trace's first draws are its raw events: redraw them with the same seed and merge them by brute force
    cfg = config(
        "cluster.gpus=96", "cluster.domain_size=8", "cluster.tp=4", "cluster.spare_domains=2", "failures.rate=mtbf",
        "failures.mtbf_hours=200", f"failures.blast_radius={blast}", f"failures.node_size={node}",
        "failures.classes=[{name: a, share: 0.5, repair_hours: [5, 30]}, {name: b, share: 0.5, repair_hours: [1, 1]}]",
    )  # fmt: skip
    lay = build_layout(cfg.cluster)
    width = {"gpu": 1, "node": node, "domain": 8}[blast]
    trace = poisson_trace(lay, cfg.failures, 100.0, True, np.random.default_rng(5))
    unit, start, end = _events(cfg.failures, lay.active_gpus // width, width, -30.0, 100.0, np.random.default_rng(5))
    merged = _brute_union(unit, start, end)
    for t in np.linspace(0.0, 100.0, 41):
        gpu_down = np.zeros(lay.active_gpus, dtype=np.int64)
        for u, ivs in merged.items():
            if any(a <= t < b for a, b in ivs):
                gpu_down[u * width : (u + 1) * width] = 1
        expected = gpu_down.reshape(-1, lay.tp).sum(axis=1)
        done = np.searchsorted(trace.times, t, side="right")
        counts = trace.initial.copy()
        np.add.at(counts, trace.groups[: trace.ptr[done]], trace.deltas[: trace.ptr[done]])
        assert np.array_equal(counts, expected), t
