"""Bucket groups dispatch their collectives in creation order
(upstream: ``megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup``).

With ``overlap_grad_reduce``, upstream starts a bucket group's all-reduce the moment its last gradient is
ready (after the first batch; in the first batch ``finish_grad_sync`` starts them in creation order).
Readiness order is a property of one rank's backward pass, and nothing makes it the same on every member
of a data-parallel group. Under NTP the members of a sync group are ranks of different replicas, and a
degraded replica's rank issues its group's collectives in creation order: a healthy rank that dispatched
in readiness order would meet it with a different bucket (gloo fails on the size mismatch; NCCL would
hang or, on equal sizes, silently sum the wrong tensors).

The rule here: a ready bucket group is dispatched only once every group created before it has been
dispatched, so the longest ready prefix goes out. Backward usually finishes buckets in creation order
(buckets are laid out in reverse parameter order for exactly that reason), so overlap is kept. The
ordered list of groups is attached by :mod:`ntp_megatron.patches.distributed_data_parallel`; a group
without one behaves as upstream.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.distributed import param_and_grad_buffer as upstream

_Group = upstream._ParamAndGradBucketGroup
_upstream_reset = _Group.reset


def _register_grad_ready(self, param, force_all_reduce: Optional[bool] = False) -> None:
    assert self.ddp_config.overlap_grad_reduce, "register_grad_ready() needs overlap_grad_reduce"
    if not self.is_last_microbatch:
        return
    assert param in self.param_to_bucket, "Param is not in the bucket group"
    self.per_param_grad_ready_counts[param] = self.per_param_grad_ready_counts.get(param, 0) + 1
    if self.is_first_batch or self.per_param_grad_ready_counts != self.golden_per_param_grad_ready_counts:
        return
    order = getattr(self, "dispatch_order", None)
    if order is None:
        self.start_grad_sync(force_all_reduce=force_all_reduce)
        return
    self.ready_to_dispatch = True
    for group in order:
        if getattr(group, "dispatched", False):
            continue
        if not getattr(group, "ready_to_dispatch", False):
            break
        group.dispatched = True
        group.start_grad_sync(force_all_reduce=force_all_reduce)


def _reset(self) -> None:
    _upstream_reset(self)
    self.ready_to_dispatch = False
    self.dispatched = False


def apply() -> None:
    _Group.register_grad_ready = _register_grad_ready
    _Group.reset = _reset
