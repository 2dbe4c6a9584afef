"""Pluggable gradient-norm computation (upstream: ``megatron.core.optimizer.optimizer``).

Megatron sums each rank's squared gradient norms over the model-parallel group. Under nonuniform TP two
replicas hold the same units split differently, so their partial sums round differently, their clip
factors differ in the last bits, and replicas that must stay bit-identical drift apart. This patch routes
``get_grad_norm_fp32`` (used by ``clip_grad_norm`` and ``get_grad_norm``) through an override when one is
set with :func:`set_grad_norm_override`; without one, upstream's function runs.
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron.core.optimizer import clip_grads as upstream_clip_grads
from megatron.core.optimizer import optimizer as upstream_optimizer

GradNormFn = Callable[..., float]

_upstream_get_grad_norm_fp32 = upstream_clip_grads.get_grad_norm_fp32
_override: Optional[GradNormFn] = None


def set_grad_norm_override(fn: Optional[GradNormFn]) -> None:
    """``fn(grads_for_norm, grad_stats_parallel_group=None, **kw) -> float`` or None for upstream's norm."""
    global _override
    _override = fn


def _get_grad_norm_fp32(grads_for_norm, *args, **kwargs):
    if _override is not None:
        return _override(grads_for_norm, *args, **kwargs)
    return _upstream_get_grad_norm_fp32(grads_for_norm, *args, **kwargs)


def apply() -> None:
    upstream_optimizer.get_grad_norm_fp32 = _get_grad_norm_fp32
