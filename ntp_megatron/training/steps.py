"""Megatron's ``forward_step_func`` for training and for evaluation, and the per-token loss they report."""

from __future__ import annotations

import torch

from ntp_megatron import phases


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss: the sum over this micro-batch and its token count; Megatron divides by the
    global token count after the DP reduction, so the gradient is the mean over the global batch."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    tokens = mask.sum()
    return loss_sum, tokens.to(torch.int), {"lm loss": torch.stack([loss_sum.detach(), tokens.detach()])}


class ForwardStep:
    """The training step's ``forward_step_func``, with the ``forward`` and ``backward`` failure-injection points at
    the middle micro-batch of the iteration."""

    def __init__(self, num_microbatches: int) -> None:
        self.middle = num_microbatches // 2
        self.index = 0

    def __call__(self, data_iterator, model):
        batch = next(data_iterator)
        middle = self.index == self.middle
        self.index += 1
        if middle:
            phases.point("forward")
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
        if middle and output.requires_grad:
            output.register_hook(_backward_point)
        return output, lambda out: loss_func(batch["loss_mask"], out)


def evaluation_step(data_iterator, model):
    """The evaluation's ``forward_step_func`` (forward only, no failure-injection points)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, lambda out: loss_func(batch["loss_mask"], out)


def _backward_point(grad: torch.Tensor) -> torch.Tensor:
    phases.point("backward")
    return grad
