"""NTP's pieces for Megatron's distributed optimizer, in one process: the grad norm from reduced shards equals the
norm from whole gradient buffers, the deferred parameter all-gather leaves the optimizer step local, and the
re-formations it cannot survive yet (a replica's layout changed since launch) are named."""

from __future__ import annotations

import copy
import math
import random
from types import SimpleNamespace

import pytest

from ntp_megatron.config.schema import load_job_config
from ntp_megatron.plan.layout import make_topology
from tests.unit.core.test_grad_sync import MODEL, _ntp_model

FAMILIES = ("heads", "ffn", "vocab")


class _Position(SimpleNamespace):
    """A data-parallel group as a buffer and the optimizer see it: ``size`` members, this one at ``position``
    (never communicated over here)."""

    def __init__(self, size: int, position: int) -> None:
        super().__init__(n=size, j=position)

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.j


def _slot_ddps(megatron, cfg, topo, group):
    """A healthy slot-s rank's model in Megatron's DDP with the distributed optimizer's buffers, for every
    block s, the buffers sharded over ``group``."""
    from megatron.core.distributed import DistributedDataParallel

    from ntp_megatron.training.model import ddp_config, transformer_config

    pg = copy.copy(megatron)
    pg.dp = pg.dp_cp = pg.intra_dp_cp = group
    config = ddp_config(cfg)
    config.use_distributed_optimizer = True
    out = []
    for block in range(topo.tp_base):
        model = _ntp_model(cfg, [tuple(topo.block(f, block)) for f in FAMILIES])
        out.append(DistributedDataParallel(transformer_config(cfg), copy.deepcopy(config), model, pg_collection=pg))
    return out


def test_shard_norm_table_equals_the_whole_buffer_table(megatron):
    """The cells a sync group's members fill from their shards of each bucket (TP-split pieces per (block,
    position), replicated pieces of block 0 per position) sum to the norm of the whole synced gradients, as
    the table without the distributed optimizer computes it per (parameter, block) — up to float64 rounding
    within cells; and summing the one-contributor cells in any order gives the same bits."""
    import torch

    from ntp_megatron.core.grad_norm import shard_square_sums

    cfg = load_job_config(None, MODEL)
    topo = make_topology(3, 1, cfg.unit_counts())
    assert any(n % 3 for n in topo.units.values()), "uneven blocks: slots' buckets differ"
    size = 4
    ddps = _slot_ddps(megatron, cfg, topo, _Position(size, 0))
    assert len(ddps[0].buffers[0].buckets) > 2, "several buckets"
    replicated_values: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(3)
    for ddp in ddps:  # synced gradients: the replicated ones alike in every slot
        for name, param in ddp.module.named_parameters():
            if hasattr(param, "ntp_held_units"):
                param.main_grad.copy_(torch.randn(param.shape, generator=generator))
            else:
                value = replicated_values.setdefault(name, torch.randn(param.shape, generator=generator))
                param.main_grad.copy_(value)

    whole = []  # the table without the distributed optimizer: per (split parameter, block), replicated once
    for block, ddp in enumerate(ddps):
        for name, param in ddp.module.named_parameters():
            if hasattr(param, "ntp_held_units") or block == 0:
                whole.append(float(param.main_grad.double().pow(2).sum()))
    cells = {}
    for block, ddp in enumerate(ddps):
        split = {id(p) for p in ddp.module.parameters() if hasattr(p, "ntp_held_units")}
        for position in range(size):
            split_sq, replicated_sq = shard_square_sums(ddp.buffers, split, position, size)
            cells[block, position, "split"] = float(split_sq)
            if block == 0:
                cells[block, position, "replicated"] = float(replicated_sq)
    want, got = math.fsum(whole), math.fsum(cells.values())
    assert abs(got - want) <= 1e-13 * want, (got, want)
    # Not vacuous: counting block 1's replicated pieces too would be visibly off.
    split_ids = {id(p) for p in ddps[1].module.parameters() if hasattr(p, "ntp_held_units")}
    extra = sum(float(shard_square_sums(ddps[1].buffers, split_ids, j, size)[1]) for j in range(size))
    assert extra > 1e-6 * want
    # One non-zero contributor per cell: the reduction is exact, whichever member's table comes first.
    index = {key: i for i, key in enumerate(sorted(cells, key=str))}
    tables = []
    for key, value in cells.items():
        table = torch.zeros(len(index), dtype=torch.float64)
        table[index[key]] = value
        tables.append(table)
    sums = []
    for seed in range(3):
        random.Random(seed).shuffle(tables)
        total = torch.zeros(len(index), dtype=torch.float64)
        for table in tables:
            total += table
        sums.append(math.fsum(total.tolist()))
    assert sums[0] == sums[1] == sums[2] == got


