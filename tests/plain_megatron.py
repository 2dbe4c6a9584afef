"""Plain Megatron-Core, without ntp-megatron: GPTModel (local spec), DistributedDataParallel,
get_megatron_optimizer, OptimizerParamScheduler, MockGPTDataset and ``dist_checkpointing``, on CPU/gloo with
one forked process per rank (TP × DP × PP, DP1 and PP1 unless ``--dp``, ``--pp``). The other side of the NTP
checkpoint tests:

    python -m tests.plain_megatron train  --tp 2 [--pp 2] --iters 6 --save-at 3 --ckpt DIR --out losses.json
    python -m tests.plain_megatron train  --tp 1 --write-init init.pt --save-at 0 --ckpt DIR --out records.json
    python -m tests.plain_megatron train  --tp 2 --pp 2 --dp 2 --init-state init.pt ... --full-records
    python -m tests.plain_megatron logits --tp 1 --tp 2 [--pp 2] --ckpt DIR [--ckpt DIR2] --out logits.pt

``train`` trains from Megatron's own initialisation, saves ``{model, optimizer, scheduler, iteration}`` at
``--save-at`` into ``DIR/iter_<n>`` and writes every iteration's lm loss. ``logits`` loads a checkpoint
(model and optimizer) at each TP degree and writes the full-vocabulary logits of :func:`fixed_batch`, as
``{(ckpt, tp): logits}``.

Whole states are one format: every tensor whole (TP slices joined as Megatron lays them out, :func:`tp_split`),
keyed by its name in the PP1 model (global layer numbers; the last stage's copy of tied embeddings left out),
flattened fp32. ``train --write-init FILE`` writes the model's initial parameters so, right after the build and
before any step; ``train --init-state FILE`` starts from such parameters instead of Megatron's initialisation, at
any TP and PP (:func:`load_whole_state`: loaded into the GPTModel before DDP and the optimizer are built, after its
own tied-embedding copy), so that every layout trains from one initial model. Megatron's initialisation differs
between layouts (its draws depend on the TP slice and, with PP, on the stage), so layouts are compared from one
``--init-state``.

``train --state FILE`` also writes the final parameters and Adam moments (a whole state), and ``--out``
each iteration's lm loss, grad norm and learning rate (``--full-records``: those records without the state): the
independent reference of the NTP equivalence property test (``tests/jobs/equivalence/test_ntp_equivalence.py``), run in a
process that never imports ntp-megatron (it asserts so). ``--spread FILE`` then trains the same model at TP1 × DP1
without the distributed optimizer and writes its records there: plain Megatron-Core's own spread between layouts.

What is trained (:class:`Model`) takes Megatron-LM's flags: ``--num-layers``, ``--hidden-size``,
``--num-attention-heads``, ``--num-query-groups``, ``--kv-channels``, ``--ffn-hidden-size``, ``--vocab-size``,
``--seq-length``, ``--position-embedding-type``, ``--normalization``, ``--swiglu`` / ``--squared-relu``,
``--untie-embeddings-and-output-weights``, ``--global-batch-size``, ``--clip-grad``; the defaults are the test jobs'
tiny model. ``serve`` pays the imports once and runs one request (a list of these arguments) per input line in a
forked child (:func:`serve`).

``train --load DIR`` continues a checkpoint (model, optimizer, scheduler; with ``--dist-opt`` in the format its
content metadata names, as Megatron-LM reads it) from its iteration to ``--iters``. With ``--dist-opt``, ``--save-at``
writes the distributed optimizer in ``--sharding-type`` (Megatron-LM's default ``dp_reshardable``, or
``fully_reshardable``) and stores Megatron-LM's content metadata with it.

``train --dp N --pp P`` runs TP × N × P ranks in Megatron's order (TP fastest, then DP, then the pipeline stage:
rank = stage · TP · N + dp_rank · TP + tp_rank). ``--pp P`` splits the layers evenly into P stages (GPTModel's
``pre_process`` / ``post_process`` from the stage) and runs Megatron's 1F1B schedule
(``forward_backward_pipelining_without_interleaving`` with a ``P2PCommunicator`` on the pipeline group); every
stage reads its DP rank's micro-batches, and the last stage's loss is broadcast along the pipeline
(:func:`train_step`); checkpoints are Megatron's sharded ones (global layer numbers), so a PP2 checkpoint loads at
any PP. The layout's other options: ``--dist-opt`` Megatron's distributed optimizer, ``--instances k`` its partial form
(``num_distributed_optimizer_instances``: reduce-scatter inside each of k instances of N/k replicas, all-reduce
across them, so every optimizer shard lives on k ranks; PP1 only), ``--overlap`` (``overlap_grad_reduce``) and
``--bucket-size``. ``--shards DIR`` writes every rank's distributed-optimizer shard (fp32 main params and Adam
moments in bucket order, ``get_parameter_state_dp_reshardable``) with its instance and position, so twins can be
compared. ``--memory DIR`` writes every rank's state bytes by kind and step times (the benchmark's reference,
``ntp_megatron.bench.memory``). With ``--dist-opt``, ``--state`` gathers the moments with Megatron's own
``get_parameter_state_dp_zero(use_gloo_comm=False)`` (instance 0's shards, over the intra-instance group) and
writes them whole, as without it; the parameters are the model's, complete on every rank after the step's
all-gather. With TP or PP, each stage's TP ranks at DP rank 0 join their TP slices and rank 0 gathers the stages'
(:func:`gather_whole_state`).

Groups: ``parallel_state.initialize_model_parallel(tp, pp)`` builds the one-instance grid (its k > 1 path imports
einops); the partial groups of k > 1 are made here with ``new_group`` by Megatron's rule
(``parallel_state.initialize_model_parallel``): instance i is the contiguous block [i·N/k, (i+1)·N/k) of each
data-parallel group, the inter-instance group joins the ranks at one position of every instance, and the
instance group (the grad-norm group) is the TP groups of one instance's replicas. They go into an explicit
``ProcessGroupCollection`` given to GPTModel, DDP, ``get_megatron_optimizer`` and the schedule.

Data: Megatron-LM's pretraining sampler (``MegatronPretrainingSampler``) cuts the sample sequence into runs of
micro_batch_size × N and gives DP rank r the r-th micro-batch of each run, so at iteration it the rank's m-th
micro-batch is samples it·G + m·mbs·N + r·mbs + [0, mbs). ntp-megatron's jobs give replica r one contiguous share
instead, it·G + r·G/N + [0, G/N) (``ntp_megatron.training.data.replica_sample_range``). Both read the same G
samples of each iteration once each; with per-token loss the loss and the gradient are sums over those samples
divided by their token total, so the two agree up to the order of summation (at N = 1 they are the same).

The optimizer, schedule and data mirror the test jobs' config (``tests.harness.TINY``, tiny_cpu.yaml), written out
here with Megatron's own names; the model too unless its flags say otherwise. No ntp-megatron code runs here, not
even its patches of upstream:
Megatron-Core runs unmodified, and what it needs to run on a machine without CUDA is this module's own
(:class:`CpuForCuda`, :func:`run_without_cuda`):

- Megatron-Core allocates DDP buffers, optimizer and schedule tensors with ``device=torch.cuda.current_device()``
  or ``device="cuda"``, moves tensors with ``.cuda()``, calls ``torch.cuda.synchronize()``, and its gradient
  clipping asserts ``grad.type() == "torch.cuda.FloatTensor"``: a torch function mode puts every such tensor on
  the CPU and answers CUDA's type names for CPU tensors. The same covers the pipeline: ``P2PCommunicator``'s
  receive buffers (``device=torch.cuda.current_device()``), its ``torch.cuda.synchronize()`` after
  ``batch_isend_irecv``, and the tied-embedding copy of ``LanguageModule.setup_embeddings_and_output_layer``
  (``weight.data = weight.data.cuda()`` before its all-reduce over the embedding group: a Tensor method, which a
  torch function mode sees too).
- With more than one distributed-optimizer instance DDP makes a ``torch.cuda.Stream`` for the inter-instance
  all-reduce (even with overlap off), and its bucket groups enter ``torch.cuda.stream(...)`` and wait on
  ``torch.cuda.default_stream()``: CPU collectives are synchronous, so a null stream whose waits do nothing
  stands in.
- Its RNG tracker keeps CUDA generator states; dropout is 0 here, so nothing is drawn inside a fork of it and
  the fork is a no-op (the weights come from the CPU generator: ``use_cpu_initialization``).
- Without Transformer Engine or Apex, Megatron-Core's optimizers are torch's Adam, whose state exists only after a
  first step and keeps a step tensor per parameter: a distributed-optimizer load needs that state to exist
  (:func:`start_torch_adam`), and its loads mishandle torch's per-parameter step (:func:`copy_without_step`,
  :func:`restore_steps`).
- An upstream bug makes a sample's loss mask depend on the first sample a process read (the cached mask is
  modified in place); the dataset's mask cache is switched off, so every sample's masks are built afresh by
  upstream's own code.

The two ``dist_checkpointing`` patches of ntp-megatron (layer-axis chunks of uneven shardings, exactly-once
coverage of uneven shardings) are not applied either: this process only ever writes and reads regular grids, as
plain Megatron-Core does, and NTP checkpoints must load here without them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import re
import select
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import forked

SEED = 1234
VOCAB = 256
SEQ = 64
MICRO = 2
GLOBAL_BATCH = 12
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 1


@dataclass(frozen=True)
class Model:
    """What is trained: the GPT's dimensions and options, the global batch and the clipping, with Megatron-LM's
    names (the defaults: the test jobs' tiny model, ``tests.harness.TINY``)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_query_groups: Optional[int] = None
    """None: multi-head attention."""
    kv_channels: Optional[int] = None
    """None: hidden_size / num_attention_heads."""
    ffn_hidden_size: Optional[int] = None
    """None: 4 × hidden_size."""
    vocab_size: int = VOCAB
    seq_length: int = SEQ
    position_embedding_type: str = "learned_absolute"
    normalization: str = "LayerNorm"
    activation: str = "gelu"
    """gelu, swiglu (Megatron-LM's ``--swiglu``: SiLU, gated) or squared_relu (``--squared-relu``)."""
    untie_embeddings_and_output_weights: bool = False
    global_batch_size: int = GLOBAL_BATCH
    clip_grad: float = 1.0


class CpuForCuda:
    """A torch function mode for a CPU-only process running Megatron-Core's CUDA-only call sites: tensors asked
    for on ``cuda`` are made on the CPU, ``.cuda()`` is the identity, and ``Tensor.type()`` names CPU tensors
    as the CUDA tensor types upstream asserts (``torch.cuda.FloatTensor``)."""

    @staticmethod
    def make():
        from torch.overrides import TorchFunctionMode

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = dict(kwargs or {})
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                if func is torch.Tensor.cuda:
                    return args[0]
                if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                    name = func(*args)
                    return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
                return func(*args, **kwargs)

        return _Mode()


class NullStream:
    """A CUDA stream for a CPU process: CPU ops and gloo collectives are synchronous, so there is nothing to
    order or wait for."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def run_without_cuda() -> None:
    """Everything this process needs to run Megatron-Core without CUDA, besides :class:`CpuForCuda` (which every
    rank enters): CUDA's device queries answer for the CPU, its streams are :class:`NullStream`, the RNG
    tracker's fork is a no-op, GPT datasets build every sample's masks afresh, and the distributed optimizer's
    loads leave torch's Adam step alone (:func:`copy_without_step`)."""
    import contextlib

    from megatron.core.datasets import gpt_dataset
    from megatron.core.optimizer import DistributedOptimizer
    from megatron.core.tensor_parallel import random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = NullStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.default_stream = torch.cuda.current_stream = lambda device=None: NullStream()
    random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    DistributedOptimizer._set_main_param_and_optimizer_states = copy_without_step(
        DistributedOptimizer._set_main_param_and_optimizer_states)
    build = gpt_dataset.GPTDataset.__init__

    def uncached(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.masks_and_position_ids_are_cacheable = False

    gpt_dataset.GPTDataset.__init__ = uncached


def transformer_config(tp: int, model: Model, pp: int = 1):
    from megatron.core.activations import squared_relu
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    activation = {"gelu": F.gelu, "swiglu": F.silu, "squared_relu": squared_relu}[model.activation]
    return TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size, hidden_dropout=0.0, attention_dropout=0.0,
        normalization=model.normalization, activation_func=activation,
        gated_linear_unit=model.activation == "swiglu", init_method_std=0.02, layernorm_epsilon=1e-5,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, calculate_per_token_loss=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        finalize_model_grads_func=finalize_model_grads, cuda_graph_scope=[],
    )


@dataclass(frozen=True)
class Layout:
    """How the job is laid out and synced: TP × DP × PP ranks, the distributed optimizer and its instances."""

    tp: int = 1
    dp: int = 1
    dist_opt: bool = False
    instances: int = 1
    overlap: bool = False
    bucket_size: Optional[int] = None
    micro_batch: int = MICRO
    model: Model = Model()
    pp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    def place(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, DP rank, TP rank) of global rank ``rank`` in Megatron's order ("tp-cp-ep-dp-pp": TP
        fastest, then DP, then the stage), i.e. rank = stage · TP · DP + dp_rank · TP + tp_rank."""
        return rank // (self.tp * self.dp), rank // self.tp % self.dp, rank % self.tp


def process_groups(layout: Layout):
    """The explicit collection every Megatron-Core object of this rank gets: parallel_state's one-instance groups,
    and for k > 1 instances the partial groups (made by every rank, in one order) by Megatron's rule."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg = ProcessGroupCollection.use_mpu_process_groups()
    k = layout.instances
    if k == 1:
        return pg
    assert layout.pp == 1, "the partial distributed-optimizer groups are made for one pipeline stage"
    rank, tp, per_instance = dist.get_rank(), layout.tp, layout.dp // k
    timeout = timedelta(seconds=120)

    def mine(groups: list[list[int]]):
        made = [(ranks, dist.new_group(ranks, timeout=timeout)) for ranks in groups]
        [group] = [group for ranks, group in made if rank in ranks]
        return group

    dp_groups = [list(range(t, layout.world, tp)) for t in range(tp)]  # one per TP rank, in DP order
    pg.intra_dp_cp = pg.intra_expt_dp = mine(
        [ranks[i * per_instance:(i + 1) * per_instance] for ranks in dp_groups for i in range(k)])
    pg.inter_dist_opt = mine([ranks[j::per_instance] for ranks in dp_groups for j in range(per_instance)])
    pg.intra_dist_opt = mine([list(range(i * per_instance * tp, (i + 1) * per_instance * tp)) for i in range(k)])
    return pg


