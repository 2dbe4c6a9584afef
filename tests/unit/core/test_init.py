"""The layout-free initialiser (in one process): the same initial weights from every layout's units as from a TP1
build, NTP or plain; Megatron's init semantics per parameter; O(local) generation; and the device-dependent
TransformerConfig (CPU initialisation and fusions)."""

from __future__ import annotations

import math

import pytest
import torch

from ntp_megatron.config.schema import load_job_config
from ntp_megatron.plan.layout import make_topology
from tests.unit.core.test_grad_sync import MODEL

FAMILIES = ("heads", "ffn", "vocab")
GATED = [*MODEL, "model.gated_linear_unit=true", "model.activation=swiglu", "model.normalization=RMSNorm",
         "model.untie_embeddings_and_output_weights=false"]


def _full(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _ntp(cfg, units, **kwargs):
    from ntp_megatron.core.gpt import RankUnits, build_ntp_gpt
    from ntp_megatron.training.model import transformer_config
    from megatron.core.process_groups_config import ProcessGroupCollection

    m = cfg.model
    tied = not m.untie_embeddings_and_output_weights
    return build_ntp_gpt(transformer_config(cfg), RankUnits(*units), m.normalization, m.vocab_size,
                         seed=cfg.training.seed, max_sequence_length=m.seq_length, pre_process=True,
                         post_process=True, share_embeddings_and_output_weights=tied,
                         position_embedding_type=m.position_embedding_type,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups(), **kwargs)


def _assemble(cfg, layouts: list[list[tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Full tensors put together from the units each rank of ``layouts`` holds (every unit exactly once)."""
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for units in layouts:
        for name, param in _ntp(cfg, units).named_parameters():
            held = getattr(param, "ntp_held_units", None)
            if held is None:  # replicated: every rank computes the same value
                assert name not in full or torch.equal(full[name], param), name
                full[name] = param.detach().clone()
                continue
            if name not in full:
                full[name] = torch.full((held.outer, held.num_units, held.inner), float("nan"))
                seen[name] = torch.zeros(held.num_units, dtype=torch.long)
            index = torch.tensor(held.units)
            full[name][:, index] = held.view(param.detach())
            seen[name][index] += 1
    for name, count in seen.items():
        assert (count == 1).all(), f"{name}: layouts must hold every unit once"
    return full


def _layouts(cfg) -> dict[str, list[list[tuple[int, ...]]]]:
    counts = cfg.unit_counts()
    topology = make_topology(4, 2, counts, dead_slots=[(1, 3)])  # replica 1: TP3 with dealt (non-contiguous) units
    degraded = [[tuple(topology.units_of(r, f)) for f in FAMILIES] for r in topology.replica(1).ranks]
    uneven = [[tuple(topology.block(f, b)) for f in FAMILIES] for b in range(4)]  # 6 groups on 4: 2/2/1/1
    parity = [[tuple(range(k, counts[f], 2)) for f in FAMILIES] for k in (0, 1)]  # every other unit
    return {"degraded_tp3": degraded, "canonical_tp4": uneven, "interleaved_tp2": parity}


@pytest.mark.parametrize("model", [MODEL, GATED], ids=["gqa_untied", "gated_rmsnorm_tied"])
def test_initial_weights_do_not_depend_on_the_layout(megatron, model):
    """Each layout's units put together are bitwise the TP1 NTP model and the plain Megatron TP1 model built with
    ``model.init: layout_free``."""
    from ntp_megatron.training.model import build_model, transformer_config

    cfg = load_job_config(None, [*model, "training.seed=77"])
    counts = cfg.unit_counts()
    tp1 = _full(_ntp(cfg, [tuple(range(counts[f])) for f in FAMILIES]))
    plain_cfg = load_job_config(None, [*model, "training.seed=77", "ntp.enabled=false", "model.init=layout_free"])
    plain = _full(build_model(plain_cfg, transformer_config(plain_cfg), megatron, torch.device("cpu")).module)
    assert tp1.keys() == plain.keys()
    for name in tp1:
        assert torch.equal(tp1[name], plain[name]), f"{name}: NTP TP1 differs from plain TP1"
    for layout_name, layout in _layouts(cfg).items():
        assembled = _assemble(cfg, layout)
        for name, value in tp1.items():
            assert torch.equal(assembled[name].reshape(value.shape), value), f"{layout_name}: {name}"
    other_seed = _full(_ntp(load_job_config(None, [*model, "training.seed=78"]),
                            [tuple(range(counts[f])) for f in FAMILIES]))
    assert not torch.equal(other_seed["decoder.layers.0.self_attention.linear_qkv.weight"],
                           tp1["decoder.layers.0.self_attention.linear_qkv.weight"])


def test_uniform_megatron_blocks_are_the_canonical_blocks(megatron):
    """A plain model at uniform TP k holds block r of k equal contiguous blocks on TP rank r: the canonical block
    of a healthy NTP replica, so plain TP k and every NTP layout start from the same weights."""
    from ntp_megatron.core.gpt import uniform_units
    from ntp_megatron.training.model import transformer_config

    cfg = load_job_config(None, [*MODEL, "model.ffn_hidden_size=48", "model.vocab_size=264"])
    tf_config = transformer_config(cfg)
    model = _ntp(cfg, [tuple(range(n)) for n in cfg.unit_counts().values()], initialize=False)
    topology = make_topology(3, 1, cfg.unit_counts())
    for name, param in model.named_parameters():
        held = getattr(param, "ntp_held_units", None)
        for rank in range(3):
            local = torch.empty(param.numel() // 3)
            got = uniform_units(name, local, tf_config, rank, 3)
            if held is None:
                assert got is None, name
            else:
                assert got.units == tuple(topology.block(held.family, rank)), name
                assert (got.outer, got.inner, got.num_units) == (held.outer, held.inner, held.num_units), name


def test_initial_weights_follow_megatrons_init_per_parameter(megatron):
    """N(0, init_method_std) for QKV/FC1/output layer and embeddings, the std scaled by 1/sqrt(2 L) for the
    attention projection and FC2, zero biases, unit norm weights."""
    cfg = load_job_config(None, [*MODEL, "model.hidden_size=64", "model.ffn_hidden_size=256",
                                 "model.init_method_std=0.05", "model.num_layers=4"])
    model = _ntp(cfg, [tuple(range(n)) for n in cfg.unit_counts().values()])
    scaled = 0.05 / math.sqrt(2 * 4)
    checked = 0
    for name, param in model.named_parameters():
        value = param.detach().double()
        if name.endswith(".bias"):
            assert (value == 0).all(), name
        elif "norm" in name:
            assert (value == 1).all(), name
        else:
            std = scaled if ("linear_proj" in name or "linear_fc2" in name) else 0.05
            assert abs(value.mean().item()) < 4 * std / math.sqrt(value.numel()), name
            assert abs(value.std().item() / std - 1) < 6 / math.sqrt(2 * value.numel()), name
            checked += 1
    assert checked == 2 + 4 * 4 + 1  # word + position embeddings, 4 weights per layer, untied output layer


def test_generation_is_o_local(megatron, monkeypatch):
    """A TP4 rank's build generates exactly its own elements, in chunks, and draws nothing full-size: the only
    torch normal draw is the position embedding's constructor (replicated, so local). A build without
    initialisation (a re-formation's) generates nothing."""
    import ntp_megatron.core.init as init

    cfg = load_job_config(None, [*MODEL, "model.hidden_size=64", "model.ffn_hidden_size=200",
                                 "model.vocab_size=1000"])
    counts = cfg.unit_counts()
    topology = make_topology(4, 1, counts)
    units = [tuple(topology.units_of(1, f)) for f in FAMILIES]
    generated: list[int] = []
    drawn: list[int] = []
    real_normal, real_torch_normal = init.normal, torch.Tensor.normal_

    def counting_normal(key, start, count, std, device):
        generated.append(count)
        return real_normal(key, start, count, std, device)

    def counting_torch_normal(tensor, *args, **kwargs):
        drawn.append(tensor.numel())
        return real_torch_normal(tensor, *args, **kwargs)

    monkeypatch.setattr(init, "normal", counting_normal)
    monkeypatch.setattr(init, "CHUNK", 4096)
    monkeypatch.setattr(torch.Tensor, "normal_", counting_torch_normal)
    _ntp(cfg, units, initialize=False)  # a re-formation's build: the weights come from the old layout and peers
    position = cfg.model.seq_length * cfg.model.hidden_size
    assert generated == [] and drawn in ([position], []), (generated, drawn)
    drawn.clear()
    model = _ntp(cfg, units)
    monkeypatch.undo()
    normal_params = [p for n, p in model.named_parameters() if not n.endswith(".bias") and "norm" not in n]
    local = sum(p.numel() for p in normal_params)
    full = sum(p.numel() // len(p.ntp_held_units.units) * p.ntp_held_units.num_units
               if hasattr(p, "ntp_held_units") else p.numel() for p in normal_params)
    assert local < 0.4 * full
    assert position == model.embedding.position_embeddings.weight.numel()
    assert drawn in ([position], []), f"torch normal draws of {drawn} elements (local: {local}, full: {full})"
    assert sum(generated) == local
    assert max(generated) <= 4096


def test_generator_chunks_and_runs_give_the_same_values():
    """Any chunk size and any unit list: the elements of each unit are the TP1 tensor's (all three copy paths:
    contiguous rows, whole strided units, rows of a unit larger than a chunk)."""
    from ntp_megatron.core.init import fill_normal_, stream_key
    from ntp_megatron.core.layers import HeldUnits

    key = stream_key(3, "w")
    for outer, num_units, inner in ((1, 7, 5), (6, 9, 1), (5, 4, 3)):
        full = torch.empty(outer, num_units, inner)
        fill_normal_(full, key, 1.0, HeldUnits("f", num_units, tuple(range(num_units)), outer, inner))
        for units in ((0, 1, 2), (1, 3, 4, 8) if num_units > 8 else (1, 3), (num_units - 1,)):
            for chunk in (1, 4, 7, 1 << 18):
                local = torch.empty(outer, len(units), inner)
                fill_normal_(local, key, 1.0, HeldUnits("f", num_units, units, outer, inner), chunk=chunk)
                assert torch.equal(local, full[:, list(units)]), (outer, num_units, inner, units, chunk)


def test_plain_layout_free_model_keeps_megatrons_tensor_parallel_attributes(megatron):
    """Built without Megatron's initialisation, a plain model's weights still carry the TP attributes Megatron
    sets while initialising (DDP, optimizer and checkpoints read them)."""
    from ntp_megatron.training.model import build_model, transformer_config

    attrs = ("tensor_model_parallel", "partition_dim", "partition_stride")
    got = {}
    for init in ("megatron", "layout_free"):
        cfg = load_job_config(None, [*GATED, "ntp.enabled=false", f"model.init={init}"])
        model = build_model(cfg, transformer_config(cfg), megatron, torch.device("cpu")).module
        got[init] = {n: tuple(getattr(p, a, None) for a in attrs) for n, p in model.named_parameters()}
    assert got["layout_free"] == got["megatron"]
    assert got["megatron"]["decoder.layers.0.mlp.linear_fc1.weight"] == (True, 0, 2)


def test_init_defaults_to_layout_free_under_ntp_only():
    assert load_job_config(None, []).initializer == "layout_free"
    assert load_job_config(None, ["ntp.enabled=false"]).initializer == "megatron"
    assert load_job_config(None, ["ntp.enabled=false", "model.init=layout_free"]).initializer == "layout_free"
    assert load_job_config(None, ["model.init=megatron"]).initializer == "megatron"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cpu_initialisation_and_fusions_follow_the_device(monkeypatch, device):
    """On CUDA (the device decision mocked: no GPU here): Megatron's fusions on, parameters allocated on the GPU;
    on CPU: fusions off, CPU initialisation. Kernels that need optional packages (Apex's fused weight-gradient
    GEMM, Transformer Engine's fused RoPE) are on only when importable: mocked present here."""
    import importlib.util

    from megatron.core.models.common.embeddings import rope_utils

    from ntp_megatron.training import model as model_lib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    real_find_spec = importlib.util.find_spec
    apex = {"apex", "fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda",
            "scaled_upper_triang_masked_softmax_cuda"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in apex else real_find_spec(name, *a))
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    cfg = load_job_config(None, ["training.device=auto", "model.position_embedding_type=rope"])
    tf_config = model_lib.transformer_config(cfg)
    flags = {name: getattr(tf_config, name) for name in model_lib.FUSIONS}
    assert flags == dict.fromkeys(model_lib.FUSIONS, device == "cuda")
    assert tf_config.use_cpu_initialization == (device == "cpu")
    assert model_lib.transformer_config(cfg, torch.device("cpu")).bias_activation_fusion is False


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_cuda_fusions_build_without_apex(megatron, normalization):  # noqa: F811
    """On a GPU node without Apex (the gpu extra does not install it), the fusions chosen for CUDA must still build
    the local-spec model: torch norms refuse the persistent layer norm, and the fused masked softmax would import
    Apex's extensions at the first forward. Built here on CPU with CUDA's fusion choices."""
    import importlib.util

    from megatron.core.models.gpt import GPTModel

    from ntp_megatron.training import model as model_lib

    if importlib.util.find_spec("apex") is not None:
        pytest.skip("Apex is installed here")
    cfg = load_job_config(None, [f"model.normalization={normalization}", "ntp.enabled=false",
                                 "parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=1"])
    flags = model_lib.fusions(cfg, on_cuda=True)
    assert flags["masked_softmax_fusion"] is False and flags["persist_layer_norm"] is False
    tf_config = model_lib.transformer_config(cfg, torch.device("cpu"))
    for name, on in flags.items():
        setattr(tf_config, name, on)
    GPTModel(config=tf_config, transformer_layer_spec=model_lib.layer_spec(cfg), vocab_size=256,
             max_sequence_length=64, pg_collection=megatron)


def test_gpu_tail_branch_gives_the_cpu_values():
    """The GPU path computes the tail formula for every element and picks (no host sync); the CPU path only for the
    elements in the tail: every one of the 2^24 inputs gives the same bits either way."""
    from ntp_megatron.core.init import standard_normal

    bits = torch.arange(1 << 24, dtype=torch.int64)
    assert torch.equal(standard_normal(bits.clone(), gather_tail=True), standard_normal(bits.clone(), gather_tail=False))
