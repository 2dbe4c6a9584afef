"""The simulator's rebalance model: a slowed GPU's TP group, not rebalanced, rebalanced, boosted; a degraded group
with and without boost. Checked against the closed forms a fine-grained model approaches."""

from __future__ import annotations

import pytest

from ntp_megatron.plan.memory_plan import ModelDims
from ntp_megatron.plan.power_curve import boost_model
from ntp_megatron.sim.rebalance import degraded_step, group_step, main

pytestmark = pytest.mark.unit

FINE = ModelDims(num_layers=2, hidden_size=256, num_attention_heads=64, num_query_groups=64, kv_channels=4,
                 ffn_hidden_size=4096, vocab_size=4096, max_position_embeddings=64)
"""Many units per family: counts within one unit of the shares are almost exactly the shares."""


def test_not_rebalanced_the_slow_rank_sets_the_pace():
    assert group_step(FINE, 4, 2.0).not_rebalanced == 2.0
    assert group_step(FINE, 4, 2.0, compute_fraction=0.6).not_rebalanced == pytest.approx(0.4 + 0.6 * 2)
    assert group_step(FINE, 4, 3.0, compute_fraction=0.0).not_rebalanced == 1.0


@pytest.mark.parametrize("tp, factor", [(4, 2.0), (8, 2.0), (4, 4.0), (2, 1.5)])
def test_rebalanced_approaches_the_groups_lost_capacity(tp, factor):
    case = group_step(FINE, tp, factor)
    ideal = tp / (tp - 1 + 1 / factor)  # the group keeps tp - 1 + 1/factor GPUs' worth of speed
    assert case.weight == round(100 / factor)
    assert sum(case.shares) == pytest.approx(1.0)
    assert ideal <= case.rebalanced <= ideal * 1.02


def test_boost_with_room_on_the_curve_gives_a_healthy_step():
    boost = boost_model(max_power=3.0, alpha=0.58, points=None)
    assert group_step(FINE, 4, 2.0, boost=boost).rebalanced_boosted == pytest.approx(1.0, abs=1e-6)
    plain, boosted = degraded_step(FINE, 4, 3, boost=boost)
    assert plain == pytest.approx(4 / 3, rel=0.01) and boosted == pytest.approx(1.0, abs=1e-6)
    capped = boost_model(max_power=1.3, alpha=0.58, points=None)  # the simulator's default cap: not enough
    _, short = degraded_step(FINE, 4, 3, boost=capped)
    assert short == pytest.approx(plain / 1.3 ** 0.58, rel=1e-6)


def test_coarse_heads_cost_the_rebalanced_group():
    """The tiny model's 8 heads over TP4: a slot holds 3 heads where its share is 16/7, so the rebalanced group is
    slower than its lost capacity says (the worked example of tests/unit/plan/test_weighted_layout.py)."""
    tiny = ModelDims(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=8, kv_channels=8,
                     ffn_hidden_size=256, vocab_size=256, max_position_embeddings=64)
    case = group_step(tiny, 4, 2.0)
    assert case.rebalanced > 8 / 7 * 1.05 and case.rebalanced < 2.0


def test_cli_prints_the_three(capsys):
    assert main(["--tp", "4", "--factor", "2", "--boost-max-power", "2"]) == 0
    out = capsys.readouterr().out
    assert "not rebalanced 2.000" in out and "rebalanced and boosted" in out
    assert main(["--tp", "4", "--factor", "0.5"]) == 2
