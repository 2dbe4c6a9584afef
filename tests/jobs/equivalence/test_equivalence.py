"""The same tiny model and data under TP1×DP1, TP2×DP1, TP1×DP2 and TP2×DP2 give the same lm loss."""

from __future__ import annotations

import pytest

from tests.harness import assert_ok, layout_args, relative_difference

ITERS = 10
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def losses_by_layout(jobs) -> dict[tuple[int, int], dict[int, float]]:
    out = {}
    for tp, dp in LAYOUTS:
        result = jobs.run(f"tp{tp}dp{dp}", layout_args(tp, dp, ITERS))
        assert_ok(result)
        out[(tp, dp)] = result.losses()
    return out


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda l: f"tp{l[0]}dp{l[1]}")
def test_loss_per_iteration_matches_tp1_dp1(losses_by_layout, layout):
    reference = losses_by_layout[(1, 1)]
    other = losses_by_layout[layout]
    assert sorted(reference) == list(range(1, ITERS + 1))
    assert sorted(other) == sorted(reference)
    worst = max(relative_difference(reference[i], other[i]) for i in reference)
    assert worst <= 1e-5, f"{layout}: worst relative loss difference {worst:.2e}"


def test_training_actually_learns(losses_by_layout):
    """Guards the comparison above against a run that does nothing (equal because constant)."""
    losses = losses_by_layout[(1, 1)]
    assert losses[ITERS] < losses[1] - 0.1
    assert len(set(losses.values())) == ITERS
