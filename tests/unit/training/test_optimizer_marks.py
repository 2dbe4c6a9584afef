"""A progress mark per parameter in Adam's CPU step (``patches/torch_optim_adam.py``): the hang detection does not
take a long optimizer step for a stuck rank, and the update is bit for bit upstream's."""

from __future__ import annotations

import torch
import torch.optim.adam as upstream

from ntp_megatron import phases
from ntp_megatron.patches import torch_optim_adam


def _train(steps: int, amsgrad: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((5, 3), (7,), (2, 2, 2))]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, foreach=False)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return [p.detach().clone() for p in params] + [opt.state[p]["exp_avg_sq"].clone() for p in params]


def test_each_parameter_is_marked_and_the_update_is_upstream_s(monkeypatch):
    for amsgrad in (False, True):
        monkeypatch.setattr(upstream, "_single_tensor_adam", torch_optim_adam._original)
        reference = _train(3, amsgrad)
        monkeypatch.setattr(upstream, "_single_tensor_adam", torch_optim_adam._marked)
        before = phases.progress()
        marked = _train(3, amsgrad)
        assert phases.progress() - before == 3 * 3, "one mark per parameter and step"
        assert all(torch.equal(a, b) for a, b in zip(reference, marked))
