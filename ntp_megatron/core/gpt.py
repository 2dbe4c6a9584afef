"""A Megatron-Core GPTModel whose TP-split tensors follow an NTP layout (one rank's view).

Built from Megatron's local layer spec with the TP modules swapped for the unit-aware ones of
:mod:`ntp_megatron.core.layers`; the GPTModel itself is upstream's, subclassed only to look tokens up and score
them through vocabulary rows that are an explicit set per rank.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from ntp_megatron.core.layers import (
    InitRecipe,
    NTPColumnParallelLinear,
    NTPRowParallelLinear,
    NTPSelfAttention,
    NTPVocabParallelEmbedding,
    HeldUnits,
    global_to_local_index,
    initialize_like_megatron,
    tag_parameter,
    vocab_parallel_cross_entropy,
)
from ntp_megatron.core.init import INIT_CHOICES, initialize_layout_free
from ntp_megatron.core.checkpoint_map import ROLE_KEY, assign_replica_ids


@dataclass(frozen=True)
class RankUnits:
    """The units one rank holds per family, ascending (global counts come from the model config)."""

    heads: tuple[int, ...]
    ffn: tuple[int, ...]
    vocab: tuple[int, ...]


def ntp_layer_spec(tf_config, units: RankUnits, normalization: str) -> ModuleSpec:
    """Megatron's local GPT layer spec with unit-aware attention, QKV/proj and fc1/fc2."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    groups = tf_config.num_query_groups
    head_dim = tf_config.kv_channels
    heads_per_group = tf_config.num_attention_heads // groups
    attn = spec.submodules.self_attention
    attn.module = NTPSelfAttention
    attn.params = {**attn.params, "query_groups": units.heads}
    attn.submodules.linear_qkv = ModuleSpec(
        module=NTPColumnParallelLinear,
        params={"units": units.heads, "num_units": groups, "unit_rows": (heads_per_group + 2) * head_dim,
                "family": "heads"},
    )
    attn.submodules.linear_proj = ModuleSpec(
        module=NTPRowParallelLinear,
        params={"units": units.heads, "num_units": groups, "unit_cols": heads_per_group * head_dim,
                "family": "heads"},
    )
    mlp = spec.submodules.mlp
    mlp.submodules.linear_fc1 = ModuleSpec(
        module=NTPColumnParallelLinear,
        params={"units": units.ffn, "num_units": tf_config.ffn_hidden_size, "unit_rows": 1, "family": "ffn"},
    )
    mlp.submodules.linear_fc2 = ModuleSpec(
        module=NTPRowParallelLinear,
        params={"units": units.ffn, "num_units": tf_config.ffn_hidden_size, "unit_cols": 1, "family": "ffn"},
    )
    return spec


class NTPMLP(MLP):
    """Megatron's MLP; only its checkpoint description differs (the computation is upstream's).

    Not named in the layer spec: upstream's TransformerLayer hands the MLP its TP group only when the spec's
    module *is* ``MLP`` (an equality test), so :class:`NTPGPTModel` builds upstream MLPs and then gives them
    this class, which adds no state."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The submodules' own descriptions, unwrapped: upstream wraps a gated fc1 in a swiglu factory that
        assumes one contiguous block per rank, while the NTP fc1 already describes its gate and up rows as
        two blocks of units."""
        out = {}
        for name, module in self._modules.items():
            out.update(module.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        return out


class NTPGPTModel(GPTModel):
    """GPTModel over one rank's NTP units. Construct with :func:`build_ntp_gpt`."""

    def __init__(self, config, units: RankUnits, normalization: str, vocab_size: int, **kwargs) -> None:
        tp_group = kwargs["pg_collection"].tp
        tp = tp_group.size()
        init_config = copy.copy(config)
        init_config.perform_initialization = False
        # Upstream sizes the embedding and output layer as divide(vocab, tp): ask for local × tp rows.
        super().__init__(config=init_config, transformer_layer_spec=ntp_layer_spec(config, units, normalization),
                         vocab_size=len(units.vocab) * tp, **kwargs)
        self.config = config
        self.vocab_size = vocab_size
        self.ntp_units = units
        # The vocabulary rows this rank scores (the output layer's, or the tied embedding's): global -> local.
        self.register_buffer("global_to_local", global_to_local_index(units.vocab, vocab_size), persistent=False)
        if self.pre_process:  # the first pipeline stage (every rank without stages) embeds the tokens
            embedding = self.embedding
            embedding.word_embeddings = NTPVocabParallelEmbedding(
                vocab_size, config.hidden_size, init_method=config.embedding_init_method, config=config,
                units=units.vocab, tp_group=tp_group,
            )
            self.setup_embeddings_and_output_layer()
            position = getattr(embedding, "position_embeddings", None)
            if position is not None:
                position.weight.ntp_init = InitRecipe("embedding", config.embedding_init_method)
        if self.post_process and self.output_layer.weight is not None:  # untied output layer: vocab rows
            tag_parameter(self.output_layer.weight,
                          InitRecipe("master", config.init_method, (vocab_size, config.hidden_size)),
                          HeldUnits("vocab", vocab_size, units.vocab, 1, config.hidden_size), dim=0)
            self.output_layer.output_size = vocab_size
        for module in self.modules():
            if type(module) is MLP:
                module.__class__ = NTPMLP
        for name, param in self.named_parameters():
            if not hasattr(param, "ntp_init") and "norm" in name:
                param.ntp_init = InitRecipe("constant")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Upstream's sharded state dict — the keys and global shapes of plain Megatron-Core's GPTModel — with
        TP-split tensors as fragments of this rank's units, and replica ids from ``metadata["ntp_role"]`` (a
        :class:`ntp_megatron.core.checkpoint_map.CheckpointRole`; see :mod:`ntp_megatron.training.checkpoint`), which
        decide the one replica that writes each piece."""
        role = (metadata or {}).get(ROLE_KEY)
        if role is None:
            raise ValueError(f"NTPGPTModel.sharded_state_dict needs metadata[{ROLE_KEY!r}] (which replica writes); "
                             "see ntp_megatron.training.checkpoint")
        out = assign_replica_ids(super().sharded_state_dict(prefix, sharded_offsets, metadata), role)
        if self.share_embeddings_and_output_weights and self.post_process and not self.pre_process:
            # The last pipeline stage's copy of tied embeddings (upstream keys it as the first stage's): never the
            # one written, as upstream marks it (its first replica-id axis 1).
            copy = out[f"{prefix}output_layer.weight"]
            copy.replica_id = (1, *copy.replica_id[1:])
        return out

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``[b, s]`` from local logits ``[s, b, local vocab]``."""
        loss = vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1).contiguous(), self.global_to_local, self.pg_collection.tp,
        )
        return loss.transpose(0, 1).contiguous()


