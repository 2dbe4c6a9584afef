"""Per-replica tensor-parallel groups in Megatron-Core's globals (upstream: ``megatron.core.parallel_state``).

``initialize_model_parallel`` assumes a dense tp × dp grid and rejects, say, 7 ranks at TP 4. Each process
keeps its own copy of the globals, so an uneven world works when every rank first initialises the rarely
changing groups at TP 1 (pipeline, context, expert: all trivial) and then installs its own replica's TP
group and the data-parallel group it syncs in. Code that still reads the globals (the RNG tracker's TP rank,
``get_model_parallel_group`` in the optimizer) then sees the replica it lives in.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch.distributed as dist
from megatron.core import parallel_state as ps


def initialize_trivial_groups(timeout: timedelta) -> None:
    """Megatron's own initializer at TP 1 / PP 1 / CP 1: valid for any world size. No gloo side groups (the
    job's backend is gloo on CPU already), and every group bounded by ``timeout``."""
    ps.destroy_model_parallel()  # unconditionally: an initializer a failure cut short leaves some groups set
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 distributed_timeout_minutes=timeout.total_seconds() / 60,
                                 create_gloo_process_groups=False)


def install_tensor_parallel_group(tp_group: dist.ProcessGroup, tp_ranks: Sequence[int]) -> None:
    """Make ``tp_group`` (this rank's replica) the tensor- and model-parallel group of this process."""
    ps._TENSOR_MODEL_PARALLEL_GROUP = tp_group
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = list(tp_ranks)
    ps._MODEL_PARALLEL_GROUP = tp_group  # PP = 1: model parallel = tensor parallel
    ps._MODEL_PARALLEL_GLOBAL_RANKS = list(tp_ranks)
    ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP = tp_group  # CP = 1
    ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = None
    ps._MPU_TENSOR_MODEL_PARALLEL_RANK = None


def install_data_parallel_group(dp_group: dist.ProcessGroup, dp_ranks: Sequence[int]) -> None:
    """The group Megatron's own DP collectives run in (for NTP: the sync group when all replicas are equally
    wide, else this rank alone). The TP1 initialiser's other DP-derived groups span the whole world, which
    is wrong for any layout, so they are cleared: code that still reaches for them fails loudly instead."""
    for name in ("_DATA_PARALLEL_GROUP_GLOO", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_DATA_PARALLEL_GROUP_WITH_CP_AG",
                 "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_TENSOR_AND_DATA_PARALLEL_GROUP",
                 "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP"):
        setattr(ps, name, None)
    ps._DATA_PARALLEL_GROUP = dp_group
    ps._DATA_PARALLEL_GLOBAL_RANKS = list(dp_ranks)
    ps._DATA_PARALLEL_GROUP_WITH_CP = dp_group
    ps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = list(dp_ranks)
    ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = dp_group
    ps._MPU_DATA_PARALLEL_WORLD_SIZE = None
    ps._MPU_DATA_PARALLEL_RANK = None
