"""Checkpoints with Megatron's distributed optimizer (``parallel.use_distributed_optimizer``), against plain
Megatron-Core (:mod:`tests.plain_megatron`, a fresh interpreter that never imports ntp-megatron).

One chain of real jobs, each continuing the previous one's checkpoint, every iteration compared with plain
Megatron-Core's uninterrupted TP2 x DP2 run (lm loss and grad norm, :data:`TOLERANCE`):

1. plain Megatron-Core TP2 x DP2 with its distributed optimizer saves at iteration 2 in Megatron-LM's default
   format (``dp_reshardable``, bucket space);
2. NTP off TP2 x DP2, distributed optimizer with two instances, reads it (its own layout: bucket space is read
   there only), runs iteration 3 and saves (``fully_reshardable``, model space, written piece by piece);
3. NTP 3 x TP2 with the distributed optimizer (one instance: three replicas) reads that, runs 4 and saves (each
   sync group's shards as boxes of NTP's unit fragments);
4. NTP off TP1 without the distributed optimizer reads that, runs 5 and saves (the non-distributed optimizer's
   format);
5. NTP 2 x TP2 with the distributed optimizer (two instances) reads that back, runs 6 and saves;
6. plain Megatron-Core TP2 x DP2 with its distributed optimizer reads that (``fully_reshardable``, Megatron's own
   loader) and runs 7 and 8.

A job's first iteration after a load depends on the weights it read; the optimizer state it read shows in the
iteration after that, which is the next job's first — and, for the last hop, its own second (iteration 8).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness import TINY, assert_ok, relative_difference, run_job, run_module

ITERS = 8
TOLERANCE = 1e-5
"""Relative, per iteration: plain Megatron-Core's own spread between layouts (``docs/testing.md``)."""


def _plain(out_dir: Path, *args: str) -> dict[int, dict]:
    out = out_dir / "plain.json"
    returncode, stderr = run_module("tests.plain_megatron", ["train", "--tp", "2", "--dp", "2", "--dist-opt",
                                                             "--iters", str(ITERS), "--out", str(out),
                                                             "--full-records", *args], out_dir)
    assert returncode == 0, f"plain_megatron failed ({returncode}):\n{stderr[-4000:]}"
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def _ours(run_dir: Path, tp: int, dp: int, load: Path, save: Path, until: int, *extra: str) -> dict[int, dict]:
    result = run_job(run_dir, [*TINY, "--set", f"parallel.tensor_model_parallel_size={tp}",
                               "--set", f"parallel.data_parallel_size={dp}", "--set", f"training.train_iters={until}",
                               "--set", f"checkpoint.load={load}", "--set", f"checkpoint.save={save}",
                               "--set", f"checkpoint.save_interval={until}", *extra])
    assert_ok(result)
    return {r["iteration"]: r for r in result.records if r.get("kind") == "iteration"}


def _matches(records: dict[int, dict], reference: dict[int, dict], iterations: list[int], what: str) -> float:
    assert sorted(records) == iterations, f"{what}: ran iterations {sorted(records)}"
    worst = 0.0
    for i in iterations:
        for key in ("lm_loss", "grad_norm"):
            difference = relative_difference(records[i][key], reference[i][key])
            assert difference <= TOLERANCE, f"{what}: iteration {i}'s {key} {records[i][key]} vs {reference[i][key]}"
            worst = max(worst, difference)
    return worst


DIST_OPT = ("--set", "parallel.use_distributed_optimizer=true")
NTP = ("--set", "ntp.enabled=true")


def test_distributed_optimizer_checkpoints_round_trip_through_ntp_and_plain_megatron(tmp_path):
    plain_dir = tmp_path / "plain-ckpt"
    reference = _plain(tmp_path / "plain", "--save-at", "2", "--ckpt", str(plain_dir))
    ours, spread = tmp_path / "ours", {}
    got = _ours(tmp_path / "k2", 2, 2, plain_dir / "iter_0000002", ours, 3, *DIST_OPT,
                "--set", "parallel.num_distributed_optimizer_instances=2")
    spread["plain dp_reshardable -> TP2 x DP2 k=2"] = _matches(got, reference, [3], "from plain's dp_reshardable")
    got = _ours(tmp_path / "ntp3", 2, 3, ours / "iter_0000003", ours, 4, *NTP, *DIST_OPT)
    spread["-> NTP 3 x TP2 k=1"] = _matches(got, reference, [4], "into NTP 3 x TP2")
    got = _ours(tmp_path / "tp1", 1, 1, ours / "iter_0000004", ours, 5)
    spread["-> TP1 without"] = _matches(got, reference, [5], "into TP1 without the distributed optimizer")
    got = _ours(tmp_path / "ntp2", 2, 2, ours / "iter_0000005", ours, 6, *NTP, *DIST_OPT)
    spread["-> NTP 2 x TP2 k=2"] = _matches(got, reference, [6], "back into the distributed optimizer under NTP")
    plain = _plain(tmp_path / "plain-load", "--save-at", "0", "--ckpt", str(tmp_path / "unused"),
                   "--load", str(ours / "iter_0000006"))
    spread["-> plain TP2 x DP2"] = _matches(plain, reference, [7, 8], "plain Megatron-Core from NTP's")
    print("worst relative difference per load:", {k: f"{v:.1e}" for k, v in spread.items()})
