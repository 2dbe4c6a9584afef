"""This rank's process groups in Megatron-Core's globals (upstream: ``megatron.core.parallel_state``).

Upstream's ``initialize_model_parallel`` builds the whole dense tp × cp × ep × dp × pp grid on every rank: each
rank calls ``new_group`` for every group of the world, and is a member of several world-sized ones (at 10,240
ranks and TP 1: 112,646 calls per rank, six world-sized groups, each a full mesh under gloo). It also rejects
an uneven world (7 ranks at TP 4). Each process keeps its own copy of the globals, so neither is needed: the
caller builds the few groups its rank is a member of and :func:`install` puts them where Megatron's code
looks (the RNG tracker's TP and expert ranks, vocab-parallel cross entropy, the pipeline schedule, sharded
state dicts' data-parallel group). The same groups go into the explicit ``ProcessGroupCollection`` it
returns for the model, DDP and the optimizer.

With context and expert parallelism 1 (the only shapes this package runs), upstream's grid has, for one rank:
the tensor-parallel group, the data-parallel group, the rank by itself for every trivial role (context, expert, and
at PP 1 pipeline, embedding and position embedding), the tensor-parallel group again for the roles that combine it
with a trivial one (tensor+context, expert tensor, and at PP 1 model), the data-parallel group again for expert
data parallelism, and the distributed optimizer's grad-norm group (the ranks of its instance: the world with one
instance). With pipeline stages (:class:`PipelineGroups`) it also has its pipeline lane, its replica's
model-parallel group (every stage) and, in the first and last stage, the embedding group. With
``num_distributed_optimizer_instances`` k > 1 it also
has the partial groups: the intra-instance part of its data-parallel group (what the optimizer shards over and
DDP reduce-scatters in) and the inter-instance group of its twins (what DDP all-reduces the shards across);
with k = 1 the intra-instance group is the data-parallel group and there is no inter-instance group. The
tensor-and-data group (FP8 amax reduction only) is left unset, so code that reaches
for it fails loudly rather than building a world-sized group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class RankGroups:
    """The groups one rank takes part in, with their global ranks (in group-rank order)."""

    tp: dist.ProcessGroup
    tp_ranks: tuple[int, ...]
    dp: dist.ProcessGroup
    dp_ranks: tuple[int, ...]
    alone: dist.ProcessGroup
    """This rank by itself: every trivial role (pipeline, context, expert, embedding)."""
    rank: int
    grad_stats: Optional[dist.ProcessGroup] = None
    """The distributed optimizer's grad-norm group: the ranks of this rank's instance (the world at PP 1 and one
    instance; None without a distributed optimizer). Not the world with k > 1 instances: every instance holds
    every reduced gradient, so the world would count each one k times (a norm √k too large)."""
    intra_dp: Optional[dist.ProcessGroup] = None
    """The intra-instance part of ``dp`` (k > 1 instances); None: ``dp`` itself (one instance)."""
    inter_dist_opt: Optional[dist.ProcessGroup] = None
    """This rank's twins, one per instance (k > 1 instances); None with one instance."""
    pipeline: Optional["PipelineGroups"] = None
    """With pipeline stages: the groups that cross them; None at PP 1 (every pipeline role is this rank alone)."""


@dataclass(frozen=True)
class PipelinePosition:
    """A rank's place in its pipeline (stage ``rank()`` of ``size()``) where no lane group exists: under NTP a
    stage of one TP degree may border one of another, so a rank's neighbours are not one rank per stage (the
    NTP communicator, :class:`ntp_megatron.core.pipeline.NTPP2PCommunicator`, sends to explicit ranks). Megatron-Core's
    schedule, model and ``finalize_model_grads`` read only ``rank()`` and ``size()`` of a pipeline group; anything
    that would communicate over it fails loudly (it is not a process group)."""

    stage: int
    stages: int

    def rank(self) -> int:
        return self.stage

    def size(self) -> int:
        return self.stages


