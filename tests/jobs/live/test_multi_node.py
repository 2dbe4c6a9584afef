"""Two launchers on one host, as docs/usage.md describes multi-node runs: a failure on either node is reported by
every node as the rank that failed (not a rank that stopped because of it), node 0's metrics file records it,
and a node that never comes is named in one line. Node 0's store takes a port of its own choosing
(``--store-port 0``) and node 0 says which; node 1 starts once it has."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.harness import TINY, Forked, run_module

JOB = ["--nnodes", "2", "--tensor-model-parallel-size", "2", "--data-parallel-size", "2", "--train-iters", "3",
       *TINY[:6], "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "1"]


def store_port(run_dir: Path, node0: Forked, timeout: float = 240) -> int:
    """The port node 0's store took (``--store-port 0``), once node 0 wrote it to ``run_dir/store.json``."""
    path = run_dir / "store.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert node0.poll() is None, f"node 0 ended ({node0.returncode}) before its store was up"
        assert time.monotonic() < deadline, f"node 0 wrote no {path} within {timeout} s"
        time.sleep(0.05)
    return json.loads(path.read_text())["port"]


def launch_node(node: int, run_dir: Path, args: list[str]) -> Forked:
    """One node's ``ntp-launch`` (a process of its own, forked from a zygote of its own; output to
    ``node<n>.stdout/.stderr`` in ``run_dir``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return Forked.start(["--node-rank", str(node), "--run-dir", str(run_dir), *args], run_dir / f"node{node}.stdout",
                        run_dir / f"node{node}.stderr")


def _two_nodes(tmp_path: Path, extra: list[str]) -> tuple[tuple[int, str], tuple[int, str], list[dict]]:
    """Node 0 as a process of its own on a port its store picks, node 1 from the test zygote once node 0 says which;
    (exit code, stderr) of each, node 0's records."""
    run_dir = tmp_path / "run"
    # The zygotes' own starts (their imports) must not count against node 0's wait for node 1: they are up first.
    assert run_module("ntp_megatron.launch.launcher", ["--help"], tmp_path / "zygote")[0] == 0
    Forked.ready(1, tmp_path)
    node0 = launch_node(0, run_dir, [*JOB, "--store-port", "0", *extra])
    try:
        port = store_port(run_dir, node0)
        node1 = run_module("ntp_megatron.launch.launcher", ["--node-rank", "1", "--store-port", str(port),
                                                     "--run-dir", str(run_dir), *JOB, *extra],
                           tmp_path / "node1", timeout=240)
        node0.wait(timeout=120)
    finally:
        if node0.poll() is None:
            node0.kill()
            node0.wait()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (node0.returncode, (run_dir / "node0.stderr").read_text()), node1, records


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
    code, err = run_module("ntp_megatron.launch.launcher", [*JOB, "--node-rank", "0", "--store-port", "0",
                                                     "--run-dir", str(tmp_path / "run"), "--set", "parallel.timeout_s=5"],
                           tmp_path / "node0", timeout=120)
    assert code == 1
    port = json.loads((tmp_path / "run" / "store.json").read_text())["port"]
    assert f"ntp-launch: node 0 of 2: store at 127.0.0.1:{port} " in err
    assert f"ntp-launch: waiting for node 1 of 2 at 127.0.0.1:{port}" in err
    assert f"ntp-launch: node 1 of 2 did not join within 4 s: start ntp-launch with the same config and --nnodes 2 " \
           f"--node-rank 1" in err
    assert "Traceback" not in err and "frame #" not in err, err
