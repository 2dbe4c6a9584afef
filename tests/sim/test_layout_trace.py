"""Cluster layout (GPUs -> TP groups -> domains -> replicas) and failure-trace invariants."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.sim.failures import poisson_trace, snapshot_counts
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


def test_replica_domains_when_stages_straddle_domains():
    # TP4 in 8-GPU domains (2 groups per domain), PP3: replica 0 = groups 0,1,2 -> domains 0,1;
    # replica 1 = groups 3,4,5 -> domains 1,2 (domain 1 is shared)
    lay = build_layout(
        config("cluster.gpus=64", "cluster.domain_size=8", "cluster.tp=4", "cluster.pp=3", "cluster.dp=2").cluster
    )
    assert lay.replica_domains().tolist() == [[0, 1], [1, 2]]


def test_replica_domains_are_padded_when_replicas_share_a_domain():
    lay = build_layout(config("cluster.gpus=72", "cluster.domain_size=72", "cluster.tp=8", "cluster.pp=1").cluster)
    assert lay.dp == 9 and lay.replica_domains().tolist() == [[0]] * 9
    assert lay.domains_for_replicas(np.arange(11)).tolist() == [0] + [1] * 9 + [2]


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
