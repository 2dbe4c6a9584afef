"""Gradient clipping on CPU (upstream: ``megatron.core.optimizer.clip_grads``).

``clip_grad_by_total_norm_fp32`` asserts ``grad.type() == 'torch.cuda.FloatTensor'``, which no CPU tensor
passes. This version checks the dtype only and scales with ``torch._foreach_mul_``, the same arithmetic
(``max_norm / (total_norm + 1e-6)`` applied when below one). ``megatron.core.optimizer.optimizer`` imports
the function by name, so both bindings are replaced.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch
from megatron.core.optimizer import clip_grads as upstream
from megatron.core.optimizer import optimizer as upstream_optimizer
from megatron.core.utils import to_local_if_dtensor


def clip_grad_by_total_norm_fp32(
    parameters: Union[Iterable[torch.Tensor], torch.Tensor],
    max_norm: Union[int, float],
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            if grad.dtype not in (torch.float32, torch.bfloat16) or (attr == "grad" and grad.dtype != torch.float32):
                raise TypeError(f"clip_grad_by_total_norm_fp32: {attr} of dtype {grad.dtype}, expected fp32")
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def apply() -> None:
    upstream.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    upstream_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
