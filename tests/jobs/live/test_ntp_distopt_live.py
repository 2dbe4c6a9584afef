"""Live failures under Megatron's distributed optimizer (two instances: every optimizer shard has a twin).

A rank is SIGKILLed mid-run; its replica re-forms at a lower TP degree while the other trains on, and nothing is
read from disk: each shard the new layout's sync-group members lack comes from its twin in the other instance,
one message per (source, destination) pair; what a rank held it copies locally (a rebuilt rank from its old
optimizer or from its old shadow of the same block); then every rank re-gathers its parameters from the shards in
the new groups. Every case asserts:

- the lm loss per iteration equals the failure-free run's (relative ≤ 1e-5, as ``tests/jobs/live/test_live_failure.py``;
  measured here: equal to the printed digits), so the shards moved and the re-gather left nothing stale;
- every live (replica, TP rank) reports the same state checksums after every iteration
  (``tests.harness.assert_replicas_agree``), and the two holders of every shard (one per instance) report the same
  checksum of it (main params and Adam moments) after every iteration, in every generation;
- every shard moved came from a surviving holder — its twin in the other instance — and the bytes moved equal the
  shards' state bytes, which ``tests.harness.check_shard_moves`` recomputes from the model's dimensions and the
  published topologies (every ``run_job`` checks it); the receiving state is NaN until it is filled, so a piece
  missed would make the next loss NaN.

2 × TP2 (four ranks): two kills per job, one in each replica (TP2, TP2 → TP2, TP1 → TP1, TP1; the second takes a
shard from a degraded rank's shadow), which covers every phase of an iteration over three jobs:
``start``/``param_gather``, ``forward``/``optimizer``, ``backward``/``grad_sync``; the fourth kills launch rank 0
while the re-formation after the first kill runs (``reform``). TP3 + TP2 started degraded, uneven blocks (five
ranks): the degraded replica's rank dies in ``param_gather``, where its peer is in the
gather's exchange with it (the iteration counts as done: the peer must not step it again), then a rank of the
healthy replica. bf16: the main params travel, rounded into the model before the gather. Both holders of one shard
killed: a ``shard_lost`` event names it and ``ntp.on_unrecoverable`` decides (``restart`` here, from the checkpoint;
``stop``, and one instance, where any death loses a shard: ``tests/jobs/equivalence/test_ntp_distopt.py``). A warm spare rejoining in a dead rank's place takes its
shard from the surviving holder in its instance and its Adam step from its peers.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.harness import JobResult, assert_groups_as_planned, assert_replicas_agree, relative_difference, run_job
from tests.jobs.live.test_live_failure import assert_same_run, launcher_lines, ntp_args, \
    widths_by_iteration

ITERS = 7
DISTOPT = ("--set", "parallel.use_distributed_optimizer=true", "--set", "parallel.num_distributed_optimizer_instances=2")
DEGRADED = ("--set", "ntp.dead_slots=[1:2]")


def distopt_args(tp: int, extra: tuple[str, ...] = ()) -> list[str]:
    return ntp_args(tp, 2, iters=ITERS, extra=DISTOPT + extra)


def kills(*specs: str) -> list[str]:
    return [arg for spec in specs for arg in ("--inject-failure", spec)]


@pytest.fixture(scope="module")
def reference(jobs) -> JobResult:
    return jobs.run("distopt-live-ref-tp2x2", distopt_args(2))


@pytest.fixture(scope="module")
def reference_degraded(jobs) -> JobResult:
    return jobs.run("distopt-live-ref-tp3-tp2", distopt_args(3, DEGRADED))


def assert_twins_agree(result: JobResult, iters: int = ITERS) -> int:
    """After every iteration each shard (block, position) was reported by a holder in each instance, and every
    report of it has the same checksum: both twins', and in every generation that reported the iteration (a
    failure can cut a check short; the next generation makes it up, from shards copied or moved). Returns how many
    (iteration, shard) were compared."""
    shards: dict[tuple[int, int, int], dict[tuple[int, int], str]] = defaultdict(dict)
    for r in result.records:
        if r.get("kind") == "state_checksums":
            for s in r["shards"]:
                shards[r["iteration"], s["block"], s["position"]][s["instance"], r.get("generation", 0)] = s["checksum"]
    for key, reports in shards.items():
        assert {instance for instance, _ in reports} == {0, 1}, f"(iteration, block, position) {key}: {reports}"
        assert len(set(reports.values())) == 1, f"the holders of {key} differ: {reports}"
    assert {k[0] for k in shards} == set(range(1, iters + 1))
    return len(shards)


def assert_from_twins(result: JobResult, expected: list[list[tuple[int, int, int]]]) -> None:
    """The re-formations moved exactly ``expected`` (per re-formation: (block, source launch rank, destination
    launch rank)), and each moved the bytes of its bound. (Which instance a source is in: :func:`check_live_run`.)"""
    reformed = result.events("reformed")
    got = [sorted((m["block"], m["src"], m["dst"]) for m in e["shard_moves"]) for e in reformed]
    assert got == [sorted(e) for e in expected], (got, launcher_lines(result))
    for event, check in zip(reformed, result.reformations):
        assert event["moved_bytes"] == check["bound"] > 0 and event["lower_bound_bytes"] == check["bound"]


def replica_of(result: JobResult) -> dict[int, int]:
    """Launch rank -> replica, from generation 0's topology."""
    [first] = [e for e in result.events("generation_published") if e["generation"] == 0]
    return {rank: rep["index"] for rep in first["topology"]["replicas"] for rank in rep["ranks"]}


