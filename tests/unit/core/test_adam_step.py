"""Adam's step where each torch optimizer keeps it (``ntp_megatron.core.adam_step``): a rebuilt rank's optimizer that is
given its peers' step continues their run exactly, with torch's Adam (step per parameter) and with an optimizer
that keeps it per group like Transformer Engine's and Apex's ``FusedAdam`` (neither runs on CPU: a stand-in
with their convention, below)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ntp_megatron.core.adam_step import keeps_step_in_groups, read_step, write_step
from ntp_megatron.core.unit_moves import UnitTensors, copy_kept, init_shard_state

pytestmark = pytest.mark.unit

LR, BETAS, EPS = 0.1, (0.9, 0.999), 1e-8


class GroupStepAdam(torch.optim.Optimizer):
    """Adam with FusedAdam's bookkeeping: the step is ``group["step"]`` (an int, absent before the first step), a
    parameter's state holds only its moments, and any other key there is refused (Transformer Engine's
    ``FusedAdam`` maps every state key to a dtype)."""

    def __init__(self, params) -> None:
        super().__init__(params, dict(lr=LR, betas=BETAS, eps=EPS))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            t = group["step"]
            (b1, b2) = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                unknown = set(state) - {"exp_avg", "exp_avg_sq"}
                if unknown:
                    raise KeyError(f"FusedAdam keeps no state {sorted(unknown)}")
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))


GroupStepAdam.__module__ = "apex.optimizers.fused_adam"  # where the convention is recognised from

OPTIMIZERS = {"torch": lambda params: torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS),
              "group-step": GroupStepAdam}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, generator=g)), torch.nn.Parameter(torch.randn(3, 2, generator=g))]


def _steps(optimizer, params, n: int) -> None:
    for i in range(n):
        for j, p in enumerate(params):
            p.grad = torch.full_like(p, math.sin(i + 3 * j) + 0.5)
        optimizer.step()


def test_the_convention_is_told_by_the_optimizer_class():
    assert not keeps_step_in_groups(OPTIMIZERS["torch"](_params()))
    assert keeps_step_in_groups(GroupStepAdam(_params()))


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_rebuilt_optimizer_given_the_step_continues_the_run(kind):
    """Six steps in one optimizer equal five, then the params and moments moved into a fresh optimizer that is
    given the step (as a re-formation does), then one: the sixth step's bias correction is the sixth's."""
    make = OPTIMIZERS[kind]
    full_params = _params()
    full = make(full_params)
    assert read_step(full) is None
    _steps(full, full_params, 6)
    assert read_step(full) == 6

    old_params = _params()
    old = make(old_params)
    _steps(old, old_params, 5)
    new_params = [torch.nn.Parameter(p.detach().clone()) for p in old_params]
    new = make(new_params)
    for p, q in zip(new_params, old_params):
        new.state[p].update({k: old.state[q][k].clone() for k in ("exp_avg", "exp_avg_sq")})
    write_step(new, read_step(old))
    assert read_step(new) == 5
    for i, p in enumerate(new_params):  # the sixth step's gradients
        p.grad = torch.full_like(p, math.sin(5 + 3 * i) + 0.5)
    new.step()
    for p, q in zip(new_params, full_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_copy_kept_and_init_shard_state_set_the_step_where_the_optimizer_reads_it(kind):
    make = OPTIMIZERS[kind]
    old_model, new_model = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    old_opt = make(list(old_model.parameters()))
    _steps(old_opt, list(old_model.parameters()), 4)
    new_opt = make(list(new_model.parameters()))
    for p in new_model.parameters():
        new_opt.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    keys = ("exp_avg", "exp_avg_sq")
    old_tensors = UnitTensors(old_model, SimpleNamespace(optimizer=old_opt), keys, True)
    new_tensors = UnitTensors(new_model, SimpleNamespace(optimizer=new_opt), keys, True)
    copy_kept(old_tensors, new_tensors, old_model, new_model)
    assert read_step(new_opt) == 4
    _steps(new_opt, list(new_model.parameters()), 1)  # a state key it does not keep would raise here
    assert read_step(new_opt) == 5

    fresh = make([torch.nn.Parameter(torch.zeros(4))])
    init_shard_state(SimpleNamespace(optimizer=fresh), keys, 7)
    assert read_step(fresh) == 7
    _steps(fresh, fresh.param_groups[0]["params"], 1)
    assert read_step(fresh) == 8


def test_parameters_that_disagree_on_the_step_are_an_error():
    params = _params()
    optimizer = OPTIMIZERS["torch"](params)
    _steps(optimizer, params, 2)
    optimizer.state[params[0]]["step"] = torch.tensor(3.0)
    with pytest.raises(RuntimeError, match="disagree on Adam's step"):
        read_step(optimizer)
