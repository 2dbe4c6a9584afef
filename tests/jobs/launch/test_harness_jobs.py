"""The suite's job runner (``tests/harness/``) with real jobs: a job that outlives its timeout, or a test
interrupted while its job runs (pytest-timeout raises inside the test), leaves no process behind, and the
zygote runs the next job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

import psutil
import pytest

from tests.harness import assert_ok, layout_args, read_records, run_job, wait_until

FOREVER = layout_args(1, 2, 100000)


class Interrupted(Exception):
    pass


def _gone(run_dir) -> None:
    """Every rank process the job started is gone (within 10 s: SIGKILL, then the reaping)."""
    pids = [pid for history in json.loads((run_dir / "ranks.node0.json").read_text()).values() for pid in history]
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def test_an_interrupted_job_is_killed_whole_and_the_next_job_runs(tmp_path):
    run_dir = tmp_path / "interrupted"

    def interrupt_once_it_trains() -> None:
        wait_until(lambda: any(r.get("kind") == "iteration" for r in read_records(run_dir / "metrics.jsonl")),
                   120, "the job's first iteration", poll_s=0.1)
        os.kill(os.getpid(), signal.SIGUSR1)

    def raise_interrupted(signum, frame):
        raise Interrupted()

    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    try:
        thread = threading.Thread(target=interrupt_once_it_trains, daemon=True)
        thread.start()
        with pytest.raises(Interrupted):
            run_job(run_dir, FOREVER)
        thread.join(timeout=5)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    _gone(run_dir)
    with pytest.raises(subprocess.TimeoutExpired):
        run_job(tmp_path / "timed-out", FOREVER, timeout=1)
    if (tmp_path / "timed-out" / "ranks.node0.json").exists():
        _gone(tmp_path / "timed-out")
    assert_ok(run_job(tmp_path / "next", layout_args(1, 1, 2)))
