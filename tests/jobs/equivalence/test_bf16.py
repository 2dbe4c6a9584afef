"""bf16 under NTP: the same training as plain Megatron-Core bf16 at TP1, to bf16's own spread between layouts,
with replicas bit for bit equal — fp32 main params and Adam moments included — before and after a live
re-formation.

Tolerances, measured on this case (3 iterations; relative differences to plain Megatron-Core bf16 at TP1 on the
same samples, every run from the layout-free initialiser, 2026-11-30):

=====================================  ===========================  =========================
                                       plain Megatron TP2 × DP2     NTP TP2 + TP1 (dead slot)
=====================================  ===========================  =========================
lm loss, worst iteration               5.2e-6                       6.6e-6
grad norm, worst iteration             7.2e-4                       1.4e-4
update of a bf16 parameter, worst      1.5e-1 (a norm's weight)     1.5e-1 (a norm's weight)
tensor's L2
update of an fp32 main param           5.3e-2 (an FC1 bias)         9.0e-2 (the same bias)
Adam moment, worst tensor's L2         1.9e-2                       9.6e-3
=====================================  ===========================  =========================

bf16 rounds every matmul output and every TP partial sum to 8 bits of mantissa, so a layout that sums in another
order computes another rounding; Adam then turns those differences, where gradients are small (biases, norms),
into a visible part of a small update, and a bf16 norm weight near 1.0 moves in steps of 2^-7, so its update is
mostly rounding. Parameters are compared by their update (final minus initial), since a weight's initial value
hides its update's error; the key rows of the QKV bias are left out as in the fp32 comparison (their true gradient
is zero). The tolerances are about twice plain Megatron-Core's own worst spread between layouts: ``LOSS_TOL``
3e-5, ``GRAD_NORM_TOL`` 1.5e-3, ``UPDATE_TOL`` 0.3 (moments included); a wrong update (a lost or doubled gradient
share) is off by order 1. They check that bf16 NTP
trains the same model; what must be exact is checked exactly — every replica's and every TP rank's bits, main
params and moments included — and the fp32 property test (test_ntp_equivalence) holds NTP's function to 1e-5.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ntp_megatron.config.schema import load_job_config
from ntp_megatron.config.files import ConfigError
from tests.equivalence_cases import ITERS, Case, assert_twins_bitwise, iteration_records, key_bias_rows
from tests.harness import JobResult, assert_ok, assert_replicas_agree, layout_args, relative_difference

BF16 = ["--set", "training.precision=bf16"]
LOSS_TOL = 3e-5
GRAD_NORM_TOL = 1.5e-3
UPDATE_TOL = 0.3

# TP2 × 2 with replica 1's slot 1 dead: replica 1 runs at TP1, slot 0 is the proxy of block 1.
CASE = Case(tp_base=2, dp=2, dead=((1, 1),), num_layers=2, query_groups=4, heads_per_group=2, kv_channels=8,
            hidden_size=32, ffn_hidden_size=64, vocab_size=256, position="learned_absolute",
            normalization="LayerNorm", untie=False, activation="gelu", overlap=False, bucket_size=None,
            clip_grad=1.0, micro_batches=2)


@pytest.fixture(scope="module")
def tp1(jobs) -> JobResult:
    """Plain Megatron-Core bf16 (NTP off) at TP1 × DP1 on the same global batches."""
    result = jobs.run("bf16-tp1", CASE.reference_args() + BF16)
    assert_ok(result)
    return result


def compare_bf16(got: JobResult, want: JobResult) -> None:
    """Loss and grad norm per iteration, and every tensor of the final state (parameters, fp32 main params, Adam
    moments) against the reference, to bf16's spread."""
    records, expected = iteration_records(got), iteration_records(want)
    assert sorted(records) == sorted(expected) == list(range(1, ITERS + 1))
    for i, record in expected.items():
        for key, tol in (("lm_loss", LOSS_TOL), ("grad_norm", GRAD_NORM_TOL)):
            diff = relative_difference(records[i][key], record[key])
            assert diff <= tol, f"iteration {i}: {key} {records[i][key]!r} vs TP1 {record[key]!r} ({diff:.2e})"
    state = torch.load(got.run_dir / "state" / "replica0.pt")
    reference = torch.load(want.run_dir / "state" / "replica0.pt")
    initial = torch.load(want.run_dir / "state" / "replica0.init.pt")
    got_initial = torch.load(got.run_dir / "state" / "replica0.init.pt")
    assert set(got_initial) == set(initial)
    for key, tensor in initial.items():  # the same initialiser, rounded to bf16 once, in both layouts
        assert torch.equal(got_initial[key], tensor), f"initial {key} differs from TP1's"
    assert set(state) == set(reference)
    for key, expected_tensor in reference.items():
        keep = ~key_bias_rows(key, expected_tensor.numel(), CASE)
        a, b = (t.double().reshape(-1)[keep] for t in (state[key], expected_tensor))
        start = initial[key].double().reshape(-1)[keep] if key in initial else torch.zeros_like(b)  # moments: 0
        update = (b - start).norm()
        if update == 0:  # a bf16 norm weight of 1.0: every update so far below its rounding step
            assert torch.equal(a, b), key
            continue
        diff = float((a - b).norm() / update)
        assert diff <= UPDATE_TOL, f"{key}: its update differs from TP1's by {diff:.2e} (L2)"


