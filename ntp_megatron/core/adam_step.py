"""Adam's step counter, wherever the torch optimizer inside Megatron's keeps it.

torch's ``Adam`` / ``AdamW`` (what Megatron-Core builds without Transformer Engine or Apex, as on CPU) keep it in
every parameter's state, as a tensor; Transformer Engine's and Apex's ``FusedAdam`` (what it builds on GPU) keep
it in each parameter group, as an int, and may not accept other keys in a parameter's state. Megatron-Core reads
both (``DistributedOptimizer.state_dict``); a re-formation that sets or reads the step must too, or a rebuilt
rank's bias correction restarts from step 1 on GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

_GROUP_STEP_PACKAGES = ("transformer_engine", "apex")


def keeps_step_in_groups(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (the torch optimizer, ``megatron_optimizer.optimizer``) keeps Adam's step in its
    parameter groups (Transformer Engine's or Apex's ``FusedAdam``) rather than in each parameter's state."""
    return type(optimizer).__module__.split(".")[0] in _GROUP_STEP_PACKAGES


def read_step(optimizer: torch.optim.Optimizer) -> Optional[float]:
    """The steps ``optimizer`` has taken, None before its first one (nor set by :func:`write_step`). Every
    parameter and every non-empty group shares one step; a disagreement is an error."""
    if keeps_step_in_groups(optimizer):
        steps = {float(g["step"]) for g in optimizer.param_groups if g["params"] and "step" in g}
    else:
        steps = {float(s["step"]) for s in optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's parameters disagree on Adam's step: {sorted(steps)}")
    return steps.pop() if steps else None


def write_step(optimizer: torch.optim.Optimizer, step: float) -> None:
    """Set Adam's step of every parameter of ``optimizer`` to ``step`` (a rebuilt or new rank's optimizer
    continuing its peers' run)."""
    if keeps_step_in_groups(optimizer):
        for group in optimizer.param_groups:
            if group["params"]:  # Transformer Engine's FusedAdam does not step an empty group
                group["step"] = int(step)
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param]["step"] = torch.tensor(float(step))
