"""The CPU shim's null CUDA stream: Megatron-Core's DDP with more than one distributed-optimizer instance makes a
``torch.cuda.Stream`` at construction (overlap or not), and with ``overlap_grad_reduce`` its bucket groups run
the reduce-scatter and the inter-instance all-reduce inside ``torch.cuda.stream(...)``, ordered against
``torch.cuda.default_stream()``. On one gloo rank every group has one member, so the sync must hand back
exactly the gradients the backward accumulated."""

from __future__ import annotations

import copy

import pytest


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_ddp_with_two_instances_builds_and_syncs_on_cpu(megatron, overlap):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from ntp_megatron.patches.cpu_shim import _NullStream

    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32,
                     max_sequence_length=8, pg_collection=megatron)
    pg = copy.copy(megatron)
    pg.inter_dist_opt = megatron.dp  # one rank: the intra- and inter-instance groups are both this rank alone
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, bucket_size=2000 if overlap else None,
        use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    ddp = DistributedDataParallel(config, ddp_config, model, pg_collection=pg)
    assert all(isinstance(g.communication_stream, _NullStream) for g in ddp.bucket_groups)
    assert all(g.inter_distributed_optimizer_instance_group is megatron.dp for g in ddp.bucket_groups)
    if overlap:
        assert len(ddp.bucket_groups) > 1, "the case should run several buckets through the stream context"

    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    ddp.zero_grad_buffer()
    ddp(tokens, positions, None, labels=tokens).sum().backward()
    accumulated = ddp.buffers[0].grad_data.clone()
    ddp.finish_grad_sync()
    assert accumulated.abs().sum() > 0
    assert torch.equal(ddp.buffers[0].grad_data, accumulated)
