"""How a rank's Megatron-Core objects are made for a layout under NTP: the training side of
:class:`ntp_megatron.elastic.interfaces.Builder`, which the re-formation calls for every generation."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from megatron.core import tensor_parallel

from ntp_megatron.config.schema import JobConfig
from ntp_megatron.core.shadows import abandon_collectives
from ntp_megatron.core.groups import GroupPool, rebind_process_groups
from ntp_megatron.plan.stages import JobTopology
from ntp_megatron.training import checkpoint
from ntp_megatron.training.components import Components, attach_grad_sync, build_components
from ntp_megatron.training.parallel import ParallelSetup, ntp_parallel


class RankBuilder:
    def __init__(self, cfg: JobConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device

    def setup(self, topology: JobTopology, rank: int, pool: Optional[GroupPool] = None) -> ParallelSetup:
        return ntp_parallel(self.cfg, topology, rank, pool)

    def build(self, setup: ParallelSetup, initialize: bool, adopt_from: Optional[Components] = None) -> Components:
        seed = self.cfg.training.seed
        torch.manual_seed(seed)  # initial weights are a function of the seed alone
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return build_components(self.cfg, setup, self.device, initialize=initialize, adopt_from=adopt_from)

    def load_start(self, objects: Components) -> int:
        coords = checkpoint.ParallelCoords.of(objects.setup, self.cfg.parallel)
        ck = self.cfg.checkpoint
        return checkpoint.load_checkpoint(Path(ck.load), objects.model, objects.optimizer, objects.scheduler, coords,
                                          checkpoint.LoadPlan.of(ck), grad_sync=objects.setup.grad_sync).iteration

    def rebind(self, objects: Components, setup: ParallelSetup) -> None:
        """Every reference to an old process group in the model and the optimizer is pointed at the new one; the
        grad sync is made anew for the new groups. Whatever the old groups had in flight is forgotten."""
        if objects.parameters_freed:  # a degraded rank's objects under the distributed optimizer: always rebuilt
            raise RuntimeError("objects whose model parameters were freed for a re-formation cannot be kept")
        abandon_collectives(objects.model)
        rebind_process_groups([objects.model, objects.optimizer], objects.setup.groups, setup.groups)
        objects.setup.grad_sync.close()
        objects.setup = setup
        attach_grad_sync(self.cfg, objects)
