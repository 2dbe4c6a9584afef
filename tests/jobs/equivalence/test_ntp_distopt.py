"""Megatron's distributed optimizer under NTP: the same training as plain Megatron-Core's distributed optimizer,
healthy replicas and replicas started degraded (``ntp.dead_slots``), with one and two optimizer instances; a live
failure it cannot survive yet stops the job at once.

- Like with like: NTP 2 × TP2 against ``tests/plain_megatron.py --tp 2 --dp 2 --dist-opt`` (plain Megatron-Core in
  a fresh interpreter): the same buckets, shards and collectives, one micro-batch of 6 samples per replica so that
  both read the same samples per replica. The lm loss is bitwise equal; the grad norm agrees within 1e-7, not
  bitwise: upstream sums the squared norms in fp32 (``get_grad_norm_fp32``), NTP in a float64 table finished with
  ``fsum`` (the layout-independent norm that keeps replicas of different TP degrees bit-identical). Measured here:
  2.0e-8 relative at most over the three iterations.
- Across layouts: the same NTP run, and NTP TP3 + TP2 (a degraded replica whose survivors hold units of the dead
  slot's block, one of them its proxy; blocks of unequal size), against plain Megatron-Core TP1 × DP2 with the
  distributed optimizer, lm loss and grad norm per iteration within 1e-5, every parameter and Adam moment at the
  end (gathered from the shards on both sides) with the property test's tolerances (``tests.equivalence_cases``).
- Two instances: NTP TP3, TP1, TP2, TP1 (four replicas, three degraded) against plain Megatron-Core TP1 × DP4
  with ``--instances 2``, the same comparison; and the two holders of every optimizer shard (twins: one block and
  position, one per instance — here a healthy rank and a degraded rank's shadow, and two degraded ranks'
  shadows) report the same checksum of their shard after every iteration.
- Uneven blocks (vocabulary, FFN and query groups no TP degree divides), whose replicated parameters sit at
  different bucket offsets in the slots' buffers: three healthy replicas, and TP2 + TP1 with two instances
  (the degraded rank's shadows twin the healthy ranks), against TP1 within 1e-5; every (replica, TP rank) reports
  the same gathered state checksums after every iteration.
- A rank killed mid-run with one instance loses the only copy of its shard: the job stops with one line naming
  it, within seconds, without a re-formation or a timeout (live failures with two instances:
  ``tests/jobs/live/test_ntp_distopt_live.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.equivalence_cases import Case, assert_twins_bitwise, compare_runs, iteration_records
from tests.harness import REPO, TINY, assert_ok, assert_replicas_agree, relative_difference, run_job
from tests.jobs.live.test_live_failure import leftover_processes, ntp_args
from tests.jobs.equivalence.test_ntp_equivalence import check_case

ITERS = 3
LIKE_TOL = 1e-7
DECIDED_WITHIN_S = 2.0
"""From the killed rank's death to the controller's stop."""
STOP_WITHIN_S = 10.0
"""From the killed rank's death to the end of the job; ``parallel.timeout_s`` is 60 s in these runs."""

# tests/plain_megatron.py's model, data and optimizer at NTP 2 x TP2 (what the comparison helpers need to know).
PLAIN = Case(tp_base=2, dp=2, dead=(), num_layers=2, query_groups=8, heads_per_group=1, kv_channels=8, hidden_size=64,
             ffn_hidden_size=256, vocab_size=256, position="learned_absolute", normalization="LayerNorm", untie=False,
             activation="gelu", overlap=False, bucket_size=None, clip_grad=1.0, micro_batches=1, dist_opt=True,
             instances=1)
MICRO = 6  # 12 samples per iteration over 2 replicas: one micro-batch each, the same samples on both sides

UNEVEN = Case(tp_base=2, dp=3, dead=(), num_layers=2, query_groups=3, heads_per_group=2, kv_channels=8,
              hidden_size=32, ffn_hidden_size=41, vocab_size=263, position="learned_absolute",
              normalization="LayerNorm", untie=False, activation="squared_relu", overlap=True, bucket_size=3000,
              clip_grad=1.0, micro_batches=1, dist_opt=True, instances=1)
# TP2 + TP1 with two instances: the degraded rank's shadow of each block twins the healthy rank of that slot.
UNEVEN_TWO = Case(tp_base=2, dp=2, dead=((1, 1),), num_layers=1, query_groups=3, heads_per_group=1, kv_channels=8,
                  hidden_size=24, ffn_hidden_size=37, vocab_size=257, position="rope", normalization="RMSNorm",
                  untie=True, activation="gelu", overlap=False, bucket_size=None, clip_grad=0.05, micro_batches=1,
                  dist_opt=True, instances=2)
