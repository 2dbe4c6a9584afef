"""Each strategy's model on its own: rate tables, power boost, calibration, spares arithmetic."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.config_io import ConfigError
from ntp_megatron.sim.calibration import StepTimeRatios, load_calibration
from ntp_megatron.sim.config import Boost
from ntp_megatron.sim.layout import Layout
from ntp_megatron.sim.strategies import (
    Degradation,
    Strategy,
    boost_rates,
    dp_drop_rates,
    evaluate,
    ntp_rates,
    perf_at,
    reduced_tp,
    spares_needed,
)


def test_dp_drop_table_is_all_or_nothing():
    assert dp_drop_rates(4).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_reduced_tp_with_allowed_degrees_of_the_nvl32_study():
    # TP32 may only shrink to 30 or 28: 1-2 failures -> 30, 3-4 -> 28, 5+ -> replica out
    assert reduced_tp(32, allowed=[32, 30, 28])[:7].tolist() == [32, 30, 30, 28, 28, 0, 0]


def test_reduced_tp_with_min_tp():
    assert reduced_tp(8, min_tp=5).tolist() == [8, 7, 6, 5, 0, 0, 0, 0, 0]


def test_ntp_ideal_rate_is_fraction_of_surviving_gpus():
    rates = ntp_rates(8, reduced_tp(8), StepTimeRatios())
    assert np.allclose(rates, [(8 - k) / 8 for k in range(9)])


def test_boost_full_speed_while_speedup_fits_else_proportional():
    boost = Boost(max_power=1.3)  # performance = power ** 0.5 -> 1.1402 at +30 %
    perf = math.sqrt(1.3)
    rates = boost_rates(32, reduced_tp(32, allowed=[32, 30, 28]), StepTimeRatios(), boost)
    assert rates[1] == 1.0 and rates[2] == 1.0  # TP30 needs 32/30 = 1.067 <= 1.140
    assert rates[3] == pytest.approx(perf * 28 / 32)  # TP28 needs 1.143 > 1.140: slower in proportion
    assert rates[5] == 0.0


def test_perf_table_curve_is_interpolated_and_held():
    boost = Boost.model_validate({"max_power": 1.3, "curve": {"kind": "table", "points": [[1.0, 1.0], [1.2, 1.1]]}})
    assert perf_at(boost, 1.1) == pytest.approx(1.05)
    assert perf_at(boost, 1.3) == pytest.approx(1.1)


@settings(max_examples=40, deadline=None)
@given(
    tp=st.integers(1, 72),
    min_tp=st.integers(1, 72),
    alpha=st.floats(0.05, 1.0),
    power=st.floats(1.0, 2.0),
)
def test_tables_are_ordered_dp_drop_le_ntp_le_boost(tp, min_tp, alpha, power):
    min_tp = min(min_tp, tp)
    eff = reduced_tp(tp, min_tp=min_tp)
    drop = dp_drop_rates(tp)
    ntp = ntp_rates(tp, eff, StepTimeRatios())
    boosted = boost_rates(
        tp, eff, StepTimeRatios(), Boost(max_power=power, curve={"kind": "power_law", "alpha": alpha})
    )
    for table in (drop, ntp, boosted):
        assert table[0] == 1.0
        assert np.all((table >= 0) & (table <= 1))
        assert np.all(np.diff(table) <= 1e-12)  # more failures never help
    assert np.all(drop <= ntp + 1e-12) and np.all(ntp <= boosted + 1e-12)


def test_calibrated_ratio_used_and_missing_pairs_fall_back_with_a_note(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"degraded_step_time_ratio": {"32": {"30": 1.1}}, "gpu": "B200"}))
    ratios = load_calibration(path)
    rates = ntp_rates(32, reduced_tp(32, allowed=[32, 30, 28]), ratios)
    assert rates[1] == pytest.approx(1 / 1.1)
    assert rates[3] == pytest.approx(28 / 32)
    assert any("32->28" in n for n in ratios.notes())


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("not json", "not valid JSON"),
        ('{"other": 1}', "degraded_step_time_ratio"),
        ('{"degraded_step_time_ratio": {"8": {"9": 1.2}}}', "reduced TP 9"),
        ('{"degraded_step_time_ratio": {"8": {"4": -1}}}', "must be > 0"),
        ('{"degraded_step_time_ratio": {"8": {"four": 1.5}}}', "degraded_step_time_ratio"),
    ],
)
def test_bad_calibration_is_a_one_line_config_error(tmp_path, content, fragment):
    path = tmp_path / "bench.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=fragment) as info:
        load_calibration(path)
    assert "\n" not in str(info.value)


def _layout(tp=32, pp=8, dp=16, domain=32, spares=0) -> Layout:
    return Layout(tp=tp, pp=pp, dp=dp, domain_size=domain, spare_domains=spares, idle_domains=0)


def _extra(layout: Layout) -> np.ndarray:
    return layout.domains_for_replicas(np.arange(layout.dp + 2))


def test_spares_dropped_replicas_are_restored_by_swapping_their_domain():
    lay = _layout()  # a replica is 8 domains; swapping the one bad domain is cheaper
    assert spares_needed(np.ones(3), np.ones(3, dtype=int), _extra(lay)) == 3


def test_spares_small_deficits_are_cheaper_to_absorb_with_an_extra_replica():
    lay = _layout()
    # 10 replicas at TP30 (deficit 1/16 each): swap 10 domains, or add 1 replica of 8 domains -> 8
    assert spares_needed(np.full(10, 1 / 16), np.ones(10, dtype=int), _extra(lay)) == 8
    # 20 of them (1.25 replicas of deficit): 1 extra replica + 4 swaps = 12 beats 20 swaps or 2 replicas
    assert spares_needed(np.full(20, 1 / 16), np.ones(20, dtype=int), _extra(lay)) == 12


def test_spares_replicas_smaller_than_a_domain_share_one_spare_domain():
    lay = _layout(tp=8, pp=1, dp=90, domain=72)  # 9 replicas fit in one spare domain
    assert spares_needed(np.ones(5), np.ones(5, dtype=int), _extra(lay)) == 1


def test_hot_spares_restore_the_cheapest_replicas_first():
    rep = np.array([0.0, 0.0, 0.0, 1.0])
    d = Degradation(rep, np.array([0, 1, 2]), np.ones(3), np.array([1, 2, 1]), 4, healthy_spares=2)
    hot = Strategy("hot_spares", dp_drop_rates(32), True, 0.0, False)
    ev = evaluate(d, hot, "shrink")
    assert ev.capacity == pytest.approx(3 / 4)  # replicas 0 and 2 (one bad domain each) come back
    assert ev.spares_used == 2
    assert ev.swapped.tolist() == [True, False, True, False]
    drop = Strategy("dp_drop", dp_drop_rates(32), False, 0.0, False)
    assert evaluate(d, drop, "shrink").capacity == pytest.approx(1 / 4)
    assert evaluate(d, drop, "fixed").capacity == 0.0  # 4 needed, 2 healthy: the fixed minibatch pauses
    assert evaluate(Degradation(rep, d.degraded, d.deficit, d.cost, 4, 4), drop, "fixed").capacity == 1.0


def _brute_force_spares(deficit: list[float], cost: list[int], extra: np.ndarray) -> int:
    """Try every set of replicas to restore and every number of extra replicas."""
    best = None
    n = len(deficit)
    for mask in range(1 << n):
        restored = [i for i in range(n) if mask >> i & 1]
        left = sum(deficit) - sum(deficit[i] for i in restored)
        k = max(0, math.ceil(left - 1e-9))
        total = int(extra[k]) + sum(cost[i] for i in restored)
        best = total if best is None else min(best, total)
    return best


@settings(max_examples=60, deadline=None)
@given(
    deficits=st.lists(st.sampled_from([1.0, 0.5, 0.25, 1 / 16, 1 / 8]), min_size=1, max_size=8),
    costs=st.lists(st.integers(1, 3), min_size=8, max_size=8),
    pp_tp=st.sampled_from([(8, 32), (1, 8), (2, 32)]),
)
def test_spares_needed_is_optimal_for_single_domain_replicas_and_an_upper_bound_otherwise(deficits, costs, pp_tp):
    pp, tp = pp_tp
    lay = _layout(tp=tp, pp=pp, dp=16, domain=32)
    d = np.array(deficits)
    ones = np.ones(len(d), dtype=int)
    assert spares_needed(d, ones, _extra(lay)) == _brute_force_spares(deficits, ones.tolist(), _extra(lay))
    c = np.array(costs[: len(d)])
    assert spares_needed(d, c, _extra(lay)) >= _brute_force_spares(deficits, c.tolist(), _extra(lay))