def build(layout: Layout, train_iters: int, pg, init_state: Optional[dict] = None):
    """GPTModel in DDP, optimizer, scheduler, as Megatron-Core builds them: this rank's pipeline stage of it
    (``pre_process`` on the first stage, ``post_process`` on the last). ``init_state`` (whole tensors under PP1
    names, :func:`load_whole_state`) replaces Megatron's initialisation before DDP and the optimizer are built,
    so they start from it as from their own."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    m = layout.model
    torch.manual_seed(SEED)  # Megatron's CPU initialisation draws from the CPU generator
    config = transformer_config(layout.tp, m, layout.pp)
    stage = pg.pp.rank()
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=m.normalization),
                   vocab_size=m.vocab_size, max_sequence_length=m.seq_length, pre_process=stage == 0,
                   post_process=stage == layout.pp - 1,
                   share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                   position_embedding_type=m.position_embedding_type, pg_collection=pg)
    if init_state is not None:  # after GPTModel's own first-to-last-stage copy of tied embeddings: both overwritten
        load_whole_state(gpt, init_state, pg)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=layout.overlap, use_distributed_optimizer=layout.dist_opt,
        num_distributed_optimizer_instances=layout.instances, bucket_size=layout.bucket_size,
        check_for_nan_in_grad=False)
    model = DistributedDataParallel(config, ddp_config, gpt, pg_collection=pg)
    if layout.overlap:
        config.no_sync_func = model.no_sync  # as Megatron-LM's training loop: sync after the last micro-batch
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                        adam_eps=1e-8, clip_grad=m.clip_grad, bf16=False, fp16=False, params_dtype=torch.float32,
                        use_distributed_optimizer=layout.dist_opt),
        [model], use_gloo_process_groups=False, pg_collection=pg)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP * m.global_batch_size,
        lr_decay_steps=train_iters * m.global_batch_size, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=train_iters * m.global_batch_size, wd_incr_style="constant")
    return model, optimizer, scheduler


WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def pp1_names(gpt, pg) -> dict[str, str]:
    """The name each of this stage's parameters has in the PP1 model, by its name here: stage-local layer i is
    global layer i + the stage's offset (Megatron's ``get_transformer_layer_offset``), and the last stage's copy
    of tied embeddings (``output_layer.weight`` with ``pre_process`` off) is the word embeddings it copies."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(gpt.config, pp_rank=pg.pp.rank())
    tied_copy = gpt.share_embeddings_and_output_weights and gpt.post_process and not gpt.pre_process
    return {name: WORD_EMBEDDINGS if tied_copy and name == OUTPUT_LAYER else
            _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name, count=1)
            for name, _ in gpt.named_parameters()}


