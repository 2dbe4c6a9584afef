"""Snapshot mode (a fixed fraction of GPUs failed uniformly at random) against exact hypergeometric values."""

from __future__ import annotations

import itertools
from fractions import Fraction
from math import comb, sqrt

import numpy as np
import pytest

from ntp_megatron.sim.calibration import StepTimeRatios
from ntp_megatron.sim.strategies import build_strategies

from .sim_helpers import SMALL_CLUSTER, config, hypergeom_none, run_point, within

FIXED = ("strategies.placement.dp_drop=fixed", "strategies.placement.ntp=fixed", "strategies.placement.ntp_boost=fixed")

TRIALS = 1500


def _stderr(stats: dict[str, float], trials: int) -> float:
    return stats["std"] / sqrt(trials)


@pytest.mark.parametrize(
    "gpus, domain, fraction", [(512, 8, 0.05), (32768, 32, 0.001)], ids=["512-gpus-5pct", "32k-nvl32-0.1pct"]
)
def test_fraction_of_domains_hit(gpus, domain, fraction):
    # n = f*N GPUs fail without replacement; a domain of D GPUs escapes with prob C(N-D, n) / C(N, n)
    trials = 300
    p = run_point(
        "failures.mode=snapshot", f"failures.fraction={fraction}", f"cluster.gpus={gpus}",
        f"cluster.domain_size={domain}", f"cluster.tp={domain}", f"run.trials={trials}",
    )  # fmt: skip
    n = round(fraction * gpus)
    expected = 1 - hypergeom_none(gpus, domain, n)
    hit = p.extra["domains_hit_fraction"]
    assert within(hit["mean"], expected, _stderr(hit, trials))
    assert p.extra["failed_gpus"] == n


def _max_count_cdf(n_total: int, tp: int, pp: int, n_failed: int) -> np.ndarray:
    """F[m] = P(no TP group of a replica (pp groups of tp GPUs) has more than m failed GPUs), exactly."""
    rest = n_total - tp * pp
    denom = comb(n_total, n_failed)
    pmf = {}
    for ks in itertools.product(range(tp + 1), repeat=pp):
        if sum(ks) <= n_failed:
            w = comb(rest, n_failed - sum(ks))
            for k in ks:
                w *= comb(tp, k)
            pmf[max(ks)] = pmf.get(max(ks), 0) + w
    return np.cumsum([pmf.get(m, 0) / denom for m in range(tp + 1)])


def _expected_replica_speed(rate: np.ndarray, cdf: np.ndarray) -> float:
    """A replica runs at rate[max failed in any of its groups] (tables never rise with k)."""
    pmf = np.diff(np.concatenate(([0.0], cdf)))
    return float((rate * pmf).sum())


@pytest.mark.parametrize("speed", ["integer_batch", "continuous"])
def test_fixed_placement_capacity_matches_exact_expectations(speed):
    fraction = 0.04  # 20 of 512 GPUs down: hypergeometric, not binomial, at this size
    overrides = (
        *SMALL_CLUSTER, "failures.mode=snapshot", f"failures.fraction={fraction}", f"run.trials={TRIALS}",
        "strategies.enabled=[dp_drop, ntp, ntp_boost]", "strategies.boost.max_power=1.1", *FIXED,
        f"strategies.degraded_speed.model={speed}", "strategies.degraded_speed.local_batch=5",
    )  # fmt: skip
    p = run_point(*overrides)
    n_total, tp, pp, n = 512, 8, 2, round(fraction * 512)
    cdf = _max_count_cdf(n_total, tp, pp, n)
    rates = {s.name: s.table.rate for s in build_strategies(config(*overrides), StepTimeRatios())}
    expected = {
        "dp_drop": hypergeom_none(n_total, tp * pp, n),
        "ntp": _expected_replica_speed(rates["ntp"], cdf),
        "ntp_boost": _expected_replica_speed(rates["ntp_boost"], cdf),
    }
    assert expected["dp_drop"] == pytest.approx(cdf[0])
    for name, value in expected.items():
        cap = p.summaries[name]["capacity"]
        assert within(cap["mean"], value, _stderr(cap, TRIALS)), (name, cap["mean"], value)


