"""Megatron-Core TP layers that hold an explicit, possibly uneven, list of units per rank.

A TP-split tensor is viewed as ``[outer, units, inner]``: the unit axis is where Megatron splits it, and a
unit (attention query group with its heads, FFN hidden unit, vocabulary row) can sit on any rank as long as
the first GEMM's rows and the second GEMM's columns of that unit sit together. Each rank keeps its units in
ascending order. Layouts come from :mod:`ntp_megatron.plan.layout`; this module only builds modules for them.

How the Megatron classes are reused: each NTP class calls the upstream constructor with a size that
upstream's ``divide(size, tp)`` turns into this rank's local size (``local × tp``), with initialisation off,
then records the true global size and the rank's :class:`HeldUnits` on every split parameter. Initial
values come later: from :mod:`ntp_megatron.core.init` (the default: each element a function of seed, name and global
index, computed for this rank's units only), or from :func:`initialize_like_megatron`, which draws every master
weight at its global size in Megatron's own order, so any layout starts from the weights a TP1 Megatron model
built with ``use_cpu_initialization`` would have (at O(model) cost per rank).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention

from ntp_megatron.core.checkpoint_map import ntp_module_sharded_state_dict

@dataclass(frozen=True)
class HeldUnits:
    """Which units of a TP-split tensor this rank holds, and how the tensor folds into ``[outer, units, inner]``."""

    family: str
    num_units: int
    units: tuple[int, ...]
    outer: int
    inner: int

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The local tensor as ``[outer, len(units), inner]`` (a view)."""
        return local.view(self.outer, len(self.units), self.inner)

    def select(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full (unsplit) tensor, in local unit order."""
        index = torch.tensor(self.units, dtype=torch.long, device=full.device)
        return full.reshape(self.outer, self.num_units, self.inner).index_select(1, index)


@dataclass(frozen=True)
class InitRecipe:
    """How Megatron initialises a parameter, so :func:`initialize_like_megatron` can replay it.

    ``master``: ``init_method`` on a float32 tensor of ``full_shape`` (the CPU RNG draws the whole tensor),
    then this rank's units. ``embedding``: ``torch.nn.Embedding``'s constructor draw, then ``init_method``.
    ``zeros``: biases. ``constant``: left as constructed (norm weights and biases).
    """

    kind: str
    init_method: Optional[Callable] = None
    full_shape: tuple[int, ...] = ()


def tag_parameter(param: Optional[torch.nn.Parameter], recipe: InitRecipe, held: Optional[HeldUnits] = None,
         dim: int = 0, stride: int = 1) -> None:
    """Record how to initialise ``param`` and, for a split tensor, its units — plus Megatron's own TP
    attributes, which upstream sets only when it initialises (it does not here)."""
    if param is None:
        return
    param.ntp_init = recipe
    if held is not None:
        param.ntp_held_units = held
        if not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, True, dim, stride)


def _no_init(config):
    """A shallow copy of ``config`` with initialisation off (no dataclass re-validation)."""
    cfg = copy.copy(config)
    cfg.perform_initialization = False
    return cfg


class NTPColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear over explicit units: ``stride`` blocks (2 for a gated MLP: gate, up) of
    ``unit_rows`` output rows per unit."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable, units: Sequence[int],
                 num_units: int, unit_rows: int, family: str, stride: int = 1, tp_group=None, **kwargs) -> None:
        local_out = stride * len(units) * unit_rows
        tp = tp_group.size()
        super().__init__(input_size, local_out * tp, config=_no_init(config), init_method=init_method,
                         stride=stride, tp_group=tp_group, **kwargs)
        self.config = config
        self.output_size = stride * num_units * unit_rows
        self.output_size_per_partition = local_out
        tag_parameter(self.weight, InitRecipe("master", init_method, (self.output_size, input_size)),
             HeldUnits(family, num_units, tuple(units), stride, unit_rows * input_size), dim=0, stride=stride)
        tag_parameter(self.bias, InitRecipe("zeros"), HeldUnits(family, num_units, tuple(units), stride, unit_rows),
             dim=0, stride=stride)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Upstream's keys, with this rank's units as fragments of the global tensors (a gated fc1 keeps
        Megatron's [gate; up] layout: its units sit in two blocks). Replica ids come from the model."""
        return ntp_module_sharded_state_dict(self, prefix, sharded_offsets, metadata)


class NTPRowParallelLinear(RowParallelLinear):
    """RowParallelLinear over explicit units of ``unit_cols`` input columns each; the bias is replicated."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable, units: Sequence[int],
                 num_units: int, unit_cols: int, family: str, tp_group=None, **kwargs) -> None:
        local_in = len(units) * unit_cols
        tp = tp_group.size()
        super().__init__(local_in * tp, output_size, config=_no_init(config), init_method=init_method,
                         tp_group=tp_group, **kwargs)
        self.config = config
        self.input_size = num_units * unit_cols
        self.input_size_per_partition = local_in
        tag_parameter(self.weight, InitRecipe("master", init_method, (output_size, self.input_size)),
             HeldUnits(family, num_units, tuple(units), output_size, unit_cols), dim=1)
        tag_parameter(self.bias, InitRecipe("zeros"))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Upstream's keys; the weight's input columns as fragments per run of units, the bias replicated."""
        return ntp_module_sharded_state_dict(self, prefix, sharded_offsets, metadata)


class NTPVocabParallelEmbedding(VocabParallelEmbedding):
    """Vocabulary rows on this rank are an explicit set, not a contiguous range: tokens are looked up through
    a global → local index map (-1 where another rank holds the row)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable, config,
                 units: Sequence[int], tp_group) -> None:
        tp = tp_group.size()
        super().__init__(len(units) * tp, embedding_dim, init_method=init_method, config=_no_init(config),
                         tp_group=tp_group)
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = len(units)
        self.register_buffer("global_to_local", global_to_local_index(units, num_embeddings), persistent=False)
        tag_parameter(self.weight, InitRecipe("master", init_method, (num_embeddings, embedding_dim)),
             HeldUnits("vocab", num_embeddings, tuple(units), 1, embedding_dim))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        local = self.global_to_local[input_]
        missing = local < 0
        output = F.embedding(local.masked_fill(missing, 0), self.weight)
        output = output.masked_fill(missing.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Upstream's key and ``allow_shape_mismatch`` (vocabulary padding); vocabulary rows as fragments."""
        return ntp_module_sharded_state_dict(self, prefix, sharded_offsets, metadata, allow_shape_mismatch=True)


def global_to_local_index(units: Sequence[int], num_units: int) -> torch.Tensor:
    index = torch.full((num_units,), -1, dtype=torch.long)
    index[torch.tensor(list(units), dtype=torch.long)] = torch.arange(len(units))
    return index


class NTPSelfAttention(SelfAttention):
    """SelfAttention over an explicit list of query groups (each with its heads).

    Upstream derives per-rank head and group counts as ``divide(total, tp)``; here it is built with a
    private config copy whose totals are ``local × tp``, so every upstream derivation (attention's and
    DotProductAttention's) lands on this rank's counts. Head size and everything else are the real ones.
    """

    def __init__(self, config, submodules, layer_number: int, *, query_groups: Sequence[int],
                 pg_collection=None, **kwargs) -> None:
        num_groups = config.num_query_groups
        heads_per_group = config.num_attention_heads // num_groups
        tp = pg_collection.tp.size()
        local = copy.copy(config)
        local.num_query_groups = len(query_groups) * tp
        local.num_attention_heads = len(query_groups) * heads_per_group * tp
        super().__init__(local, submodules, layer_number, pg_collection=pg_collection, **kwargs)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits whose vocabulary rows are an explicit set per rank (see
    :class:`NTPVocabParallelEmbedding`), reduced over the replica's TP group."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, global_to_local: torch.Tensor, group):
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local_target = global_to_local[target]
        missing = local_target < 0
        safe_target = local_target.masked_fill(missing, 0)
        predicted = shifted.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1).masked_fill(missing, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        reduced = torch.stack([predicted, sum_exp])
        torch.distributed.all_reduce(reduced, group=group)
        predicted, sum_exp = reduced[0], reduced[1]
        loss = torch.log(sum_exp) - predicted
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe_target, missing)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        softmax, safe_target, missing = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~missing).to(grad.dtype)
        grad.scatter_add_(-1, safe_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, global_to_local: torch.Tensor,
                                 group) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, target, global_to_local, group)