def tp_split(name: str, param, config) -> Optional[tuple[int, bool]]:
    """How Megatron lays out ``param``'s TP slices: None if every TP rank holds it whole, else (``partition_dim``,
    gated). Shard r is chunk r of the whole on that dimension, except for ``linear_fc1`` under a gated linear unit
    (swiglu): the whole is [gate; up] and each rank holds [its gate rows; its up rows], since its MLP splits its own
    output in two halves. linear_qkv needs nothing special even under GQA: its rows are laid out query group by
    query group ([q heads of group g, k_g, v_g] for each g), and each TP rank holds whole groups, a contiguous
    chunk."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    gated = config.gated_linear_unit and name.rsplit(".", 2)[-2] == "linear_fc1"
    return param.partition_dim, gated


def tp_slices(whole: torch.Tensor, split: tuple[int, bool], tp: int) -> list[torch.Tensor]:
    """The TP slices of a whole tensor, by :func:`tp_split`'s layout."""
    dim, gated = split
    if not gated:
        return list(whole.chunk(tp, dim))
    gate, up = whole.chunk(2, dim)
    return [torch.cat(pair, dim) for pair in zip(gate.chunk(tp, dim), up.chunk(tp, dim))]


def tp_whole(parts: list[torch.Tensor], split: tuple[int, bool]) -> torch.Tensor:
    """The whole tensor of its TP slices (the inverse of :func:`tp_slices`)."""
    dim, gated = split
    if not gated:
        return torch.cat(parts, dim)
    halves = [part.chunk(2, dim) for part in parts]
    return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim)


