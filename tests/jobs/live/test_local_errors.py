"""A rank's own error is an error, not a peer's failure: the rank reports it at once, the controller stops the job
naming it within seconds — no rank waits for ``parallel.timeout_s``, no generation is re-formed around it, and
nothing is left running.

The save case breaks ``checkpoint.save`` after the job has started (so any check before the start passes): the
test reads the launcher's output as it comes and, at the first iteration line, replaces the directory with a
regular file; the first save is due many iterations later.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.harness import Forked, JobResult, run_job
from tests.jobs.live.test_live_failure import leftover_processes, ntp_args

# Asserts how soon the job stops after a rank's own error: scripts/test.sh runs it alone.
pytestmark = pytest.mark.timed

STOP_WITHIN_S = 30.0
"""From the iteration the error came after to the end of the job; ``parallel.timeout_s`` is 60 s in these runs."""
SAVE_AT = 40
"""The first (and only) save: the window between the first iteration line and it is about this many iterations."""
START_TIMEOUT_S = 300.0


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def launch_and_break_save(run_dir: Path, args: list[str], ckpt: Path) -> JobResult:
    """Run the launcher (forked from a zygote of its own); once it printed the first iteration, make ``ckpt`` a
    regular file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = run_dir / "launcher.stdout", run_dir / "launcher.stderr"
    proc = Forked.start(["--run-dir", str(run_dir), "--metrics-file", str(run_dir / "metrics.jsonl"), *args],
                        stdout_path, stderr_path)
    broken = False
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while proc.poll() is None:
            if " iteration        1/" in stdout_path.read_text(errors="replace"):
                shutil.rmtree(ckpt)
                ckpt.write_text("not a directory\n")
                broken = True
                break
            assert time.monotonic() < deadline, (
                f"no first iteration within {START_TIMEOUT_S:.0f} s:\n{stdout_path.read_text()[-3000:]}")
            time.sleep(0.02)  # the poll of a file another process appends to (line-buffered)
        proc.wait(timeout=START_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert broken, "the job never printed its first iteration:\n" + stderr_path.read_text()[-3000:]
    return JobResult(proc.returncode, stdout_path.read_text(), stderr_path.read_text(), read_records(run_dir), run_dir)


def events(result: JobResult, name: str) -> list[dict]:
    return [r for r in result.records if r.get("kind") == "event" and r.get("event") == name]


def assert_stopped_naming(result: JobResult, failed_iteration: int, *named: str) -> str:
    """The job ended non-zero, within STOP_WITHIN_S of the iteration the error came after, with one reason that
    names everything in ``named`` and the rank; no failure counted, no re-formation, no rank left behind."""
    assert result.returncode != 0, result.stderr[-3000:]
    [stopped] = events(result, "job_stopped")
    reason = stopped["reason"]
    for text in named:
        assert text in reason, reason
    assert reason in result.stderr  # the launcher says it
    [ended] = events(result, "job_ended")
    iterations = {r["iteration"]: r for r in result.records if r.get("kind") == "iteration"}
    assert max(iterations) == failed_iteration
    took = ended["time"] - iterations[failed_iteration]["time"]
    assert took < STOP_WITHIN_S, f"the job took {took:.1f} s to stop after the error"
    assert not events(result, "reformed")
    # An own error is no failure of a rank (docs/metrics.md): the job_stopped event names the rank, the summary counts
    # no failure.
    assert not events(result, "rank_failed")
    assert f"launch rank {stopped['launch_rank']} " in reason and stopped["iteration"] is not None
    [summary] = events(result, "job_summary")
    assert summary["failures"] == 0
    assert "no surviving holder" not in result.stderr
    assert leftover_processes(result) == []
    return reason


def test_a_save_that_fails_mid_run_stops_the_job_naming_the_path(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    args = ntp_args(2, 2, iters=SAVE_AT + 2) + ["--set", f"checkpoint.save={ckpt}",
                                                "--set", f"checkpoint.save_interval={SAVE_AT}"]
    result = launch_and_break_save(tmp_path / "run", args, ckpt)
    reason = assert_stopped_naming(result, SAVE_AT, str(ckpt), "FileExistsError", "launch rank 0",
                                   f"iteration {SAVE_AT}", "phase checkpoint")
    assert not events(result, "checkpoint_saved")
    # The rank says it too, in one line, before it exits.
    assert f"error: launch rank 0, iteration {SAVE_AT}, phase checkpoint" in result.stderr, reason


@pytest.mark.parametrize("ntp, async_save", [(True, False), (False, False), (False, True)])
def test_a_write_that_fails_in_megatrons_checkpoint_writer_stops_the_job_naming_it(tmp_path, ntp, async_save):
    """A failed write in Megatron-Core's writer (a full disk, an I/O error) reaches every rank of the save as
    torch's CheckpointException, a BaseException: the job stops naming the rank whose write failed, the save, the
    path and the failure, whichever rank exits first; no rank is taken for lost, and NTP off does not restart
    into it again. An async save (NTP off only) fails where it is finalized, still as the save of iteration 3."""
    ckpt = tmp_path / "ckpt"
    spec = "error:rank=1,iter=3,phase=checkpoint_write"
    args = ntp_args(2, 2, iters=5) + ["--set", f"checkpoint.save={ckpt}", "--set", "checkpoint.save_interval=3",
                                      "--inject-failure", spec]
    if not ntp:
        args += ["--set", "ntp.enabled=false"]
    if async_save:
        args += ["--set", "checkpoint.async_save=true"]
    result = run_job(tmp_path / "run", args)
    named = ["launch rank 1 ", str(ckpt), "iteration 3", "this rank's write failed", "InjectedError", spec]
    if ntp:
        assert_stopped_naming(result, 3, *named)
    else:
        assert result.returncode != 0 and "restarting all" not in result.stderr, result.stderr[-3000:]
        [failed] = events(result, "rank_failed")
        assert failed["launch_rank"] == 1 and failed["iteration"] == 3, failed  # async: finalized in a later one
        for text in named[1:]:
            assert text in failed["cause"], failed
        assert leftover_processes(result) == []
    assert "no replica survives" not in result.stderr and "CheckpointException" not in result.stderr
    assert not events(result, "checkpoint_saved")


@pytest.mark.parametrize("phase", ["optimizer", "backward"])
def test_an_exception_in_a_rank_stops_the_job_naming_it(tmp_path, phase):
    spec = f"error:rank=1,iter=3,phase={phase}"
    result = run_job(tmp_path / "run", ntp_args(2, 2) + ["--inject-failure", spec])
    # optimizer: the iteration was committed (every rank voted) and the others stepped it; backward: never.
    failed_iteration = 3 if phase == "optimizer" else 2
    assert_stopped_naming(result, failed_iteration, "launch rank 1", "InjectedError", spec, f"phase {phase}")
    assert "Traceback" in result.stderr  # an exception of the program (not of the machine): where it came from