@torch.no_grad()
def initialize_like_megatron(model: torch.nn.Module) -> None:
    """Give every parameter the value a TP1 Megatron model built from the same CPU RNG state would have.

    Megatron draws master weights in construction order, which is the order parameters are registered,
    so replaying the recipes in ``named_parameters()`` order from the same RNG state reproduces them.
    Call it with the CPU RNG in the state it had before the model was constructed.
    """
    for name, param in model.named_parameters():
        recipe: Optional[InitRecipe] = getattr(param, "ntp_init", None)
        if recipe is None:
            raise RuntimeError(f"initialize_like_megatron: no init recipe for parameter {name}")
        if recipe.kind == "master":
            master = torch.empty(recipe.full_shape, dtype=torch.float)
            recipe.init_method(master)
            held: Optional[HeldUnits] = getattr(param, "ntp_held_units", None)
            value = held.select(master) if held is not None else master
            param.copy_(value.reshape(param.shape).to(param.dtype))
        elif recipe.kind == "embedding":
            torch.nn.init.normal_(param)  # what torch.nn.Embedding.__init__ draws before Megatron re-initialises
            recipe.init_method(param)
        elif recipe.kind == "zeros":
            param.zero_()
        elif recipe.kind != "constant":
            raise RuntimeError(f"initialize_like_megatron: unknown recipe {recipe.kind!r} for {name}")
