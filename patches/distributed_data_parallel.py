"""Give every DDP bucket group the creation order of its siblings
(upstream: ``megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.__init__``).

Companion of :mod:`ntp_megatron.patches.distributed_param_and_grad_buffer`, which dispatches bucket groups
strictly in that order. Dense and expert-parallel groups are ordered separately, as upstream keeps them.
"""

from __future__ import annotations

from megatron.core.distributed import distributed_data_parallel as upstream

_upstream_init = upstream.DistributedDataParallel.__init__


def _init(self, *args, **kwargs) -> None:
    _upstream_init(self, *args, **kwargs)
    for groups in (self.bucket_groups, self.expert_parallel_bucket_groups):
        order = list(groups)
        for group in order:
            group.dispatch_order = order


def apply() -> None:
    upstream.DistributedDataParallel.__init__ = _init