def check_live_run(result: JobResult, reference: JobResult, iters: int = ITERS) -> None:
    assert_same_run(result, reference, iters)
    assert_replicas_agree(result, iters)
    assert_twins_agree(result, iters)
    assert_groups_as_planned(result, instances=2)
    replicas = replica_of(result)
    for event in result.events("reformed"):
        for m in event["shard_moves"]:
            assert replicas[m["src"]] != replicas[m["dst"]], f"shard {m} did not come from the other instance"


# Launch rank 3 (replica 1, slot 1) dies at iteration 3, launch rank 1 (replica 0, slot 1) at iteration 5. Block 1's
# shard goes to replica 1's survivor from launch rank 1, then to replica 0's survivor from launch rank 2's shadow.
TWO_KILLS = [[(1, 1, 2)], [(1, 2, 0)]]


@pytest.mark.parametrize("first, second", [("start", "param_gather"), ("forward", "optimizer"),
                                           ("backward", "grad_sync")])
def test_kills_in_every_phase(tmp_path, reference, first, second):
    result = run_job(tmp_path / "run", distopt_args(2) + kills(f"kill:rank=3,iter=3,phase={first}",
                                                               f"kill:rank=1,iter=5,phase={second}"))
    check_live_run(result, reference)
    assert [e["tp_per_replica"] for e in result.events("reformed")] == [[2, 1], [1, 1]]
    assert_from_twins(result, TWO_KILLS)
    assert sorted((e["launch_rank"], e["phase"]) for e in result.events("rank_failed")) == [(1, second), (3, first)]


def test_kill_while_re_forming(tmp_path, reference):
    """Launch rank 0 dies in the re-formation after launch rank 3's death (after building, before any shard moved):
    launch rank 2 had adopted its healthy DDP as its shadow of block 0 and hands it back to its old objects, bound
    to their groups again; the next generation builds on generation 0 without both, and each replica's survivor
    adopts its DDP again and takes its missing shard from the other. (Seen failing with the hand-back's rebinding
    left out: the second adoption finds the DDP bound to the failed generation's groups.)"""
    result = run_job(tmp_path / "run", distopt_args(2) + kills("kill:rank=3,iter=3,phase=param_gather",
                                                               "kill:rank=0,iter=3,phase=reform"))
    check_live_run(result, reference)
    [reformed] = result.events("reformed")
    assert reformed["generation"] == 2 and reformed["tp_per_replica"] == [1, 1]
    assert_from_twins(result, [[(0, 2, 1), (1, 1, 2)]])


