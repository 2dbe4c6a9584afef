"""The two-level control plane in a real job: two launchers on one host (node 0 hosts the root store and the
controller; node 1 hosts its node's store and a relay, :mod:`ntp_megatron.elastic.relay`). Node 1's ranks vote,
beat and wait for generations in their node's store; kills on both nodes, in every phase of an iteration, are
absorbed with the failure-free loss, as on one node.

Asserted: the run completes with the lm loss of the same job on one node without a failure (relative 1e-5, every
iteration, the redone ones included); node 1's launcher says it hosts the node's store; node 1's ranks hold two
connections to the root store (their control client and their generation's own, which torch's rendezvous needs) and
three to their node's (votes, heartbeat, watchdog), node 0's none to another store; no process is left behind.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.harness import TINY, Forked, alive, kill_remaining, read_records, relative_difference, wait_until
from tests.jobs.live.test_multi_node import launch_node, store_port

ITERS = 9
TOL = 1e-5
COMMON = [*TINY, "--set", "ntp.enabled=true", "--set", "parallel.tensor_model_parallel_size=2",
          "--set", "parallel.data_parallel_size=2", "--set", f"training.train_iters={ITERS}",
          "--set", "parallel.timeout_s=60", "--set", "ntp.rejoin_after_s=null"]


@pytest.fixture(scope="module")
def reference(jobs):
    """The same job on one node, no failure."""
    return jobs.run("two-level-reference", COMMON)


def two_nodes(run_dir: Path, failures: list[str], timeout: float = 300,
              extra: tuple[str, ...] = ()) -> tuple[list[int], list[dict], list[str]]:
    """The job on two launchers (``--nnodes 2``), node 0's store on a port it picks: exit codes, node 0's records, each
    node's stderr."""
    metrics = run_dir / "metrics.jsonl"
    args = ["--nnodes", "2", *COMMON, *extra, *[a for f in failures for a in ("--inject-failure", f)]]
    Forked.ready(2, run_dir.parent)
    nodes = [launch_node(0, run_dir, [*args, "--store-port", "0", "--metrics-file", str(metrics)])]
    try:
        nodes.append(launch_node(1, run_dir, [*args, "--store-port", str(store_port(run_dir, nodes[0]))]))
        deadline = time.monotonic() + timeout
        while any(n.poll() is None for n in nodes):
            assert time.monotonic() < deadline, f"the job did not end within {timeout} s"
            time.sleep(0.1)  # the poll of two processes the test does not own the exits of
    finally:
        kill_remaining(nodes)
    return [n.returncode for n in nodes], read_records(metrics), [(run_dir / f"node{i}.stderr").read_text()
                                                                   for i in (0, 1)]


def node_records(run_dir: Path, node: int) -> list[dict]:
    """The records of node ``node``'s ranks (node 0's in the metrics file, another node's beside it)."""
    return read_records(run_dir / ("metrics.jsonl" if node == 0 else f"metrics.node{node}.jsonl"))


@pytest.mark.parametrize("failures", [
    ["kill:rank=3,iter=3,phase=grad_sync", "kill:rank=0,iter=6,phase=forward"],
    ["kill:rank=2,iter=2,phase=backward", "kill:rank=1,iter=5,phase=optimizer"],
    ["kill:rank=0,iter=4,phase=forward", "kill:rank=3,iter=4,phase=reform"],
], ids=["node1-grad_sync-then-node0-forward", "node1-backward-then-node0-optimizer",
        "node0-forward-then-node1-in-the-re-formation"])
def test_kills_on_both_nodes_with_node_stores(tmp_path, reference, failures):
    run_dir = tmp_path / "run"
    codes, records, (err0, err1) = two_nodes(run_dir, failures)
    assert codes == [0, 0], (err0[-3000:], err1[-3000:])
    assert "its ranks vote, beat and wait in the node's store on port" in err1, err1[-2000:]
    assert "node's store" not in err0
    got = {r["iteration"]: r["lm_loss"] for r in records if r.get("kind") == "iteration"}
    want = reference.losses()
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    differing = {i: relative_difference(got[i], want[i]) for i in want
                 if not relative_difference(got[i], want[i]) <= TOL}  # a NaN loss differs too
    assert not differing, f"lm loss differs from the failure-free run at (iteration: relative) {differing}"
    widths = {r["iteration"]: r["tp_per_replica"] for r in records if r.get("kind") == "iteration"}
    assert widths[ITERS] == [1, 1]  # each replica lost a rank: both re-formed
    for node, want_connections in ((0, {"root_connections"}), (1, {"root_connections", "node_connections"})):
        resources = [r for r in node_records(run_dir, node) if r.get("kind") == "resources"]
        assert resources, f"node {node} printed no resources record"
        for r in resources:
            assert want_connections <= r.keys() and "node_connections" not in r.keys() - want_connections, r
            if node == 1:
                assert (r["root_connections"], r["node_connections"]) == (2, 3), r
    pids = [pid for node in (0, 1) for history in json.loads((run_dir / f"ranks.node{node}.json").read_text()).values()
            for pid in history]
    assert alive(pids) == []


