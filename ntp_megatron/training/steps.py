"""Megatron's ``forward_step_func`` for training and for evaluation, the per-token loss they report, and the
schedule that runs them (Megatron-Core's: no pipelining at PP 1, 1F1B across stages)."""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from ntp_megatron import phases
from ntp_megatron.core.pipeline import NTPP2PCommunicator


def run_schedule(setup, tf_config, model, forward_step_func: Callable, data_iterator: Iterator, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, forward_only: bool) -> list[dict]:
    """Megatron-Core's forward/backward schedule over ``num_microbatches`` micro-batches in ``setup``'s groups (a
    :class:`ntp_megatron.training.parallel.ParallelSetup`); returns the last stage's per-micro-batch records (none
    on the other stages)."""
    groups = {"pg_collection": setup.pg}
    if setup.stages > 1 and setup.groups is not None:  # NTP: stages of different widths border each other
        device = next(model.parameters()).device
        groups["p2p_communicator"] = NTPP2PCommunicator(setup.groups.job, setup.rank, tf_config, device)
    elif setup.stages > 1:  # the 1F1B schedule takes explicit groups only together with its communicator
        groups["p2p_communicator"] = P2PCommunicator(pp_group=setup.pg.pp, config=tf_config)
    return get_forward_backward_func(pp_size=setup.stages, vp_size=None)(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=[model],
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=forward_only, **groups)


def loss_of(reported: list[dict], dtype: torch.dtype) -> torch.Tensor:
    """``[loss sum, tokens]`` of the records :func:`run_schedule` returned (zeros on a stage without any)."""
    if not reported:
        return torch.zeros(2, dtype=dtype)
    return torch.stack([r["lm loss"] for r in reported]).to(dtype).sum(dim=0)


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
        if self.index == 0:
            # Before the batch is read: a data read that hangs is the forward's, a phase where the rank is suspect.
            phases.enter("forward")
        batch = next(data_iterator)
        phases.tick(micro_batch=True)
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
