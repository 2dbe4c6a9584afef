"""The planned state bytes (:mod:`ntp_megatron.plan.memory_plan`): the parameter list against the real NTP GPT model, the
byte counts against the tensors Megatron-Core and the NTP grad sync allocate, and the worst case over reachable
layouts."""

from __future__ import annotations

import itertools

import pytest
import torch

from ntp_megatron.plan.layout import make_topology, next_topology
from ntp_megatron.plan.memory_plan import (ModelDims, Training, gpt_params, param_specs, plan, rank_state,
                                      stage_rank_state, stage_state, worst_state)

DIMS = [
    ModelDims(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, kv_channels=8,
              ffn_hidden_size=40, vocab_size=97, max_position_embeddings=16),
    ModelDims(num_layers=1, hidden_size=48, num_attention_heads=6, num_query_groups=3, kv_channels=8,
              ffn_hidden_size=24, vocab_size=64, max_position_embeddings=16, normalization="RMSNorm",
              gated_linear_unit=True, learned_position_embedding=False, untied_output=True),
]


def _config(dims: ModelDims, precision: str = "fp32", dist_opt: bool = False, tp: int = 1, dead: str = ""):
    from ntp_megatron.config.schema import load_job_config

    overrides = [f"model.num_layers={dims.num_layers}", f"model.hidden_size={dims.hidden_size}",
                 f"model.num_attention_heads={dims.num_attention_heads}",
                 f"model.num_query_groups={dims.num_query_groups}", f"model.kv_channels={dims.kv_channels}",
                 f"model.ffn_hidden_size={dims.ffn_hidden_size}", f"model.vocab_size={dims.vocab_size}",
                 f"model.seq_length={dims.max_position_embeddings}", f"model.normalization={dims.normalization}",
                 f"model.gated_linear_unit={str(dims.gated_linear_unit).lower()}",
                 f"model.activation={'swiglu' if dims.gated_linear_unit else 'gelu'}",
                 f"model.position_embedding_type={'learned_absolute' if dims.learned_position_embedding else 'rope'}",
                 f"model.untie_embeddings_and_output_weights={str(dims.untied_output).lower()}",
                 f"parallel.tensor_model_parallel_size={tp}", f"training.precision={precision}",
                 "ntp.enabled=true", "training.device=cpu"]
    if dist_opt:  # the config only feeds the model's and DDP's configs here (NTP's refusal of it aside)
        overrides += ["parallel.use_distributed_optimizer=true", "ntp.enabled=false"]
    if dead:
        overrides.append(f"ntp.dead_slots=[{dead}]")
    return load_job_config(overrides=overrides)