def assert_covers_main_state(result: JobResult) -> None:
    """Every checksum report covers each parameter's fp32 main param and both Adam moments."""
    reports = [r for r in result.records if r.get("kind") == "state_checksums"]
    assert reports
    for report in reports:
        keys = report["checksums"]
        params = [k for k in keys if k.endswith(("weight", "bias"))]
        missing = [f"{p}.{s}" for p in params for s in ("main_param", "exp_avg", "exp_avg_sq") if f"{p}.{s}" not in keys]
        assert params and not missing, f"checksums skip {missing[:3]}"


def checksums_by_rank(result: JobResult, iteration: int) -> dict[tuple[int, int], dict]:
    return {(r["replica"], r["tp_rank"]): r["checksums"] for r in result.records
            if r.get("kind") == "state_checksums" and r["iteration"] == iteration}


def test_ntp_bf16_matches_plain_megatron_bf16_tp1(jobs, tp1, tmp_path_factory):
    """Also through a checkpoint: resumed from the one saved at iteration 2, the same topology reaches the same
    bits at iteration 3 (main params and moments are saved and loaded, not rebuilt from the bf16 weights)."""
    ckpt = tmp_path_factory.mktemp("bf16-ckpt")
    saving = ["--set", f"checkpoint.save={ckpt}", "--set", "checkpoint.save_interval=2"]
    ntp = jobs.run("bf16-ntp", CASE.ntp_args() + BF16 + saving)
    assert_ok(ntp)
    compare_bf16(ntp, tp1)
    assert_covers_main_state(ntp)
    assert_replicas_agree(ntp, ITERS)  # every TP rank's view, bit for bit, every iteration
    resumed = jobs.run("bf16-ntp-resumed", CASE.ntp_args() + BF16 + ["--set", f"checkpoint.load={ckpt}/iter_0000002"])
    assert_ok(resumed)
    assert checksums_by_rank(resumed, ITERS) == checksums_by_rank(ntp, ITERS) != {}


def test_live_kill_under_bf16_moves_main_params_and_moments(jobs, tp1):
    """TP2 × 2, replica 1's slot 1 killed in iteration 2: the re-formation moves the dead rank's units with their
    fp32 main params and moments, the replicas stay bit for bit equal, and training still matches TP1."""
    case = replace(CASE, dead=())
    result = jobs.run("bf16-kill", case.ntp_args() + BF16 + ["--set", "parallel.timeout_s=60",
                                                             "--inject-failure", "kill:rank=3,iter=2,phase=backward"])
    assert_ok(result)
    [reformed] = result.events("reformed")
    assert reformed["tp_per_replica"] == [2, 1]
    assert reformed["moved_bytes"] > 0  # equal to the units that had to move: run_job checks every re-formation
    assert_covers_main_state(result)
    assert_replicas_agree(result, ITERS)
    compare_bf16(result, tp1)


def test_a_degraded_replica_under_the_distributed_optimizer(jobs, tp1):
    """The same case under Megatron's distributed optimizer (two instances: each replica its own): replica 1's one
    rank steps both blocks' shards in its shadows, whose fp32 main params the optimizer cloned from them; it trains
    as TP1 does, the replicas agree bit for bit, and each shadow's shard equals the healthy twin's."""
    result = jobs.run("bf16-distopt", CASE.ntp_args() + BF16 + ["--set", "parallel.use_distributed_optimizer=true"])
    assert_ok(result)
    compare_bf16(result, tp1)
    assert_covers_main_state(result)
    assert_replicas_agree(result, ITERS)
    assert_twins_bitwise(result, replace(CASE, dist_opt=True, instances=2))


def test_fp16_under_ntp_is_refused_and_plain_fp16_is_allowed():
    """fp16's loss scaler all-reduces found-inf inside the optimizer step, after NTP's commit point."""
    with pytest.raises(ConfigError) as err:
        load_job_config(overrides=["training.precision=fp16"])
    assert str(err.value).startswith("training.precision 'fp16' is not supported with ntp.enabled yet"), err.value
    assert "\n" not in str(err.value)
    assert load_job_config(overrides=["training.precision=fp16", "ntp.enabled=false"]).training.precision == "fp16"


def test_plain_fp16_trains_and_resumes_with_its_loss_scale(jobs, tmp_path_factory):
    """fp16 (NTP off) on CPU: Megatron's dynamic loss scale starts at 2^32, so the first iterations overflow and
    are skipped until it has come down; a checkpoint taken after that resumes with the same scale (the steps after
    it — skipped or not, grad norm, next loss — are the uninterrupted run's, bit for bit)."""
    ckpt = tmp_path_factory.mktemp("fp16-ckpt")
    fp16 = layout_args(1, 1, 27) + ["--set", "training.precision=fp16"]
    full = jobs.run("fp16", fp16 + ["--set", f"checkpoint.save={ckpt}", "--set", "checkpoint.save_interval=25"])
    assert_ok(full)
    records = iteration_records(full)
    skipped = [records[i]["skipped"] for i in sorted(records)]
    assert skipped[0] == 1 and skipped[-3:] == [0, 0, 0], skipped  # skipped while the scale overflows fp16
    resumed = jobs.run("fp16-resumed", fp16 + ["--set", f"checkpoint.load={ckpt}/iter_0000025"])
    assert_ok(resumed)
    after = iteration_records(resumed)
    for i in (26, 27):
        assert [after[i][k] for k in ("lm_loss", "grad_norm", "skipped")] == \
            [records[i][k] for k in ("lm_loss", "grad_norm", "skipped")], i
