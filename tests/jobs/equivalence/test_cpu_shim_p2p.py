"""The CPU shim for Megatron-Core's pipeline p2p: ``P2PCommunicator`` allocates its receive buffers on
``torch.cuda.current_device()`` and synchronises CUDA after a batched send/receive; on CPU both go through the
shim (without it: "Torch not compiled with CUDA enabled"). Two forked gloo ranks, stage 0 and stage 1: an
activation forward, its gradient back, with batched and with single p2p operations, bit for bit."""

from __future__ import annotations

import multiprocessing
import os

import pytest


def _stage(rank: int, store_path: str, batched: bool) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from ntp_megatron.patches import apply_patches

    apply_patches(cpu=True)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                 batch_p2p_comm=batched)
    p2p = P2PCommunicator(dist.group.WORLD, config)
    shape = (4, 2, 8)
    activation = torch.arange(64, dtype=torch.float32).view(shape) / 7
    if rank == 0:
        p2p.send_forward(activation, is_last_stage=False)
        grad = p2p.recv_backward(shape, is_last_stage=False)
        ok = torch.equal(grad, -activation)
    else:
        received = p2p.recv_forward(shape, is_first_stage=False)
        ok = torch.equal(received, activation)
        p2p.send_backward(-received, is_first_stage=False)
    dist.destroy_process_group()
    os._exit(0 if ok else 3)


def _run(tmp_path, batched: bool) -> list[int]:
    context = multiprocessing.get_context("fork")
    store = str(tmp_path / f"store-{batched}")
    stages = [context.Process(target=_stage, args=(rank, store, batched)) for rank in (0, 1)]
    for stage in stages:
        stage.start()
    for stage in stages:
        stage.join(timeout=60)
    codes = [stage.exitcode for stage in stages]
    for stage in stages:
        if stage.is_alive():
            stage.kill()
    return codes


@pytest.mark.parametrize("batched", [True, False], ids=["batch_isend_irecv", "isend-irecv"])
def test_a_stage_boundary_carries_activation_and_gradient_on_cpu(tmp_path, batched):
    assert _run(tmp_path, batched) == [0, 0]