# On tests/plain_megatron.py's model: TP3 + TP2 (8 query groups, 256 FFN units and vocabulary rows: blocks of unequal
# size), one instance; and four replicas TP3, TP1, TP2, TP1 in two instances (twins: replicas 0 and 2, 1 and 3).
DEGRADED = replace(PLAIN, tp_base=3, dead=((1, 2),))
FOUR = replace(PLAIN, tp_base=3, dp=4, dead=((1, 1), (1, 2), (2, 0), (3, 0), (3, 2)), instances=2)
MICRO_FOUR = 3  # 12 samples over 4 replicas


def plain_megatron(out_dir: Path, *args: str, micro: int = MICRO) -> dict[int, dict]:
    """``tests.plain_megatron train`` for ITERS iterations in a fresh interpreter (it never imports
    ntp-megatron): each iteration's lm loss, grad norm and lr."""
    out_dir.mkdir(parents=True)
    out = out_dir / "records.json"
    proc = subprocess.run([
        sys.executable, "-m", "tests.plain_megatron", "train", "--iters", str(ITERS), "--save-at", "0",
        "--ckpt", str(out_dir / "unused"), "--out", str(out), "--full-records", "--micro-batch", str(micro),
        "--dist-opt", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {int(i): r for i, r in json.loads(out.read_text()).items()}


def ntp_on_plain_model(run_dir: Path, case: Case, micro: int = MICRO):
    """An NTP job of ``case``'s topology on tests/plain_megatron.py's model, data and initial weights, dumping its
    replica state at the end."""
    sets = {"ntp.enabled": "true", "model.init": "megatron", "parallel.tensor_model_parallel_size": case.tp_base,
            "parallel.data_parallel_size": case.dp, "parallel.use_distributed_optimizer": "true",
            "parallel.num_distributed_optimizer_instances": case.instances, "training.micro_batch_size": micro,
            "training.train_iters": ITERS, "logging.state_checksums": "true",
            "logging.dump_state": run_dir / "state"}
    if case.dead:
        sets["ntp.dead_slots"] = "[" + ",".join(f"{r}:{s}" for r, s in case.dead) + "]"
    result = run_job(run_dir, [*TINY, *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))])
    assert_ok(result)
    return result


@pytest.fixture(scope="module")
def plain_tp1(tmp_path_factory):
    """Plain Megatron-Core TP1 × DP2 with the distributed optimizer: its records and final state (run once)."""
    where = tmp_path_factory.mktemp("plain_tp1")
    state = where / "state.pt"
    return plain_megatron(where / "run", "--tp", "1", "--dp", "2", "--state", str(state)), torch.load(state)


def test_healthy_replicas_train_as_plain_megatrons_distributed_optimizer(tmp_path, plain_tp1):
    ntp_dir = tmp_path / "ntp"
    ntp = run_job(ntp_dir, [
        *TINY, "--set", "ntp.enabled=true", "--set", "model.init=megatron",
        "--set", "parallel.tensor_model_parallel_size=2", "--set", "parallel.data_parallel_size=2",
        "--set", "parallel.use_distributed_optimizer=true", "--set", "parallel.num_distributed_optimizer_instances=1",
        "--set", f"training.micro_batch_size={MICRO}",
        "--set", f"training.train_iters={ITERS}", "--set", "logging.state_checksums=true",
        "--set", f"logging.dump_state={ntp_dir / 'state'}"])
    assert_ok(ntp)
    got = iteration_records(ntp)
    like = plain_megatron(tmp_path / "plain_tp2", "--tp", "2", "--dp", "2")
    assert sorted(got) == sorted(like) == list(range(1, ITERS + 1))
    worst = 0.0
    for i, record in like.items():
        assert got[i]["lm_loss"] == record["lm_loss"], f"iteration {i}: lm loss {got[i]['lm_loss']!r} vs plain " \
                                                       f"TP2 x DP2 {record['lm_loss']!r}"
        diff = relative_difference(got[i]["grad_norm"], record["grad_norm"])
        worst = max(worst, diff)
        assert diff <= LIKE_TOL, f"iteration {i}: grad norm {got[i]['grad_norm']!r} vs {record['grad_norm']!r}"
    assert any(r["grad_norm"] > PLAIN.clip_grad for r in like.values())  # clipping is part of what is compared
    across = compare_runs(PLAIN, got, torch.load(ntp_dir / "state" / "replica0.pt"), *plain_tp1)
    assert_replicas_agree(ntp, ITERS)
    print(f"NTP 2 x TP2 vs plain TP2 x DP2 (distributed optimizer): grad norm within {worst:.1e}; vs plain TP1 x "
          f"DP2: {across}")