def load_whole_state(gpt, state: dict, pg) -> None:
    """Overwrite this rank's part of the model with ``state``: whole tensors under PP1 names, flattened (what
    ``--write-init`` and ``--state`` write), at any TP and PP (:func:`pp1_names`, :func:`tp_slices`). A collective
    over the world: every key must be some stage's (``output_layer.weight`` aside when the embeddings are tied:
    the last stage loads the word embeddings into its copy)."""
    tp, tp_rank = pg.tp.size(), pg.tp.rank()
    names = pp1_names(gpt, pg)
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            key = names[name]
            if key not in state:
                raise KeyError(f"the initial state has no {key} (stage {pg.pp.rank()}'s {name})")
            split = tp_split(name, param, gpt.config)
            shape = list(param.shape)
            if split is not None:
                shape[split[0]] *= tp
            if state[key].numel() != torch.Size(shape).numel():
                raise ValueError(f"the initial state's {key} has {state[key].numel()} elements, not {shape}")
            whole = state[key].reshape(shape)
            param.copy_(whole if split is None else tp_slices(whole, split, tp)[tp_rank])
    used: list = [None] * dist.get_world_size()
    dist.all_gather_object(used, sorted(set(names.values())))
    unused = set(state) - {key for keys in used for key in keys}
    if gpt.share_embeddings_and_output_weights:
        unused.discard(OUTPUT_LAYER)
    if unused:
        raise ValueError(f"the initial state has tensors no stage holds: {sorted(unused)[:5]}")


def gather_whole_state(gpt, pg, layout: Layout, moments: Optional[dict] = None) -> Optional[dict]:
    """Every parameter whole under its PP1 name, flattened fp32, on rank 0 (None elsewhere), with each one's Adam
    moments (``name.exp_avg``, ``name.exp_avg_sq``) if ``moments`` (:func:`whole_moments`) is given. A collective
    over the world: the TP ranks of each stage's DP rank 0 all-gather the TP slices, their TP rank 0 sends the stage's
    tensors to rank 0 (``gather_object``), which puts them in PP1 order (stage by stage). The last stage's copy of
    tied embeddings is left out, after checking that it equals the word embeddings."""
    rank = dist.get_rank()
    _, dp_rank, tp_rank = layout.place(rank)
    names = pp1_names(gpt, pg)
    mine: dict = {}
    if dp_rank == 0:  # every rank of this TP group: the gathers are collectives of the group
        for name, param in gpt.named_parameters():
            tensors = {names[name]: param.detach()}
            if moments is not None:
                tensors.update({f"{names[name]}.{key}": moments[param][key].view(param.shape)
                                for key in ("exp_avg", "exp_avg_sq")})
            split = tp_split(name, param, gpt.config)
            copy = gpt.share_embeddings_and_output_weights and name == OUTPUT_LAYER  # the tied copy: only compared
            for key, local in tensors.items():
                if split is not None and layout.tp > 1:
                    slices = [torch.empty_like(local) for _ in range(layout.tp)]
                    dist.all_gather(slices, local.contiguous(), group=pg.tp)
                    local = tp_whole(slices, split)
                mine[(copy, key)] = local.reshape(-1).float().clone()
    parts: Optional[list] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine if dp_rank == 0 and tp_rank == 0 else None, parts, dst=0)
    if rank != 0:
        return None
    out, copies = {}, []
    for part in parts:  # in rank order: stage by stage
        for (copy, key), value in (part or {}).items():
            if copy:
                copies += [value] if key == WORD_EMBEDDINGS else []
                continue
            assert key not in out, f"two stages hold {key}"
            out[key] = value
    for value in copies:
        assert torch.equal(value, out[WORD_EMBEDDINGS]), "the last stage's tied output layer left the word embeddings"
    return out


def dataset(train_iters: int, cache: Path, model: Model = Model()):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers import MegatronTokenizer

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"},
                                                  vocab_size=model.vocab_size)
    config = GPTDatasetConfig(random_seed=SEED, sequence_length=model.seq_length, blend=None, split="100,0,0",
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=str(cache))
    return BlendedMegatronDatasetBuilder(MockGPTDataset, [train_iters * model.global_batch_size, 0, 0],
                                         lambda: True, config).build()[0]


