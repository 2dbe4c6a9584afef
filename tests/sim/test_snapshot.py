"""Snapshot mode (a fixed fraction of GPUs failed uniformly at random) against exact hypergeometric values."""

from __future__ import annotations

import itertools
from math import comb, sqrt

import numpy as np
import pytest

from ntp_megatron.sim.calibration import StepTimeRatios
from ntp_megatron.sim.config import Boost
from ntp_megatron.sim.strategies import boost_rates, ntp_rates, reduced_tp

from .sim_helpers import SMALL_CLUSTER, hypergeom_none, run_point, within

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


def test_dp_drop_ntp_and_boost_capacity_match_exact_expectations():
    fraction = 0.04  # 20 of 512 GPUs down: hypergeometric, not binomial, at this size
    p = run_point(
        *SMALL_CLUSTER, "failures.mode=snapshot", f"failures.fraction={fraction}", f"run.trials={TRIALS}",
        "strategies.enabled=[dp_drop, ntp, ntp_boost]", "strategies.boost.max_power=1.1",
    )  # fmt: skip
    n_total, tp, pp, n = 512, 8, 2, round(fraction * 512)
    cdf = _max_count_cdf(n_total, tp, pp, n)
    eff = reduced_tp(tp)
    expected = {
        "dp_drop": hypergeom_none(n_total, tp * pp, n),
        "ntp": _expected_replica_speed(ntp_rates(tp, eff, StepTimeRatios()), cdf),
        "ntp_boost": _expected_replica_speed(boost_rates(tp, eff, StepTimeRatios(), Boost(max_power=1.1)), cdf),
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
        "strategies.enabled=[dp_drop, hot_spares]",
    )  # fmt: skip
    n = round(fraction * 512)
    expected = 64 * (1 - hypergeom_none(512, 8, n))
    need = p.summaries["dp_drop"]["spares_needed"]
    assert within(need["mean"], expected, _stderr(need, TRIALS))
    # with no spare domains, hot spares are exactly DP-drop
    assert p.summaries["hot_spares"] == p.summaries["dp_drop"]
