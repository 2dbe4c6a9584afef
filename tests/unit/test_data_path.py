"""The data path builds no attention mask: Megatron's causal path attends without one (issue 12: a materialised
[mbs, 1, s, s] mask per micro-batch is 64 MiB at s = 8K), and the numbers are the ones a mask gives."""

from __future__ import annotations

import torch

from ntp_megatron.config import load_job_config
from ntp_megatron.patches import apply_patches
from ntp_megatron.training import data


def test_samples_carry_no_attention_mask_and_attention_stays_causal(tmp_path):
    cfg = load_job_config(overrides=["model.seq_length=16"])
    dataset = data.build_datasets(cfg, data.build_tokenizer(cfg.data, cfg.model.vocab_size), tmp_path).train
    batch = next(data.microbatches(dataset, range(4), 2, torch.device("cpu")))
    assert "attention_mask" not in batch and batch["tokens"].shape == (2, 16)

    apply_patches(cpu=True)
    from megatron.core.transformer.utils import get_default_causal_mask

    explicit = torch.tril(torch.ones(16, 16)) < 0.5  # what the dataset's mask was: True above the diagonal
    assert torch.equal(get_default_causal_mask(16), explicit)