def sampler_microbatches(iteration: int, dp_rank: int, layout: Layout) -> list[range]:
    """The samples of each micro-batch DP rank ``dp_rank`` reads at 0-based ``iteration``, as Megatron-LM's
    ``MegatronPretrainingSampler`` deals them: the ``dp_rank``-th micro-batch of every run of
    micro_batch × dp consecutive samples of the global batch."""
    mbs, dp, batch = layout.micro_batch, layout.dp, layout.model.global_batch_size
    if batch % (mbs * dp):
        raise ValueError(f"global batch {batch} is not a multiple of micro batch {mbs} × dp {dp}")
    first = iteration * batch + dp_rank * mbs
    return [range(first + m * mbs * dp, first + m * mbs * dp + mbs) for m in range(batch // (mbs * dp))]


def train_step(model, optimizer, scheduler, data, iteration: int, layout: Layout, pg) -> dict[str, float]:
    """Iteration ``iteration`` (0-based) on global samples ``[iteration·G, (iteration+1)·G)``, this rank's part
    of them (:func:`sampler_microbatches`): the global lm loss, grad norm (before clipping, as Megatron reports
    it) and the learning rate its step used.

    With PP, Megatron's 1F1B schedule (``forward_backward_pipelining_without_interleaving``, which takes explicit
    groups only together with a ``P2PCommunicator``) runs every stage on the same micro-batches of its DP rank:
    the first stage reads the tokens, the last the labels and loss mask. Only the last stage gets the
    micro-batches' ``[loss sum, tokens]``; their sum over its DP group is broadcast along the pipeline, so that
    every rank (rank 0 the one that writes them) returns the same records."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    stage, dp_rank, _ = layout.place(dist.get_rank())
    parts = sampler_microbatches(iteration, dp_rank, layout)

    def batches():
        for samples in parts:
            items = [data[i] for i in samples]
            yield {key: torch.stack([item[key] for item in items]) for key in items[0]}

    def forward_step(iterator, model):
        batch = next(iterator)
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])

        def loss_func(output_tensor):
            losses = output_tensor.float().view(-1)
            mask = batch["loss_mask"].float().view(-1)
            loss_sum = torch.sum(losses * mask)
            return loss_sum, mask.sum().to(torch.int), {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}

        return output, loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    pipeline = {"p2p_communicator": P2PCommunicator(pp_group=pg.pp, config=model.config)} if layout.pp > 1 else {}
    reported = get_forward_backward_func(pp_size=layout.pp)(
        forward_step_func=forward_step, data_iterator=batches(), model=[model],
        num_microbatches=len(parts), seq_length=layout.model.seq_length, micro_batch_size=layout.micro_batch,
        forward_only=False, pg_collection=pg, **pipeline)
    last = stage == layout.pp - 1
    total = torch.stack([r["lm loss"] for r in reported]).sum(dim=0) if last else torch.zeros(2)
    if layout.dp > 1 and last:  # the loss over the whole global batch, as Megatron-LM reports it
        dist.all_reduce(total, group=pg.dp_cp)
    if layout.pp > 1:
        dist.broadcast(total, src=dist.get_global_rank(pg.pp, layout.pp - 1), group=pg.pp)
    lr = optimizer.param_groups[0]["lr"]
    _, grad_norm, _ = optimizer.step()
    scheduler.step(increment=layout.model.global_batch_size)
    return {"lm_loss": float(total[0] / total[1]), "grad_norm": float(grad_norm), "lr": lr}


def sharded_state(model, optimizer, is_loading: bool, metadata: Optional[dict] = None) -> dict:
    """The checkpoint request; ``metadata`` (the distributed optimizer's: :func:`checkpoint_metadata`) goes to the
    optimizer, as Megatron-LM's ``generate_state_dict`` passes it."""
    model_sd = model.module.sharded_state_dict()
    if metadata is None:
        return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}


def checkpoint_metadata(layout: Layout, sharding_type: str) -> Optional[dict]:
    """What Megatron-LM's ``_build_sharded_state_dict_metadata`` builds, and stores as the checkpoint's content
    metadata, with the distributed optimizer (None without: this script's checkpoints then stay as they were):
    ``dp_reshardable`` (Megatron-LM's default, bucket space) or ``fully_reshardable``
    (``--dist-ckpt-optim-fully-reshardable``, model space)."""
    if not layout.dist_opt:
        return None
    metadata = {"distrib_optim_sharding_type": sharding_type}
    if sharding_type == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata.update(singleton_local_shards=False, chained_optim_avoid_prefix=True)
    return metadata


def start_torch_adam(dist_opt) -> None:
    """Give a fresh distributed optimizer the state torch's Adam has only after its first step (zero moments, step
    0). Megatron's ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` reads the step from every
    parameter's state; with Transformer Engine's or Apex's Adam (not installed here) the step lives in the
    parameter groups instead."""
    dist_opt.init_state_fn(dist_opt.optimizer, dist_opt.config)
    for state in dist_opt.optimizer.state.values():
        state.setdefault("step", torch.tensor(0.0))


def restore_steps(dist_opt) -> None:
    """Every parameter's Adam step, from the parameter groups the load restored (where Megatron's distributed
    optimizer keeps it): its ``load_state_dict`` gives all parameters one shared step tensor, which torch's Adam
    would advance once per parameter and step, and ``dp_reshardable``'s parameter state then copies in the step the
    request was built with."""
    for group in dist_opt.optimizer.param_groups:
        for param in group["params"]:
            dist_opt.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))


