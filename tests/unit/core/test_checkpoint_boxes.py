"""A distributed-optimizer shard written in model space (``ntp_megatron.core.checkpoint_map.flat_boxes`` / ``shard_boxes`` /
``piece_sharded_tensor``): every element of every global tensor exactly once, whatever the buffer's buckets, the
data-parallel size and the units each block holds. The element counts are numpy's, independent of the boxes'
arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.plan.optimizer_shards import ParamSpec, buffer_layout, shard_pieces
from ntp_megatron.core.checkpoint_map import Fragment, UnitAxis, flat_boxes, fragments, shard_boxes

pytestmark = pytest.mark.unit


def _count(shape, boxes, field="offset") -> np.ndarray:
    count = np.zeros(shape, dtype=np.int32)
    for box in boxes:
        offset = getattr(box, field)
        count[tuple(slice(o, o + s) for o, s in zip(offset, box.shape))] += 1
    return count


@st.composite
def flat_ranges(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    numel = math.prod(shape)
    start = draw(st.integers(0, numel))
    return shape, start, draw(st.integers(start, numel))


@settings(max_examples=200, deadline=None)
@given(flat_ranges())
def test_flat_boxes_tile_the_range_in_order(case):
    shape, start, end = case
    boxes = flat_boxes(shape, start, end)
    assert len(boxes) <= 2 * len(shape) - 1
    expected = np.zeros(math.prod(shape), dtype=np.int32)
    expected[start:end] = 1
    assert (_count(shape, boxes).reshape(-1) == expected).all()
    firsts = [int(np.ravel_multi_index(b.offset, shape)) for b in boxes]
    assert firsts == sorted(firsts) and (not boxes or firsts[0] == start)


@st.composite
def sync_groups(draw):
    """One split parameter of ``num_units`` units dealt to ``tp`` blocks (any units each: non-contiguous ones
    too), and a replicated one, in a buffer with other parameters, bucketed and sharded over ``dp`` positions."""
    tp = draw(st.integers(1, 3))
    num_units = draw(st.integers(tp, 7))
    axis = draw(st.integers(0, 1))
    unit_len, other = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    bounds = sorted(draw(st.sets(st.integers(1, num_units - 1), min_size=tp - 1, max_size=tp - 1))) if tp > 1 else []
    edges = [0, *bounds, num_units]
    order = draw(st.permutations(range(num_units)))  # any units per block, as after failures (several runs)
    blocks = [tuple(sorted(order[edges[b]:edges[b + 1]])) for b in range(tp)]
    dp = draw(st.integers(1, 4))
    bucket_size = draw(st.one_of(st.none(), st.integers(1, 200)))
    extra = draw(st.lists(st.integers(1, 90), max_size=3))
    return tp, num_units, axis, unit_len, other, blocks, dp, bucket_size, extra


@settings(max_examples=100, deadline=None)
@given(sync_groups())
def test_the_positions_of_every_sync_group_write_each_element_once(case):
    """the pieces of one instance's positions, over every block (a replicated tensor: block 0's pieces only),
    tile each global tensor exactly once: the main replicas of a save (every instance holds the same pieces)."""
    tp, num_units, axis, unit_len, other, blocks, dp, bucket_size, extra = case
    global_split = (num_units * unit_len, other) if axis == 0 else (other, num_units * unit_len)
    replicated = (other,)
    main = {"split": np.zeros(global_split, np.int32), "norm": np.zeros(replicated, np.int32)}
    for block, units in enumerate(blocks):
        local = list(global_split)
        local[axis] = len(units) * unit_len
        split = UnitAxis(axis=axis, blocks=1, unit_len=unit_len, num_units=num_units)
        places = {"split": (tuple(local), fragments(local, split, units), axis),
                  "norm": (replicated, [Fragment((0,), replicated, 0)], 0)}
        specs = [ParamSpec("split", math.prod(local)), ParamSpec("norm", other),
                 *(ParamSpec(f"x{i}", n) for i, n in enumerate(extra))]
        layout = buffer_layout(specs, bucket_size, dp, use_distributed_optimizer=True)
        for position in range(dp):
            for piece in shard_pieces(layout, dp, position):
                if piece.name not in places:
                    continue
                shape, frags, cut = places[piece.name]
                boxes = shard_boxes(shape, frags, cut, piece.start, piece.end)
                assert _count(shape, boxes, "local_offset").sum() == piece.end - piece.start
                if piece.name == "split" or block == 0:  # the replicated tensor: block 0's copy
                    main[piece.name] += _count(main[piece.name].shape, boxes, "global_offset")
    for name, count in main.items():
        assert (count == 1).all(), f"{name}: main pieces cover {count.tolist()}"


def test_a_piece_round_trips_through_its_boxes():
    """build cuts a piece (elements [5, 23) of a 4 x 7 tensor of units {0, 2} of 4, split on axis 1) into boxes
    at their global places; merge puts loaded boxes back into the flat piece."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from ntp_megatron.core.checkpoint_map import ModelPlace, piece_sharded_tensor

    split = UnitAxis(axis=1, blocks=1, unit_len=2, num_units=4)
    local = torch.arange(4 * 4, dtype=torch.float32).reshape(4, 4)
    place = ModelPlace("w", (4, 4), (4, 8), (), tuple(fragments((4, 4), split, (0, 2))), 1, (0, 0, 0))
    flat = local.reshape(-1)[5:13].clone()
    factory = piece_sharded_tensor("optimizer.state.exp_avg.w", flat, place, 5, 13, (0, 0, 0))
    parts = factory.build()
    assert all(isinstance(p, ShardedTensor) and p.global_shape == (4, 8) for p in parts)
    full = torch.full((4, 8), -1.0)
    for part in parts:
        index = tuple(slice(o, o + s) for o, s in zip(part.global_offset, part.local_shape))
        full[index] = part.data
    expected = torch.full((4, 8), -1.0)
    columns = [0, 1, 4, 5]  # units 0 and 2
    for k in range(5, 13):
        row, col = divmod(k, 4)
        expected[row, columns[col]] = local[row, col]
    assert torch.equal(full, expected)
    assert torch.equal(factory.merge_fn([p.data for p in parts]), flat)


