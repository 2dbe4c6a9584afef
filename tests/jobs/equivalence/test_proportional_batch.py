"""``ntp.degraded_batch: proportional``: a narrower replica runs fewer micro-batches, and the update equals
the one a single uniform replica computes on exactly the samples that were processed."""

from __future__ import annotations

import torch

from tests.harness import TINY, assert_ok

HEADS, HEAD_DIM = 8, 8  # the tiny model: hidden 64, 8 heads
# SGD: the update is linear in the gradient, so comparing updates compares the averaged gradients (Adam's
# first step is lr·sign(g), which turns round-off in near-zero gradients into whole steps). A large learning
# rate makes the update large next to the weights, so final - initial measures it to fp32 round-off.
ONE_STEP = [*TINY, "--set", "training.train_iters=1", "--set", "training.lr_warmup_iters=0",
            "--set", "training.lr_decay_style=constant", "--set", "training.optimizer=sgd",
            "--set", "training.lr=1.0", "--set", "model.init=layout_free"]  # the plain reference starts as NTP does


def one_step(jobs, name: str, tp: int, dp: int, extra: list[str]):
    args = [*ONE_STEP, "--set", f"parallel.tensor_model_parallel_size={tp}",
            "--set", f"parallel.data_parallel_size={dp}", *extra]
    result = jobs.run(name, args)
    assert_ok(result)
    state = result.run_dir / "state"
    return result, torch.load(state / "replica0.init.pt"), torch.load(state / "replica0.pt")


def updates(init: dict, final: dict) -> dict:
    """Parameter updates of one step (optimizer state left out), without the QKV bias's key rows: their true
    gradient is exactly zero, so they carry only round-off."""
    out = {}
    for key, before in init.items():
        delta = final[key] - before
        if ".linear_qkv.bias" in key:
            delta = delta.reshape(HEADS, 3 * HEAD_DIM)[:, [*range(HEAD_DIM), *range(2 * HEAD_DIM, 3 * HEAD_DIM)]]
        out[key] = delta.reshape(-1)
    return out


def worst(a: dict, b: dict) -> float:
    """The largest relative L2 difference between two sets of updates, tensor by tensor."""
    assert set(a) == set(b) and len(b) > 10
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)) for k in b)


def test_proportional_update_equals_uniform_replica_on_same_samples(jobs):
    ntp = ["--set", "ntp.enabled=true", "--set", "ntp.dead_slots=[1:1]"]
    # TP2 + TP1, 12 samples of 2 per micro-batch: 3 micro-batches per replica when full; proportional gives
    # the TP1 replica round(3 × 1/2) = 2. Samples read: replica 0 → 0..5, replica 1 → 6..9.
    prop, prop_init, prop_final = one_step(jobs, "prop", 2, 2, ntp + ["--set", "ntp.degraded_batch=proportional"])
    full, _, full_final = one_step(jobs, "prop-full", 2, 2, ntp)
    # The same ten samples, 0..9, in one uniform TP1 replica.
    ref, ref_init, ref_final = one_step(jobs, "prop-ref", 1, 1, ["--set", "training.global_batch_size=10"])

    [record] = [r for r in prop.records if r.get("kind") == "iteration"]
    assert record["global_batch_size"] == 10 and record["tp_per_replica"] == [2, 1]
    assert abs(record["lm_loss"] - ref.losses()[1]) / ref.losses()[1] <= 1e-5
    assert worst(prop_init, ref_init) <= 1e-7  # the same starting model, whatever the layout
    reference = updates(ref_init, ref_final)
    assert worst(updates(prop_init, prop_final), reference) <= 1e-5
    # Not vacuous: the full-batch run saw two more samples and its update differs clearly.
    assert worst(updates(prop_init, full_final), reference) > 1e-2
