"""Launcher: a failing rank is reported by rank and cause, and no process of the job is left behind — not after a
failure, not after SIGTERM (exit 143), not after the launcher itself is SIGKILLed while a replacement boots; and
failures injected at random times count from the first iteration."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from ntp_megatron import faults
from tests.harness import Forked, layout_args, run_job
from tests.jobs.live.test_live_failure import ntp_args


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


def test_rank_output_is_prefixed(jobs):
    # The TP1 x DP2 run of tests/jobs/equivalence/test_equivalence.py (the session runs it once): any healthy job prints so.
    result = jobs.run("tp1dp2", layout_args(1, 2, 10))
    assert result.returncode == 0, result.stderr[-3000:]
    iteration_lines = [l for l in result.stdout.splitlines() if " iteration " in l]
    assert iteration_lines and all(l.startswith("[rank 0] ") for l in iteration_lines)
    assert "tp per replica: [1, 1]" in iteration_lines[-1]
def _launch(run_dir: Path, args: list[str]) -> Forked:
    """``ntp-launch`` as a process of its own (so the test can signal it; forked from a zygote of its own), output
    to files in ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return Forked.start(["--run-dir", str(run_dir), *args], run_dir / "launcher.stdout", run_dir / "launcher.stderr")


def _wait_for_line(proc: Forked, path: Path, pattern: str, timeout: float) -> re.Match:
    """The first line of ``path`` matching ``pattern``, once it is written (bounded; fails if ``proc`` ends)."""
    deadline = time.monotonic() + timeout
    while True:
        for line in path.read_text(errors="replace").splitlines():
            found = re.search(pattern, line)
            if found:
                return found
        assert proc.poll() is None, f"the launcher ended ({proc.returncode}):\n{path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no line matching {pattern!r} within {timeout} s"
        time.sleep(0.05)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_launcher_killed_while_a_replacement_boots_leaves_no_process(tmp_path):
    """SIGKILL of the launcher alone (as the OOM killer or a scheduler would) while a replacement process for a
    failed rank is still booting: every process it started dies with it, the replacement included."""
    run_dir = tmp_path / "run"
    args = ntp_args(2, 2, iters=100000, extra=("--set", "ntp.rejoin_after_s=0")) + [
        "--inject-failure", "kill:rank=3,iter=3,phase=backward"]
    launcher = _launch(run_dir, args)
    started: list[psutil.Process] = []
    try:
        found = _wait_for_line(launcher, run_dir / "launcher.stderr",
                               r"ntp-launch: starting a replacement for launch rank 3 \(pid (\d+)", timeout=240)
        replacement = psutil.Process(int(found.group(1)))
        started = psutil.Process(launcher.pid).children(recursive=True)
        assert replacement in started
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _alive(started)
        assert left == [], [(p.pid, p.name()) for p in left]
    finally:
        for p in _alive(started):  # a broken build leaves them
            p.kill()
        if launcher.poll() is None:
            launcher.kill()


def test_sigterm_stops_the_job_with_exit_143(tmp_path):
    run_dir = tmp_path / "run"
    launcher = _launch(run_dir, layout_args(2, 2, 100000))
    try:
        _wait_for_line(launcher, run_dir / "launcher.stdout", r"\[rank 0\] .* iteration ", timeout=240)
        started = psutil.Process(launcher.pid).children(recursive=True)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 143
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "ntp-launch: interrupted (SIGTERM): stopping all ranks" in (run_dir / "launcher.stderr").read_text()
    assert _alive(started) == []


def test_random_failures_are_spaced_as_drawn_from_the_first_iteration(tmp_path):
    """``random:`` draws its failure times from the first iteration on: none during start-up, each at its drawn
    offset from there (the launcher's poll and the relay of the first iteration's record take milliseconds)."""
    spec = "random:mtbf=1.5,seed=10,max=2"
    drawn, victims, live = [], [], [0, 1, 2, 3]
    for offset, rng in faults.parse_failure_spec(spec).schedule():  # as the launcher draws them
        drawn.append(offset)
        victims.append(rng.choice(live))
        live.remove(victims[-1])
    assert victims == [3, 0]  # replica 1 slot 1 at 1.27 s, replica 0 slot 0 at 2.26 s: both blocks keep a holder
    result = run_job(tmp_path / "run", ntp_args(2, 2, iters=60) + ["--inject-failure", spec])
    assert result.returncode == 0, result.stderr[-3000:]
    first = min(r["time"] for r in result.records if r.get("kind") == "iteration")
    failed = result.events("rank_failed")
    assert [e["launch_rank"] for e in failed] == victims
    offsets = [e["time"] - first for e in failed]
    assert all(abs(got - want) < 0.5 for got, want in zip(offsets, drawn)), (offsets, drawn)
    assert abs((offsets[1] - offsets[0]) - (drawn[1] - drawn[0])) < 0.5, (offsets, drawn)
