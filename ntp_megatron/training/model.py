"""The GPT model on Megatron-Core: ``TransformerConfig`` from the YAML ``model`` section, ``GPTModel``
with the local layer spec (or Transformer Engine's), wrapped in Megatron's DDP."""

from __future__ import annotations

import importlib.util
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.gpt import GPTModel, gpt_layer_specs
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from ntp_megatron import phases
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.core.gpt import RankUnits, build_ntp_gpt, uniform_units
from ntp_megatron.core.init import initialize_layout_free
from ntp_megatron.plan.optimizer_shards import ddp_bucket_size

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(cfg: JobConfig, device: Optional[torch.device] = None) -> TransformerConfig:
    """Megatron's TransformerConfig; the YAML ``model`` keys are its own field names. ``device``: where the model
    will live (default: where ``training.device`` resolves on this machine); it decides CPU initialisation and
    the fusions."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    on_cuda = (device.type if device is not None else _requested_device_type(cfg)) == "cuda"
    activation = {"gelu": F.gelu, "swiglu": F.silu, "squared_relu": lambda x: torch.pow(F.relu(x), 2)}
    dtype = _DTYPES[t.precision]
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.kv_channels,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        normalization=m.normalization,
        gated_linear_unit=m.gated_linear_unit,
        activation_func=activation[m.activation],
        init_method_std=m.init_method_std,
        layernorm_epsilon=m.layernorm_epsilon,
        # Under NTP the TP degree differs per replica and comes from the process group; the config's value
        # only feeds upstream's divisibility asserts, which uneven layouts must not hit.
        tensor_model_parallel_size=1 if cfg.ntp.enabled else p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,  # a stage builds num_layers / pp layers
        sequence_parallel=p.sequence_parallel,
        # Megatron allocates parameters on the current CUDA device unless this is set; on CPU it must be.
        use_cpu_initialization=not on_cuda,
        # Off only for a plain model with model.init layout_free (build_model initialises it); NTP models switch it
        # off in their own copy and initialise themselves.
        perform_initialization=cfg.ntp.enabled or cfg.initializer == "megatron",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        # Mean over every token of the global batch, whatever the DP/TP layout.
        calculate_per_token_loss=True,
        **fusions(cfg, on_cuda),
        finalize_model_grads_func=finalize_model_grads,
        cuda_graph_scope=[],  # the non-deprecated spelling of upstream's default "full"
    )


def _requested_device_type(cfg: JobConfig) -> str:
    requested = cfg.training.device
    return "cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()) else "cpu"


def fusions(cfg: JobConfig, on_cuda: bool) -> dict[str, bool]:
    """Megatron's fused kernels: all off on CPU (they are CUDA kernels); on CUDA, Megatron-LM's defaults (all on)
    where this model and the installed packages allow them: no fused bias-activation for squared ReLU; the fused
    masked softmax only with Apex's ``scaled_*masked_softmax_cuda`` extensions (the local spec imports them at the
    first forward); the persistent layer norm only where it is Apex's LayerNorm (the local spec's RMSNorm, and its
    LayerNorm without Apex, are torch norms that refuse the flag) or Transformer Engine's (which ignores it); fused
    RoPE only with rotary embeddings and Transformer Engine's kernel; gradient-accumulation fusion only with Apex's
    ``fused_weight_gradient_mlp_cuda`` (Megatron's own linear layers, the output layer included, need it even with
    Transformer Engine layers)."""
    if not on_cuda:
        return dict.fromkeys(FUSIONS, False)
    m = cfg.model
    te = m.transformer_impl == "transformer_engine"
    return {
        "bias_activation_fusion": m.activation in ("gelu", "swiglu"),
        "masked_softmax_fusion": _importable("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
        "bias_dropout_fusion": True,
        "apply_rope_fusion": m.position_embedding_type == "rope" and _fused_rope_available(),
        "gradient_accumulation_fusion": _importable("fused_weight_gradient_mlp_cuda"),
        "persist_layer_norm": te or (m.normalization == "LayerNorm" and _importable("apex")),
    }


def _importable(*modules: str) -> bool:
    return all(importlib.util.find_spec(name) is not None for name in modules)


FUSIONS = ("bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion", "persist_layer_norm")


def _fused_rope_available() -> bool:
    return rope_utils.fused_apply_rotary_pos_emb is not None


def layer_spec(cfg: JobConfig):
    if cfg.model.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401 - an optional dependency: only whether it is there
        except ImportError:
            raise SystemExit(
                "model.transformer_impl is 'transformer_engine' but Transformer Engine is not installed; "
                "use 'local' or install the gpu extra"
            ) from None
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization=cfg.model.normalization)


def ddp_config(cfg: JobConfig) -> DistributedDataParallelConfig:
    """The job's DDP config (a fresh object each call: Megatron's DDP writes into the one it is given).

    The bucket size is fixed here, from the launch-time data-parallel size, rather than left to Megatron's
    default (which reads the size of the DP group at construction): under NTP a rank built after a
    re-formation must lay its buckets out exactly as the healthy ranks built at launch did.
    """
    p = cfg.parallel
    bucket_size = ddp_bucket_size(p.ddp_bucket_size, p.overlap_grad_reduce, p.data_parallel_size)  # at launch
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=p.overlap_grad_reduce,
        bucket_size=bucket_size,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        num_distributed_optimizer_instances=cfg.parallel.num_distributed_optimizer_instances,
        check_for_nan_in_grad=False,
    )


def build_model(
    cfg: JobConfig, tf_config: TransformerConfig, pg_collection: ProcessGroupCollection, device: torch.device,
    topology=None, rank: int | None = None, own_buckets_sync: bool = True, initialize: bool = True,
) -> DistributedDataParallel:
    """Megatron's GPTModel (uniform TP), or with ``topology`` the NTP model of ``rank``'s units; wrapped in DDP.

    ``own_buckets_sync=False`` (a degraded NTP replica): the DDP buckets only accumulate gradients; they are
    never communicated (the NTP grad sync copies them into slot-shaped shadows), so no overlap is set up, and
    under the distributed optimizer they are not sharded either.
    """
    m = cfg.model
    pp = pg_collection.pp
    common = dict(
        max_sequence_length=m.max_position_embeddings or m.seq_length,
        pre_process=pp.rank() == 0,  # the first stage embeds the tokens
        post_process=pp.rank() == pp.size() - 1,  # the last one computes the logits and the loss
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        pg_collection=pg_collection,
    )
    if topology is None:
        gpt = GPTModel(config=tf_config, transformer_layer_spec=layer_spec(cfg), vocab_size=m.vocab_size, **common)
        gpt = gpt.to(device)
        if not tf_config.perform_initialization:
            mark_tensor_parallel(gpt, tf_config)
            if initialize:
                initialize_uniform_layout_free(gpt, tf_config, cfg.training.seed, pg_collection.tp, pp.rank())
    else:
        units = RankUnits(*(tuple(topology.units_of(rank, family)) for family in ("heads", "ffn", "vocab")))
        gpt = build_ntp_gpt(tf_config, units, m.normalization, m.vocab_size, initialize=initialize,
                            init=cfg.initializer, seed=cfg.training.seed, device=device,
                            layer_offset=layer_offset(tf_config, pp.rank()), **common)
    # bf16 / fp16: the whole model in 16 bits, norms included, as Megatron-LM's Float16Module casts it (the
    # wrapper itself is left out: NTP code reads the GPT module directly; the loss is fp32 either way).
    gpt = gpt.to(device=device, dtype=tf_config.params_dtype)
    if cfg.ntp.enabled and cfg.ntp.progress_fence:
        mark_progress(gpt)
    config = ddp_config(cfg)
    if not own_buckets_sync:
        config.overlap_grad_reduce = False
        # Nor is it sharded: under the distributed optimizer the shadows hold the shards (no parameter buffer here).
        config.use_distributed_optimizer = False
        config.num_distributed_optimizer_instances = 1
    model = DistributedDataParallel(tf_config, config, gpt, pg_collection=pg_collection)
    if config.overlap_grad_reduce:
        tf_config.no_sync_func = model.no_sync  # as Megatron-LM's training loop: sync after the last micro-batch
    n_params = sum(p.numel() for p in gpt.parameters())
    logger.info("GPT model: %d parameters on this rank", n_params)
    return model


def mark_progress(gpt: torch.nn.Module) -> None:
    """A progress mark (:func:`ntp_megatron.phases.tick`) as every transformer layer's forward begins and as its
    backward begins, so that a working rank's progress count moves within a micro-batch (``ntp.progress_fence``:
    the launcher takes a rank whose count stands still while its peers wait on it for a stuck one)."""
    for module in gpt.modules():
        if isinstance(module, TransformerLayer):
            module.register_forward_pre_hook(_tick_forward)
            module.register_forward_hook(_tick_at_backward)


def _tick_forward(module: torch.nn.Module, args) -> None:
    phases.tick()


def _tick_at_backward(module: torch.nn.Module, args, output) -> None:
    hidden = output[0] if isinstance(output, tuple) else output
    if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
        hidden.register_hook(_tick_gradient)


def _tick_gradient(grad: torch.Tensor) -> None:
    phases.tick()  # returns None: the gradient is left as it is


def mark_tensor_parallel(gpt: torch.nn.Module, tf_config: TransformerConfig) -> None:
    """The TP attributes Megatron sets on a split weight only while initialising it (``perform_initialization``),
    set here for a model built without: DDP, the optimizer and checkpoints read them."""
    for name, module in gpt.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            stride = 2 if name.endswith("linear_fc1") and tf_config.gated_linear_unit else 1
            set_tensor_model_parallel_attributes(weight, True, 0, stride)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)


def initialize_uniform_layout_free(gpt: torch.nn.Module, tf_config: TransformerConfig, seed: int, tp_group,
                                   stage: int = 0) -> None:
    """``model.init: layout_free`` for a plain Megatron model at uniform TP, any stage: the same values as every NTP
    layout (and every pipeline layout: layers are named by their global number)."""
    rank, size = tp_group.rank(), tp_group.size()
    initialize_layout_free(gpt, tf_config, seed, lambda name, param: uniform_units(name, param, tf_config, rank, size),
                           layer_offset=layer_offset(tf_config, stage))


def layer_offset(tf_config: TransformerConfig, stage: int) -> int:
    """The global number of pipeline stage ``stage``'s first transformer layer (Megatron's rule)."""
    return get_transformer_layer_offset(tf_config, pp_rank=stage)