def copy_without_step(set_states):
    """Megatron's ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every key of a parameter's
    optimizer state from the loaded tensors; torch's Adam keeps its ``step`` there, which ``fully_reshardable``'s
    loader does not hand in (KeyError) and ``dp_reshardable``'s hands in stale: the copy runs with the step set
    aside, and :func:`restore_steps` sets it."""
    def copy(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return set_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    return copy


def load_training_state(model, optimizer, scheduler, path: str, layout: Layout) -> int:
    """Model, optimizer and scheduler from the checkpoint in ``path`` (with the distributed optimizer in the format
    its content metadata names, as Megatron-LM's ``load_checkpoint`` reads it); returns its iteration."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(path)
    metadata = None
    if layout.dist_opt:
        metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
        start_torch_adam(optimizer.chained_optimizers[0])
    state = dist_checkpointing.load(sharded_state(model, optimizer, True, metadata), path)
    model.module.load_state_dict(state["model"])
    with torch.no_grad():  # dp_reshardable's loader copies into fp32 main params, views of the model's leaves
        optimizer.load_state_dict(state["optimizer"])
    if layout.dist_opt:
        restore_steps(optimizer.chained_optimizers[0])
    scheduler.load_state_dict(next(state[key] for key in ("scheduler", "opt_param_scheduler") if key in state))
    return int(common["iteration"])


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, position ids ([2, SEQ]) and the causal mask (True: masked, as MockGPTDataset builds it) every
    logits comparison runs on."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ).contiguous()
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).expand(2, 1, SEQ, SEQ).contiguous()
    return tokens, positions, mask


def whole_moments(model, optimizer, dist_opt: bool) -> Optional[dict]:
    """Every parameter's Adam moments (its TP slice's: :func:`gather_whole_state` makes them whole), on every
    rank, or with the distributed optimizer on DP rank 0 of each stage and TP rank (None elsewhere). Those are
    gathered by Megatron's own ``get_parameter_state_dp_zero`` (a collective over the intra-instance group: every
    rank calls it) and cut back into parameters by the buffer's ``param_index_map``; the world tensors it returns
    hold each buffer's buckets back to back without their end padding."""
    if not dist_opt:
        state = optimizer.optimizer.state
        return {param: {key: state[param][key] for key in ("exp_avg", "exp_avg_sq")}
                for param in model.module.parameters()}
    gathered = optimizer.get_parameter_state_dp_zero(use_gloo_comm=False)
    if optimizer.data_parallel_group.rank() != 0:
        return None
    out = {}
    for index, buffer in enumerate(optimizer.buffers):
        [world] = gathered[index].values()
        offsets, at = [], 0
        for bucket in buffer.buckets:
            offsets.append(at - bucket.offset)
            at += bucket.numel_unpadded
        assert at == world["numel_unpadded"]
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            first = start + offsets[bucket_id]
            out[param] = {key: world[key][first:first + end - start].view(param.shape)
                          for key in ("exp_avg", "exp_avg_sq")}
    return out


def write_shard(path: Path, optimizer, layout: Layout) -> None:
    """This rank's distributed-optimizer shard: fp32 main params and Adam moments of every piece, bucket by
    bucket in Megatron's order (``get_parameter_state_dp_reshardable``, no communication), with where the rank
    sits (instance, position inside it) so that twins (one position, every instance) can be compared."""
    state = optimizer.get_parameter_state_dp_reshardable()
    pieces = [piece for index in range(len(optimizer.buffers)) for buckets in state[index].values()
              for bucket in buckets for piece in bucket]
    out = {key: torch.cat([piece[key].detach().reshape(-1) for piece in pieces]).clone()
           for key in ("param", "exp_avg", "exp_avg_sq")}
    out["step"] = float(pieces[0]["step"])
    out.update(instance=optimizer.distributed_optimizer_instance_id,
               position=optimizer.data_parallel_group.rank(), tp_rank=dist.get_rank() % layout.tp)
    torch.save(out, path)