def test_a_deferred_step_is_local_and_the_gather_completes_it(megatron):
    """With the parameter all-gather deferred, ``optimizer.step()`` updates this rank's shard and calls no
    all-gather; ``start_param_sync(force_sync=True)`` then completes it. Not deferred: upstream's step gathers."""
    import torch
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from ntp_megatron.patches.optimizer_distrib_optimizer import defer_param_sync, param_sync_deferred

    cfg = load_job_config(None, MODEL)
    [ddp] = _slot_ddps(megatron, cfg, make_topology(1, 1, cfg.unit_counts()), megatron.dp)  # one member
    optimizer = DistributedOptimizer(torch.optim.AdamW(ddp.module.parameters(), lr=1e-2),
                                     OptimizerConfig(lr=1e-2, clip_grad=0.0), None, None, [ddp], {0: ddp.buffers},
                                     megatron.dp, None, 0, 0)
    gathers: list[bool] = []
    upstream_sync = ddp.start_param_sync
    ddp.start_param_sync = lambda *a, **kw: (gathers.append(kw.get("force_sync", False)), upstream_sync(*a, **kw))
    for param in ddp.module.parameters():
        param.main_grad.fill_(1.0)
    before = [p.detach().clone() for p in ddp.module.parameters()]

    defer_param_sync(optimizer)
    assert param_sync_deferred(optimizer)
    optimizer.step()
    assert gathers == [], "the deferred step all-gathered"
    assert all(not torch.equal(b, p) for b, p in zip(before, ddp.module.parameters())), "the shard was stepped"
    ddp.start_param_sync(force_sync=True)
    assert gathers == [True]

    defer_param_sync(optimizer, False)
    optimizer.step()
    assert gathers == [True, False], "upstream's step gathers when not deferred"
    with pytest.raises(TypeError):
        defer_param_sync(SimpleNamespace())


def test_gathered_state_of_a_bf16_distributed_optimizer(megatron):
    """The state checks' view of a distributed optimizer (one member here): before the first step only the
    parameters and their fp32 main params, read without adding entries to the optimizer's state (a second look
    finds it as empty); after a step every parameter's main param and Adam moments, at the parameter's shape."""
    import torch
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from ntp_megatron.training.inspect_state import gathered_shard_state
    from ntp_megatron.training.model import ddp_config, transformer_config

    cfg = load_job_config(None, [*MODEL, "training.precision=bf16"])
    counts = cfg.unit_counts()
    model = _ntp_model(cfg, [tuple(range(counts[f])) for f in FAMILIES]).to(torch.bfloat16)
    config = ddp_config(cfg)
    config.use_distributed_optimizer = True
    pg = copy.copy(megatron)
    ddp = DistributedDataParallel(transformer_config(cfg), config, model, pg_collection=pg)
    optimizer = DistributedOptimizer(torch.optim.AdamW(ddp.module.parameters(), lr=1e-2),
                                     OptimizerConfig(lr=1e-2, clip_grad=0.0, bf16=True), None, None, [ddp],
                                     {0: ddp.buffers}, megatron.dp, None, 0, 0)
    names = [n for n, _ in ddp.module.named_parameters()]
    for _ in range(2):
        before = gathered_shard_state(ddp, optimizer, ("exp_avg", "exp_avg_sq"))
        assert sorted(before) == sorted(names + [f"{n}.main_param" for n in names])
        assert not optimizer.optimizer.state
    for param in ddp.module.parameters():
        param.main_grad.fill_(0.5)
    optimizer.step()
    after = gathered_shard_state(ddp, optimizer, ("exp_avg", "exp_avg_sq"))
    assert sorted(after) == sorted(names + [f"{n}.{k}" for n in names for k in ("main_param", "exp_avg", "exp_avg_sq")])
    for name, param in ddp.module.named_parameters():
        assert after[f"{name}.exp_avg"][1].shape == param.shape
        assert torch.equal(after[f"{name}.main_param"][1].to(torch.bfloat16), param.data)  # main rounded = param
