"""This rank's place in the job: its replica, the groups it talks in, which samples it reads.

Two builders with one result: :func:`uniform_parallel` (Megatron's own dense grid, NTP off) and
:func:`ntp_parallel` (any topology, NTP on; called again at every re-formation). The rest of training only
reads :class:`ParallelSetup`.

Samples: the global batch of iteration ``k`` is cut into ``dp`` *shares*, one per replica index of the
starting topology (:func:`ntp_megatron.training.data.replica_sample_range`). A replica reads its own share;
when a replica has been dropped (``ntp.on_unrecoverable: drop_replica``) its share is read by a surviving
replica, so the global batch and the data order do not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from ntp_megatron.plan import stages
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.plan.grid import Grid
from ntp_megatron.core.groups import GroupPool, build_groups, dense_groups
from ntp_megatron.patches import parallel_state as ps_patch


@dataclass
class ParallelSetup:
    pg: ProcessGroupCollection
    replica: int                     # replica index (stable for the whole job)
    num_replicas: int                # shares the global batch is cut into (dp at launch)
    tp_rank: int
    tp_per_replica: list             # per replica index; 0 for a dropped replica; with stages, one per stage
    shares: list[int]                # shares of the global batch this replica reads, ascending
    microbatches_per_share: int      # micro-batches this replica runs per share
    samples_per_iteration: int       # over all replicas
    rank: int = 0                    # this process's rank in its generation
    generation: int = 0
    topology: Optional[object] = None
    groups: Optional[object] = None  # ntp_megatron.core.groups.NTPGroups when NTP is on
    grad_sync: Optional[object] = field(default=None, repr=False)  # ntp_megatron.core.grad_sync.GradSync (NTP)
    stage: int = 0                   # pipeline stage
    stages: int = 1                  # pipeline stages of a replica

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        """Where the loss is computed (Megatron's ``post_process``)."""
        return self.stage == self.stages - 1

    @property
    def microbatches(self) -> int:
        return self.microbatches_per_share * len(self.shares)

    def loss_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """A loss sum (and token count) of this rank's stage summed over replicas, on every rank: only the last
        stage computes the loss (the other stages hold zeros), and it broadcasts the sum along the pipeline."""
        if self.last_stage:
            value = self.sum_over_replicas(value)
        if self.stages > 1 and self.groups is not None:  # NTP: from the last stage's first rank, over the replica
            dist.broadcast(value, src=self.groups.last_stage_rank, group=self.groups.mp)
        elif self.stages > 1:
            dist.broadcast(value, group=self.pg.pp, group_src=self.stages - 1)
        return value

    def sum_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a value every rank of a replica's stage holds alike, each replica once (the loss for the log)."""
        if self.grad_sync is not None:
            return self.grad_sync.sum_over_replicas(value)
        value = value.clone()
        dist.all_reduce(value, group=self.pg.dp)
        return value


def microbatches_per_share(cfg: JobConfig, width: int) -> int:
    """``full``: the configured count. ``proportional``: about width/tp_base of it (at least one)."""
    full = cfg.num_microbatches
    if cfg.ntp.degraded_batch == "full":
        return full
    return max(1, round(full * width / cfg.parallel.tensor_model_parallel_size))


def assign_shares(live: list[int], num_replicas: int) -> dict[int, list[int]]:
    """Each live replica reads its own share; the share of a dropped replica goes to a live one (the i-th
    dropped share to the (i mod live)-th live replica), so every share is read exactly once."""
    out = {r: [r] for r in live}
    dropped = [r for r in range(num_replicas) if r not in out]
    for i, share in enumerate(dropped):
        out[live[i % len(live)]].append(share)
    return {r: sorted(s) for r, s in out.items()}


def uniform_parallel(cfg: JobConfig) -> ParallelSetup:
    """Megatron's dense grid at the configured TP, but only this rank's groups: its TP and DP groups and
    itself alone for the trivial roles (never upstream's initializer, which makes every group of the world on
    every rank), and with the distributed optimizer its instance's groups (:func:`dense_groups`)."""
    p = cfg.parallel
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = dense_groups(p.tensor_model_parallel_size, rank, world, timedelta(seconds=p.timeout_s),
                          distributed_optimizer=p.use_distributed_optimizer,
                          instances=p.num_distributed_optimizer_instances, pp_size=p.pipeline_model_parallel_size)
    pg = ps_patch.install(groups)
    stage, replica, tp_rank = Grid.of_world(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                            world).coords(rank)
    return ParallelSetup(
        pg=pg,
        replica=replica,
        num_replicas=p.data_parallel_size,
        tp_rank=tp_rank,
        tp_per_replica=Grid(p.tensor_model_parallel_size, p.data_parallel_size, p.pipeline_model_parallel_size
                            ).tp_per_replica(),
        shares=[replica],
        microbatches_per_share=cfg.num_microbatches,
        samples_per_iteration=cfg.training.global_batch_size,
        rank=rank,
        stage=stage,
        stages=p.pipeline_model_parallel_size,
    )


def ntp_parallel(cfg: JobConfig, topology, rank: int, pool: Optional[GroupPool] = None) -> ParallelSetup:
    """Groups (collective over each group's members; with ``pool``, those it offers kept) and samples for
    ``rank`` in ``topology``."""
    groups = build_groups(topology, rank, cfg.parallel.timeout_s, dp=cfg.parallel.data_parallel_size,
                          instances=cfg.parallel.num_distributed_optimizer_instances, pool=pool)
    tp_per_replica = stages.tp_per_replica(topology, cfg.parallel.data_parallel_size)
    topology = groups.topology  # with pipeline stages: this rank's stage
    widths = {rep.index: rep.width for rep in topology.replicas}
    shares = assign_shares(list(widths), cfg.parallel.data_parallel_size)
    counts = {rep.index: microbatches_per_share(cfg, rep.width) * len(shares[rep.index])
              for rep in topology.replicas}
    replica = topology.replica_of(rank)
    return ParallelSetup(
        pg=groups.pg_collection,
        replica=replica.index,
        num_replicas=cfg.parallel.data_parallel_size,
        tp_rank=topology.local_rank(rank),
        tp_per_replica=tp_per_replica,
        shares=shares[replica.index],
        microbatches_per_share=microbatches_per_share(cfg, replica.width),
        samples_per_iteration=sum(counts.values()) * cfg.training.micro_batch_size,
        rank=rank,
        generation=topology.generation,
        topology=topology,
        groups=groups,
        stage=topology.stage,
        stages=groups.job.num_stages,
    )