def test_a_stop_reaches_both_nodes(tmp_path):
    """A failure NTP may not absorb (``ntp.on_unrecoverable: stop``, replica 1 would fall below ``ntp.min_tp``):
    node 0's controller stops the job, both launchers end non-zero within seconds, naming the failure, and no
    process is left. (Node 1's launcher reads the stop from the root and stops its ranks, which may read it from their
    node's store first: that copy is test_relay's.)"""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    codes, records, (err0, err1) = two_nodes(run_dir, ["kill:rank=3,iter=3,phase=backward"],
                                             extra=["--set", "ntp.min_tp=2", "--set", "ntp.on_unrecoverable=stop"])
    assert codes[0] != 0 and codes[1] != 0, (err0[-3000:], err1[-3000:])
    assert time.monotonic() - started < 120
    assert "NTP cannot absorb the failure" in err0, err0[-3000:]
    assert [r["reason"] for r in records if r.get("event") == "job_stopped"], records[-5:]
    pids = [pid for node in (0, 1) for history in json.loads((run_dir / f"ranks.node{node}.json").read_text()).values()
            for pid in history]
    assert alive(pids) == []


def test_a_rank_spinning_on_node_1_is_fenced_by_its_own_launcher(tmp_path, reference):
    """TP1 x DP2, one rank per node: launch rank 1 (node 1) spins in the gradient sync with its heartbeat alive, and
    the only rank that waits on it is launch rank 0, on node 0. Node 0's launcher publishes that wait in the root
    store; node 1's launcher, and only it, fences rank 1 by name; replica 1 is dropped (it had no other rank), replica
    0 trains on with the whole global batch, and the loss is the failure-free run's."""
    run_dir = tmp_path / "run"
    codes, records, (err0, err1) = two_nodes(run_dir, ["spin:rank=1,iter=4,phase=grad_sync"],
                                             extra=("--set", "parallel.tensor_model_parallel_size=1"))
    assert codes == [0, 0], (err0[-3000:], err1[-3000:])
    got = {r["iteration"]: r["lm_loss"] for r in records if r.get("kind") == "iteration"}
    want = reference.losses()
    assert sorted(got) == list(range(1, ITERS + 1))
    assert all(relative_difference(got[i], want[i]) <= TOL for i in want), (got, want)
    [failed] = [r for r in records if r.get("event") == "rank_failed"]
    assert failed["launch_rank"] == 1 and "while launch rank 0 has waited" in failed["cause"], failed
    assert "launch rank 1 (pid" in err1 and "stopped responding" in err1 and "stopped responding" not in err0


NODE_TIMEOUT_S = 5.0


def test_a_node_that_loses_node_0_says_so_once_and_exits_1(tmp_path):
    """Node 0's launcher (the root store, the controller) is SIGKILLed while the job trains: node 1's ranks cannot go
    on. Node 1's launcher says so in one line once node 0 has not answered for ``ntp.node_timeout_s``, stops its ranks
    and exits 1 — not 0 ("all 0 ranks finished", once its ranks had failed on the missing generation) — with the C++
    stacks of its ranks' store warnings left out, and leaves no process."""
    run_dir = tmp_path / "run"
    args = ["--nnodes", "2", *COMMON, "--set", "training.train_iters=400",
            "--set", f"ntp.heartbeat_timeout_s={NODE_TIMEOUT_S}", "--set", f"ntp.node_timeout_s={NODE_TIMEOUT_S}"]
    Forked.ready(2, run_dir.parent)
    nodes = [launch_node(0, run_dir, [*args, "--store-port", "0"])]
    try:
        nodes.append(launch_node(1, run_dir, [*args, "--store-port", str(store_port(run_dir, nodes[0]))]))
        wait_until(lambda: " iteration        2/" in (run_dir / "node0.stdout").read_text(errors="replace"), 240,
                   "node 0's second iteration")
        nodes[0].kill()
        killed = time.monotonic()
        code = nodes[1].wait(timeout=NODE_TIMEOUT_S + 60)
        took = time.monotonic() - killed
    finally:
        kill_remaining(nodes)
    err = (run_dir / "node1.stderr").read_text()
    said = [line for line in err.splitlines() if line.startswith("ntp-launch: ")]
    assert code == 1, err[-3000:]
    assert said[-1].startswith(f"ntp-launch: node 0 is lost: its store at 127.0.0.1:") and said[-1].endswith(
        f"has not answered for {NODE_TIMEOUT_S:.0f} s (ntp.node_timeout_s {NODE_TIMEOUT_S:g}); stopping this node's "
        "ranks"), said
    assert sum("node 0 is lost" in line for line in said) == 1
    # Within the timeout, plus stopping the ranks and the launcher's own teardown on this loaded machine.
    assert NODE_TIMEOUT_S - 1.0 < took < NODE_TIMEOUT_S + 15.0, took
    # Node 1's own store clients fail a few times with a C++ stack each (bounded: no call reaches them while node 0 is
    # silent); its ranks' warnings come without theirs. It wrote 4.7 MB in two minutes before.
    assert "Traceback" not in err and len(err) < 20_000, err[-3000:]
    assert not [line for line in err.splitlines() if line.startswith("[rank") and "frame #" in line]
    pids = [pid for history in json.loads((run_dir / "ranks.node1.json").read_text()).values() for pid in history]
    assert alive(pids) == []
