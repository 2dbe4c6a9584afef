"""fp16's dynamic loss scale restored on CPU (upstream: ``megatron.core.optimizer.grad_scaler``,
``DynamicGradScaler.load_state_dict``).

Upstream moves the saved scale with ``tensor.cuda(torch.cuda.current_device())``, which a CPU process cannot
run (``Invalid device, must be cuda device``): a fp16 checkpoint would not load. The scale goes to the device of
the scaler's own tensors instead; the trackers are restored as upstream restores them.
"""

from __future__ import annotations

from megatron.core.optimizer import grad_scaler as upstream


def load_state_dict(self, state_dict: dict) -> None:
    self._scale = state_dict["scale"].to(self.min_scale.device)
    self._growth_tracker = state_dict["growth_tracker"]
    self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def apply() -> None:
    upstream.DynamicGradScaler.load_state_dict = load_state_dict
