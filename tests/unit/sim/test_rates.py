"""Rate tables: TP re-formation, the integer local-batch rule, power boost, calibration."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.config.files import ConfigError
from ntp_megatron.sim.calibration import StepTimeRatios, load_calibration
from ntp_megatron.plan.power_curve import Boost, perf_at, power_for
from ntp_megatron.sim.config import DegradedSpeed
from ntp_megatron.sim.rates import boost_table, drop_table, ntp_table, reduced_tp

CONTINUOUS = DegradedSpeed(model="continuous")


def batch(b: int) -> DegradedSpeed:
    return DegradedSpeed(model="integer_batch", local_batch=b)


def largest_batch(tp: int, tp_eff: int, local_batch: int) -> int:
    """Brute force in exact arithmetic: the most samples b with b * (tp / tp_eff) <= local_batch (one healthy step)."""
    return max(b for b in range(local_batch + 1) if Fraction(b * tp, tp_eff) <= local_batch)


def largest_batch_at(tp: int, tp_eff: int, local_batch: int, perf: float) -> int:
    """The most samples b with b * (tp / tp_eff) / perf <= local_batch: what a group sped up by ``perf`` finishes."""
    return max(b for b in range(local_batch + 1) if b * tp <= local_batch * tp_eff * perf * (1 + 1e-12))


def test_dp_drop_table_is_all_or_nothing():
    assert drop_table(4).rate.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_reduced_tp_with_allowed_degrees_of_the_nvl32_study():
    # TP32 may only shrink to 30 or 28: 1-2 failures -> 30, 3-4 -> 28, 5+ -> replica out
    assert reduced_tp(32, allowed=[32, 30, 28])[:7].tolist() == [32, 30, 30, 28, 28, 0, 0]


def test_reduced_tp_with_min_tp():
    assert reduced_tp(8, min_tp=5).tolist() == [8, 7, 6, 5, 0, 0, 0, 0, 0]


def test_continuous_rate_is_fraction_of_surviving_gpus():
    rates = ntp_table(8, reduced_tp(8), StepTimeRatios(), CONTINUOUS).rate
    assert np.allclose(rates, [(8 - k) / 8 for k in range(9)])


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(2, 72), local_batch=st.integers(1, 64), data=st.data())
def test_integer_batch_is_the_largest_batch_finished_in_a_healthy_step(tp, local_batch, data):
    k = data.draw(st.integers(0, tp - 1))
    rates = ntp_table(tp, reduced_tp(tp), StepTimeRatios(), batch(local_batch)).rate
    assert rates[k] == pytest.approx(largest_batch(tp, tp - k, local_batch) / local_batch)


def test_integer_batch_examples_of_the_nvl32_study():
    eff = reduced_tp(32, allowed=[32, 30, 28])
    # TP30 finishes 15/16 of a batch: 3 of 4, 7 of 8, 15 of 16 samples; TP28 7/8: 3 of 4, 7 of 8, 14 of 16
    assert ntp_table(32, eff, StepTimeRatios(), batch(4)).rate[:6].tolist() == [1, 0.75, 0.75, 0.75, 0.75, 0]
    assert ntp_table(32, eff, StepTimeRatios(), batch(8)).rate[:6].tolist() == [1, 0.875, 0.875, 0.875, 0.875, 0]
    assert ntp_table(32, eff, StepTimeRatios(), batch(16)).rate[:5].tolist() == [1, 15 / 16, 15 / 16, 14 / 16, 14 / 16]


def test_boost_full_batch_at_least_power_else_integer_batch_at_max_power():
    eff = reduced_tp(32, allowed=[32, 30, 28])
    sqrt_law = Boost(max_power=1.3, curve={"kind": "power_law", "alpha": 0.5})  # 1.3 ** 0.5 = 1.1402
    t = boost_table(32, eff, StepTimeRatios(), sqrt_law, batch(8))
    assert t.rate[1] == 1.0 and t.power[1] == pytest.approx((32 / 30) ** 2)  # TP30 needs 1.0667x -> 1.138x power
    # TP28 needs 32/28 = 1.1429x > 1.1402x: it finishes 7 of 8 samples, which it does at nominal power already
    assert t.rate[3] == pytest.approx(7 / 8) and t.power[3] == 1.0
    assert boost_table(32, eff, StepTimeRatios(), sqrt_law, CONTINUOUS).rate[3] == pytest.approx(math.sqrt(1.3) * 28 / 32)
    default = boost_table(32, eff, StepTimeRatios(), Boost(), batch(8))  # alpha 0.58: TP28 keeps its full batch
    assert default.rate[3] == 1.0 and default.power[3] == pytest.approx((32 / 28) ** (1 / 0.58))
    assert t.rate[5] == 0.0


@settings(max_examples=40, deadline=None)
@given(alpha=st.floats(0.2, 1.0), max_power=st.floats(1.0, 1.5), local_batch=st.integers(1, 16), tp=st.integers(4, 32))
def test_boost_power_is_the_least_that_finishes_the_batch_it_takes(alpha, max_power, local_batch, tp):
    boost = Boost(max_power=max_power, curve={"kind": "power_law", "alpha": alpha})
    t = boost_table(tp, reduced_tp(tp), StepTimeRatios(), boost, batch(local_batch))
    grid = np.linspace(1.0, max_power, 2001)
    for k in range(1, tp):
        # brute force: the most samples any power up to the cap finishes in a healthy step, and the least power
        # that finishes them (exact fractions for the step time at TP tp - k)
        done = [largest_batch_at(tp, tp - k, local_batch, float(x) ** alpha) for x in grid]
        assert t.rate[k] == pytest.approx(max(done) / local_batch), k
        if max(done) > 0:
            least = grid[done.index(max(done))]
            assert least - (grid[1] - grid[0]) - 1e-9 <= t.power[k] <= least + 1e-9, k


def test_default_curve_rests_on_b200_published_points():
    # 4.5 PFLOPS at 1,000 W and 5.0 PFLOPS at 1,200 W (dense FP8): 1.2 ** alpha = 5 / 4.5
    assert perf_at(Boost(), 1.2) == pytest.approx(5.0 / 4.5, rel=2e-3)


@settings(max_examples=40, deadline=None)
@given(alpha=st.floats(0.1, 1.0), perf=st.floats(1.0, 1.5), max_power=st.floats(1.0, 2.0))
def test_power_for_is_the_least_power_reaching_the_performance(alpha, perf, max_power):
    boost = Boost(max_power=max_power, curve={"kind": "power_law", "alpha": alpha})
    p = power_for(boost, perf)
    grid = np.linspace(1.0, max_power, 4001)
    reach = grid[np.array([perf_at(boost, x) for x in grid]) >= perf - 1e-9]
    if p is None:
        assert reach.size == 0 or perf_at(boost, max_power) < perf - 1e-9
    else:
        assert perf_at(boost, p) >= perf - 1e-6 and (reach.size == 0 or p <= reach[0] + 1e-9)


def test_power_for_inverts_a_table_curve():
    boost = Boost.model_validate({"max_power": 1.3, "curve": {"kind": "table", "points": [[1.0, 1.0], [1.2, 1.1]]}})
    assert power_for(boost, 1.05) == pytest.approx(1.1)
    assert power_for(boost, 1.2) is None  # the table is held at 1.1 past 1.2


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
    local_batch=st.integers(1, 32),
    continuous=st.booleans(),
)
def test_tables_are_ordered_dp_drop_le_ntp_le_boost(tp, min_tp, alpha, power, local_batch, continuous):
    min_tp = min(min_tp, tp)
    eff = reduced_tp(tp, min_tp=min_tp)
    speed = CONTINUOUS if continuous else batch(local_batch)
    drop = drop_table(tp).rate
    ntp = ntp_table(tp, eff, StepTimeRatios(), speed).rate
    boosted = boost_table(tp, eff, StepTimeRatios(), Boost(max_power=power, curve={"kind": "power_law", "alpha": alpha}), speed).rate
    for table in (drop, ntp, boosted):
        assert table[0] == 1.0
        assert np.all((table >= 0) & (table <= 1))
        assert np.all(np.diff(table) <= 1e-12)  # more failures never help
    assert np.all(drop <= ntp + 1e-12) and np.all(ntp <= boosted + 1e-12)


def test_calibrated_ratio_used_and_missing_pairs_fall_back_with_a_note(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"degraded_step_time_ratio": {"32": {"30": 1.1}}, "gpu": "B200"}))
    ratios = load_calibration(path)
    rates = ntp_table(32, reduced_tp(32, allowed=[32, 30, 28]), ratios, CONTINUOUS).rate
    assert rates[1] == pytest.approx(1 / 1.1)
    assert rates[3] == pytest.approx(28 / 32)
    assert any("32->28" in n for n in ratios.notes())
    assert ratios.reconfigure_s(60.0) == 60.0  # no measured recovery: the configured pause


def test_calibrated_recovery_replaces_the_reconfigure_pause(tmp_path):
    path = tmp_path / "runtime.json"
    path.write_text(json.dumps({"recovery_s": 42.5}))
    ratios = load_calibration(path)
    assert ratios.reconfigure_s(60.0) == 42.5
    assert ratios.ratio(32, 30) == pytest.approx(32 / 30)
    notes = " ".join(ratios.notes())
    assert "42.5 s per failure" in notes and "no step-time ratios" in notes


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("not json", "not valid JSON"),
        ('{"other": 1}', "needs 'degraded_step_time_ratio' or 'recovery_s'"),
        ("[1, 2]", "the top level must be an object"),
        ('{"degraded_step_time_ratio": {"8": {"9": 1.2}}}', "reduced TP 9"),
        ('{"degraded_step_time_ratio": {"8": {"4": -1}}}', "degraded_step_time_ratio.8.4 must be >= 1"),
        ('{"degraded_step_time_ratio": {"8": {"4": 0.9}}}', "degraded_step_time_ratio.8.4 must be >= 1"),
        ('{"degraded_step_time_ratio": {"8": {"4": NaN}}}', "'degraded_step_time_ratio.8.4': Input should be a finite"),
        ('{"degraded_step_time_ratio": {"8": {"4": Infinity}}}', "'degraded_step_time_ratio.8.4': Input should be a fin"),
        ('{"recovery_s": Infinity}', "'recovery_s': Input should be a finite number"),
        ('{"recovery_s": NaN}', "'recovery_s': Input should be a finite number"),
        ('{"degraded_step_time_ratio": {"8": {"four": 1.5}}}', "degraded_step_time_ratio"),
        ('{"recovery_s": -3}', "recovery_s"),
    ],
)
def test_bad_calibration_is_a_one_line_config_error(tmp_path, content, fragment):
    path = tmp_path / "bench.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=fragment) as info:
        load_calibration(path)
    assert "\n" not in str(info.value)
