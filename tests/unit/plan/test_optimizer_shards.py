"""The buffer and distributed-optimizer shard geometry (ntp_megatron.plan.optimizer_shards): its invariants over drawn
parameter lists, and equality with the real Megatron-Core DDP buffers and DistributedOptimizer ranges; the
instances, shard holders and the shard plan of a re-formation over drawn topologies."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.plan.layout import TopologyError, join_topology, make_topology, next_topology, survivor_ranks
from ntp_megatron.plan.placement import Placement
from ntp_megatron.plan.optimizer_shards import (
    PARAM_ALIGN,
    STATE_BYTES,
    BufferLayout,
    ParamSpec,
    ShardLostError,
    bucket_divisor,
    buffer_layout,
    instance_of,
    instances,
    lost_shards,
    shard_holders,
    shard_lower_bound_bytes,
    shard_numel,
    shard_pieces,
    shard_plan,
    shard_range,
    twin_replicas,
)

FAST = settings(max_examples=150, deadline=None)


@st.composite
def layouts(draw) -> tuple[list[ParamSpec], int | None, int, bool, bool, BufferLayout]:
    """A drawn parameter list with bucket size, DP size and padding switches, and its layout."""
    n = draw(st.integers(1, 12))
    specs = [ParamSpec(f"p{i}", draw(st.integers(1, 3000)), shared_embedding=draw(st.integers(0, 5)) == 0)
             for i in range(n)]
    bucket_size = draw(st.none() | st.integers(1, 8000))
    dp = draw(st.integers(1, 8))
    dist_opt = draw(st.booleans())
    high_busbw = draw(st.integers(0, 9)) == 0
    return specs, bucket_size, dp, dist_opt, high_busbw, buffer_layout(specs, bucket_size, dp, dist_opt, high_busbw)


@FAST
@given(layouts())
def test_parameters_fill_buckets_in_reverse_order_with_only_the_padding_megatron_adds(case):
    specs, _, dp, dist_opt, high_busbw, layout = case
    assert [p.name for p in layout.params] == [s.name for s in reversed(specs)]
    assert all(p.end - p.start == s.numel for p, s in zip(layout.params, reversed(specs)))
    divisor = bucket_divisor(dp, high_busbw)
    specs_by_name = {s.name: s for s in specs}
    offset = 0
    for index, bucket in enumerate(layout.buckets):
        assert bucket.offset == offset, "buckets are contiguous from 0"
        members = [p for p in layout.params if p.bucket == index]
        assert members, "no empty bucket"
        assert members[0].start - bucket.offset < (PARAM_ALIGN if dist_opt else 1)
        # Upstream closes the bucket before a shared embedding at that embedding's padded start.
        before_shared = index + 1 < len(layout.buckets) and specs_by_name[
            next(p.name for p in layout.params if p.bucket == index + 1)].shared_embedding and dist_opt
        tail = bucket.offset + bucket.numel_unpadded - members[-1].end
        assert (0 <= tail < PARAM_ALIGN) if before_shared else (tail == 0)
        for before, after in pairwise(members):
            gap = after.start - before.end
            assert 0 <= gap < (PARAM_ALIGN if dist_opt else 1)
        if dist_opt:
            assert all(p.start % PARAM_ALIGN == 0 for p in members)
            assert bucket.numel % divisor == 0 and 0 <= bucket.numel - bucket.numel_unpadded < divisor
        else:
            assert bucket.numel == bucket.numel_unpadded
        offset += bucket.numel
    assert layout.numel == offset
    assert [p.bucket for p in layout.params] == sorted(p.bucket for p in layout.params)


@FAST
@given(layouts())
def test_a_bucket_closes_at_the_first_parameter_reaching_bucket_size_or_around_a_shared_embedding(case):
    specs, bucket_size, _, dist_opt, _, layout = case
    shared = {s.name for s in specs if s.shared_embedding} if dist_opt else set()
    for index, bucket in enumerate(layout.buckets):
        members = [p for p in layout.params if p.bucket == index]
        if any(p.name in shared for p in members):
            assert len(members) == 1, "a shared embedding has a bucket of its own"
        reach = [p.end - bucket.offset >= bucket_size if bucket_size is not None else False for p in members]
        assert not any(reach[:-1]), "no parameter after the one that reached bucket_size"
        last = index == len(layout.buckets) - 1
        if not last and not reach[-1]:
            following = next(p for p in layout.params if p.bucket == index + 1)
            assert members[-1].name in shared or following.name in shared
    if bucket_size is None and not shared:
        assert len(layout.buckets) == 1


@FAST
@given(st.lists(st.integers(1, 500), min_size=2, max_size=8), st.data())
def test_a_bucket_that_reaches_bucket_size_exactly_closes_there(numels, data):
    specs = [ParamSpec(f"p{i}", n) for i, n in enumerate(numels)]
    k = data.draw(st.integers(1, len(specs) - 1))
    layout = buffer_layout(specs, sum(numels[-k:]), 1, False)
    assert [p.bucket for p in layout.params[:k + 1]] == [0] * k + [1]


@FAST
@given(layouts())
def test_shards_of_each_bucket_are_disjoint_equal_and_tile_it(case):
    _, _, dp, dist_opt, _, layout = case
    if not dist_opt and any(b.numel % dp for b in layout.buckets):
        with pytest.raises(ValueError, match="does not split"):
            [shard_range(layout, i, dp, 0) for i in range(len(layout.buckets))]
        return
    for index, bucket in enumerate(layout.buckets):
        ranges = [shard_range(layout, index, dp, j) for j in range(dp)]
        assert ranges[0][0] == bucket.offset and ranges[-1][1] == bucket.offset + bucket.numel
        assert all(a[1] == b[0] for a, b in pairwise(ranges))
        assert len({hi - lo for lo, hi in ranges}) == 1


@FAST
@given(layouts())
def test_shard_pieces_cover_every_parameter_exactly_once_inside_their_shards(case):
    specs, _, dp, dist_opt, _, layout = case
    if not dist_opt:
        return  # no optimizer shards without the distributed optimizer
    covered: dict[str, list[tuple[int, int]]] = {s.name: [] for s in specs}
    places = {p.name: p for p in layout.params}
    for j in range(dp):
        for piece in shard_pieces(layout, dp, j):
            lo, hi = shard_range(layout, piece.bucket, dp, j)
            assert places[piece.name].bucket == piece.bucket
            assert piece.buffer_start == places[piece.name].start + piece.start
            assert lo <= piece.buffer_start and piece.buffer_start + piece.end - piece.start <= hi
            covered[piece.name].append((piece.start, piece.end))
    for spec in specs:
        spans = sorted(covered[spec.name])
        assert spans[0][0] == 0 and spans[-1][1] == spec.numel
        assert all(a[1] == b[0] for a, b in pairwise(spans))
    assert sum(shard_numel(layout, dp, j) for j in range(dp)) == sum(s.numel for s in specs)


def test_bad_input_is_refused():
    spec = [ParamSpec("w", 10)]
    with pytest.raises(ValueError, match="dp_size"):
        buffer_layout(spec, None, 0, True)
    with pytest.raises(ValueError, match="at least one"):
        buffer_layout([], None, 2, True)
    with pytest.raises(ValueError, match="outside"):
        shard_range(buffer_layout(spec, None, 2, True), 0, 2, 2)


# The real objects. One process, a 1-rank gloo world; the DP size is what a stand-in group object reports.
# Megatron's _ParamAndGradBuffer, its bucket groups and DistributedOptimizer read only size() and rank() of the
# data-parallel group while they are built (collectives come later, in the grad sync and the param gather), so
# a stand-in that says "size dp, rank j" gives exactly the layout and the ranges rank j of a DP group of dp would
# build. DDP is built once at position 0; for each position j the buffer's group is replaced by a stand-in at
# rank j and a DistributedOptimizer is built over it (the buffer layout itself reads only the size).


class _DpPosition:
    """Stands in for a data-parallel process group of ``dp`` ranks, as seen from position ``rank``."""

    def __init__(self, dp: int, rank: int) -> None:
        self._dp, self._rank = dp, rank

    def size(self) -> int:
        return self._dp

    def rank(self) -> int:
        return self._rank


@dataclass(frozen=True)
class Case:
    hidden: int
    heads: int
    ffn: int
    vocab: int
    layers: int
    tied: bool
    bucket_size: int | None  # None: overlap_grad_reduce off, hence one bucket
    dp: int
    dist_opt: bool
    high_busbw: bool = False
    shared_embedding: bool = False  # mark the word embedding as Megatron does on the first stage when PP > 1
    rope: bool = False  # no position embedding: a 32-element norm weight precedes the word embedding


CASES = [
    Case(32, 4, 40, 100, 2, tied=True, bucket_size=2000, dp=3, dist_opt=True, shared_embedding=True),
    Case(32, 4, 40, 100, 2, tied=True, bucket_size=3000, dp=2, dist_opt=True, shared_embedding=True, rope=True),
    Case(48, 6, 72, 131, 2, tied=False, bucket_size=5000, dp=8, dist_opt=True),
    Case(24, 3, 37, 97, 1, tied=False, bucket_size=1, dp=5, dist_opt=True),
    Case(32, 4, 40, 100, 2, tied=True, bucket_size=None, dp=2, dist_opt=True, high_busbw=True),
    # 3200 = the untied output layer, first in the buffer: its bucket is full exactly at its end.
    Case(32, 4, 40, 100, 2, tied=False, bucket_size=3200, dp=4, dist_opt=False),
]


def _build(megatron, case: Case):
    """A real GPTModel wrapped in Megatron's DDP over a stand-in DP group of ``case.dp`` at position 0."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=case.layers, hidden_size=case.hidden, num_attention_heads=case.heads,
                               ffn_hidden_size=case.ffn, use_cpu_initialization=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=case.vocab,
                     max_sequence_length=16, share_embeddings_and_output_weights=case.tied,
                     position_embedding_type="rope" if case.rope else "learned_absolute",
                     pg_collection=megatron)
    if case.shared_embedding:
        model.embedding.word_embeddings.weight.shared_embedding = True
    group = _DpPosition(case.dp, 0)
    pg = copy.copy(megatron)
    pg.dp = pg.dp_cp = pg.intra_dp_cp = group
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=case.bucket_size is not None, bucket_size=case.bucket_size,
        use_distributed_optimizer=case.dist_opt, pad_buckets_for_high_nccl_busbw=case.high_busbw)
    return model, DistributedDataParallel(config, ddp_config, model, pg_collection=pg)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"dp{c.dp}-b{c.bucket_size}-{'do' if c.dist_opt else 'ddp'}")
