"""How many bytes of training state a rank holds in a layout: a pure function of the model's dimensions, the
topology and the precision / optimizer choices, so the launcher can print it, and refuse a ``ntp.min_tp`` that
would not fit, before any rank starts.

*State* is what lives for the whole run: parameters, gradient buffers, optimizer state (fp32 main params and
moments), and on a rank of a degraded replica the slot-shaped shadow buffers of every canonical block it is the
sync-group member of (:mod:`ntp_megatron.core.grad_sync`). Activations, the allocator's caches and communication
buffers are not state and are not counted. Byte sizes follow Megatron-Core: gradients accumulate in fp32
(``grad_reduce_in_fp32``); Adam keeps two fp32 moments, and under bf16 / fp16 an fp32 main copy of every
parameter it steps; with the distributed optimizer both cover only this rank's shard of each bucket, and the
parameters live in the DDP's padded flat buffer (:mod:`ntp_megatron.plan.optimizer_shards`). ``tests/unit/plan/test_memory_plan.py``
pins the parameter list to the real NTP GPT model and the totals to the tensors Megatron-Core and the grad sync
allocate, for healthy and degraded ranks, with and without the distributed optimizer (a degraded rank's model with
its accumulating gradient buffer, its shadows' padded parameter and gradient buffers, and the optimizer's state of
its shard of each shadow's buckets: :mod:`ntp_megatron.core.grad_sync`). A shadow's parameters are expanded single
elements until its DDP points them into its parameter buffer, so building one allocates its buffers and nothing
more.

Parameters are listed in ``named_parameters()`` order of the GPT model on Megatron-Core's local layer spec (the
spec NTP builds on), with each TP-split parameter's elements per unit of its family (``(outer, inner)`` of
:class:`ntp_megatron.core.layers.HeldUnits`). With pipeline stages a rank holds its stage's part of the model (its
layers; the embeddings in the first stage, the final norm and the output layer in the last, which holds a copy
of tied embeddings as its output layer), and a plan is the largest over the stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Optional

from ntp_megatron.plan.layout import Topology, balanced_counts
from ntp_megatron.plan.optimizer_shards import ParamSpec, buffer_layout, ddp_bucket_size, shard_numel
from ntp_megatron.plan.stages import JobTopology

GIB = 2**30


@dataclass(frozen=True)
class ParamShape:
    """One parameter: its family and elements per unit when it is TP-split, else its elements (replicated)."""

    name: str
    family: Optional[str]
    numel: int
    """Elements per unit of ``family``; for a replicated parameter (family None) all of them."""


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a GPT model that decide its parameters (the YAML ``model`` section's, resolved)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    normalization: str = "LayerNorm"
    gated_linear_unit: bool = False
    learned_position_embedding: bool = True
    untied_output: bool = False
    pipeline_stages: int = 1
    """The stages the layers are split into, evenly (``parallel.pipeline_model_parallel_size``)."""

    @classmethod
    def of(cls, model, pipeline_stages: int = 1) -> "ModelDims":
        """From a :class:`ntp_megatron.config.schema.ModelSection`, its defaults resolved as :mod:`training.model` does."""
        heads = model.num_attention_heads
        return cls(num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=heads,
                   num_query_groups=model.num_query_groups or heads,
                   kv_channels=model.kv_channels or model.hidden_size // heads,
                   ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size, vocab_size=model.vocab_size,
                   max_position_embeddings=model.max_position_embeddings or model.seq_length,
                   normalization=model.normalization, gated_linear_unit=model.gated_linear_unit,
                   learned_position_embedding=model.position_embedding_type == "learned_absolute",
                   untied_output=model.untie_embeddings_and_output_weights, pipeline_stages=pipeline_stages)

    @property
    def units(self) -> dict[str, int]:
        """Units per family (:meth:`ntp_megatron.config.schema.JobConfig.unit_counts`)."""
        return {"heads": self.num_query_groups, "ffn": self.ffn_hidden_size, "vocab": self.vocab_size}


def gpt_params(dims: ModelDims, stage: int = 0) -> list[ParamShape]:
    """Pipeline stage ``stage``'s parameters of the GPT model in ``named_parameters()`` order (biases on, as
    Megatron's default ``add_bias_linear``; LayerNorm has a bias, RMSNorm none), layers named by their global
    number. Without stages, the whole model."""
    if not 0 <= stage < dims.pipeline_stages:
        raise ValueError(f"stage {stage} out of range 0..{dims.pipeline_stages - 1}")
    first, last = stage == 0, stage == dims.pipeline_stages - 1
    per_stage = dims.num_layers // dims.pipeline_stages
    h = dims.hidden_size
    per_group = dims.num_attention_heads // dims.num_query_groups * dims.kv_channels  # query channels per group
    qkv_rows = per_group + 2 * dims.kv_channels  # a query group's rows: its queries, one key, one value
    gate = 2 if dims.gated_linear_unit else 1

    def norm(prefix: str) -> list[ParamShape]:
        out = [ParamShape(f"{prefix}.weight", None, h)]
        return out + [ParamShape(f"{prefix}.bias", None, h)] if dims.normalization == "LayerNorm" else out

    params = []
    if first:
        params.append(ParamShape("embedding.word_embeddings.weight", "vocab", h))
        if dims.learned_position_embedding:
            params.append(ParamShape("embedding.position_embeddings.weight", None, dims.max_position_embeddings * h))
    for layer in range(stage * per_stage, (stage + 1) * per_stage):
        p = f"decoder.layers.{layer}"
        params += norm(f"{p}.input_layernorm")
        params += [ParamShape(f"{p}.self_attention.linear_proj.weight", "heads", h * per_group),
                   ParamShape(f"{p}.self_attention.linear_proj.bias", None, h),
                   ParamShape(f"{p}.self_attention.linear_qkv.weight", "heads", qkv_rows * h),
                   ParamShape(f"{p}.self_attention.linear_qkv.bias", "heads", qkv_rows)]
        params += norm(f"{p}.pre_mlp_layernorm")
        params += [ParamShape(f"{p}.mlp.linear_fc1.weight", "ffn", gate * h),
                   ParamShape(f"{p}.mlp.linear_fc1.bias", "ffn", gate),
                   ParamShape(f"{p}.mlp.linear_fc2.weight", "ffn", h),
                   ParamShape(f"{p}.mlp.linear_fc2.bias", None, h)]
    if last:
        params += norm("decoder.final_layernorm")
        if dims.untied_output or not first:  # untied, or the last stage's copy of tied embeddings
            params.append(ParamShape("output_layer.weight", "vocab", h))
    return params


def unit_cost(dims: ModelDims, stage: int = 0) -> dict[str, int]:
    """Parameter elements of one unit of each family in pipeline stage ``stage``: a rank's GEMM work per unit it
    holds (the rebalance monitor and the simulator's rebalance model weigh ranks' work by it)."""
    cost = dict.fromkeys(dims.units, 0)
    for p in gpt_params(dims, stage):
        if p.family is not None:
            cost[p.family] += p.numel
    return cost


def param_specs(params: Sequence[ParamShape], units: Mapping[str, int]) -> list[ParamSpec]:
    """The parameters of a rank that holds ``units[family]`` units of each family, for the buffer layout."""
    return [ParamSpec(p.name, p.numel * units[p.family] if p.family else p.numel) for p in params]


@dataclass(frozen=True)
class Training:
    """The choices besides the model that decide the bytes per element."""

    precision: str = "fp32"                 # training.precision
    optimizer: str = "adam"                 # training.optimizer
    distributed_optimizer: bool = False     # parallel.use_distributed_optimizer
    shard_over: int = 1
    """With the distributed optimizer: the ranks one instance shards a bucket over (data-parallel size /
    ``num_distributed_optimizer_instances``)."""
    bucket_size: Optional[int] = None
    """The DDP's bucket size in elements (None: one bucket; see :func:`ntp_megatron.training.model.ddp_config`)."""

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer bytes per stepped element: moments (Adam two, SGD's momentum one), plus the fp32 main copy
        under 16-bit precision."""
        moments = 8 if self.optimizer == "adam" else 4
        return moments + (0 if self.precision == "fp32" else 4)


@dataclass(frozen=True)
class StateBytes:
    """One rank's training state, by kind (bytes)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    shadow_params: int = 0
    shadow_grads: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def __add__(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def _numel(params: Sequence[ParamShape], units: Mapping[str, int]) -> int:
    return sum(spec.numel for spec in param_specs(params, units))


def _sharded(params: Sequence[ParamShape], units: Mapping[str, int], training: Training) -> tuple[int, int]:
    """(elements of the padded flat buffer, most elements any position's shard of it holds)."""
    layout = buffer_layout(param_specs(params, units), training.bucket_size, training.shard_over, True)
    return layout.numel, max(shard_numel(layout, training.shard_over, j) for j in range(training.shard_over))


def rank_state(dims: ModelDims, topology: JobTopology, rank: int, training: Training) -> StateBytes:
    """The state ``rank`` of ``topology`` (a whole :class:`~ntp_megatron.plan.stages.JobTopology`) holds: its stage's
    :func:`stage_rank_state`."""
    return stage_rank_state(dims, topology.stage_of(rank), rank, training)


def stage_rank_state(dims: ModelDims, topology: Topology, rank: int, training: Training) -> StateBytes:
    """The state ``rank`` of ``topology`` holds (:func:`state`): ``topology`` is the layout of ``rank``'s stage (a
    :class:`~ntp_megatron.plan.layout.Topology`, its ``stage``)."""
    stage = topology.stage
    held = {family: len(topology.units_of(rank, family)) for family in dims.units}
    if topology.is_healthy(topology.replica_of(rank).index):  # canonical: no shadow (a weighted replica has them)
        return state(dims, held, None, training, stage)
    blocks = [{family: len(topology.block(family, b)) for family in dims.units} for b in topology.member_blocks(rank)]
    return state(dims, held, blocks, training, stage)


def state(dims: ModelDims, held: Mapping[str, int], member_blocks: Optional[Sequence[Mapping[str, int]]],
          training: Training, stage: int = 0) -> StateBytes:
    """The state of a rank of pipeline stage ``stage`` that holds ``held[family]`` units, and is the sync-group
    member of blocks of ``member_blocks`` sizes (None: a rank of a healthy replica).

    - A healthy rank: Megatron-Core's own, at slot ``s``. With the distributed optimizer the parameters sit in the
      DDP's padded flat buffer and the optimizer covers this rank's shard of every bucket.
    - A rank of a degraded replica: its model (its own units and those dealt to it) with a gradient buffer that
      only accumulates; for every block it is the sync-group member of, a shadow with that block's slot-shaped
      gradient buffer. Without the distributed optimizer its optimizer steps its model's parameters; with it,
      each shadow also holds the slot-shaped parameters, and the optimizer covers the rank's shard of each
      shadow's buckets.
    """
    params = gpt_params(dims, stage)
    pb, gb, ob = training.param_bytes, 4, training.optimizer_bytes
    if member_blocks is None:
        if training.distributed_optimizer:
            numel, shard = _sharded(params, held, training)
            return StateBytes(params=numel * pb, grads=numel * gb, optimizer=shard * ob)
        numel = _numel(params, held)
        return StateBytes(params=numel * pb, grads=numel * gb, optimizer=numel * ob)
    numel = _numel(params, held)
    total = StateBytes(params=numel * pb, grads=numel * gb,
                       optimizer=0 if training.distributed_optimizer else numel * ob)
    for block_units in member_blocks:
        if training.distributed_optimizer:
            shadow, shard = _sharded(params, block_units, training)
            total += StateBytes(optimizer=shard * ob, shadow_params=shadow * pb, shadow_grads=shadow * gb)
        else:
            total += StateBytes(shadow_grads=_numel(params, block_units) * gb)
    return total


@dataclass(frozen=True)
class Plan:
    """The state of a healthy rank, and a bound on any rank's in any layout a replica can reach down to
    ``min_tp``."""

    healthy: StateBytes
    worst: StateBytes
    worst_width: int
    """The replica width (TP degree) the bound is largest at."""
    min_tp: int


def worst_state(dims: ModelDims, tp_base: int, width: int, training: Training) -> StateBytes:
    """At least the state of any rank of a replica of ``width`` live slots, whatever died in what order, in the
    stage that holds the most (:func:`stage_state`)."""
    return max((stage_state(dims, tp_base, width, training, p) for p in range(dims.pipeline_stages)),
               key=lambda s: s.total)


def stage_state(dims: ModelDims, tp_base: int, width: int, training: Training, stage: int = 0) -> StateBytes:
    """At least the state of any rank of a replica's stage ``stage`` at ``width`` live slots, whatever died in
    what order.

    :mod:`ntp_megatron.plan.layout` keeps a degraded replica's unit counts balanced per family (a rank holds at most
    ``ceil(N / width)`` units of a family of N) and deals proxy roles to the live slot with the fewest (a rank is
    the sync-group member of its own block and of at most ``ceil((tp_base - width) / width)`` dead ones). The
    bound takes all of those at once, its blocks the largest ones (blocks are balanced, larger first); it is exact
    at width 1, where the one rank holds everything and is every block's member."""
    units = dims.units
    sizes = {f: balanced_counts(n, tp_base) for f, n in units.items()}  # block sizes, larger first
    if width == tp_base:
        return state(dims, {f: counts[0] for f, counts in sizes.items()}, None, training, stage)
    held = {f: -(-n // width) for f, n in units.items()}
    roles = 1 + -(-(tp_base - width) // width)
    return state(dims, held, [{f: counts[b] for f, counts in sizes.items()} for b in range(roles)], training, stage)


def plan(dims: ModelDims, tp_base: int, min_tp: int, training: Training) -> Plan:
    """The state of a healthy rank (the largest block's), and the bound of :func:`worst_state` over every width
    from ``min_tp`` to ``tp_base - 1``. With the distributed optimizer the shard count is every replica's: a
    degraded replica keeps a member in every sync group."""
    healthy = worst_state(dims, tp_base, tp_base, training)
    worst, worst_width = healthy, tp_base
    for width in range(min_tp, tp_base):
        bound = worst_state(dims, tp_base, width, training)
        if bound.total > worst.total:
            worst, worst_width = bound, width
    return Plan(healthy, worst, worst_width, min_tp)


def training_of(cfg) -> Training:
    """The :class:`Training` choices of a :class:`ntp_megatron.config.schema.JobConfig`."""
    p = cfg.parallel
    instances = p.num_distributed_optimizer_instances
    return Training(precision=cfg.training.precision, optimizer=cfg.training.optimizer,
                    distributed_optimizer=p.use_distributed_optimizer,
                    shard_over=max(1, p.data_parallel_size // instances) if p.use_distributed_optimizer else 1,
                    bucket_size=ddp_bucket_size(p.ddp_bucket_size, p.overlap_grad_reduce,
                                                p.data_parallel_size))


def dims_of(cfg) -> ModelDims:
    """The :class:`ModelDims` of a :class:`ntp_megatron.config.schema.JobConfig` (its model, split into its stages)."""
    return ModelDims.of(cfg.model, cfg.parallel.pipeline_model_parallel_size)


def plan_of(cfg, min_tp: Optional[int] = None) -> Plan:
    """:func:`plan` for a :class:`ntp_megatron.config.schema.JobConfig` (down to its ``ntp.min_tp``, or ``min_tp``)."""
    return plan(dims_of(cfg), cfg.parallel.tensor_model_parallel_size,
                cfg.ntp.min_tp if min_tp is None else min_tp, training_of(cfg))


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 100 else f"{n / 2**20:.2f} MiB"


def describe(plan_: Plan) -> str:
    """One line for the launcher's header."""
    return (f"training state per rank: {_gib(plan_.healthy.total)} healthy, at most {_gib(plan_.worst.total)} down "
            f"to ntp.min_tp {plan_.min_tp} (at TP{plan_.worst_width}); activations not counted")


def table(cfg) -> str:
    """Every width's bound, healthy down to ``ntp.min_tp``, by kind (``ntp-launch --print-memory-plan``)."""
    dims, training, tp_base = dims_of(cfg), training_of(cfg), cfg.parallel.tensor_model_parallel_size
    rows = [(width, worst_state(dims, tp_base, width, training)) for width in range(tp_base, cfg.ntp.min_tp - 1, -1)]
    name, size = ("GiB", GIB) if rows[0][1].total >= GIB else ("MiB", 2**20)
    sharding = (f"distributed optimizer over {training.shard_over}" if training.distributed_optimizer
                else "optimizer not sharded")
    stages = f" (of any of its {dims.pipeline_stages} stages)" if dims.pipeline_stages > 1 else ""
    lines = [f"training state per rank: the most any rank{stages} holds at each TP degree of its replica (in total, "
             f"with that rank's parts by kind), in {name} "
             f"(activations, caches and communication buffers not counted); {training.precision}, "
             f"{training.optimizer}, {sharding}",
             f"{'TP':>4} {'params':>10} {'grads':>10} {'optimizer':>10} {'shadows':>10} {'total':>10}"]
    for width, s in rows:
        lines.append(f"{width:>4} {s.params / size:>10.3f} {s.grads / size:>10.3f} {s.optimizer / size:>10.3f} "
                     f"{(s.shadow_params + s.shadow_grads) / size:>10.3f} {s.total / size:>10.3f}"
                     + ("  healthy" if width == tp_base else ""))
    if cfg.ntp.memory_budget_gib is not None:
        lines.append(f"ntp.memory_budget_gib: {cfg.ntp.memory_budget_gib:g} GiB")
    return "\n".join(lines)


def check_budget(cfg) -> None:
    """Refuse (ValueError) a ``ntp.min_tp`` whose plan exceeds ``ntp.memory_budget_gib``, naming the lowest one that
    fits."""
    budget = cfg.ntp.memory_budget_gib
    if budget is None:
        return
    limit = budget * GIB
    worst = plan_of(cfg)
    if worst.worst.total <= limit:
        return
    tp_base = cfg.parallel.tensor_model_parallel_size
    fits = next((m for m in range(cfg.ntp.min_tp + 1, tp_base + 1) if plan_of(cfg, m).worst.total <= limit), None)
    hint = (f"ntp.min_tp {fits} is the lowest that fits" if fits is not None else
            f"not even a healthy rank fits ({_gib(worst.healthy.total)})")
    raise ValueError(f"ntp.min_tp ({cfg.ntp.min_tp}) lets a rank hold up to {_gib(worst.worst.total)} of training "
                     f"state (at TP{worst.worst_width}), above ntp.memory_budget_gib ({budget:g} GiB): {hint} "
                     "(ntp-launch --print-memory-plan shows every TP degree)")
