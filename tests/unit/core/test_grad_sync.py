"""The pieces of the canonical-block sync, in one process: shadow buckets that match a healthy rank's, NTP
parameters that carry Megatron's TP attributes, and creation-order dispatch of bucket groups."""

from __future__ import annotations

from types import SimpleNamespace

from ntp_megatron.config.schema import load_job_config
from ntp_megatron.plan.layout import make_topology

MODEL = ["model.num_attention_heads=12", "model.num_query_groups=6", "model.kv_channels=8", "model.hidden_size=32",
         "model.ffn_hidden_size=41", "model.vocab_size=263", "model.num_layers=2", "training.lr_warmup_iters=1",
         "model.untie_embeddings_and_output_weights=true", "parallel.tensor_model_parallel_size=1",
         "parallel.data_parallel_size=1", "parallel.overlap_grad_reduce=true", "parallel.ddp_bucket_size=900"]


def _ntp_model(cfg, units):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from ntp_megatron.core.gpt import RankUnits, build_ntp_gpt
    from ntp_megatron.training.model import transformer_config

    m = cfg.model
    return build_ntp_gpt(transformer_config(cfg), RankUnits(*units), m.normalization, m.vocab_size,
                         max_sequence_length=m.seq_length, pre_process=True, post_process=True,
                         share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                         position_embedding_type=m.position_embedding_type,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _bucket_layout(ddp) -> list[list[tuple[str, tuple[int, int], tuple[int, ...]]]]:
    """Per bucket: (parameter name, offsets in the bucket, shape), in bucket order."""
    names = {p: n for n, p in ddp.module.named_parameters()}
    return [[(names[p], bucket.param_to_index[p], tuple(p.shape)) for p in bucket.params_list]
            for group in ddp.bucket_groups for bucket in group.buckets]


def test_shadow_buckets_are_a_healthy_slot_ranks_buckets(megatron):
    """A degraded rank's shadow of block s has exactly the DDP buckets of a healthy rank at slot s: same
    parameters in the same buckets at the same offsets with the same shapes (uneven blocks, small buckets)."""
    from megatron.core.distributed import DistributedDataParallel

    from ntp_megatron.core.shadows import shadow_module
    from ntp_megatron.training.model import ddp_config, transformer_config

    cfg = load_job_config(None, [f"{kv}" for kv in MODEL])
    tf_config = transformer_config(cfg)
    topo = make_topology(4, 2, cfg.unit_counts(), dead_slots=[(1, 3), (1, 1)])
    degraded_rank = topo.rank_of(1, 0)  # holds block 0 plus dealt units, and is the proxy of a dead block
    assert len(topo.member_blocks(degraded_rank)) == 2
    families = ("heads", "ffn", "vocab")
    degraded = _ntp_model(cfg, [tuple(topo.units_of(degraded_rank, f)) for f in families])
    for block in range(4):
        healthy = _ntp_model(cfg, [tuple(topo.block(f, block)) for f in families])
        expected = _bucket_layout(DistributedDataParallel(tf_config, ddp_config(cfg), healthy,
                                                          pg_collection=megatron))
        shadow = DistributedDataParallel(tf_config, ddp_config(cfg), shadow_module(degraded, topo, block),
                                         pg_collection=megatron)
        got = _bucket_layout(shadow)
        assert len(expected) > 3, "small buckets: several per model"
        assert got == expected, f"block {block}"
    # Not vacuous: the degraded rank's own buckets are laid out differently.
    own = _bucket_layout(DistributedDataParallel(tf_config, ddp_config(cfg), degraded, pg_collection=megatron))
    assert own != expected


def test_ntp_parameters_carry_megatrons_tensor_parallel_attributes(megatron):
    """Every parameter of the NTP model has the TP attributes plain Megatron-Core gives the same parameter
    (the untied output layer included), so Megatron code that reads them treats both alike."""
    from megatron.core.models.gpt import GPTModel

    from ntp_megatron.training.model import layer_spec, transformer_config

    cfg = load_job_config(None, MODEL)
    m = cfg.model
    plain = GPTModel(config=transformer_config(cfg), transformer_layer_spec=layer_spec(cfg), vocab_size=m.vocab_size,
                     max_sequence_length=m.seq_length, share_embeddings_and_output_weights=False,
                     pg_collection=megatron)
    counts = cfg.unit_counts()
    ntp = _ntp_model(cfg, [tuple(range(counts[f])) for f in ("heads", "ffn", "vocab")])
    attrs = ("tensor_model_parallel", "partition_dim", "partition_stride")
    expected = {n: tuple(getattr(p, a, None) for a in attrs) for n, p in plain.named_parameters()}
    got = {n: tuple(getattr(p, a, None) for a in attrs) for n, p in ntp.named_parameters()}
    assert "output_layer.weight" in got and expected["output_layer.weight"][0] is True
    assert got == expected


class _FakeGroup(SimpleNamespace):
    """Just what ``register_grad_ready`` reads and calls on a bucket group."""

    def start_grad_sync(self, force_all_reduce=False):
        self.log.append(self.name)


def test_bucket_groups_dispatch_in_creation_order():
    """Groups that become ready out of order (g2, g0, g1) are dispatched g0, g1, g2 — upstream would start g2
    first, and members of a sync group whose backward orders differ would then pair different buckets."""
    from ntp_megatron.patches.distributed_param_and_grad_buffer import _register_grad_ready

    log: list[str] = []
    params = [object() for _ in range(3)]
    groups = []
    for i, param in enumerate(params):
        groups.append(_FakeGroup(
            name=f"g{i}", log=log, ddp_config=SimpleNamespace(overlap_grad_reduce=True), is_last_microbatch=True,
            is_first_batch=False, param_to_bucket={param: None}, per_param_grad_ready_counts={},
            golden_per_param_grad_ready_counts={param: 1}))
    for group in groups:
        group.dispatch_order = groups
    _register_grad_ready(groups[2], params[2])
    assert log == []
    _register_grad_ready(groups[0], params[0])
    assert log == ["g0"]
    _register_grad_ready(groups[1], params[1])
    assert log == ["g0", "g1", "g2"]


def _shard_ranges(buffer) -> list[dict[str, tuple]]:
    """Megatron's distributed-optimizer ranges of one buffer at its group position: per bucket, per parameter (by
    its place in the buffer) the (start, end) of each of its ranges."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    start = {param: index[0] for param, index in buffer.param_index_map.items()}
    [buckets] = DistributedOptimizer._build_gbuf_range_map(buffer).values()
    return [{start[param]: tuple((key, r.start, r.end) for key, r in sorted(ranges.items()))
             for param, ranges in bucket["param_map"].items()} for bucket in buckets]


def test_real_shadows_have_a_healthy_slot_ranks_buffers_and_shards(megatron):
    """Under the distributed optimizer a degraded rank's shadow of block s (real parameters, the buffers sharded
    over a stand-in group of 3) has a healthy slot-s rank's buckets, padded buffer and, at every position, the
    same shard ranges; its parameters live in the DDP's parameter buffer. The rank's own DDP has no parameter
    buffer (it only accumulates)."""
    import copy

    import torch
    from megatron.core.distributed import DistributedDataParallel

    from ntp_megatron.core.shadows import Shadow
    from ntp_megatron.training.model import build_model, ddp_config, transformer_config
    from tests.unit.plan.test_optimizer_shards import _DpPosition

    cfg = load_job_config(None, [*MODEL, "parallel.use_distributed_optimizer=true"])
    tf_config = transformer_config(cfg)
    topo = make_topology(4, 2, cfg.unit_counts(), dead_slots=[(1, 3), (1, 1)])
    rank = topo.rank_of(1, 0)
    blocks = topo.member_blocks(rank)
    assert len(blocks) == 2
    families = ("heads", "ffn", "vocab")
    own = build_model(cfg, tf_config, megatron, torch.device("cpu"), topo, rank, own_buckets_sync=False)
    assert [b.param_data for b in own.buffers] == [None] and not own.ddp_config.use_distributed_optimizer
    size = 3
    for position in (0, size - 1):  # the first shard, and the last (which holds the buffer's padding)
        pg = copy.copy(megatron)
        pg.dp = pg.dp_cp = pg.intra_dp_cp = _DpPosition(size, position)
        groups = SimpleNamespace(with_sync_groups=lambda block, pg=pg: pg)
        for block in blocks:
            shadow = Shadow(own.module, topo, block, groups, tf_config, ddp_config(cfg), distributed_optimizer=True)
            healthy = DistributedDataParallel(tf_config, ddp_config(cfg),
                                              _ntp_model(cfg, [tuple(topo.block(f, block)) for f in families]),
                                              pg_collection=pg)
            assert _bucket_layout(shadow.ddp) == _bucket_layout(healthy), f"block {block}"
            [got], [want] = shadow.ddp.buffers, healthy.buffers
            assert len(got.buckets) > 3 and got.numel == want.numel and got.param_data.numel() == want.numel
            assert _shard_ranges(got) == _shard_ranges(want), f"block {block}, position {position}"
            base = got.param_data.data_ptr()
            for param in shadow.module.parameters():
                assert param.device.type == "cpu" and param.data.untyped_storage().data_ptr() == base
            shadow.close()
