"""Shared test helpers: run configs given as dotted overrides, and closed-form probability helpers."""

from __future__ import annotations

from math import comb

from ntp_megatron.sim.config import SimConfig, load
from ntp_megatron.sim.run import PointResult, simulate


def run_point(*overrides: str) -> PointResult:
    _, points = load(None, list(overrides))
    results, _ = simulate(points)
    assert len(results) == 1
    return results[0]


def config(*overrides: str) -> SimConfig:
    base, _ = load(None, list(overrides))
    return base


def hypergeom_none(n_total: int, group: int, n_failed: int) -> float:
    """P(a fixed set of ``group`` GPUs has no failed GPU) when ``n_failed`` of ``n_total`` fail at random."""
    return comb(n_total - group, n_failed) / comb(n_total, n_failed)


def within(value: float, expected: float, stderr: float, sigmas: float = 4.5) -> bool:
    return abs(value - expected) <= sigmas * stderr + 1e-12


# A 512-GPU cluster of 64 eight-GPU domains, TP8 x PP2: small enough for exact combinatorics.
SMALL_CLUSTER = ("cluster.gpus=512", "cluster.domain_size=8", "cluster.tp=8", "cluster.pp=2")
