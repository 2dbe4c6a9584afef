"""Checkpoints with Megatron's distributed optimizer (``parallel.use_distributed_optimizer``), against plain
Megatron-Core (:mod:`tests.plain_megatron`, a fresh interpreter that never imports ntp-megatron).

Two chains of real jobs, each job continuing the previous one's checkpoint, every iteration compared with plain
Megatron-Core's uninterrupted TP2 x DP2 run with its distributed optimizer (lm loss and grad norm,
:data:`TOLERANCE`; the run is shared, :func:`reference`). A job's first iteration after a load depends on the
weights it read; the optimizer state it read shows in the iteration after that, which is the next job's first —
and, for a chain's last hop, its own second. With fp32 weights the distributed optimizer's main parameters are views
of the parameter buffers, so the main parameters a job reads are the weights it trains on from its first step.

Healthy layouts:

1. plain Megatron-Core TP2 x DP2 with its distributed optimizer saves at iteration 2 in Megatron-LM's default
   format (``dp_reshardable``, bucket space) — the reference run itself;
2. NTP off TP2 x DP2, distributed optimizer with two instances, reads it (its own layout: bucket space is read
   there only), runs iteration 3 and saves (``fully_reshardable``, model space, written piece by piece);
3. NTP 3 x TP2 with the distributed optimizer (one instance: three replicas) reads that, runs 4 and saves (each
   sync group's shards as boxes of NTP's unit fragments);
4. NTP off TP1 without the distributed optimizer reads that, runs 5 and saves (the non-distributed optimizer's
   format);
5. NTP 2 x TP2 with the distributed optimizer (two instances) reads that back, runs 6 and saves;
6. plain Megatron-Core TP2 x DP2 with its distributed optimizer reads that (``fully_reshardable``, Megatron's own
   loader) and runs 7 and 8.

Layouts that start degraded (``ntp.dead_slots``). A degraded rank's optimizer steps slot-shaped shadows of the
blocks it serves (``ntp_megatron.core.grad_sync``), not its own parameters: it writes the pieces of its shadows' shards,
each where it sits in the global tensors, and reads them back into its shadows:

1. NTP TP4 + TP3 (replica 1's slot 3 dead: its block dealt to the survivors, slot 0 its proxy) with one instance,
   so that every bucket's optimizer shards are split between the healthy replica and the degraded one's shadows
   and both write main pieces, runs iterations 1 and 2 from Megatron's initialisation and saves;
2. NTP TP2 + TP2 + TP2 with the distributed optimizer reads it, runs 3 and saves;
3. NTP off, TP1, without the distributed optimizer reads that, runs 4 and saves;
4. NTP TP3 + TP4 (replica 0's slot 3 dead) with two instances reads that (a checkpoint without main parameters:
   the shadows take the loaded weights, the main parameters follow them), runs 5 and saves: replica 0 is
   instance 0, so every optimizer piece written as main is a shadow's;
5. plain Megatron-Core TP2 x DP2 with its distributed optimizer reads that (Megatron's own loader), runs 6 and
   saves (``fully_reshardable``);
6. NTP TP4 + TP3 with two instances reads plain's (the degraded replica's shadows hold every shard) and runs 7 and
   8, every (replica, TP rank) reporting the same state checksums (parameters and Adam moments, gathered) after
   each.

Plain Megatron-Core's distributed optimizer reads no checkpoint of the non-distributed fp32 one (its
``fully_reshardable`` request asks for main parameters that optimizer does not keep), so in both chains a TP1
checkpoint reaches plain Megatron-Core through a distributed-optimizer NTP run.

And a model-only Megatron-Core checkpoint (Megatron-LM's ``release`` layout) starts a degraded NTP run with the
distributed optimizer at iteration 0: the shadows take the loaded weights before the fresh optimizer's main
parameters follow them (without the distributed optimizer: ``tests/jobs/checkpoint/test_ntp_checkpoint.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

from tests.harness import TINY, assert_ok, assert_replicas_agree, relative_difference, run_job, run_module
from tests.jobs.checkpoint.test_ntp_checkpoint import assert_matches, ntp_args

ITERS = 8
TOLERANCE = 1e-5
"""Relative, per iteration: plain Megatron-Core's own spread between layouts (``docs/testing.md``)."""

