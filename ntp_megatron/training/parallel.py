"""This rank's place in the job: its replica, the groups it talks in, how many micro-batches it runs.

Two builders with one result: :func:`uniform_parallel` (Megatron's own dense grid, NTP off) and
:func:`ntp_parallel` (any topology, NTP on). The rest of training only reads :class:`ParallelSetup`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from ntp_megatron.config import JobConfig


@dataclass
class ParallelSetup:
    pg: ProcessGroupCollection
    replica: int                     # replica index: with the iteration, it alone decides the samples read
    num_replicas: int                # replicas the data is divided among (dp; a dropped replica keeps its index)
    tp_rank: int
    tp_per_replica: list[int]
    microbatches: int                # micro-batches this replica runs per iteration
    samples_per_iteration: int       # over all replicas
    topology: Optional[object] = None
    groups: Optional[object] = None  # ntp_megatron.groups.NTPGroups when NTP is on
    grad_sync: Optional[object] = None  # ntp_megatron.grad_sync.GradSync, once the model exists (NTP on)

    def sum_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a value every rank of a replica holds alike, each replica once (the loss for the log)."""
        if self.grad_sync is not None:
            return self.grad_sync.sum_over_replicas(value)
        value = value.clone()
        dist.all_reduce(value, group=self.pg.dp)
        return value


def microbatches_per_replica(cfg: JobConfig, widths: dict[int, int]) -> dict[int, int]:
    """``full``: the configured count everywhere. ``proportional``: about width/tp_base of it (at least one)."""
    full = cfg.num_microbatches
    if cfg.ntp.degraded_batch == "full":
        return {r: full for r in widths}
    tp_base = cfg.parallel.tensor_model_parallel_size
    return {r: max(1, round(full * w / tp_base)) for r, w in widths.items()}


def uniform_parallel(cfg: JobConfig) -> ParallelSetup:
    p = cfg.parallel
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=p.tensor_model_parallel_size,
                                             distributed_timeout_minutes=p.timeout_s / 60,
                                             create_gloo_process_groups=False)
    m = cfg.num_microbatches
    return ParallelSetup(
        pg=ProcessGroupCollection.use_mpu_process_groups(),
        replica=parallel_state.get_data_parallel_rank(),
        num_replicas=p.data_parallel_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_per_replica=[p.tensor_model_parallel_size] * p.data_parallel_size,
        microbatches=m,
        samples_per_iteration=cfg.training.global_batch_size,
    )


def ntp_parallel(cfg: JobConfig, store: dist.Store, rank: int, generation: int = 0) -> ParallelSetup:
    """Groups for the topology the launcher published in the store for ``generation``."""
    from ntp_megatron.groups import build_groups
    from ntp_megatron.layout import Topology
    from ntp_megatron.training.runtime import TOPOLOGY_KEY

    topology = Topology.from_json(json.loads(store.get(TOPOLOGY_KEY.format(generation=generation))))
    groups = build_groups(topology, rank, cfg.parallel.timeout_s)
    widths = {rep.index: rep.width for rep in topology.replicas}
    counts = microbatches_per_replica(cfg, widths)
    replica = topology.replica_of(rank)
    return ParallelSetup(
        pg=groups.pg_collection,
        replica=replica.index,
        num_replicas=cfg.parallel.data_parallel_size,
        tp_rank=topology.local_rank(rank),
        tp_per_replica=[rep.width for rep in topology.replicas],
        microbatches=counts[replica.index],
        samples_per_iteration=sum(counts.values()) * cfg.training.micro_batch_size,
        topology=topology,
        groups=groups,
    )
