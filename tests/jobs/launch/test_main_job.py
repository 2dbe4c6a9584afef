"""The main job (configs/main_job.yaml, shortened): the failure, the degraded replica, the rejoin and the full width
again, with the replacement a warm spare started with the ranks — so the rejoin does not wait for an interpreter
to boot — and the loss curve of the same job without the failure."""

from __future__ import annotations

import json

from tests.harness import REPO, assert_ok, run_job
from tests.jobs.live.test_live_failure import assert_same_run, widths_by_iteration

ITERS = 60
MAIN_JOB = ["--config", str(REPO / "configs" / "main_job.yaml"), "--train-iters", str(ITERS),
            "--set", "logging.tensorboard_dir="]


def test_the_main_job_rejoins_with_a_warm_spare(tmp_path, jobs):
    reference = jobs.run("main-job-no-failure", [*MAIN_JOB, "--set", "faults.inject=[]"])
    result = run_job(tmp_path / "run", MAIN_JOB)
    assert_same_run(result, reference, ITERS)  # no process of the job left behind, spares included
    [failed] = result.events("rank_failed")
    assert (failed["launch_rank"], failed["iteration"], failed["phase"]) == (3, 15, "backward")
    [started] = result.events("replacement_started")
    assert started["launch_rank"] == 3 and started["warm"] is True and started["attempt"] == 1
    pids = json.loads((result.run_dir / "ranks.node0.json").read_text())
    spare, next_spare = pids["spares"]  # started with the ranks; the one started for a next failure
    assert pids["3"][1] == started["pid"] == spare
    assert f"starting a replacement for launch rank 3 (pid {spare}, a warm spare, attempt 1 of 3)" in result.stderr
    reformed = result.events("reformed")
    assert [e["tp_per_replica"] for e in reformed] == [[2, 1], [2, 2]]
    assert reformed[-1]["joined"] == [[1, 1]]
    assert all(e["moved_bytes"] == e["lower_bound_bytes"] > 0 for e in reformed)
    widths = widths_by_iteration(result)
    assert widths[14] == [2, 2] and widths[15] == [2, 1] and widths[ITERS] == [2, 2]


def test_the_main_job_on_two_pipeline_stages(tmp_path):
    """``--pipeline-model-parallel-size 2`` on the main job's flags (8 ranks, one layer per stage), shortened as
    above: the launcher says where each stage runs; launch rank 3 (stage 0, replica 1, slot 1) is killed in
    iteration 15, replica 1's stage 0 trains at TP1 while its stage 1 stays at TP2, and the warm spare brings it
    back (2 s after the failure, well before the run's end)."""
    iters = ITERS
    result = run_job(tmp_path / "run", [*MAIN_JOB, "--pipeline-model-parallel-size", "2"])
    assert_ok(result)
    assert "stage 0 (layers 0..0) on node 0: replica 0 = launch ranks 0..1 in slots 0..1; replica 1 = launch ranks " \
           "2..3 in slots 0..1" in result.stderr
    [failed] = result.events("rank_failed")
    assert (failed["launch_rank"], failed["stage"], failed["replica"], failed["slot"]) == (3, 0, 1, 1)
    widths = widths_by_iteration(result)
    assert widths[14] == [[2, 2], [2, 2]] and widths[15] == [[2, 2], [1, 2]] and widths[iters] == [[2, 2], [2, 2]]
    assert result.events("reformed")[-1]["joined"] == [[1, 1, 0]]
