"""The measured state (:mod:`ntp_megatron.training.memory`) of real Megatron-Core objects against the plan
(:mod:`ntp_megatron.plan.memory_plan`), kind by kind, and the freeing of dead gradient buffers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ntp_megatron.plan.layout import make_topology, next_topology
from ntp_megatron.plan.memory_plan import Training, stage_rank_state
from ntp_megatron.training import memory
from tests.unit.plan.test_memory_plan import DIMS, _config, _objects


def _parts(model, optimizer, shadows):
    """The attributes :func:`memory.state_bytes` reads of a rank's components: shadows as the grad sync holds
    them (a module and its DDP)."""
    held = {b: SimpleNamespace(module=ddp.module, ddp=ddp) for b, ddp in enumerate(shadows)}
    return SimpleNamespace(model=model, optimizer=optimizer,
                           setup=SimpleNamespace(grad_sync=SimpleNamespace(shadows=held)))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_measured_state_of_real_objects_is_the_plan(megatron, precision):
    """A healthy rank, a survivor and a proxy of a TP3 replica that lost a slot: every kind measured from the
    objects equals the plan's, and the proxy's shadows are measured larger than the survivor's."""
    dims = DIMS[1]
    cfg = _config(dims, precision=precision)
    healthy = make_topology(3, 1, dims.units)
    degraded = next_topology(healthy, [1])
    proxy = degraded.sync_member(0, 1)
    measured = {}
    for name, topology, rank in [("healthy", healthy, 0), ("proxy", degraded, proxy),
                                 ("survivor", degraded, 1 - proxy)]:
        parts = _parts(*_objects(megatron, cfg, topology, rank))
        measured[name] = memory.state_bytes(parts)
        assert measured[name] == stage_rank_state(dims, topology, rank, Training(precision=precision)), name
        assert memory.role(topology, rank) == name
    assert measured["proxy"].shadow_grads > measured["survivor"].shadow_grads > 0 == measured["healthy"].shadow_grads


def test_freed_gradients_count_zero_and_come_back_zeroed_in_the_same_views(megatron):
    """Freeing a rank's gradient buffers (its DDP's and its shadows') removes exactly the planned gradient bytes
    from the measure; restoring them gives every ``main_grad`` view its storage back, zeroed."""
    dims = DIMS[0]
    cfg = _config(dims)
    topology = next_topology(make_topology(2, 1, dims.units), [1])
    parts = _parts(*_objects(megatron, cfg, topology, 0))
    before = memory.state_bytes(parts)
    param = next(parts.model.module.parameters())
    param.main_grad.fill_(1.0)
    assert memory.free_gradients(parts) == before.grads + before.shadow_grads > 0
    after = memory.state_bytes(parts)
    assert (after.grads, after.shadow_grads) == (0, 0)
    assert after.params == before.params and after.optimizer == before.optimizer
    assert memory.free_gradients(parts) == 0  # nothing left to free
    memory.restore_gradients(parts)
    assert memory.state_bytes(parts) == before
    assert torch.count_nonzero(param.main_grad) == 0
    param.main_grad.fill_(2.0)  # the view writes into the DDP's buffer again
    assert parts.model.buffers[0].grad_data.sum() > 0


def test_a_sample_counts_storages_shared_by_two_sets_of_objects_once(megatron):
    dims = DIMS[0]
    parts = _parts(*_objects(megatron, _config(dims), make_topology(2, 1, dims.units), 0))
    probe = memory.RankMemory(_config(dims), torch.device("cpu"), 0)
    probe.begin()
    total = memory.state_bytes(parts).total
    assert probe.sample(parts, parts, None, transient=10) == total + 10
    assert probe.sample(parts) == total
    assert probe.peak() == (total + 10, "sampled_state")