def test_a_shadow_lies_where_its_blocks_units_are():
    """A degraded rank's shadow of block 1 (units {2, 3} of 6, in a gated fc1: gate rows then up rows) takes the
    checkpoint tensor, global shape and layer offset of the model parameter (the rank's own units {0, 1, 4}), and
    the fragments of its own units; a replicated tensor keeps the model's place; units that do not fit the global
    tensor are refused."""
    import torch

    from ntp_megatron.core.layers import HeldUnits
    from ntp_megatron.core.checkpoint_map import ModelPlace, place_of_units

    def tagged(units, rows_per_unit=2, cols=3):
        param = torch.zeros(2 * len(units) * rows_per_unit, cols)  # [gate, up] x units x rows
        param.ntp_held_units = HeldUnits("ffn", 6, tuple(units), 2, rows_per_unit * cols)
        param.partition_dim = 0
        return param

    split = UnitAxis(axis=0, blocks=2, unit_len=2, num_units=6)
    own = (0, 1, 4)
    place = ModelPlace("decoder.layers.mlp.linear_fc1.weight", (12, 3), (2, 24, 3), (1,),
                       tuple(fragments((12, 3), split, own)), 0, (0, 0, 1))
    shadow = place_of_units(place, tagged((2, 3)))
    assert (shadow.key, shadow.global_shape, shadow.prepend, shadow.axis, shadow.replica_id) == \
        (place.key, place.global_shape, place.prepend, 0, place.replica_id)
    assert shadow.local_shape == (8, 3)
    assert [(f.global_offset, f.shape, f.local_start) for f in shadow.places] == \
        [((4, 0), (4, 3), 0), ((16, 0), (4, 3), 4)]  # gate rows of units 2, 3; then their up rows
    norm = ModelPlace("decoder.layers.input_layernorm.weight", (3,), (2, 3), (1,), (Fragment((0,), (3,), 0),), 0,
                      (0, 1, 0))
    assert place_of_units(norm, torch.zeros(3)) is norm
    with pytest.raises(ValueError, match="replicated tensor of shape"):
        place_of_units(norm, torch.zeros(4))
    with pytest.raises(ValueError, match="do not lie in the global tensor"):
        wrong = tagged((2, 3))
        wrong.ntp_held_units = HeldUnits("ffn", 7, (2, 3), 2, 6)  # another family size: another global tensor
        place_of_units(place, wrong)