def build_ntp_gpt(config, units: RankUnits, normalization: str, vocab_size: int, initialize: bool = True,
                  init: str = "layout_free", seed: int = 0, device: Optional[torch.device] = None,
                  layer_offset: int = 0, **gpt_kwargs) -> NTPGPTModel:
    """Construct the model (on ``device`` if given), then give it layout-independent initial weights:
    ``init="layout_free"`` computes this rank's units from (``seed``, name, element index) in O(local);
    ``"megatron"`` replays a TP1 Megatron model's CPU initialisation from the torch RNG state at the call (every
    full-size weight drawn on every rank). ``initialize=False`` leaves the weights to the caller (a re-formation
    copies them). The torch RNG state is left as it was at the call, or as the replay leaves it. ``layer_offset``:
    the global number of this pipeline stage's first layer (layout-free values are those of the whole model's)."""
    if init not in INIT_CHOICES:
        raise ValueError(f"init must be one of {', '.join(INIT_CHOICES)}, not {init!r}")
    rng_state = torch.get_rng_state()
    model = NTPGPTModel(config, units, normalization, vocab_size, **gpt_kwargs)
    torch.set_rng_state(rng_state)  # construction's own draws are overwritten: do not let them shift the stream
    if initialize and init == "megatron":
        initialize_like_megatron(model)  # replays from where a Megatron model's construction would have started
    if device is not None:
        model = model.to(device)
    if initialize and init == "layout_free":  # on the device: nothing full-size, nothing through the host
        initialize_layout_free(model, config, seed, lambda name, param: getattr(param, "ntp_held_units", None),
                               layer_offset=layer_offset)
    return model


def uniform_units(name: str, param: torch.nn.Parameter, tf_config, tp_rank: int, tp_size: int) -> Optional[HeldUnits]:
    """The units of a plain Megatron model's (uniform TP) parameter on ``tp_rank``: block ``tp_rank`` of equal
    contiguous blocks, folded as :func:`family_geometry` says; None for a replicated parameter."""
    geometry = family_geometry(name, tf_config)
    if geometry is None:
        return None
    family, outer, inner = geometry
    local = param.numel() // (outer * inner)
    return HeldUnits(family, local * tp_size, tuple(range(tp_rank * local, (tp_rank + 1) * local)), outer, inner)


def family_geometry(name: str, tf_config) -> Optional[tuple[str, int, int]]:
    """(family, outer, inner) of a TP-split GPT parameter by name, None for a replicated one.

    The same folding the NTP layers tag their parameters with; used to read a uniform Megatron model's
    TP-split tensors (contiguous unit blocks per rank) the same way as an NTP model's.
    """
    hidden = tf_config.hidden_size
    head_dim = tf_config.kv_channels
    heads_per_group = tf_config.num_attention_heads // tf_config.num_query_groups
    gate = 2 if tf_config.gated_linear_unit else 1
    table = {
        "word_embeddings.weight": ("vocab", 1, hidden),
        "output_layer.weight": ("vocab", 1, hidden),
        "linear_qkv.weight": ("heads", 1, (heads_per_group + 2) * head_dim * hidden),
        "linear_qkv.bias": ("heads", 1, (heads_per_group + 2) * head_dim),
        "linear_proj.weight": ("heads", hidden, heads_per_group * head_dim),
        "linear_fc1.weight": ("ffn", gate, hidden),
        "linear_fc1.bias": ("ffn", gate, 1),
        "linear_fc2.weight": ("ffn", hidden, 1),
    }
    for suffix, geometry in table.items():
        if name.endswith(suffix):
            return geometry
    return None