@dataclass(frozen=True)
class PipelineGroups:
    """The groups of one rank that cross pipeline stages (:class:`ntp_megatron.plan.grid.Grid`), with their global
    ranks in group-rank order."""

    lane: "dist.ProcessGroup | PipelinePosition"
    """Megatron's pipeline group: this rank's slot of its replica, one rank per stage (under NTP its position)."""
    lane_ranks: tuple[int, ...]
    mp: dist.ProcessGroup
    """Megatron's model-parallel group: every stage and slot of this rank's replica."""
    mp_ranks: tuple[int, ...]
    embd: Optional[dist.ProcessGroup]
    """The first and the last stage's ranks of the lane (tied word embeddings); None in a middle stage."""
    embd_ranks: tuple[int, ...]
    pos_embd: Optional[dist.ProcessGroup]
    """The first stage's rank of the lane, alone; None in a later stage."""
    pos_embd_ranks: tuple[int, ...]


def install(groups: RankGroups) -> ProcessGroupCollection:
    """Replace Megatron-Core's globals by ``groups`` and return the matching explicit collection."""
    ps.destroy_model_parallel()  # unconditionally: a build a failure cut short leaves some globals set
    tp_ranks, dp_ranks, me = list(groups.tp_ranks), list(groups.dp_ranks), [groups.rank]
    ps._TENSOR_MODEL_PARALLEL_GROUP = groups.tp
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = tp_ranks
    pipe = groups.pipeline
    mp, mp_ranks = (pipe.mp, list(pipe.mp_ranks)) if pipe else (groups.tp, tp_ranks)  # PP 1: mp = tp
    lane, lane_ranks = (pipe.lane, list(pipe.lane_ranks)) if pipe else (groups.alone, me)
    embd, embd_ranks = (pipe.embd, list(pipe.embd_ranks)) if pipe else (groups.alone, me)
    pos_embd, pos_embd_ranks = (pipe.pos_embd, list(pipe.pos_embd_ranks)) if pipe else (groups.alone, me)
    ps._MODEL_PARALLEL_GROUP = mp
    ps._MODEL_PARALLEL_GLOBAL_RANKS = mp_ranks
    ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP = groups.tp  # CP = 1
    ps._PIPELINE_MODEL_PARALLEL_GROUP = lane
    ps._PIPELINE_GLOBAL_RANKS = lane_ranks or None
    if isinstance(lane, PipelinePosition):  # upstream's getters read these before the group
        ps._MPU_PIPELINE_MODEL_PARALLEL_RANK, ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = lane.stage, lane.stages
    ps._EMBEDDING_GROUP = embd  # first and last pipeline stage (PP 1: this rank)
    ps._EMBEDDING_GLOBAL_RANKS = embd_ranks or None
    ps._POSITION_EMBEDDING_GROUP = pos_embd
    ps._POSITION_EMBEDDING_GLOBAL_RANKS = pos_embd_ranks or None
    ps._CONTEXT_PARALLEL_GROUP = groups.alone
    ps._CONTEXT_PARALLEL_GLOBAL_RANKS = me
    ps._DATA_PARALLEL_GROUP = groups.dp
    ps._DATA_PARALLEL_GLOBAL_RANKS = dp_ranks
    ps._DATA_PARALLEL_GROUP_WITH_CP = groups.dp
    ps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = dp_ranks
    intra_dp = groups.intra_dp if groups.intra_dp is not None else groups.dp
    ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = intra_dp
    ps._INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP = groups.grad_stats
    # Expert parallelism 1, expert tensor parallelism = TP (upstream's default): no expert weights here, but
    # the RNG tracker seeds its expert stream from these ranks, and DDP wants an expert data-parallel group.
    ps._EXPERT_MODEL_PARALLEL_GROUP = groups.alone
    ps._EXPERT_MODEL_PARALLEL_RANKS = me
    ps._EXPERT_TENSOR_PARALLEL_GROUP = groups.tp
    ps._EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP = groups.tp
    ps._EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP = mp
    ps._EXPERT_DATA_PARALLEL_GROUP = groups.dp
    ps._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP = intra_dp
    ps._INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP = groups.inter_dist_opt
    ps._set_global_memory_buffer()
    return ProcessGroupCollection(
        tp=groups.tp, pp=lane, mp=mp, embd=embd, pos_embd=pos_embd, cp=groups.alone,
        tp_cp=groups.tp, hcp=None, ep=groups.alone, expt_tp=groups.tp, tp_ep=groups.tp, tp_ep_pp=mp,
        tp_dp_cp=None, dp=groups.dp, dp_cp=groups.dp, expt_dp=groups.dp, intra_dp_cp=intra_dp,
        intra_expt_dp=intra_dp, inter_dist_opt=groups.inter_dist_opt, intra_dist_opt=groups.grad_stats,
    )

