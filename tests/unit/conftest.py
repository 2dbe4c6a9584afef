"""Fixtures shared by the unit tests that build Megatron-Core objects in this one process."""

from __future__ import annotations

from datetime import timedelta

import pytest


@pytest.fixture(scope="module")
def megatron():
    """A one-rank gloo world with Megatron-Core's groups and this package's patches (in this process)."""
    import torch.distributed as dist

    from ntp_megatron.patches import apply_patches
    from ntp_megatron.patches import parallel_state as ps_patch

    apply_patches(cpu=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port at all
    from ntp_megatron.core.groups import dense_groups

    yield ps_patch.install(dense_groups(1, 0, 1, timedelta(seconds=60)))
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
