"""Training data through Megatron-Core's dataset stack, read in a layout-free order.

Datasets come from ``BlendedMegatronDatasetBuilder``: ``MockGPTDataset`` by default, or ``GPTDataset`` over
indexed ``.bin/.idx`` files built by ``ntp-preprocess``. Which samples a replica reads depends only on
(iteration, replica index), never on the TP layout: iteration ``k`` consumes global
samples ``[k·G, (k+1)·G)`` and replica ``r`` of ``D`` takes the ``r``-th contiguous ``G/D`` of them.

Evaluation reads the validation and test splits the same way, one ``G``-sample batch after another, each share
in full whatever ``ntp.degraded_batch`` says (:func:`evaluation_batches`): its loss is the same number under every
layout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                    parse_and_normalize_split)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizer

from ntp_megatron.config.schema import DataSection, JobConfig, split_fractions

logger = logging.getLogger(__name__)

BYTE_VOCAB = 256


def build_tokenizer(data: DataSection, vocab_size: int):
    """A tokenizer that needs no download: UTF-8 bytes (``data.tokenizer: byte-level``)."""
    if vocab_size < BYTE_VOCAB:
        raise SystemExit(f"model.vocab_size ({vocab_size}) must be ≥ {BYTE_VOCAB} for the byte-level tokenizer")
    return MegatronTokenizer.from_pretrained(metadata_path={"library": data.tokenizer}, vocab_size=vocab_size)


def parse_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path`` convention: ``[prefix, ...]`` or ``[w1, prefix1, w2, prefix2, ...]``."""
    try:
        float(data_path[0])
    except ValueError:
        return list(data_path), None
    if len(data_path) % 2:
        raise SystemExit("data.data_path: a weighted blend needs weight, prefix pairs")
    return [str(p) for p in data_path[1::2]], [float(w) for w in data_path[0::2]]


def check_data(cfg: JobConfig) -> None:
    """Indexed data only: every prefix names a dataset (``PREFIX.bin`` and ``PREFIX.idx``), and the split leaves
    the evaluations data to read (:func:`check_evaluation_split`); SystemExit with one line otherwise. The launcher
    calls it before any rank starts, the dataset builder again."""
    if cfg.data.mock:
        return
    for prefix in parse_blend(cfg.data.data_path)[0]:
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise SystemExit(f"data.data_path: {prefix}{suffix} not found (relative paths are relative to "
                                 f"{Path.cwd()}); build it with ntp-preprocess --output-prefix")
    check_evaluation_split(cfg)


def describe(cfg: JobConfig) -> str:
    """One line on the data in use, for the start of a run: mock or indexed, paths, documents, tokens."""
    t, m = cfg.training, cfg.model
    needed = f"{t.train_iters * t.global_batch_size} training samples of {m.seq_length} tokens"
    if cfg.data.mock:
        return f"data: mock (Megatron-Core MockGPTDataset, vocabulary {m.vocab_size}), {needed}"
    prefixes, weights = parse_blend(cfg.data.data_path)
    parts = []
    for i, prefix in enumerate(prefixes):
        ds = IndexedDataset(prefix)
        weight = f"weight {weights[i]:g}, " if weights else ""
        parts.append(f"{prefix} ({weight}{len(ds)} documents, {int(ds.sequence_lengths.sum())} tokens)")
    return (f"data: indexed (Megatron-Core GPTDataset), {'; '.join(parts)}, split {cfg.data.split}, "
            f"{cfg.data.tokenizer} tokenizer, {needed}")


@dataclass
class Datasets:
    """The splits of ``data.split`` that the run reads (validation and test only with evaluation on)."""

    train: GPTDataset
    validation: Optional[GPTDataset] = None
    test: Optional[GPTDataset] = None


def evaluation_sizes(cfg: JobConfig) -> tuple[int, int]:
    """Samples the run's evaluations read from the validation and the test split, as Megatron-LM sizes them:
    every evaluation reads ``eval_iters`` fresh global batches (the periodic ones and the final one), the test
    split is read once, at the end."""
    t = cfg.training
    if not t.evaluates:
        return 0, 0
    per_evaluation = t.eval_iters * t.global_batch_size
    # Megatron-Core splits mock data "1,1,1" whatever the split says: it always has test documents.
    test = per_evaluation if cfg.data.mock or split_fractions(cfg.data.split)[2] > 0 else 0
    return (evaluation_window(cfg, t.train_iters, "validation", final=True) + 1) * per_evaluation, test