DIST_OPT = ("--set", "parallel.use_distributed_optimizer=true")
NTP = ("--set", "ntp.enabled=true")


def degraded(dead: str, instances: int) -> tuple[str, ...]:
    """NTP with the distributed optimizer in ``instances`` instances, starting with the slots ``dead`` dead."""
    return (*NTP, *DIST_OPT, "--set", f"ntp.dead_slots=[{dead}]",
            "--set", f"parallel.num_distributed_optimizer_instances={instances}")


def _plain(out_dir: Path, iters: int, *args: str) -> dict[int, dict]:
    out = out_dir / "plain.json"
    returncode, stderr = run_module("tests.plain_megatron", ["train", "--tp", "2", "--dp", "2", "--dist-opt",
                                                             "--iters", str(iters), "--out", str(out),
                                                             "--full-records", *args], out_dir)
    assert returncode == 0, f"plain_megatron failed ({returncode}):\n{stderr[-4000:]}"
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain Megatron-Core TP2 x DP2 with its distributed optimizer, ITERS iterations uninterrupted: its records,
    and its checkpoint of iteration 2 (``dp_reshardable``)."""
    base = tmp_path_factory.mktemp("plain")
    records = _plain(base / "run", ITERS, "--save-at", "2", "--ckpt", str(base / "ckpt"))
    return SimpleNamespace(records=records, ckpt=base / "ckpt" / "iter_0000002")


def _ours(run_dir: Path, tp: int, dp: int, load: Optional[Path], save: Path, until: int, *extra: str):
    """Our job at TP ``tp`` x DP ``dp`` (NTP off unless ``extra`` says so) up to iteration ``until``, saving
    there: the result and its iteration records."""
    args = [*TINY, "--set", f"parallel.tensor_model_parallel_size={tp}", "--set", f"parallel.data_parallel_size={dp}",
            "--set", f"training.train_iters={until}", "--set", f"checkpoint.save={save}",
            "--set", f"checkpoint.save_interval={until}", *extra]
    if load is not None:
        args += ["--set", f"checkpoint.load={load}"]
    result = run_job(run_dir, args)
    assert_ok(result)
    return result, {r["iteration"]: r for r in result.records if r.get("kind") == "iteration"}


def _matches(records: dict[int, dict], reference: dict[int, dict], iterations: list[int], what: str) -> float:
    assert sorted(records) == iterations, f"{what}: ran iterations {sorted(records)}"
    worst = 0.0
    for i in iterations:
        for key in ("lm_loss", "grad_norm"):
            difference = relative_difference(records[i][key], reference[i][key])
            assert difference <= TOLERANCE, f"{what}: iteration {i}'s {key} {records[i][key]} vs {reference[i][key]}"
            worst = max(worst, difference)
    return worst


def test_distributed_optimizer_checkpoints_round_trip_through_ntp_and_plain_megatron(reference, tmp_path):
    ref, ours, spread = reference.records, tmp_path / "ours", {}
    _, got = _ours(tmp_path / "k2", 2, 2, reference.ckpt, ours, 3, *DIST_OPT,
                   "--set", "parallel.num_distributed_optimizer_instances=2")
    spread["plain dp_reshardable -> TP2 x DP2 k=2"] = _matches(got, ref, [3], "from plain's dp_reshardable")
    _, got = _ours(tmp_path / "ntp3", 2, 3, ours / "iter_0000003", ours, 4, *NTP, *DIST_OPT)
    spread["-> NTP 3 x TP2 k=1"] = _matches(got, ref, [4], "into NTP 3 x TP2")
    _, got = _ours(tmp_path / "tp1", 1, 1, ours / "iter_0000004", ours, 5)
    spread["-> TP1 without"] = _matches(got, ref, [5], "into TP1 without the distributed optimizer")
    _, got = _ours(tmp_path / "ntp2", 2, 2, ours / "iter_0000005", ours, 6, *NTP, *DIST_OPT)
    spread["-> NTP 2 x TP2 k=2"] = _matches(got, ref, [6], "back into the distributed optimizer under NTP")
    plain = _plain(tmp_path / "plain-load", ITERS, "--save-at", "0", "--ckpt", str(tmp_path / "unused"),
                   "--load", str(ours / "iter_0000006"))
    spread["-> plain TP2 x DP2"] = _matches(plain, ref, [7, 8], "plain Megatron-Core from NTP's")
    print("worst relative difference per load:", {k: f"{v:.1e}" for k, v in spread.items()})


def test_a_degraded_distributed_optimizer_checkpoint_round_trips_through_every_layout(reference, tmp_path):
    ref, ours, spread = reference.records, tmp_path / "ours", {}
    # The first job's schedule is the chain's (each load restores it): plain's, decaying over ITERS.
    _, got = _ours(tmp_path / "tp4-tp3", 4, 2, None, ours, 2, *degraded("1:3", 1), "--set", "model.init=megatron",
                   "--set", f"training.lr_decay_iters={ITERS}")
    assert {tuple(r["tp_per_replica"]) for r in got.values()} == {(4, 3)}
    spread["NTP TP4+TP3 k=1"] = _matches(got, ref, [1, 2], "NTP TP4 + TP3 from Megatron's initialisation")
    _, got = _ours(tmp_path / "tp2x3", 2, 3, ours / "iter_0000002", ours, 3, *NTP, *DIST_OPT)
    spread["-> NTP TP2+TP2+TP2 k=1"] = _matches(got, ref, [3], "into NTP TP2 + TP2 + TP2")
    _, got = _ours(tmp_path / "tp1", 1, 1, ours / "iter_0000003", ours, 4)
    spread["-> TP1 without"] = _matches(got, ref, [4], "into TP1 without the distributed optimizer")
    _, got = _ours(tmp_path / "tp3-tp4", 4, 2, ours / "iter_0000004", ours, 5, *degraded("0:3", 2))
    assert {tuple(r["tp_per_replica"]) for r in got.values()} == {(3, 4)}
    spread["-> NTP TP3+TP4 k=2"] = _matches(got, ref, [5], "into NTP TP3 + TP4 from TP1 without")
    plain_dir = tmp_path / "plain-ckpt"
    got = _plain(tmp_path / "plain-load", 6, "--save-at", "6", "--ckpt", str(plain_dir),
                 "--sharding-type", "fully_reshardable", "--load", str(ours / "iter_0000005"))
    spread["-> plain TP2 x DP2"] = _matches(got, ref, [6], "plain Megatron-Core from NTP TP3 + TP4's")
    result, got = _ours(tmp_path / "back", 4, 2, plain_dir / "iter_0000006", ours, ITERS, *degraded("1:3", 2),
                        "--set", "logging.state_checksums=true")
    spread["-> NTP TP4+TP3 k=2"] = _matches(got, ref, [7, 8], "back into NTP TP4 + TP3 from plain's")
    assert_replicas_agree(result)
    print("worst relative difference per hop:", {k: f"{v:.1e}" for k, v in spread.items()})


def test_a_model_only_megatron_checkpoint_starts_a_degraded_distributed_optimizer_run_at_iteration_0(tmp_path):
    """plain Megatron-Core trains 2 iterations at TP2 and saves the model part alone in a ``release`` directory;
    NTP TP2 + TP1 with the distributed optimizer (two instances: the degraded rank's shadows hold every shard of
    both blocks) starts from it at iteration 0, and its iterations 1..3 are plain Megatron-Core's from those
    weights with a fresh optimizer and scheduler (:mod:`tests.megatron_model_only`)."""
    root, out = tmp_path / "model-only", tmp_path / "reference.json"
    returncode, stderr = run_module("tests.megatron_model_only", ["--tp", "2", "--pretrain", "2", "--save", str(root),
                                                                  "--layout", "release", "--iters", "3",
                                                                  "--out", str(out)], tmp_path)
    assert returncode == 0, f"megatron_model_only failed ({returncode}):\n{stderr[-4000:]}"
    want = {int(k): v for k, v in json.loads(out.read_text()).items()}
    result = run_job(tmp_path / "run", [*ntp_args(2, 2, "1:1", DIST_OPT), "--set", f"checkpoint.load={root}",
                                        "--set", "training.train_iters=3", "--set", "logging.state_checksums=true"])
    assert_ok(result)
    worst = assert_matches(result, want, "model-only -> NTP TP2 + TP1, distributed optimizer")
    assert_replicas_agree(result)
    print(f"model-only TP2 (release) -> NTP TP2 + TP1 with the distributed optimizer: worst {worst:.2e}")