def write_memory(path: Path, model, optimizer, step_s: list[float]) -> None:
    """The rank's state bytes by kind, each storage counted once in the first kind holding it (the parameters,
    under the distributed optimizer the flat buffer they are views of; the gradient buffers; what the torch
    optimizer steps and its per-element state), its resident-set high-water mark and its step times."""
    seen: set = set()

    def nbytes(tensors) -> int:
        new = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        total = sum(n for ptr, n in new.items() if ptr not in seen)
        seen.update(new)
        return total

    inner = [part.optimizer for part in getattr(optimizer, "chained_optimizers", [optimizer])]
    state = {"params": nbytes(model.module.parameters()), "grads": nbytes(b.grad_data for b in model.buffers),
             "optimizer": nbytes([p for o in inner for g in o.param_groups for p in g["params"]]
                                 + [t for o in inner for st in o.state.values() for t in st.values()
                                    if isinstance(t, torch.Tensor) and t.dim() > 0])}
    hwm = [line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:")]
    path.write_text(json.dumps({"rank": dist.get_rank(), "state": state, "step_s": step_s,
                                "rss_hwm_bytes": int(hwm[0].split()[1]) * 1024 if hwm else None}))


def run_train(rank: int, layout: Layout, args) -> None:
    from megatron.core import dist_checkpointing

    pg = process_groups(layout)
    init_state = torch.load(args.init_state) if args.init_state else None
    model, optimizer, scheduler = build(layout, args.iters, pg, init_state)
    del init_state
    if args.write_init:
        initial = gather_whole_state(model.module, pg, layout)
        if rank == 0:
            torch.save(initial, args.write_init)
    data = dataset(args.iters, Path(args.out).parent / "plain_data_cache", layout.model)
    records, step_s = {}, []
    start = load_training_state(model, optimizer, scheduler, args.load, layout) if args.load else 0
    metadata = checkpoint_metadata(layout, args.sharding_type)
    for iteration in range(start, args.iters):
        started = time.perf_counter()
        records[iteration + 1] = train_step(model, optimizer, scheduler, data, iteration, layout, pg)
        step_s.append(time.perf_counter() - started)
        if iteration + 1 == args.save_at:
            state = sharded_state(model, optimizer, is_loading=False, metadata=metadata)
            state.update(scheduler=scheduler.state_dict(), iteration=iteration + 1)
            path = Path(args.ckpt) / f"iter_{iteration + 1:07d}"
            if rank == 0:
                path.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            if metadata is None:
                dist_checkpointing.save(state, str(path))
            else:
                dist_checkpointing.save(state, str(path), content_metadata=metadata)
    dist_opt = optimizer.chained_optimizers[0] if layout.dist_opt else optimizer
    if args.memory:
        write_memory(Path(args.memory) / f"rank{rank}.json", model, optimizer, step_s)
    if args.shards:
        write_shard(Path(args.shards) / f"rank{rank}.pt", dist_opt, layout)
    if args.state:
        full = gather_whole_state(model.module, pg, layout, whole_moments(model, dist_opt, layout.dist_opt))
    if rank != 0:
        return
    if args.state:
        torch.save(full, args.state)
    if args.state or args.full_records:
        Path(args.out).write_text(json.dumps(records))
    else:
        Path(args.out).write_text(json.dumps({i: r["lm_loss"] for i, r in records.items()}))


def pipelined_logits(model, layout: Layout, pg) -> Optional[torch.Tensor]:
    """The logits of :func:`fixed_batch` through the pipeline, one micro-batch in Megatron's forward-only 1F1B
    schedule: on the last stage (its TP slice, [b, s, vocab / tp]), None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    tokens, positions, mask = fixed_batch()

    def forward_step(iterator, model):
        next(iterator)
        return model(tokens, positions, mask), None  # no loss function: the schedule keeps the last stage's output

    with torch.no_grad():
        out = get_forward_backward_func(pp_size=layout.pp)(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True, pg_collection=pg,
            p2p_communicator=P2PCommunicator(pp_group=pg.pp, config=model.config))
    return out[0] if pg.pp.rank() == layout.pp - 1 else None


def run_logits(rank: int, layout: Layout, args) -> torch.Tensor:
    """The full-vocabulary logits of :func:`fixed_batch` on rank 0 (with PP the last stage's TP rank 0 sends them
    there), from the checkpoint ``args.load_dir``."""
    from megatron.core import dist_checkpointing

    pg = process_groups(layout)
    model, optimizer, scheduler = build(layout, args.iters, pg)
    state = dist_checkpointing.load(sharded_state(model, optimizer, is_loading=True), args.load_dir)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if layout.pp == 1:
        with torch.no_grad():
            logits = model.module(*fixed_batch())  # [b, s, vocab / tp]
    else:
        logits = pipelined_logits(model, layout, pg)
    full = None
    if logits is not None:
        # Megatron's gather_from_tensor_model_parallel_region allocates on CUDA; the same gather with gloo:
        parts = [torch.empty_like(logits) for _ in range(pg.tp.size())]
        dist.all_gather(parts, logits.contiguous(), group=pg.tp)
        full = torch.cat(parts, dim=-1)
    if layout.pp > 1:
        sender = (layout.pp - 1) * layout.tp * layout.dp  # the last stage's DP rank 0, TP rank 0
        if rank == sender:
            dist.send(full, dst=0)
        elif rank == 0:
            tokens = fixed_batch()[0]
            full = torch.empty(*tokens.shape, layout.model.vocab_size)
            dist.recv(full, src=sender)
    return full


PORT = struct.Struct("<q")


def fork_ranks(world: int, target, *args) -> tuple[list, object]:
    """Fork ``world`` processes running ``target(rank, port, *args)``, then host their TCPStore here and tell them
    its port through a pipe. Forked first so that no thread runs while forking: the store's server thread, when the
    store was started before the forks, once left a rank stuck for good before it joined the store (a lock held by
    that thread at the fork). Returns the processes and the store (keep it until they end)."""
    ctx = multiprocessing.get_context("fork")
    read_fd, write_fd = os.pipe()
    procs = [ctx.Process(target=_with_port, args=(read_fd, target, rank, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    os.close(read_fd)
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=120),
                          wait_for_workers=False)
    os.write(write_fd, PORT.pack(store.port) * world)  # one write under PIPE_BUF: each rank reads one whole record
    os.close(write_fd)
    return procs, store


def _with_port(read_fd: int, target, rank: int, *args) -> None:
    ready, _, _ = select.select([read_fd], [], [], 120)
    record = os.read(read_fd, PORT.size) if ready else b""
    os.close(read_fd)
    if len(record) != PORT.size:
        print(f"rank {rank}: no store port from the parent within 120 s", file=sys.stderr, flush=True)
        os._exit(1)
    target(rank, PORT.unpack(record)[0], *args)


def run_rank(rank: int, layout: Layout, port: int, body) -> None:
    """One forked rank: join the job's gloo world through the store on ``port``, Megatron's groups for
    ``layout``, then ``body()`` under :class:`CpuForCuda`; any exception is printed and ends the process with
    exit code 1 (the parent reports the failed ranks)."""
    try:
        from megatron.core import parallel_state

        store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=timedelta(seconds=120),
                              wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=layout.world,
                                timeout=timedelta(seconds=120))
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                                 pipeline_model_parallel_size=layout.pp,
                                                 create_gloo_process_groups=False)
        with CpuForCuda.make():
            body()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _worker(rank: int, port: int, layout: Layout, args, results) -> None:
    def body() -> None:
        if args.mode == "train":
            run_train(rank, layout, args)
        else:
            logits = run_logits(rank, layout, args)
            if rank == 0:
                results.put(logits.numpy())

    run_rank(rank, layout, port, body)


def launch(layout: Layout, args):
    """Fork the ranks of a TP × DP job (this process imported torch and Megatron once)."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs, store = fork_ranks(layout.world, _worker, layout, args, results)  # noqa: F841 - the store serves them
    out = None
    if args.mode == "logits":
        while out is None:
            try:
                out = results.get(timeout=1)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or not any(p.is_alive() for p in procs):
                    break
    for p in procs:
        p.join(timeout=300)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"plain_megatron {args.mode} at {layout}: ranks {failed} failed")
    return out


def model_flags(parser: argparse.ArgumentParser) -> None:
    """The :class:`Model` flags, with Megatron-LM's names (``--swiglu``, ``--squared-relu``: the activation)."""
    group = parser.add_argument_group("model (train)")
    defaults = Model()
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "ffn_hidden_size", "vocab_size", "seq_length", "global_batch_size"):
        group.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    group.add_argument("--clip-grad", type=float, default=defaults.clip_grad)
    group.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                       default=defaults.position_embedding_type)
    group.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=defaults.normalization)
    group.add_argument("--swiglu", dest="activation", action="store_const", const="swiglu",
                       default=defaults.activation)
    group.add_argument("--squared-relu", dest="activation", action="store_const", const="squared_relu")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")


