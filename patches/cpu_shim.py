"""CPU shim for Megatron-Core call sites that hard-code CUDA (upstream: several modules, listed below).

Megatron-Core allocates buffers with ``device=torch.cuda.current_device()`` or ``device='cuda'`` and calls
``torch.cuda.synchronize()`` in code paths we need on CPU. With more than one distributed-optimizer instance
(``num_distributed_optimizer_instances``) DDP also makes a ``torch.cuda.Stream`` for the inter-instance
all-reduce, even with overlap off, and its bucket groups run their collectives inside ``torch.cuda.stream(...)``
and order them against ``torch.cuda.default_stream()``: the patched modules see a null stream instead (CPU ops
and gloo collectives are synchronous, so there is nothing to order). Rather than change ``torch`` for the whole
process (a global TorchFunctionMode would intercept every op), each listed module gets its own view of
``torch`` whose ``cuda`` namespace answers for the CPU and whose tensor factories map ``'cuda'`` to ``'cpu'``.
Everything else is the real ``torch``. Apply only in processes without CUDA.

One call site moves a tensor with the ``Tensor.cuda`` method, which no module's view of ``torch`` reaches:
``LanguageModule.setup_embeddings_and_output_layer`` (``megatron.core.models.common.language_module``), before
the embedding-group all-reduce that copies the first stage's tied word embeddings into the last stage's output
layer (pipeline stages only). While it runs, ``Tensor.cuda`` returns the tensor itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

# Modules whose own code allocates on, or synchronises, the CUDA device on the paths we run
# (model build, DDP buffers, optimizer, schedules, checkpoint save/load).
PATCHED_MODULES = (
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",  # fp16's loss scale
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",  # stage boundaries: receive buffers, the sync after p2p
    "megatron.core.tensor_parallel.layers",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.module",
    "megatron.core.transformer.utils",  # the causal mask of the local spec's softmax (no materialised mask)
    "megatron.core.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",  # async saves: the writer fork, finalization
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
)

_FACTORIES = frozenset(
    {"tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like",
     "full_like", "randn", "rand", "randint", "as_tensor"}
)


def _cpu_device(device: Any) -> Any:
    if device is not None and str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class _NullStream:
    """A CUDA stream on the CPU: nothing runs asynchronously there, so waits and synchronisation are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by a patched module: the current device is the CPU."""

    def __init__(self, owner: str) -> None:
        super().__init__(f"{owner}.torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Nothing to wait for: CPU ops are synchronous."""

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def empty_cache() -> None:
        """No caching allocator on CPU."""

    Stream = _NullStream

    @staticmethod
    def stream(stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def default_stream(device: Any = None) -> _NullStream:
        return _NullStream()

    current_stream = default_stream


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by a patched module: factories place ``'cuda'`` tensors on the CPU."""

    def __init__(self, owner: str) -> None:
        super().__init__(f"{owner}.torch")
        self.cuda = _CpuCuda(owner)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in _FACTORIES:
            return _on_cpu(attr)
        return attr


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return make


def _tensor_cuda_is_identity(method: Callable) -> Callable:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    run.ntp_cpu_shim = True
    return run


def apply() -> None:
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is not torch:
            raise RuntimeError(f"cpu_shim: {name} does not use the plain torch module; patch written for 0.16.x")
        module.torch = _CpuTorch(name)
    # after the modules above see the shim's torch
    from megatron.core.models.common.language_module.language_module import LanguageModule

    if not getattr(LanguageModule.setup_embeddings_and_output_layer, "ntp_cpu_shim", False):
        LanguageModule.setup_embeddings_and_output_layer = _tensor_cuda_is_identity(
            LanguageModule.setup_embeddings_and_output_layer)
    logger.debug("cpu_shim: %d Megatron-Core modules see a CPU torch.cuda", len(PATCHED_MODULES))
