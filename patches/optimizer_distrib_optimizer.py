"""bf16 / fp16 distributed optimizer on CPU (upstream: ``megatron.core.optimizer.distrib_optimizer``,
``DistributedOptimizer``).

Upstream sorts the parameters it shards by ``param.type()`` against CUDA type names, as the non-distributed
mixed-precision optimizer does; the same remedy (:mod:`ntp_megatron.patches.optimizer_optimizer`): while its
constructor runs, CPU parameters answer with the CUDA name of their dtype.
"""

from __future__ import annotations

from megatron.core.optimizer import distrib_optimizer as upstream

from ntp_megatron.patches.optimizer_optimizer import answer_cuda_type_in_constructor


def apply() -> None:
    answer_cuda_type_in_constructor(upstream.DistributedOptimizer)
