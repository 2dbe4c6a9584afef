"""bf16 / fp16 optimizer on CPU (upstream: ``megatron.core.optimizer.optimizer``,
``Float16OptimizerWithFloat16Params``).

Upstream sorts the parameters it wraps by ``param.type()`` and accepts only the CUDA type names
(``torch.cuda.BFloat16Tensor`` …): every CPU parameter is refused with ``TypeError: Wrapped parameters must be
one of torch.cuda.FloatTensor …``. While upstream's constructor runs, each CPU parameter it is given answers
``type()`` with the CUDA name of its dtype, so upstream's own code makes the fp32 main params (and copies
Megatron's TP attributes to them); the answer is taken back afterwards. The rest of the mixed-precision path
(buffers allocated on ``'cuda'``) is the CPU shim's (:mod:`ntp_megatron.patches.cpu_shim`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from megatron.core.optimizer import optimizer as upstream

_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def answering_cuda_type(init: Callable) -> Callable:
    """``init(self, optimizer, ...)`` during which the CPU parameters of ``optimizer`` answer ``type()`` with
    their CUDA type name."""
    @functools.wraps(init)
    def wrapped(self, optimizer, *args, **kwargs):
        masked = []
        if optimizer:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.device.type == "cpu" and param.dtype in _CUDA_TYPE_NAMES and "type" not in vars(param):
                        param.type = functools.partial(_CUDA_TYPE_NAMES.__getitem__, param.dtype)
                        masked.append(param)
        try:
            init(self, optimizer, *args, **kwargs)
        finally:
            for param in masked:
                del param.type
    return wrapped


def answer_cuda_type_in_constructor(cls: type) -> None:
    """Wrap ``cls.__init__`` with :func:`answering_cuda_type` (once)."""
    if getattr(cls.__init__, "_ntp_cpu_types", False):
        return
    cls.__init__ = answering_cuda_type(cls.__init__)
    cls.__init__._ntp_cpu_types = True


def apply() -> None:
    answer_cuda_type_in_constructor(upstream.Float16OptimizerWithFloat16Params)