def test_layout_and_shards_equal_megatrons_buffers_and_distributed_optimizer(megatron, case):
    import torch
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    model, ddp = _build(megatron, case)
    assert len(ddp.buffers) == 1 and not ddp.expert_parallel_buffers
    buffer = ddp.buffers[0]
    names = {p: n for n, p in model.named_parameters()}
    specs = [ParamSpec(n, p.numel(), getattr(p, "shared_embedding", False))
             for n, p in model.named_parameters() if p.requires_grad]
    layout = buffer_layout(specs, case.bucket_size, case.dp, case.dist_opt, case.high_busbw)

    assert layout.params == tuple((names[p], *where) for p, where in buffer.param_index_map.items())
    assert layout.buckets == tuple((b.offset, b.grad_data.numel(), b.numel_unpadded) for b in buffer.buckets)
    assert layout.numel == buffer.numel
    if case.bucket_size not in (None, 1):
        assert len(layout.buckets) > 2, "the case should exercise several buckets"
    if case.rope:
        closed = layout.buckets[-2]
        assert layout.params[-2].end < closed.offset + closed.numel_unpadded, "the case should exercise the " \
            "bucket closed before a shared embedding at its padded start"
    if not case.dist_opt:
        return

    base = buffer.grad_data.storage_offset()
    for j in range(case.dp):
        for index, bucket in enumerate(buffer.buckets):
            view = shard_buffer(bucket.grad_data, case.dp)[j]  # what the reduce-scatter hands position j
            start = view.storage_offset() - base
            assert shard_range(layout, index, case.dp, j) == (start, start + view.numel())
        group = _DpPosition(case.dp, j)
        buffer.data_parallel_group = group
        optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), OptimizerConfig(lr=1e-3),
                                         None, None, [ddp], {0: ddp.buffers}, group, None, 0, 0)
        ((_, per_bucket),) = optimizer.gbuf_ranges[0].items()
        got = []
        for index, ranges in enumerate(per_bucket):
            offset = buffer.buckets[index].offset
            for p, r in ranges["param_map"].items():
                world, in_bucket = r["gbuf_world"], r["gbuf_world_in_bucket"]
                assert world.size == r["param"].size
                assert (in_bucket.start, in_bucket.end) == (world.start - offset, world.end - offset)
                got.append((names[p], index, r["param"].start, r["param"].end, world.start))
        pieces = shard_pieces(layout, case.dp, j)
        assert pieces == got, f"position {j}"
        assert [names[p] for p in optimizer.opt_group_ranges[0]["params"]] == [p.name for p in pieces]
        assert shard_numel(layout, case.dp, j) == sum(r["param"].size for m in per_bucket
                                                      for r in m["param_map"].values())