def test_ntp_loses_exactly_the_failed_gpus_with_pp1_and_any_tp_allowed():
    # with one TP group per replica and every TP allowed, capacity = surviving GPUs / GPUs in every draw
    p = run_point(
        "failures.mode=snapshot", "failures.fraction=0.01", "cluster.gpus=4096", "cluster.domain_size=8",
        "cluster.tp=8", "run.trials=20", "strategies.enabled=[ntp]",
    )  # fmt: skip
    cap = p.summaries["ntp"]["capacity"]
    assert cap["min"] == pytest.approx(1 - round(0.01 * 4096) / 4096)
    assert cap["max"] == pytest.approx(cap["min"])


def test_dp_drop_spares_needed_is_the_number_of_hit_domains():
    fraction = 0.02
    p = run_point(
        *SMALL_CLUSTER, "failures.mode=snapshot", f"failures.fraction={fraction}", f"run.trials={TRIALS}",
        "strategies.enabled=[dp_drop, hot_spares]", "strategies.placement.dp_drop=fixed",
    )  # fmt: skip
    n = round(fraction * 512)
    expected = 64 * (1 - hypergeom_none(512, 8, n))
    need = p.summaries["dp_drop"]["spares_needed"]
    assert within(need["mean"], expected, _stderr(need, TRIALS))
    # with no spare domains, hot spares are exactly DP-drop; the pool that never pauses holds at least the need
    assert p.summaries["hot_spares"] == p.summaries["dp_drop"]
    assert p.summaries["dp_drop"]["spares_no_pause"]["min"] >= p.summaries["dp_drop"]["spares_needed"]["min"]


def _healthy_groups_pmf(n_total: int, groups: int, size: int, n_failed: int) -> list[Fraction]:
    """P(exactly h of ``groups`` fixed groups of ``size`` GPUs have no failed GPU), by inclusion-exclusion."""
    denom = comb(n_total, n_failed)
    at_least = [Fraction(comb(groups, m) * comb(n_total - m * size, n_failed), denom) for m in range(groups + 1)]
    return [sum((-1) ** (m - h) * comb(m, h) * at_least[m] for m in range(h, groups + 1)) for h in range(groups + 1)]


def test_packed_dp_drop_keeps_every_full_replica_of_healthy_groups():
    # packed DP-drop runs floor(healthy groups / pp) replicas: E[floor(H / 2)] / 32 with H's exact law
    fraction = 0.04
    p = run_point(
        *SMALL_CLUSTER, "failures.mode=snapshot", f"failures.fraction={fraction}", f"run.trials={TRIALS}",
        "strategies.enabled=[dp_drop]", "strategies.placement.dp_drop=packed",
    )  # fmt: skip
    pmf = _healthy_groups_pmf(512, 64, 8, round(fraction * 512))
    assert sum(pmf) == 1
    expected = float(sum(w * (h // 2) for h, w in enumerate(pmf))) / 32
    cap = p.summaries["dp_drop"]["capacity"]
    assert within(cap["mean"], expected, _stderr(cap, TRIALS)), (cap["mean"], expected)
    assert cap["mean"] > hypergeom_none(512, 16, 20)  # packing beats a fixed placement


def test_spares_are_infinite_when_spare_domains_are_almost_never_healthy():
    p = run_point(
        "failures.mode=snapshot", "failures.fraction=0.5", "cluster.gpus=1024", "run.trials=2",
        "strategies.enabled=[dp_drop]",
    )  # fmt: skip
    assert p.summaries["dp_drop"]["spares_no_pause"]["min"] == float("inf")
    assert p.summaries["dp_drop"]["spares_needed"]["max"] < float("inf")