def test_dims_of_the_config_resolve_its_defaults():
    from ntp_megatron.config.schema import load_job_config

    cfg = load_job_config(overrides=["model.hidden_size=64", "model.num_attention_heads=8"])
    dims = ModelDims.of(cfg.model)
    assert (dims.num_query_groups, dims.kv_channels, dims.ffn_hidden_size) == (8, 8, 256)
    assert dims.units == cfg.unit_counts()


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_split_the_model_and_the_plan_takes_the_largest_stage(tied):
    """PP2 and PP4 of a four-layer model: the stages hold the whole model's parameters once each, in order (the
    embeddings in the first stage, the final norm and output layer in the last), bar the last stage's copy of
    tied embeddings; a stage holds less than the whole model, and the plan is its largest stage's."""
    import dataclasses

    whole = dataclasses.replace(DIMS[0], num_layers=4, untied_output=not tied)
    want = [(p.name, p.family, p.numel) for p in gpt_params(whole)]
    for pp in (2, 4):
        dims = dataclasses.replace(whole, pipeline_stages=pp)
        stages = [[(p.name, p.family, p.numel) for p in gpt_params(dims, stage)] for stage in range(pp)]
        copy = ("output_layer.weight", "vocab", whole.hidden_size)
        assert (copy in stages[-1]) and (copy in want) != tied
        assert [p for stage in stages for p in stage if tied is False or p != copy] == want
        layers = [{n.split(".")[2] for n, _, _ in stage if n.startswith("decoder.layers.")} for stage in stages]
        assert layers == [{str(i) for i in range(p * 4 // pp, (p + 1) * 4 // pp)} for p in range(pp)]
        healthy = [stage_state(dims, 2, 2, Training(), p) for p in range(pp)]
        assert max(s.total for s in healthy) < stage_state(whole, 2, 2, Training()).total
        assert worst_state(dims, 2, 1, Training()).total == max(stage_state(dims, 2, 1, Training(), p).total
                                                                for p in range(pp))
    with pytest.raises(ValueError, match="stage 2 out of range 0..1"):
        gpt_params(dataclasses.replace(whole, pipeline_stages=2), 2)
    # A rank's state is its own stage's, whether given the whole pipeline topology or its stage's (a rank's setup).
    from ntp_megatron.plan.stages import make_pipeline_topology

    dims = dataclasses.replace(whole, pipeline_stages=2)
    topology = make_pipeline_topology(2, 2, 2, dims.units, dead_slots=[(1, 0, 1)])
    for rank in range(topology.world_size):
        replica, slot, stage = topology.slot_of(rank)
        got = rank_state(dims, topology, rank, Training())
        assert got == stage_rank_state(dims, topology.stage_of(rank), rank, Training())
        width = topology.widths(replica)[stage]
        bound = stage_state(dims, 2, width, Training(), stage)
        # exact at width 1, and for slot 0 of a healthy stage (the larger block of the odd vocabulary)
        assert got.total <= bound.total and (got == bound) is (width == 1 or slot == 0), (rank, stage)


def test_the_plan_of_a_pipeline_config_is_per_stage():
    from ntp_megatron.config.schema import load_job_config
    from ntp_megatron.plan.memory_plan import plan_of, table

    sets = ["ntp.enabled=true", "parallel.tensor_model_parallel_size=2", "model.init=layout_free",
            "model.num_layers=4"]
    pp1 = plan_of(load_job_config(overrides=sets))
    pp2_cfg = load_job_config(overrides=[*sets, "parallel.pipeline_model_parallel_size=2"])
    pp2 = plan_of(pp2_cfg)
    assert pp2.healthy.total < pp1.healthy.total and pp2.worst.total < pp1.worst.total
    assert "(of any of its 2 stages)" in table(pp2_cfg)


def _objects(megatron, cfg, topology, rank: int):
    """What a rank of ``topology`` builds, made with the product's own constructors in this one-rank world: its NTP
    model in DDP, its optimizer, and (degraded) a shadow DDP per block it is the sync-group member of."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallel

    from ntp_megatron.core.shadows import shadow_module
    from ntp_megatron.core.gpt import RankUnits, build_ntp_gpt
    from ntp_megatron.training.components import build_optimizer
    from ntp_megatron.training.model import ddp_config, transformer_config

    m, tf_config = cfg.model, transformer_config(cfg, torch.device("cpu"))
    units = RankUnits(*(tuple(topology.units_of(rank, f)) for f in ("heads", "ffn", "vocab")))
    gpt = build_ntp_gpt(tf_config, units, m.normalization, m.vocab_size, initialize=False,
                        max_sequence_length=m.seq_length, pre_process=True, post_process=True,
                        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                        position_embedding_type=m.position_embedding_type, pg_collection=megatron)
    gpt = gpt.to(dtype=tf_config.params_dtype)
    model = DistributedDataParallel(tf_config, ddp_config(cfg), gpt, pg_collection=megatron)
    optimizer = build_optimizer(cfg, tf_config, model, SimpleNamespace(pg=megatron, topology=None))
    inner = optimizer.chained_optimizers[0]
    inner.init_state_fn(inner.optimizer)  # Adam's moments, allocated as at the first step
    shadows = [] if topology.replica_of(rank).width == topology.tp_base else [
        DistributedDataParallel(tf_config, ddp_config(cfg), shadow_module(gpt, topology, b), pg_collection=megatron)
        for b in topology.member_blocks(rank)]
    return model, optimizer, shadows


@pytest.mark.parametrize("dims", DIMS, ids=["layernorm-tied", "rmsnorm-gqa-gated-rope-untied"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameters_and_bytes_equal_the_real_objects(megatron, dims, precision):
    """A healthy rank, a survivor and a proxy of a TP3 replica that lost a slot: the NTP model's parameters in
    order, and every byte its model, DDP buffers, shadows and optimizer allocate, against the plan."""
    cfg = _config(dims, precision=precision)
    healthy = make_topology(3, 1, dims.units)
    degraded = next_topology(healthy, [1])
    proxy = degraded.sync_member(0, 1)
    cases = [(healthy, 0), (degraded, proxy), (degraded, 1 - proxy)]
    for topology, rank in cases:
        model, optimizer, shadows = _objects(megatron, cfg, topology, rank)
        held = {f: len(topology.units_of(rank, f)) for f in dims.units}
        assert [(s.name, s.numel) for s in param_specs(gpt_params(dims), held)] == \
            [(n, p.numel()) for n, p in model.module.named_parameters()]
        want = stage_rank_state(dims, topology, rank, Training(precision=precision))
        assert want.params == _bytes(model.module.parameters())
        assert want.grads == _bytes(b.grad_data for b in model.buffers)
        assert want.optimizer == _bytes(_optimizer_tensors(optimizer))
        assert want.shadow_grads == _bytes(b.grad_data for s in shadows for b in s.buffers)
        assert want.shadow_params == 0 and len(shadows) == len(topology.member_blocks(rank)) * (topology is degraded)
    assert stage_rank_state(dims, degraded, proxy, Training()).shadow_grads > \
        stage_rank_state(dims, degraded, 1 - proxy, Training()).shadow_grads > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_healthy_rank_with_the_distributed_optimizer_equals_megatrons_objects(megatron, precision):
    """Megatron-Core's DDP buffers and DistributedOptimizer for slot 0 of a TP3 replica, sharding over 3
    positions (a stand-in group): the padded buffer, and the largest shard's main params and moments."""
    import copy

    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from ntp_megatron.core.gpt import RankUnits, build_ntp_gpt
    from ntp_megatron.training.model import ddp_config, transformer_config
    from tests.unit.plan.test_optimizer_shards import _DpPosition

    dims = DIMS[1]
    cfg = _config(dims, precision=precision, dist_opt=True)
    m, tf_config = cfg.model, transformer_config(cfg, torch.device("cpu"))
    topology = make_topology(3, 1, dims.units)
    units = RankUnits(*(tuple(topology.units_of(0, f)) for f in ("heads", "ffn", "vocab")))
    gpt = build_ntp_gpt(tf_config, units, m.normalization, m.vocab_size, initialize=False,
                        max_sequence_length=m.seq_length, pre_process=True, post_process=True,
                        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                        position_embedding_type=m.position_embedding_type, pg_collection=megatron)
    gpt = gpt.to(dtype=tf_config.params_dtype)
    pg = copy.copy(megatron)
    pg.dp = pg.dp_cp = pg.intra_dp_cp = _DpPosition(3, 0)
    ddp = DistributedDataParallel(tf_config, ddp_config(cfg), gpt, pg_collection=pg)
    [buffer] = ddp.buffers
    largest = 0
    for j in range(3):
        buffer.data_parallel_group = _DpPosition(3, j)
        optimizer = DistributedOptimizer(torch.optim.AdamW(gpt.parameters(), lr=1e-3),
                                         OptimizerConfig(lr=1e-3, bf16=precision == "bf16"), None, None, [ddp],
                                         {0: ddp.buffers}, _DpPosition(3, j), None, 0, 0)
        stepped = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
        moments = 2 * sum(p.numel() * 4 for p in stepped)  # what Adam's first step allocates
        mains = 0 if precision == "fp32" else _bytes(stepped)  # fp32: the steps are views of the param buffer
        largest = max(largest, moments + mains)
    want = stage_rank_state(dims, topology, 0, Training(precision=precision, distributed_optimizer=True, shard_over=3))
    assert want.params == buffer.param_data.untyped_storage().nbytes()
    assert want.grads == buffer.grad_data.untyped_storage().nbytes()
    assert want.optimizer == largest


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_degraded_rank_with_the_distributed_optimizer_equals_its_real_objects(megatron, precision):
    """A proxy and a survivor of a TP3 replica that lost a slot, under the distributed optimizer sharding over 2
    positions (a stand-in group): the rank's own model and accumulating gradient buffer (no parameter buffer),
    each shadow's padded parameter and gradient buffers as :class:`ntp_megatron.core.shadows.Shadow` builds them
    (its parameters live in them), and the optimizer over the shadows: at each position the main params (bf16) and
    Adam's moments of its shard of every shadow, the plan being the largest position's per shadow."""
    import copy
    from types import SimpleNamespace

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from ntp_megatron.core.shadows import Shadow
    from ntp_megatron.training.model import build_model, ddp_config, transformer_config
    from tests.unit.plan.test_optimizer_shards import _DpPosition

    dims, size = DIMS[1], 2
    cfg = _config(dims, precision=precision, dist_opt=True)
    tf_config = transformer_config(cfg, torch.device("cpu"))
    degraded = next_topology(make_topology(3, 1, dims.units), [1])
    proxy = degraded.sync_member(0, 1)
    for rank in (proxy, 1 - proxy):
        model = build_model(cfg, tf_config, megatron, torch.device("cpu"), degraded, rank, own_buckets_sync=False,
                            initialize=False)
        blocks = degraded.member_blocks(rank)
        largest = dict.fromkeys(blocks, 0)
        for j in range(size):
            pg = copy.copy(megatron)
            pg.dp = pg.dp_cp = pg.intra_dp_cp = _DpPosition(size, j)
            groups = SimpleNamespace(with_sync_groups=lambda block, pg=pg: pg)
            shadows = [Shadow(model.module, degraded, b, groups, tf_config, ddp_config(cfg), distributed_optimizer=True)
                       for b in blocks]
            chunks = [s.ddp for s in shadows]
            optimizer = DistributedOptimizer(
                torch.optim.AdamW([p for c in chunks for p in c.module.parameters()], lr=1e-3),
                OptimizerConfig(lr=1e-3, bf16=precision == "bf16"), None, None, chunks,
                {i: c.buffers for i, c in enumerate(chunks)}, _DpPosition(size, j), None, 0, 0)
            for block, shadow in zip(blocks, shadows):
                stepped = []  # the tensors the optimizer steps for this shadow: its shard's main params
                for param in shadow.module.parameters():
                    group, order = optimizer.model_param_group_index_map.get(param, (None, None))
                    if group is not None:
                        stepped.append(optimizer.optimizer.param_groups[group]["params"][order])
                moments = 2 * sum(p.numel() * 4 for p in stepped)  # what Adam's first step allocates
                mains = 0 if precision == "fp32" else _bytes(stepped)  # fp32: views of the parameter buffer
                largest[block] = max(largest[block], moments + mains)
        want = stage_rank_state(dims, degraded, rank, Training(precision=precision, distributed_optimizer=True,
                                                         shard_over=size))
        assert model.buffers[0].param_data is None
        assert want.params == _bytes(model.module.parameters())
        assert want.grads == _bytes(b.grad_data for b in model.buffers)
        assert want.shadow_params == _bytes(p for s in shadows for p in s.module.parameters()) == \
            sum(s.ddp.buffers[0].param_data.untyped_storage().nbytes() for s in shadows)
        assert want.shadow_grads == _bytes(b.grad_data for s in shadows for b in s.ddp.buffers)
        assert want.optimizer == sum(largest.values())
    assert len(degraded.member_blocks(proxy)) == 2


def _optimizer_tensors(optimizer):
    """Every tensor the optimizer keeps besides the model's parameters: per-element state and fp32 main copies."""
    inner = optimizer.chained_optimizers[0]
    out = [t for state in inner.optimizer.state.values() for t in state.values()
           if isinstance(t, torch.Tensor) and t.dim() > 0]
    for group in getattr(inner, "fp32_from_float16_groups", ()):
        out += list(group)
    return out


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def test_the_distributed_optimizer_counts_the_padded_buffer_and_one_shard():
    """A healthy rank: parameters and gradients in the padded flat buffer, optimizer state for its shard only
    (about 1/D of the non-distributed optimizer's)."""
    dims = DIMS[0]
    topology = make_topology(2, 1, dims.units)
    plain = stage_rank_state(dims, topology, 0, Training(precision="bf16"))
    sharded = stage_rank_state(dims, topology, 0, Training(precision="bf16", distributed_optimizer=True, shard_over=4))
    assert plain.params <= sharded.params < plain.params + 2 * 64 * len(gpt_params(dims)) + 2 * 128
    assert plain.optimizer / 4 <= sharded.optimizer < plain.optimizer / 4 + 12 * 64 * len(gpt_params(dims))
    assert plain.optimizer == 12 * plain.params // 2  # bf16: 2 bytes per parameter, 12 of optimizer state


def test_a_proxy_holds_more_than_a_survivor_and_the_worst_case_grows_as_min_tp_falls():
    dims = DIMS[0]
    training = Training(precision="bf16", distributed_optimizer=True, shard_over=2)
    healthy = make_topology(4, 1, dims.units)
    after = next_topology(healthy, [3])
    proxy = after.sync_member(0, 3)
    survivor = next(r for r in range(after.world_size) if r != proxy)
    assert stage_rank_state(dims, after, proxy, training).total > stage_rank_state(dims, after, survivor, training).total
    assert stage_rank_state(dims, after, survivor, training).total > stage_rank_state(dims, healthy, 0, training).total
    totals = [plan(dims, 4, min_tp, training).worst.total for min_tp in (3, 2, 1)]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    at_one = plan(dims, 4, 1, training)
    assert at_one.worst_width == 1 and at_one.healthy.total < at_one.worst.total


def reachable(tp_base: int, units: dict, min_tp: int):
    """Every layout one replica can have at widths min_tp .. tp_base - 1, each once: started with slots dead, and
    reached by deaths one at a time in every order (dealing is sticky: the order matters)."""
    def key(t):
        return tuple((tuple(tuple(t.units_of(r, f)) for f in sorted(units)), tuple(t.member_blocks(r)))
                     for r in range(t.world_size))

    found = {}
    for dead in range(1, tp_base - min_tp + 1):
        for slots in itertools.combinations(range(tp_base), dead):
            t = make_topology(tp_base, 1, units, dead_slots=[(0, s) for s in slots])
            found.setdefault(key(t), t)
    frontier, expanded = [make_topology(tp_base, 1, units)], set()
    while frontier:
        current = frontier.pop()
        if current.replicas[0].width <= min_tp:
            continue
        for rank in range(current.world_size):
            after = next_topology(current, [rank])
            if key(after) not in expanded:
                expanded.add(key(after))
                frontier.append(after)
            found.setdefault(key(after), after)
    return list(found.values())


@pytest.mark.parametrize("tp_base, units", [(4, {"heads": 6, "ffn": 10, "vocab": 9}),
                                            (5, {"heads": 5, "ffn": 12, "vocab": 7})])
@pytest.mark.parametrize("dist_opt", [False, True])
def test_the_bound_covers_every_rank_of_every_reachable_layout(tp_base, units, dist_opt):
    """:func:`worst_state` at each width is at least every rank's state in every layout reachable at that width
    (launch-time dead slots and deaths in every order), equal to the largest at width 1, and close above it."""
    dims = ModelDims(num_layers=1, hidden_size=16, num_attention_heads=units["heads"],
                     num_query_groups=units["heads"], kv_channels=4, ffn_hidden_size=units["ffn"],
                     vocab_size=units["vocab"], max_position_embeddings=8)
    training = Training(precision="bf16", distributed_optimizer=dist_opt, shard_over=2)
    exact: dict[int, int] = {}
    for topology in reachable(tp_base, units, 1):
        width = topology.replicas[0].width
        for rank in range(topology.world_size):
            exact[width] = max(exact.get(width, 0), stage_rank_state(dims, topology, rank, training).total)
    assert sorted(exact) == list(range(1, tp_base))
    for width, largest in exact.items():
        bound = worst_state(dims, tp_base, width, training).total
        assert largest <= bound <= 1.25 * largest, (width, largest, bound)
    assert worst_state(dims, tp_base, 1, training).total == exact[1]
    assert plan(dims, tp_base, 1, training).worst.total == max(worst_state(dims, tp_base, w, training).total
                                                                for w in range(1, tp_base))


def test_a_min_tp_whose_plan_exceeds_the_budget_is_refused_naming_the_one_that_fits(capsys):
    from ntp_megatron.config.schema import load_job_config
    from ntp_megatron.config.files import ConfigError
    from ntp_megatron.launch.launcher import main
    from ntp_megatron.plan.memory_plan import GIB, plan_of

    base = ["parallel.tensor_model_parallel_size=4", "training.precision=bf16"]
    cfg = load_job_config(overrides=base)
    needs = {m: plan_of(cfg, m).worst.total for m in (1, 2, 3, 4)}
    assert needs[1] > needs[2] > needs[3] > needs[4]
    between = (needs[2] + needs[1]) / 2 / GIB  # fits min_tp 2, not 1
    with pytest.raises(ConfigError, match=r"ntp.min_tp \(1\) lets a rank hold up to .* ntp.min_tp 2 is the lowest"):
        load_job_config(overrides=base + [f"ntp.memory_budget_gib={between}"])
    assert load_job_config(overrides=base + [f"ntp.memory_budget_gib={between}", "ntp.min_tp=2"])
    with pytest.raises(ConfigError, match="not even a healthy rank fits"):
        load_job_config(overrides=base + [f"ntp.memory_budget_gib={needs[4] / 2 / GIB}"])
    args = [f"--set={kv}" for kv in base + [f"ntp.memory_budget_gib={between}"]]
    assert main(args + ["--train-iters", "10"]) == 2
    assert "ntp.min_tp 2 is the lowest that fits" in capsys.readouterr().err
    assert main([f"--set={kv}" for kv in base] + ["--print-memory-plan"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == [4, 3, 2, 1] and rows[0][-1] == "healthy"
    assert float(rows[-1][5]) * 2**20 == pytest.approx(needs[1], rel=1e-3)


def test_the_budget_check_with_the_distributed_optimizer_uses_its_resolved_instances():
    """Under NTP with the distributed optimizer the instance count defaults (2 at an even DP): the plan shards over
    DP / 2, and a budget below it is one line, not a crash."""
    from ntp_megatron.config.schema import load_job_config
    from ntp_megatron.config.files import ConfigError
    from ntp_megatron.plan.memory_plan import GIB, plan_of

    base = ["parallel.tensor_model_parallel_size=2", "parallel.data_parallel_size=4",
            "parallel.use_distributed_optimizer=true", "training.global_batch_size=16"]
    cfg = load_job_config(overrides=base + ["ntp.memory_budget_gib=1000"])
    assert cfg.parallel.num_distributed_optimizer_instances == 2
    planned = plan_of(cfg)
    assert planned.worst.total > planned.healthy.total
    with pytest.raises(ConfigError, match="above ntp.memory_budget_gib"):
        load_job_config(overrides=base + [f"ntp.memory_budget_gib={planned.healthy.total / 2 / GIB}"])
