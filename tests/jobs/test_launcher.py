"""Launcher: a failing rank is reported by rank and cause, and no process of the job is left behind."""

from __future__ import annotations

import json
import re

import psutil
import pytest

from tests.harness import layout_args, run_job


def job_processes(run_dir) -> list[int]:
    """Rank processes of the job in ``run_dir`` (pids the launcher recorded) that still exist."""
    pids = json.loads((run_dir / "ranks.node0.json").read_text())
    assert len(pids) == 4
    alive = []
    for rank, pid in ((rank, pid) for rank, history in pids.items() for pid in history):
        try:
            if psutil.Process(pid).name() == f"ntp-rank{rank}" and psutil.Process(pid).status() != "zombie":
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.mark.parametrize(
    "spec, cause",
    [("exit:rank=2,iter=3,code=7", r"rank 2 \(pid \d+\) exited with code 7"),
     ("kill:rank=1,iter=2", r"rank 1 \(pid \d+\) was killed by signal SIGKILL")],
    ids=["exit-code", "sigkill"],
)
def test_failed_rank_is_reported_and_nothing_is_left(tmp_path, spec, cause):
    run_dir = tmp_path / "run"
    result = run_job(run_dir, layout_args(2, 2, 20) + ["--inject-failure", spec], timeout=240)
    assert result.returncode == 1
    failed = result.events("rank_failed")
    assert len(failed) == 1
    rank = int(spec.split("rank=")[1].split(",")[0])
    assert failed[0]["launch_rank"] == rank
    lines = [l for l in result.stderr.splitlines() if l.startswith("ntp-launch: rank ")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert re.fullmatch("ntp-launch: " + cause, lines[0]), lines[0]
    assert "ntp-launch: all ranks stopped" in result.stderr
    assert job_processes(run_dir) == []
    # The job was really running before the failure.
    assert result.losses(), "no iteration completed before the injected failure"


def test_rank_output_is_prefixed(tmp_path):
    result = run_job(tmp_path / "run", layout_args(1, 2, 2))
    assert result.returncode == 0, result.stderr[-3000:]
    iteration_lines = [l for l in result.stdout.splitlines() if " iteration " in l]
    assert iteration_lines and all(l.startswith("[rank 0] ") for l in iteration_lines)
    assert "tp per replica: [1, 1]" in iteration_lines[-1]