def test_degraded_replica_with_uneven_blocks(tmp_path, reference_degraded):
    """TP3 + TP2 (8 query groups, 256 FFN units and vocabulary rows: blocks 3/3/2 and 86/85/85), replica 1's slot 0
    the proxy of block 2. Launch rank 4 (replica 1, slot 1) dies in ``param_gather`` of iteration 3, while launch
    rank 3 sends it block 2's dealt units: launch rank 3 keeps its shards of blocks 0 and 2 (copied from its old
    shadows) and takes block 1's from launch rank 1. Then launch rank 2 (replica 0, slot 2) dies: replica 0's slot
    0 becomes block 2's proxy and takes its shard from launch rank 3's shadow."""
    result = run_job(tmp_path / "run", distopt_args(3, DEGRADED) + kills("kill:rank=4,iter=3,phase=param_gather",
                                                                        "kill:rank=2,iter=5,phase=backward"))
    check_live_run(result, reference_degraded)
    assert [e["tp_per_replica"] for e in result.events("reformed")] == [[3, 1], [2, 1]]
    assert_from_twins(result, [[(1, 1, 3)], [(2, 3, 0)]])
    # Launch rank 3 stepped iteration 3 before its gather failed: it resumes at 4, with everyone.
    assert result.events("reformed")[0]["resume_iteration"] == 4


def test_both_holders_of_a_shard_killed_restart_the_job_from_its_checkpoint(tmp_path, reference):
    """Launch rank 1 (replica 0, slot 1) dies at iteration 3; launch rank 3 (replica 1, slot 1), the other holder of
    block 1's shard, dies in the re-formation that follows, before any shard moved: the next generation builds on
    generation 0 without both, and block 1's shard has no holder left. (Two deaths at one point of an iteration
    are no more certain to meet in one generation: the first aborts every collective of it, and a rank that was in
    one re-forms before it gets there.) ``ntp.on_unrecoverable: restart``, the natural choice here: a ``shard_lost``
    event names the shard, the survivors restart from the iteration-2 checkpoint as TP1 + TP1 (a degraded launch
    that reads its shadows' shards from the checkpoint), and the run's losses are the failure-free run's.
    (``stop`` after a lost shard: tests/jobs/equivalence/test_ntp_distopt.py.)"""
    args = distopt_args(2, ("--set", "ntp.on_unrecoverable=restart", "--set", f"checkpoint.save={tmp_path / 'ckpt'}",
                            "--set", "checkpoint.save_interval=2"))
    result = run_job(tmp_path / "run", args + kills("kill:rank=1,iter=3,phase=backward",
                                                    "kill:rank=3,iter=3,phase=reform"))
    [lost] = result.events("shard_lost")
    assert (lost["block"], lost["position"], lost["holders"]) == (1, 0, [1, 3])
    assert lost["numel"] > 0
    [restarted] = result.events("restarted")
    assert (restarted["iteration"], restarted["tp_per_replica"]) == (2, [1, 1]), restarted
    assert not result.events("reformed") and not result.events("job_stopped")
    assert "timed out" not in result.stderr.lower()
    assert_same_run(result, reference, ITERS)


def test_a_replacement_takes_its_shard_from_its_twin(tmp_path, reference):
    """Launch rank 3 (replica 1, slot 1) dies at iteration 2; replica 1 goes on at TP1, its survivor taking block
    1's shard from launch rank 1. A warm spare is admitted in launch rank 3's place as soon as it can be
    (``ntp.rejoin_after_s: 0``; seen one to two iterations later): it holds nothing, so its shard of block 1 comes
    from the holder in its own instance, replica 1's survivor (launch rank 2, whose shadow of block 1 took the shard
    from launch rank 1), its units from that survivor too, and its Adam step and schedule from its peers (a wrong
    step would change the next loss: Adam's bias correction)."""
    args = distopt_args(2, ("--set", "ntp.rejoin_after_s=0", "--set", "ntp.warm_spares=1"))
    result = run_job(tmp_path / "run", args + kills("kill:rank=3,iter=2,phase=forward"))
    assert_same_run(result, reference, ITERS)
    assert_replicas_agree(result, ITERS)
    assert_twins_agree(result, ITERS)
    reformed = result.events("reformed")
    assert [e["tp_per_replica"] for e in reformed] == [[2, 1], [2, 2]], launcher_lines(result)
    assert reformed[-1]["joined"] == [[1, 1]]
    assert_from_twins(result, [[(1, 1, 2)], [(1, 2, 3)]])
    assert widths_by_iteration(result)[ITERS] == [2, 2]