# -- instances, holders and the shard plan ---------------------------------------------------------------------

UNITS = {"heads": 8, "ffn": 24, "vocab": 29}
PLANS = settings(max_examples=120, deadline=None)


@st.composite
def grids(draw) -> tuple[int, int, int]:
    """(tp_base, dp, k) with k dividing dp."""
    k = draw(st.integers(1, 3))
    return draw(st.integers(1, 4)), k * draw(st.integers(1, 3)), k


@st.composite
def failures(draw):
    """A starting topology (maybe degraded), the ranks that then die and the next topology (or None where no
    replica survives at min_tp 1)."""
    tp_base, dp, k = draw(grids())
    slots = [(r, s) for r in range(dp) for s in range(tp_base)]
    dead_at_start = draw(st.lists(st.sampled_from(slots), unique=True, max_size=len(slots) // 2))
    by_replica = {r: sum(1 for rr, _ in dead_at_start if rr == r) for r in range(dp)}
    dead_at_start = [(r, s) for r, s in dead_at_start if by_replica[r] < tp_base]  # every replica keeps a slot
    old = make_topology(tp_base, dp, UNITS, dead_slots=dead_at_start)
    dead = draw(st.lists(st.integers(0, old.world_size - 1), unique=True, min_size=1, max_size=3))
    try:
        new = next_topology(old, dead)
    except TopologyError:
        new = None
    return dp, k, old, dead, new


def test_instances_are_contiguous_blocks_of_replicas_and_twins_share_a_position():
    assert instances(4, 2) == ((0, 1), (2, 3)) and instances(6, 3) == ((0, 1), (2, 3), (4, 5))
    assert [instance_of(r, 6, 3) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert twin_replicas(1, 4, 2) == (1, 3) and twin_replicas(0, 4, 1) == (0,)
    for bad in ((4, 3), (4, 0), (0, 1)):
        with pytest.raises(ValueError, match="do not divide"):
            instances(*bad)
    with pytest.raises(ValueError, match="outside"):
        instance_of(4, 4, 2)


@PLANS
@given(failures())
def test_shard_plan_is_minimal_complete_deterministic_or_names_the_lost_shards(case):
    dp, k, old, dead, new = case
    if new is None:
        return
    needed = {(b, instance_of(rep.index, dp, k)[1]): None for rep in new.replicas for b in range(new.tp_base)}
    lost = [s for s in lost_shards(old, dead, dp, k) if s in needed]
    if lost:
        with pytest.raises(ShardLostError) as err:
            shard_plan(old, new, dead, dp, k)
        assert err.value.shards == lost
        return
    plan = shard_plan(old, new, dead, dp, k)
    assert plan == shard_plan(old, new, list(reversed(dead)), dp, k), "deterministic"
    assert len({(m.shard, m.dst) for m in plan}) == len(plan), "each shard reaches each rank once"
    old_of = {n: o for o, n in survivor_ranks(old, new, dead).items()}
    received = {(m.shard, m.dst) for m in plan}
    for rep in new.replicas:
        position = instance_of(rep.index, dp, k)[1]
        for block in range(new.tp_base):
            dst, shard = new.sync_member(rep.index, block), (block, position)
            had = dst in old_of and old_of[dst] in shard_holders(old, dp, k, shard)
            # minimal: a process that held its shard keeps it; complete: every other member receives it
            assert ((shard, dst) in received) == (not had), (shard, dst, had)
    for move in plan:
        assert move.src not in dead and move.src in shard_holders(old, dp, k, move.shard)


@PLANS
@given(failures())
def test_a_rejoining_slot_takes_its_shard_back_from_inside_its_replica(case):
    dp, k, old, dead, new = case
    if new is None:
        return
    back = [old.slot_of(r) for r in dead if old.slot_of(r)[0] in {rep.index for rep in new.replicas}]
    if not back:
        return
    joined = join_topology(new, back)
    for move in shard_plan(new, joined, [], dp, k):
        assert new.replica_of(move.src).index == joined.replica_of(move.dst).index, move


@settings(max_examples=200, deadline=None)
@given(grids(), st.integers(1, 9), st.data())
def test_the_holders_of_a_shard_sit_on_different_nodes_when_there_are_enough_nodes(grid, nnodes, data):
    """Under the placement rule (nodes host whole replicas, in index order), contiguous instances put a shard's
    k holders on k different nodes whenever there are at least k nodes (so with two instances on any job of more
    than one node), and on every node otherwise."""
    tp_base, dp, k = grid
    if dp % nnodes:
        return
    placement = Placement(tp_base, dp, nnodes)
    dead_slots = data.draw(st.lists(st.tuples(st.integers(0, dp - 1), st.integers(1, tp_base - 1)), unique=True,
                                    max_size=2)) if tp_base > 1 else []
    topology = make_topology(tp_base, dp, UNITS, dead_slots=dead_slots)
    for block in range(tp_base):
        for position in range(dp // k):
            nodes = [placement.device(*topology.slot_of(rank)).node
                     for rank in shard_holders(topology, dp, k, (block, position))]
            assert len(nodes) == k
            assert len(set(nodes)) == min(k, nnodes), (block, position, nodes)


def test_the_lower_bound_counts_twelve_bytes_per_shard_element_moved():
    specs = [ParamSpec(f"p{i}", n) for i, n in enumerate((300, 70, 1000))]
    dp, k = 4, 2
    layouts = {b: [buffer_layout(specs, None, dp // k, True)] for b in range(2)}
    old = make_topology(2, dp, UNITS)
    dead = [old.rank_of(0, 1), old.rank_of(1, 1)]  # instance 0 loses block 1 at both positions
    new = next_topology(old, dead)
    plan = shard_plan(old, new, dead, dp, k)
    assert {m.shard for m in plan} == {(1, 0), (1, 1)}
    assert {old.replica_of(m.src).index for m in plan} == {2, 3}, "from the twins in the other instance"
    assert shard_lower_bound_bytes(plan, layouts, dp, k) == STATE_BYTES * sum(s.numel for s in specs)
    assert lost_shards(old, dead + [old.rank_of(2, 1)], dp, k) == [(1, 0)]