_prepared = False


def prepare() -> None:
    """Once per process: :func:`run_without_cuda`, and what the ranks import, imported here (each forked rank would
    otherwise pay seconds of imports)."""
    global _prepared
    if _prepared:
        return
    import warnings

    warnings.filterwarnings("ignore")
    run_without_cuda()
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.tokenizers  # noqa: F401

    _prepared = True


def serve() -> int:
    """``python -m tests.plain_megatron serve``: pay the imports once, then run one request per input line, each
    in a forked child of its own process group: ``{"args": [...], "stdout": FILE, "stderr": FILE}`` runs
    ``main(args)`` with its output in those files; the answers are ``{"pid": ...}`` at the fork and
    ``{"returncode": ...}`` at its end. Ends at the end of the input (its client's exit). It never imports
    ntp-megatron (a ``train`` request with ``--state`` or ``--spread`` asserts so)."""
    prepare()
    forked.serve(_serve_one)
    return 0


def _serve_one(request: dict) -> NoReturn:
    """A forked child of :func:`serve`: ``main(args)`` in a process group of its own, its exit code the run's."""
    code = 1
    try:
        os.setsid()
        forked.redirect_output(request)
        code = main(request["args"])
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["serve"]:
        return serve()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["train", "logits"])
    parser.add_argument("--tp", type=int, action="append", required=True)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--ckpt", action="append", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--state", default="",
                        help="train: write the final parameters and Adam moments here (whole, PP1 names)")
    parser.add_argument("--dp", type=int, default=1, help="train: data-parallel replicas (world = TP × DP × PP)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B; the layers split evenly)")
    parser.add_argument("--write-init", default="",
                        help="train: write the initial parameters here (whole, PP1 names, flattened fp32)")
    parser.add_argument("--init-state", default="",
                        help="train: start from these parameters (as --write-init or --state writes them) at any "
                             "TP and PP, instead of Megatron's initialisation")
    parser.add_argument("--dist-opt", action="store_true", help="train: Megatron's distributed optimizer")
    parser.add_argument("--instances", type=int, default=1,
                        help="train: num_distributed_optimizer_instances (with --dist-opt)")
    parser.add_argument("--overlap", action="store_true", help="train: overlap_grad_reduce")
    parser.add_argument("--bucket-size", type=int, default=None, help="train: DDP bucket size (elements)")
    parser.add_argument("--micro-batch", type=int, default=MICRO, help="train: micro-batch size")
    parser.add_argument("--full-records", action="store_true",
                        help="train: --out gets each iteration's lm loss, grad norm and lr (as with --state)")
    parser.add_argument("--sharding-type", choices=["dp_reshardable", "fully_reshardable"], default="dp_reshardable",
                        help="train, --dist-opt: the distributed optimizer's checkpoint format (Megatron-LM's "
                             "default; or --dist-ckpt-optim-fully-reshardable's)")
    parser.add_argument("--load", default="", help="train: continue from this checkpoint directory (iter_*)")
    parser.add_argument("--shards", default="",
                        help="train, --dist-opt: write every rank's optimizer shard into this directory")
    parser.add_argument("--spread", default="",
                        help="train: then train TP1 × DP1 without the distributed optimizer (one bucket, no overlap) "
                             "and write its records (as --full-records) here")
    parser.add_argument("--memory", default="",
                        help="train: write every rank's state bytes and step times into this directory")
    model_flags(parser)
    args = parser.parse_args(argv)
    model = Model(**{name: getattr(args, name) for name in Model.__dataclass_fields__})
    if args.instances > 1 and not args.dist_opt or args.dp % args.instances:
        parser.error(f"--instances {args.instances} needs --dist-opt and divides --dp {args.dp}")
    if args.load and (args.mode != "train" or len(args.tp) != 1):
        parser.error("--load: train at one TP degree")
    if args.shards and not args.dist_opt:
        parser.error("--shards needs --dist-opt")
    if args.pp < 1 or args.num_layers % args.pp:
        parser.error(f"--pp {args.pp} must divide --num-layers {args.num_layers}")
    if args.pp > 1 and args.instances > 1:
        parser.error("--instances > 1 with --pp > 1: the partial distributed-optimizer groups are made for PP1 only")
    if (args.write_init or args.init_state) and args.mode != "train":
        parser.error("--write-init and --init-state: train only")
    prepare()
    if args.mode == "train":
        args.ckpt = args.ckpt[0]
        for directory in (args.shards, args.memory):
            if directory:
                Path(directory).mkdir(parents=True, exist_ok=True)
        for tp in args.tp:
            launch(Layout(tp=tp, dp=args.dp, dist_opt=args.dist_opt, instances=args.instances, overlap=args.overlap,
                          bucket_size=args.bucket_size, micro_batch=args.micro_batch, model=model, pp=args.pp), args)
        if args.spread:  # the same training in Megatron's simplest layout, for the spread between the two
            launch(Layout(micro_batch=args.micro_batch, model=model),
                   argparse.Namespace(**{**vars(args), "out": args.spread, "state": "", "shards": "", "memory": "",
                                         "full_records": True, "load": "", "save_at": 0, "write_init": ""}))
        # the independent reference: nothing of ntp-megatron imported, let alone run
        if args.state or args.spread or args.write_init or args.init_state:
            ours = sorted(name for name in sys.modules if name.split(".")[0] == "ntp_megatron")
            assert not ours, f"the plain Megatron-Core reference imported ntp-megatron modules: {ours[:5]}"
        return 0
    out = {}
    for ckpt in args.ckpt:
        args.load_dir = ckpt
        for tp in args.tp:
            out[ckpt, tp] = torch.from_numpy(launch(Layout(tp=tp, pp=args.pp), args))
    torch.save(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
