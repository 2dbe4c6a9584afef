"""The distributed optimizer's step (upstream: ``megatron.core.optimizer.distrib_optimizer``,
``DistributedOptimizer``).

Every device: a deferrable parameter all-gather. Upstream's ``step_with_ready_grads`` steps the local shard and
then all-gathers the updated parameters over the data-parallel group (``model_chunk.start_param_sync()``), inside
``optimizer.step()``. Under NTP the optimizer step comes after the commit point and must not communicate: a peer's
failure there would interrupt a step every rank is bound to take. :func:`defer_param_sync` makes one optimizer
skip that gather (its step is then local only, like the non-distributed optimizer's); the caller runs it as a step
of its own (``DistributedDataParallel.start_param_sync(force_sync=True)``, the same synchronous gather).
Optimizers not deferred run upstream's code unchanged.

CPU only: bf16 / fp16 (and fp32) parameters. Upstream sorts the parameters it shards by ``param.type()`` against
CUDA type names, as the non-distributed mixed-precision optimizer does; the same remedy
(:mod:`ntp_megatron.patches.optimizer_optimizer`): while its constructor runs, CPU parameters answer with the CUDA
name of their dtype.
"""

from __future__ import annotations

import functools

from megatron.core.optimizer import distrib_optimizer as upstream
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

from ntp_megatron.patches.optimizer_optimizer import answer_cuda_type_in_constructor

_DEFERRED = "_ntp_defer_param_sync"


def defer_param_sync(optimizer, defer: bool = True) -> None:
    """Whether ``optimizer`` (a ``DistributedOptimizer``, or a ``ChainedOptimizer`` of them) leaves the parameter
    all-gather after its step to the caller. Raises for anything else, and with ``overlap_param_gather`` (whose
    gather upstream already defers, to the next forward's pre-hooks)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(part, upstream.DistributedOptimizer):
            raise TypeError(f"defer_param_sync needs a DistributedOptimizer, got {type(part).__name__}")
        if defer and (part.ddp_config.overlap_param_gather or part.ddp_config.use_megatron_fsdp):
            raise ValueError("defer_param_sync: overlap_param_gather and Megatron FSDP gather elsewhere")
        setattr(part, _DEFERRED, defer)


def param_sync_deferred(optimizer) -> bool:
    return getattr(optimizer, _DEFERRED, False)


def _deferrable(step_with_ready_grads):
    @functools.wraps(step_with_ready_grads)
    def step(self) -> bool:
        if param_sync_deferred(self):
            # Upstream's step without its all-gather: the inner step and the copy of the updated main params into
            # this rank's shard of the parameter buffer.
            return MixedPrecisionOptimizer.step_with_ready_grads(self)
        return step_with_ready_grads(self)

    step._ntp_deferrable = True
    return step


def apply() -> None:
    cls = upstream.DistributedOptimizer
    if not getattr(cls.step_with_ready_grads, "_ntp_deferrable", False):
        cls.step_with_ready_grads = _deferrable(cls.step_with_ready_grads)


def apply_cpu() -> None:
    answer_cuda_type_in_constructor(upstream.DistributedOptimizer)
