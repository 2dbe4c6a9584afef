"""bf16 / fp16 distributed optimizer on CPU (upstream: ``megatron.core.optimizer.distrib_optimizer``,
``DistributedOptimizer``).

Upstream sorts the parameters it shards by ``param.type()`` against CUDA type names, as the non-distributed
mixed-precision optimizer does; the same remedy (:mod:`ntp_megatron.patches.optimizer_optimizer`): while its
constructor runs, CPU parameters answer with the CUDA name of their dtype.
"""

from __future__ import annotations

from megatron.core.optimizer import distrib_optimizer as upstream

from ntp_megatron.patches.optimizer_optimizer import answering_cuda_type


def apply() -> None:
    cls = upstream.DistributedOptimizer
    if getattr(cls.__init__, "_ntp_cpu_types", False):
        return
    cls.__init__ = answering_cuda_type(cls.__init__)
    cls.__init__._ntp_cpu_types = True
