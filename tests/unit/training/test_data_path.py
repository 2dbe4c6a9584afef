"""The data path builds no attention mask: Megatron's causal path attends without one (a materialised
[mbs, 1, s, s] mask per micro-batch is 64 MiB at s = 8K), and the model computes with none what it computes with
the explicit causal mask the dataset used to build."""

from __future__ import annotations

import torch

from ntp_megatron.config.schema import load_job_config
from ntp_megatron.training import data

SEQ = 16


def test_samples_carry_no_attention_mask(tmp_path):
    # The default sequence length: Megatron's mock corpus is of fixed size, so its index has 4x the samples (and
    # takes 4x as long to build) at a quarter of it.
    cfg = load_job_config()
    dataset = data.build_datasets(cfg, data.build_tokenizer(cfg.data, cfg.model.vocab_size), tmp_path).train
    batch = next(data.microbatches(dataset, range(4), 2, torch.device("cpu")))
    assert "attention_mask" not in batch and batch["tokens"].shape == (2, cfg.model.seq_length)


def test_no_mask_gives_the_logits_of_the_causal_mask(megatron):  # noqa: F811
    """The training model (plain Megatron-Core GPT, local spec) on one batch: without a mask, as the data path
    feeds it, the logits equal those with the explicit causal mask (True above the diagonal, as Megatron's
    datasets build it) — and differ from those of a mask that lets every token see every other, so the
    comparison would see a model that ignores causality."""
    from megatron.core import tensor_parallel

    from ntp_megatron.training.model import build_model, transformer_config

    tensor_parallel.model_parallel_cuda_manual_seed(1234)  # the attention's RNG fork (dropout is 0)
    cfg = load_job_config(None, [f"model.seq_length={SEQ}", "model.hidden_dropout=0", "model.attention_dropout=0",
                                 "ntp.enabled=false", "parallel.tensor_model_parallel_size=1",
                                 "parallel.data_parallel_size=1", "model.init=layout_free"])
    model = build_model(cfg, transformer_config(cfg), megatron, torch.device("cpu")).module.eval()
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, SEQ), generator=generator)
    positions = torch.arange(SEQ).expand(2, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).expand(2, 1, SEQ, SEQ)
    with torch.no_grad():
        unmasked = model(tokens, positions, None)
        masked = model(tokens, positions, causal)
        sees_all = model(tokens, positions, torch.zeros_like(causal))
    assert unmasked.shape == (2, SEQ, cfg.model.vocab_size)
    torch.testing.assert_close(unmasked, masked, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(unmasked[:, :-1], sees_all[:, :-1], atol=1e-4)  # the last position sees all anyway
