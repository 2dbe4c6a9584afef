"""Nonuniform TP computes the same model: replicas of different TP degrees (uneven splits, GQA, gated MLP,
overlap on and off) give the loss per iteration and the parameters of plain Megatron-Core at uniform TP and
at TP1, and all replicas stay bit-identical after every iteration."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.jobs import assert_ok, layout_args, relative_difference

ITERS = 10
TOL = 1e-5          # lm loss per iteration; each tensor's relative L2 difference
PEAK_TOL = 1e-4     # each tensor's largest elementwise difference relative to its largest entry: Adam turns
                    # round-off into whole steps for near-zero gradients (plain Megatron TP2 vs TP1: 1.1e-5)
GQA_GATED = ["--set", "model.num_query_groups=4", "--set", "model.gated_linear_unit=true",
             "--set", "model.activation=swiglu"]
HEAD_DIM, HEADS = 8, 8  # the tiny model: hidden 64, 8 heads


def ntp_args(tp: int, dp: int, dead: list[str], extra: list[str] = ()) -> list[str]:
    args = layout_args(tp, dp, ITERS) + ["--set", "ntp.enabled=true", "--set", "logging.state_checksums=true"]
    if dead:
        args += ["--set", f"ntp.dead_slots=[{','.join(dead)}]"]
    return args + list(extra)


# name: (NTP args, model variant args, expected TP degree per replica)
TOPOLOGIES = {
    "tp4+tp3": (ntp_args(4, 2, ["1:3"]), [], [4, 3]),
    # Small buckets: many of them, with boundaries that differ between layouts (and between a core and its extra).
    "tp4+tp3-overlap": (ntp_args(4, 2, ["1:3"], ["--set", "parallel.overlap_grad_reduce=true",
                                                 "--set", "parallel.ddp_bucket_size=3000"]), [], [4, 3]),
    "tp2+tp1": (ntp_args(2, 2, ["1:1"]), [], [2, 1]),
    "tp4+tp3+tp2": (ntp_args(4, 3, ["1:3", "2:2", "2:3"]), [], [4, 3, 2]),
    "tp3-8heads": (ntp_args(3, 1, []), [], [3]),
    # Equal widths: Megatron's own DDP all-reduce over the sync groups, NTP layers and groups around it.
    "tp2+tp2": (ntp_args(2, 2, []), [], [2, 2]),
    "gqa-gated-tp3+tp2": (ntp_args(3, 2, ["1:2"]), GQA_GATED, [3, 2]),
}


def masked_key_bias(key: str, tensor: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Drop the key rows of the QKV bias: their true gradient is exactly zero (softmax ignores a shift shared
    by all keys), so Adam turns round-off noise into steps in any implementation — plain Megatron TP2 vs TP1
    included. Everything else is compared in full."""
    if ".linear_qkv.bias" not in key:
        return tensor
    q = HEADS // num_groups * HEAD_DIM
    per_group = tensor.reshape(num_groups, q + 2 * HEAD_DIM)
    return torch.cat([per_group[:, :q], per_group[:, q + HEAD_DIM:]], dim=1).reshape(-1)


def compare(result, reference, num_groups: int, what: str) -> None:
    losses, ref_losses = result.losses(), reference.losses()
    assert sorted(losses) == sorted(ref_losses) == list(range(1, ITERS + 1))
    worst_loss = max(relative_difference(losses[i], ref_losses[i]) for i in ref_losses)
    assert worst_loss <= TOL, f"{what}: lm loss differs by {worst_loss:.2e}"
    state = torch.load(result.run_dir / "state" / "replica0.pt")
    ref = torch.load(reference.run_dir / "state" / "replica0.pt")
    assert set(state) == set(ref) and len(ref) > 20
    for key, expected in ref.items():
        a = masked_key_bias(key, state[key].reshape(-1), num_groups)
        b = masked_key_bias(key, expected.reshape(-1), num_groups)
        l2 = float((a - b).norm() / b.norm().clamp_min(1e-30))
        peak = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        assert l2 <= TOL and peak <= PEAK_TOL, f"{what}: {key} differs by {l2:.2e} (L2), {peak:.2e} (peak)"


@pytest.fixture(scope="module")
def references(jobs):
    out = {}
    for variant, extra in (("mha", []), ("gqa-gated", GQA_GATED)):
        for tp, dp in ((1, 1), (2, 2)):
            result = jobs.run(f"ref-{variant}-tp{tp}dp{dp}", layout_args(tp, dp, ITERS) + extra)
            assert_ok(result)
            out[(variant, tp, dp)] = result
    return out


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_ntp_matches_uniform_and_tp1(jobs, references, name):
    args, variant_args, widths = TOPOLOGIES[name]
    result = jobs.run(name, args + variant_args)
    assert_ok(result)
    iterations = [r for r in result.records if r.get("kind") == "iteration"]
    assert all(r["tp_per_replica"] == widths for r in iterations), iterations[0]["tp_per_replica"]
    variant, groups = ("gqa-gated", 4) if variant_args else ("mha", HEADS)
    compare(result, references[(variant, 1, 1)], groups, f"{name} vs TP1")
    compare(result, references[(variant, 2, 2)], groups, f"{name} vs uniform TP2xDP2")


@pytest.mark.parametrize("name", [n for n, (_, _, w) in TOPOLOGIES.items() if len(w) > 1])
def test_replicas_hold_identical_units_after_every_iteration(jobs, name):
    """Invariant 2: every replica's full parameters and Adam state have the same checksums, each iteration."""
    args, variant_args, widths = TOPOLOGIES[name]
    result = jobs.run(name, args + variant_args)
    assert_ok(result)
    by_iteration: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in result.records:
        if r.get("kind") == "state_checksums":
            by_iteration[r["iteration"]][r["replica"]] = r["checksums"]
    assert sorted(by_iteration) == list(range(1, ITERS + 1))
    for iteration, replicas in by_iteration.items():
        assert len(replicas) == len(widths)
        first, *others = replicas.values()
        assert any(key.endswith("exp_avg_sq") for key in first)
        for other in others:
            differing = [k for k in first if first[k] != other[k]]
            assert not differing, f"iteration {iteration}: replicas differ in {differing[:3]}"
    # Not vacuous: the parameters do change from one iteration to the next.
    assert by_iteration[1][0] != by_iteration[ITERS][0]
