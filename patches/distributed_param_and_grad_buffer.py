"""Pluggable gradient communication for DDP bucket groups
(upstream: ``megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup``).

Megatron's bucket group all-reduces each flat bucket over one data-parallel group. That only works when
every replica lays its buckets out identically; nonuniform TP layouts do not. This patch lets a bucket group
hand its communication to a *grad syncer* (``bucket_group.grad_syncer``): ``start(bucket_group, async_op)``
launches it without blocking and returns a handle whose ``wait()`` completes it.
Everything else about the bucket group — readiness counting, first-batch handling, gradient scaling, the
overlap on/off split between ``start_grad_sync`` and ``finish_grad_sync`` — stays upstream's. Bucket groups
without a syncer, and the distributed optimizer, take upstream's path unchanged.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.distributed import param_and_grad_buffer as upstream

_upstream_start_grad_sync = upstream._ParamAndGradBucketGroup.start_grad_sync


def _start_grad_sync(self, force_all_reduce: Optional[bool] = False):
    syncer = getattr(self, "grad_syncer", None)
    if syncer is None or self.ddp_config.use_distributed_optimizer:
        return _upstream_start_grad_sync(self, force_all_reduce=force_all_reduce)
    if self.is_first_batch and self.grad_reduce_handle is not None:
        return
    assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
    if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
        self.check_grads(
            check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
            check_for_large=self.ddp_config.check_for_large_grads,
        )
    for bucket in self.buckets:
        if bucket.gradient_scaling_factor != 1.0:
            bucket.grad_data *= bucket.gradient_scaling_factor
    handle = syncer.start(self, async_op=self.ddp_config.overlap_grad_reduce)
    if self.ddp_config.overlap_grad_reduce:
        self.grad_reduce_handle = handle  # finish_grad_sync waits for it
    else:
        handle.wait()


def apply() -> None:
    upstream._ParamAndGradBucketGroup.start_grad_sync = _start_grad_sync