def test_shards_cut_inside_each_instance(jobs, tmp_path):
    """2 x TP2 x 2 per instance (TP2 x DP4, two instances of two replicas): each block's buffer is cut in two
    positions, so a parameter all-gather gathers from another rank, a killed gather is a real one, and a shard's
    twin is the same position in the other instance. Launch rank 7 (replica 3, slot 1) dies in the gather of
    iteration 2, launch rank 1 (replica 0, slot 1) in the optimizer step of 3: block 1's position 1 comes from
    replica 1's rank 3 to replica 3's proxy (6), position 0 from replica 2's rank 5 to replica 0's proxy (0).
    (The moved bytes here are checked against the figure of the real objects; the harness's own geometry covers
    one position per instance.)"""
    iters = 5  # two after the second kill (eight ranks on two cores: each iteration counts)
    args = ntp_args(2, 4, iters=iters, extra=DISTOPT + ("--set", "training.global_batch_size=16"))
    reference = jobs.run("distopt-live-ref-tp2x4", args)
    result = run_job(tmp_path / "run", args + kills("kill:rank=7,iter=2,phase=param_gather",
                                                    "kill:rank=1,iter=3,phase=optimizer"))
    check_live_run(result, reference, iters)
    reformed = result.events("reformed")
    assert [sorted((m["block"], m["position"], m["src"], m["dst"]) for m in e["shard_moves"]) for e in reformed] \
        == [[(1, 1, 3, 6)], [(1, 0, 5, 0)]], launcher_lines(result)
    for event in reformed:
        assert event["moved_bytes"] == sum(m["bytes"] for m in event["shard_moves"]) == event["lower_bound_bytes"] > 0


BF16 = ("--set", "training.precision=bf16")
BF16_ITERS = 4
BF16_LOSS_TOL = 3e-5
"""bf16's spread between layouts (``tests/jobs/equivalence/test_bf16.py``, measured over three iterations): after the
re-formation replica 1 trains at TP1, whose partial sums round differently from the failure-free run's TP2, and
Adam grows that difference step by step (measured here, relative: 4.1e-6 at iteration 3, 9.6e-6 at 4, 2.8e-5 at
6), so the run stops one iteration after the redone one."""


def test_bf16_main_params_come_from_the_twin(tmp_path, jobs):
    """Under bf16 a shard's fp32 main params travel (not the bf16 parameters), and the rebuilt rank's bf16 shard of
    the parameter buffer is their rounding before the gather: the twins stay bit for bit equal, main params and
    moments included, and the loss follows the failure-free bf16 run within bf16's own spread between layouts."""
    args = ntp_args(2, 2, iters=BF16_ITERS, extra=DISTOPT + BF16)
    reference = jobs.run("distopt-live-ref-tp2x2-bf16", args)
    result = run_job(tmp_path / "run", args + kills("kill:rank=3,iter=3,phase=backward"))
    assert result.returncode == 0, result.stderr[-3000:]
    got, want = result.losses(), reference.losses()
    assert sorted(got) == sorted(want) == list(range(1, BF16_ITERS + 1))
    differing = {i: relative_difference(got[i], want[i]) for i in want
                 if not relative_difference(got[i], want[i]) <= BF16_LOSS_TOL}
    assert not differing, differing
    assert_replicas_agree(result, BF16_ITERS)
    assert_twins_agree(result, BF16_ITERS)
    assert_from_twins(result, TWO_KILLS[:1])