def test_a_degraded_replica_trains_as_plain_megatrons_distributed_optimizer(tmp_path, plain_tp1):
    """TP3 + TP2, one instance: replica 1's slot 0 is the proxy of block 2, whose units both survivors hold; each
    serves its blocks through shadows the distributed optimizer steps."""
    ntp = ntp_on_plain_model(tmp_path / "ntp", DEGRADED)
    worst = compare_runs(DEGRADED, iteration_records(ntp), torch.load(tmp_path / "ntp" / "state" / "replica0.pt"),
                         *plain_tp1)
    assert_replicas_agree(ntp, ITERS)
    print(f"NTP TP3 + TP2 vs plain TP1 x DP2 (distributed optimizer): {worst}")


def test_degraded_replicas_with_two_instances_train_as_plain_megatron(tmp_path):
    ntp = ntp_on_plain_model(tmp_path / "ntp", FOUR, micro=MICRO_FOUR)
    state = tmp_path / "plain_state.pt"
    want = plain_megatron(tmp_path / "plain", "--tp", "1", "--dp", "4", "--instances", "2", "--state", str(state),
                          micro=MICRO_FOUR)
    worst = compare_runs(FOUR, iteration_records(ntp), torch.load(tmp_path / "ntp" / "state" / "replica0.pt"), want,
                         torch.load(state))
    assert_replicas_agree(ntp, ITERS)
    assert_twins_bitwise(ntp, FOUR)
    print(f"NTP TP3, TP1, TP2, TP1 vs plain TP1 x DP4, two instances: {worst}")


@pytest.mark.parametrize("case", [UNEVEN, UNEVEN_TWO], ids=["three-replicas", "two-replicas-degraded"])
def test_uneven_blocks(tmp_path_factory, case):
    """Slots' buckets place the replicated parameters at different offsets. Over three replicas the sums of
    their gradients round differently per slot, so block 0's member broadcasts the replicated parameters after
    the gather and its optimizer state is the replica's (each slot's parameters are still compared); over two
    the sums are exact in either order, and every slot's own optimizer state is compared."""
    check_case(tmp_path_factory, case)


@pytest.mark.timed  # asserts how soon the controller stops the job: scripts/test.sh runs it alone
def test_a_failure_with_one_instance_loses_a_shard_and_stops_the_job_naming_it(tmp_path):
    """With one instance every shard has a single holder: the controller stops the job at once (no restart is
    configured) with a ``shard_lost`` event naming the shard, without a re-formation or a timeout."""
    args = ntp_args(2, 2, iters=4, extra=("--set", "parallel.use_distributed_optimizer=true",
                                          "--set", "parallel.num_distributed_optimizer_instances=1"))
    result = run_job(tmp_path / "run", args + ["--inject-failure", "kill:rank=3,iter=2,phase=backward"])
    assert result.returncode != 0, result.stderr[-3000:]
    [stopped] = result.events("job_stopped")
    reason = stopped["reason"]
    for text in ("distributed-optimizer shards (block, position) [(1, 1)] lost", "one instance"):
        assert text in reason, reason
    assert reason in result.stderr
    [lost] = result.events("shard_lost")
    assert (lost["block"], lost["position"], lost["holders"]) == (1, 1, [3]) and lost["numel"] > 0
    assert not result.events("reformed")
    killed = [f for f in result.events("rank_failed") if f["launch_rank"] == 3]
    assert killed, result.events("rank_failed")
    decided = stopped["time"] - killed[0]["time"]
    assert decided < DECIDED_WITHIN_S, f"the controller stopped the job {decided:.1f} s after the failure"
    [ended] = result.events("job_ended")
    took = ended["time"] - killed[0]["time"]
    assert took < STOP_WITHIN_S, f"the job took {took:.1f} s to stop after the failure"
    assert max(iteration_records(result)) == 1
    assert "timed out" not in result.stderr.lower() and "did not notice" not in result.stderr
    assert leftover_processes(result) == []
