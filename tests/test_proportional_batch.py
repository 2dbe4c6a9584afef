"""``ntp.degraded_batch: proportional``: a narrower replica runs fewer micro-batches, and the update equals
the one a single uniform replica computes on exactly the samples that were processed."""

from __future__ import annotations

import torch

from tests.jobs import TINY, assert_ok
from tests.test_ntp_equivalence import HEADS, masked_key_bias

# SGD: the update is linear in the gradient, so comparing updates compares the averaged gradients (Adam's
# first step is lr·sign(g), which turns round-off in near-zero gradients into whole steps).
ONE_STEP = [*TINY, "--set", "training.train_iters=1", "--set", "training.lr_warmup_iters=0",
            "--set", "training.lr_decay_style=constant", "--set", "training.optimizer=sgd"]


def one_step(jobs, name: str, tp: int, dp: int, extra: list[str]):
    args = [*ONE_STEP, "--set", f"parallel.tensor_model_parallel_size={tp}",
            "--set", f"parallel.data_parallel_size={dp}", *extra]
    result = jobs.run(name, args)
    assert_ok(result)
    return result, torch.load(result.run_dir / "state" / "replica0.pt")


def worst(a: dict, b: dict) -> float:
    """The largest relative L2 difference over all tensors (key biases masked, see test_ntp_equivalence)."""
    diffs = []
    for k in b:
        x, y = masked_key_bias(k, a[k].reshape(-1), HEADS), masked_key_bias(k, b[k].reshape(-1), HEADS)
        diffs.append(float((x - y).norm() / y.norm().clamp_min(1e-30)))
    return max(diffs)


def test_proportional_update_equals_uniform_replica_on_same_samples(jobs):
    ntp = ["--set", "ntp.enabled=true", "--set", "ntp.dead_slots=[1:1]"]
    # TP2 + TP1, 12 samples of 2 per micro-batch: 3 micro-batches per replica when full; proportional gives
    # the TP1 replica round(3 × 1/2) = 2. Samples read: replica 0 → 0..5, replica 1 → 6..9.
    prop, prop_state = one_step(jobs, "prop", 2, 2, ntp + ["--set", "ntp.degraded_batch=proportional"])
    full, full_state = one_step(jobs, "prop-full", 2, 2, ntp)
    # The same ten samples, 0..9, in one uniform TP1 replica.
    ref, ref_state = one_step(jobs, "prop-ref", 1, 1, ["--set", "training.global_batch_size=10"])

    [record] = [r for r in prop.records if r.get("kind") == "iteration"]
    assert record["global_batch_size"] == 10 and record["tp_per_replica"] == [2, 1]
    assert abs(record["lm_loss"] - ref.losses()[1]) / ref.losses()[1] <= 1e-5
    assert worst(prop_state, ref_state) <= 1e-5
    # Not vacuous: the full-batch run saw two more samples and ends elsewhere.
    assert worst(full_state, ref_state) > 1e-3