def build_datasets(cfg: JobConfig, tokenizer, cache_dir: Path) -> Datasets:
    """The training split sized for the whole run, and the validation and test splits its evaluations read.

    Megatron's builder orders the ranks itself (global rank 0 writes the index caches, the others read
    them after a barrier), so ``cache_dir`` must be on a file system every node sees, as in Megatron-LM.
    """
    t, d = cfg.training, cfg.data
    check_data(cfg)
    blend = None if d.mock else parse_blend(d.data_path)
    ds_config = GPTDatasetConfig(
        random_seed=t.seed,
        sequence_length=cfg.model.seq_length,
        blend=blend,
        split=d.split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # No [mbs, 1, s, s] mask per micro-batch (64 MiB at s = 8K, copied from pageable memory): both layer
        # specs attend causally without one (the local spec's softmax makes an [s, s] causal mask on the device,
        # Transformer Engine's kernels need none); the same boolean mask, so the same numbers.
        create_attention_mask=False,
        path_to_cache=str(cache_dir),
    )
    dataset_cls = MockGPTDataset if d.mock else GPTDataset
    validation, test = evaluation_sizes(cfg)
    train_ds, validation_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_cls, [t.train_iters * t.global_batch_size, validation, test], lambda: True, ds_config).build()
    return Datasets(train_ds, validation_ds if validation else None, test_ds if test else None)


def check_evaluation_split(cfg: JobConfig) -> None:
    """With evaluation on indexed data: refuse a validation or test share of ``data.split`` that holds no
    document of some prefix (Megatron's builder would loop forever on it), before anything is built."""
    if cfg.data.mock or not cfg.training.evaluates:
        return
    split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(cfg.data.split))
    for prefix in parse_blend(cfg.data.data_path)[0]:
        documents = IndexedDataset(prefix, mmap=True).sequence_lengths.shape[0]
        for name, bounds in (("validation", split_matrix[1]), ("test", split_matrix[2])):
            if bounds is not None and round(bounds[1] * documents) == round(bounds[0] * documents):
                raise SystemExit(f"data.split '{cfg.data.split}' leaves no {name} document of the {documents} in "
                                 f"{prefix}, but training.eval_iters ({cfg.training.eval_iters}) asks for "
                                 f"evaluation: give the {name} share more weight"
                                 + (" (or none)" if name == "test" else "") + ", or set training.eval_iters: 0")


def evaluation_window(cfg: JobConfig, iteration: int, split: str, final: bool) -> int:
    """Which window of ``eval_iters`` global batches of ``split`` the evaluation after ``iteration`` reads: the
    periodic ones read successive windows of the validation split and the final one the window after them, as
    Megatron-LM's validation iterator goes on from one evaluation to the next; the test split is read once."""
    interval = cfg.training.eval_interval
    if split == "test":
        return 0
    return cfg.training.train_iters // interval if final else iteration // interval - 1


def evaluation_batches(window: int, eval_iters: int, shares: list[int], num_replicas: int,
                       global_batch_size: int) -> list[list[int]]:
    """The samples a replica reads in each batch of evaluation window ``window``: its shares of global batches
    ``window·eval_iters …`` of the split, every share in full. A function of (window, shares) only."""
    return [[i for share in shares
             for i in replica_sample_range(window * eval_iters + b, share, num_replicas, global_batch_size)]
            for b in range(eval_iters)]


def replica_sample_range(iteration: int, replica: int, num_replicas: int, global_batch_size: int) -> range:
    """Global sample indices that ``replica`` consumes at 0-based ``iteration``: a function of those only."""
    per_replica = global_batch_size // num_replicas
    start = iteration * global_batch_size + replica * per_replica
    return range(start, start + per_replica)


def microbatches(
    dataset: GPTDataset, samples: range, micro_batch_size: int, device: torch.device
) -> Iterator[dict[str, torch.Tensor]]:
    """Collate ``samples`` into micro-batches of ``micro_batch_size``, in order."""
    for first in range(0, len(samples), micro_batch_size):
        items = [dataset[i] for i in samples[first : first + micro_batch_size]]
        yield {key: torch.stack([item[key] for item in items]).to(device) for key in items[0]}
