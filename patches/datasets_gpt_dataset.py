"""Loss masks that do not depend on which sample a process read first
(upstream: ``megatron.core.datasets.gpt_dataset.GPTDataset.__getitem__``).

When masks are cacheable (no EOD masking, no position/attention-mask resets — our configuration), upstream
caches the loss mask of the first sample it builds and then, in the same call, zeroes that very tensor where
the labels are padding. Every later sample starts from that mutated cache, so it inherits the first sample's
padding positions: two processes that read different first samples train on different loss masks for the
same sample. Under data parallelism that makes the loss depend on the DP layout (found by the NTP equivalence
tests: TP1 × DP2 differed from TP1 × DP1 at the first iteration). The cached mask here is a clean copy, as
upstream computes it before masking; everything else is upstream's.
"""

from __future__ import annotations

from megatron.core.datasets import gpt_dataset as upstream

_upstream_getitem = upstream.GPTDataset.__getitem__


def _getitem(self, idx):
    caching_now = self.masks_and_position_ids_are_cacheable and not self.masks_and_position_ids_are_cached
    if not caching_now:
        return _upstream_getitem(self, idx)
    # Build the first sample with caching off (upstream computes its masks fresh), then cache clean masks
    # computed the way upstream would have before it masked padding in place.
    self.masks_and_position_ids_are_cacheable = False
    try:
        sample = _upstream_getitem(self, idx)
    finally:
        self.masks_and_position_ids_are_cacheable = True
    tokens = sample["tokens"]
    attention_mask, loss_mask, position_ids = upstream._get_ltor_masks_and_position_ids(
        tokens, self.config.tokenizer.eod, self.config.reset_position_ids, self.config.reset_attention_mask,
        self.config.eod_mask_loss, self.config.create_attention_mask,
    )
    self.cached_attention_mask, self.cached_loss_mask, self.cached_position_ids = (
        attention_mask, loss_mask, position_ids)
    self.masks_and_position_ids_are_cached = True
    return sample


def apply() -> None:
    upstream.GPTDataset.__getitem__ = _getitem
