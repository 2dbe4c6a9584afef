"""A progress mark per parameter inside Adam's step (upstream: ``torch.optim.adam._single_tensor_adam``, torch 2.13;
what torch's ``Adam`` and ``AdamW`` run on CPU tensors, Megatron-Core's optimizer without Transformer Engine or Apex).

The hang detection (:mod:`ntp_megatron.elastic.blame`) takes a rank whose progress count stands still for half of
``ntp.heartbeat_timeout_s`` while a peer waits on it for a stuck one. The optimizer step was one long stretch with
no mark: a large model's step on a slow host could outlast that and be fenced. Here the step runs one parameter at
a time, with :func:`ntp_megatron.phases.tick` before each. Adam updates every parameter independently of the
others (``_single_tensor_adam`` itself loops over them one by one), so the result is bit for bit upstream's; the
foreach and fused paths (CUDA tensors) are left as they are: on a GPU the host only enqueues, and the device's
progress is counted from the flight recorder instead (:mod:`ntp_megatron.elastic.sequences`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch.optim.adam as upstream

from ntp_megatron import phases

_original = upstream._single_tensor_adam


def _one(values: list, i: int) -> list:
    return values[i:i + 1] if values else values


@functools.wraps(_original)
def _marked(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, max_exp_avg_sqs: list, state_steps: list,
            grad_scale: Any, found_inf: Any, **options: Any) -> None:
    for i in range(len(params)):
        phases.tick()
        _original(_one(params, i), _one(grads, i), _one(exp_avgs, i), _one(exp_avg_sqs, i),
                  _one(max_exp_avg_sqs, i), _one(state_steps, i), grad_scale, found_inf, **options)


def apply() -> None:
    upstream._single_tensor_adam = _marked


def revert() -> None:
    upstream._single_tensor_adam = _original
