"""Two launchers on one host, as the README describes multi-node runs: a failure on either node is reported by
every node as the rank that failed (not a rank that stopped because of it), node 0's metrics file records it,
and a node that never comes is named in one line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, TINY, run_module

JOB = ["--nnodes", "2", "--tensor-model-parallel-size", "2", "--data-parallel-size", "2", "--train-iters", "3",
       *TINY[:6], "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "1"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path: Path, extra: list[str]) -> tuple[tuple[int, str], tuple[int, str], list[dict]]:
    """Node 1 as its own process, node 0 from the test zygote; (exit code, stderr) of each, node 0's records."""
    args = [*JOB, "--store-port", str(_port()), "--run-dir", str(tmp_path / "run"), *extra]
    node1 = subprocess.Popen([sys.executable, "-m", "ntp_megatron.launcher", "--node-rank", "1", *args], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = node1.stderr.readline()  # node 1 has started (imports done) and waits for node 0's store
        assert first.startswith("ntp-launch: waiting for node 0 of 2 at 127.0.0.1:"), first
        node0 = run_module("ntp_megatron.launcher", ["--node-rank", "0", *args], tmp_path / "node0", timeout=240)
        _, err1 = node1.communicate(timeout=120)
        err1 = first + err1
    finally:
        node1.kill()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return node0, (node1.returncode, err1), records


@pytest.mark.parametrize("action, failed_rank, cause", [
    ("kill", 3, "was killed by signal SIGKILL"),
    ("kill", 0, "was killed by signal SIGKILL"),
    ("hang", 1, "is stopped (hung): its peers' collectives timed out"),
])
def test_every_node_names_the_rank_that_failed(tmp_path, action, failed_rank, cause):
    """NTP off: the failed rank's peers on both nodes stop (at once after a kill, at the collective timeout after a
    hang); whichever deaths a launcher sees first, it names the failed rank, the other node says another node
    aborted the job, and nobody prints a traceback or a C++ stack."""
    (code0, err0), (code1, err1), records = _two_nodes(
        tmp_path, ["--set", "ntp.enabled=false", "--set", "parallel.timeout_s=6",
                   "--inject-failure", f"{action}:rank={failed_rank},iter=2"])
    assert code0 == code1 == 1, (err0, err1)
    own, other = (err0, err1) if failed_rank < 2 else (err1, err0)
    assert f"ntp-launch: rank {failed_rank} (pid " in own and cause in own, own
    assert f"ntp-launch: another node aborted the job: rank {failed_rank} (pid " in other and cause in other, other
    for err in (err0, err1):
        assert "Traceback" not in err and "frame #" not in err, err
    failed = [r for r in records if r.get("event") == "rank_failed"]
    assert [(r["launch_rank"], r["iteration"], r["cause"]) for r in failed] == [(failed_rank, 2, cause)]


def test_a_node_that_never_comes_is_named_in_one_line(tmp_path):
    port = _port()
    code, err = run_module("ntp_megatron.launcher", [*JOB, "--node-rank", "0", "--store-port", str(port),
                                                     "--run-dir", str(tmp_path / "run"), "--set", "parallel.timeout_s=5"],
                           tmp_path / "node0", timeout=120)
    assert code == 1
    assert f"ntp-launch: waiting for node 1 of 2 at 127.0.0.1:{port}" in err
    assert f"ntp-launch: node 1 of 2 did not join within 4 s: start ntp-launch with the same config and --nnodes 2 " \
           f"--node-rank 1" in err
    assert "Traceback" not in err and "frame #" not in err, err
