"""What comes after a batch of deaths: the next topology, or why NTP cannot absorb them (pure).

The controller (:mod:`ntp_megatron.elastic.controller`) gathers the facts from the store — the layout the survivors
hold, the ranks of it that died, whether the run has committed an iteration since it started — and this module
decides; the controller then publishes the decision or stops the job with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ntp_megatron.plan import memory_plan
from ntp_megatron.plan.layout import TopologyError
from ntp_megatron.plan.optimizer_shards import buffer_layout, lost_shards, shard_numel
from ntp_megatron.plan.stages import JobTopology, next_topology, transition_plan


@dataclass(frozen=True)
class ShardedOptimizer:
    """What the controller knows of a job's distributed-optimizer shards: the launch data-parallel size, the
    instances (Megatron's ``num_distributed_optimizer_instances``), and per block the parameter elements of each
    position's shard (``numel[block][position]``: :func:`ntp_megatron.plan.optimizer_shards.shard_numel` over that
    block's buffers), for the ``shard_lost`` event."""

    data_parallel_size: int
    instances: int
    numel: tuple[tuple[int, ...], ...] = ()

    def shard_numel(self, block: int, position: int) -> Optional[int]:
        return self.numel[block][position] if block < len(self.numel) else None

    @classmethod
    def of(cls, cfg) -> Optional["ShardedOptimizer"]:
        """A :class:`ntp_megatron.config.schema.JobConfig`'s, None without the distributed optimizer."""
        p = cfg.parallel
        if not p.use_distributed_optimizer:
            return None
        if p.pipeline_model_parallel_size > 1:  # refused by the config (JobConfig._check_pipeline) for now
            raise ValueError("the distributed optimizer's shards are planned for one pipeline stage")
        dims, training = memory_plan.ModelDims.of(cfg.model), memory_plan.training_of(cfg)
        topology = cfg.topology().only_stage
        params = memory_plan.gpt_params(dims)
        numel = []
        for block in range(topology.tp_base):
            units = {family: len(topology.block(family, block)) for family in dims.units}
            layout = buffer_layout(memory_plan.param_specs(params, units), training.bucket_size,
                                   training.shard_over, True)
            numel.append(tuple(shard_numel(layout, training.shard_over, j) for j in range(training.shard_over)))
        return cls(p.data_parallel_size, p.num_distributed_optimizer_instances, tuple(numel))


@dataclass(frozen=True)
class Succession:
    """The decision: the next topology (its generation number not yet set), or why NTP cannot absorb the deaths."""

    topology: Optional[JobTopology]
    reason: Optional[str] = None
    lost_shards: tuple[tuple[int, int], ...] = ()
    """Distributed-optimizer shards (block, position) every holder of which died (one ``shard_lost`` event each)."""


def succession(base: JobTopology, dead_ranks: list[int], min_tp: int, policy: str,
               sharded: Optional[ShardedOptimizer], moves_needed: bool) -> Succession:
    """The generation after ``base`` loses ``dead_ranks`` (its ranks). ``moves_needed``: the run committed an
    iteration since it started, so survivors hold state nobody can rebuild from the seed or the loaded checkpoint:
    every lost unit (and, under the distributed optimizer, every shard) must keep a surviving holder."""
    try:
        new = next_topology(base, dead_ranks, min_tp=min_tp, policy=policy)
        if sharded is not None:  # before the first commit too: a drop would cut the shards anew
            _check_no_drop(base, new, sharded.instances)
        if moves_needed:
            if sharded is not None:  # the state is the shards (units are gathered from them)
                lost = lost_shards(base.only_stage, dead_ranks, sharded.data_parallel_size, sharded.instances)
                if lost:
                    one = " (one instance: every shard has a single holder)" if sharded.instances == 1 else ""
                    return Succession(None, _cannot(f"distributed-optimizer shards (block, position) {lost} lost: "
                                                    f"every holder died{one}; nothing live holds them any more"),
                                      tuple(lost))
            transition_plan(base, new, dead_ranks)  # every lost unit must have a surviving holder somewhere
    except TopologyError as exc:
        return Succession(None, _cannot(str(exc)))
    return Succession(new)


def _cannot(why: str) -> str:
    return f"NTP cannot absorb the failure: {why}"


def _check_no_drop(base: JobTopology, new: JobTopology, instances: int) -> None:
    """Under the distributed optimizer with several instances no replica may be dropped, before the first commit as
    after it: each instance shards over its replicas' positions, which a drop would renumber (the shards would have
    to be cut anew, and the instances would shard differently), which nothing does live."""
    dropped = sorted(set(base.replica_indices) - set(new.replica_indices))
    if dropped and instances > 1:
        raise TopologyError(
            f"replica{'s' if len(dropped) > 1 else ''} {', '.join(map(str, dropped))} would be dropped, which "
            f"parallel.use_distributed_optimizer with {instances} instances does not support live (the instances' "
            "shards would be cut anew)")
