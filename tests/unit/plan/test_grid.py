"""The dense grid with pipeline stages (ntp_megatron.plan.grid.Grid) against Megatron-Core's own ``RankGenerator``
(``parallel_state``, order tp-cp-ep-dp-pp): every group of every rank, for many shapes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from megatron.core.parallel_state import RankGenerator, default_embedding_ranks

from ntp_megatron.plan.grid import Grid

pytestmark = pytest.mark.unit


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 8), dp=st.integers(1, 6), pp=st.integers(1, 5))
def test_grid_is_megatrons_rank_order(tp, dp, pp):
    grid = Grid(tp, dp, pp)
    upstream = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    ranks_of = {mode: {r: tuple(g) for g in upstream.get_ranks(mode) for r in g} for mode in ("tp", "dp", "pp", "tp-pp")}
    assert Grid.of_world(tp, pp, grid.world_size) == grid
    for rank in range(grid.world_size):
        stage, replica, slot = grid.coords(rank)
        assert grid.rank(stage, replica, slot) == rank
        assert grid.tp_ranks(stage, replica) == ranks_of["tp"][rank]
        assert grid.dp_ranks(stage, slot) == ranks_of["dp"][rank]
        lane = grid.lane(replica, slot)
        assert lane == ranks_of["pp"][rank] and lane.index(rank) == stage
        assert tuple(sorted(grid.mp_ranks(replica))) == ranks_of["tp-pp"][rank]
        assert grid.embedding_ranks(replica, slot) == tuple(default_embedding_ranks(list(lane)))
    parts = grid.partition(lambda p, r, s: (r, s))
    assert sorted(parts) == sorted(set(ranks_of["pp"].values()))


def test_bad_grids_are_refused():
    with pytest.raises(ValueError, match="not a multiple of tensor × pipeline"):
        Grid.of_world(2, 2, 6)
    with pytest.raises(ValueError, match="outside 0..7"):
        Grid(2, 2, 2).coords(8)
    with pytest.raises(ValueError, match="pp must be ≥ 1"):
        Grid(1, 1, 0)
