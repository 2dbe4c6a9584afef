"""A lost node: four launchers on this machine (``--nproc-per-node 2``), TP4 × DP2 in scale-up domains of two nodes,
so each replica's TP group spans two nodes (replica 0 on nodes 0 and 1, replica 1 on nodes 2 and 3).

- Node 1's launcher SIGKILLed at iteration 8 (its ranks die with it): node 0 reads its link closed, declares node 1
  lost within a second and loses launch ranks 2 and 3 in one generation; replica 0 re-forms at TP2, replica 1 keeps
  TP4 and its objects; then a replacement launcher for node 1 brings replica 0 back to TP4.
- Node 1's launcher and ranks SIGSTOPped at iteration 8: node 0 declares it lost once it has not heard from it for
  ``ntp.node_timeout_s``; SIGCONT then finds the old launcher fenced: it kills its ranks and exits 1 in one line.

Both finish with the failure-free run's loss (the same job on one launcher), every replica agreeing, the moved bytes
at their bound, and no process left. Timed (how soon a loss is declared): ``scripts/test.sh`` runs it alone.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.harness import TINY, Forked, JobResult, alive, assert_replicas_agree, check_reformations, kill_remaining, \
    read_records, relative_difference, wait_until
from tests.jobs.live.test_multi_node import launch_node, store_port

pytestmark = pytest.mark.timed

ITERS = 36
AT = 8
TOL = 1e-5
NODE_TIMEOUT_S = 3.0
COMMON = [*TINY, "--set", "ntp.enabled=true", "--set", "parallel.tensor_model_parallel_size=4",
          "--set", "parallel.data_parallel_size=2", "--set", f"training.train_iters={ITERS}",
          "--set", "parallel.timeout_s=60", "--set", "ntp.rejoin_after_s=null", "--set", "logging.state_checksums=true",
          "--set", f"ntp.node_timeout_s={NODE_TIMEOUT_S}", "--set", f"ntp.heartbeat_timeout_s={NODE_TIMEOUT_S}"]
NODES = ["--nnodes", "4", "--nproc-per-node", "2", "--nnodes-per-domain", "2"]


@pytest.fixture(scope="module")
def reference(jobs) -> JobResult:
    """The same job on one launcher (8 ranks), no failure."""
    return jobs.run("lost-node-reference", COMMON)


class FourNodes:
    """Four launchers of one job on this machine; node 0's store on a port it picks."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.metrics = run_dir / "metrics.jsonl"
        Forked.ready(5, run_dir.parent)  # a replacement's zygote too: no launcher waits for another's imports
        self.nodes = {0: launch_node(0, run_dir, [*NODES, *COMMON, "--store-port", "0", "--metrics-file",
                                                  str(self.metrics)])}
        self.port = store_port(run_dir, self.nodes[0])
        for n in (1, 2, 3):
            self.nodes[n] = launch_node(n, run_dir, [*NODES, *COMMON, "--store-port", str(self.port)])

    def replace_node_1(self) -> Forked:
        self.nodes["1r"] = Forked.start(["--node-rank", "1", "--run-dir", str(self.run_dir), *NODES, *COMMON,
                                         "--store-port", str(self.port)], self.run_dir / "node1r.stdout",
                                        self.run_dir / "node1r.stderr")
        return self.nodes["1r"]

    def err(self, node) -> str:
        return (self.run_dir / f"node{node}.stderr").read_text(errors="replace")

    def records(self) -> list[dict]:
        return read_records(self.metrics)

    def all_records(self) -> list[dict]:
        """Node 0's records and every other node's ranks' (their state checksums and re-formation records)."""
        return [*self.records(), *(r for n in (1, 2, 3) for r in read_records(self.run_dir / f"metrics.node{n}.jsonl"))]

    def events(self, name: str) -> list[dict]:
        return [r for r in self.records() if r.get("event") == name]

    def rank_pids(self, node: int) -> list[int]:
        history = json.loads((self.run_dir / f"ranks.node{node}.json").read_text())
        return [pid for pids in history.values() for pid in pids]

    def wait_iteration(self, iteration: int, timeout_s: float = 240) -> None:
        wait_until(lambda: any(r.get("kind") == "iteration" and r["iteration"] >= iteration for r in self.records())
                   or self.nodes[0].poll() is not None, timeout_s, f"iteration {iteration}")
        assert self.nodes[0].poll() is None, self.err(0)[-3000:]

    def finish(self, timeout_s: float = 240) -> dict:
        """Every launcher's exit code (the job ends by itself)."""
        deadline = time.monotonic() + timeout_s
        codes = {}
        for name, node in self.nodes.items():
            codes[name] = node.wait(timeout=max(1.0, deadline - time.monotonic()))
        return codes

    def close(self) -> None:
        for node in self.nodes.values():
            if node.poll() is None:
                node.kill()
                node.wait()


def assert_failure_free(nodes: FourNodes, reference: JobResult) -> None:
    """The loss at every iteration is the failure-free run's, every replica agrees after every step, every
    re-formation moved exactly its bound."""
    assert reference.returncode == 0, reference.stderr[-3000:]
    got = {r["iteration"]: r["lm_loss"] for r in nodes.records() if r.get("kind") == "iteration"}
    want = reference.losses()
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1)), sorted(got)
    differing = {i: relative_difference(got[i], want[i]) for i in want
                 if not relative_difference(got[i], want[i]) <= TOL}  # a NaN loss differs too
    assert not differing, f"lm loss differs from the failure-free run at (iteration: relative) {differing}"
    assert_replicas_agree(JobResult(0, "", "", nodes.all_records(), nodes.run_dir), ITERS)
    found = check_reformations(nodes.records(), nodes.run_dir)
    assert found and all(f["moved_bytes"] == f["bound"] for f in found), found


def assert_replica_1_kept_its_objects(nodes: FourNodes, generation: int) -> None:
    """Launch ranks 4..7 (replica 1, nodes 2 and 3) adopted ``generation`` with the model, DDP wrapper and optimizer
    they held: not rebuilt."""
    kept = {r["launch_rank"]: (r["rebuilt"], r["same_model"], r["same_ddp"], r["same_optimizer"])
            for r in nodes.all_records() if r.get("kind") == "reform_rank" and r["generation"] == generation
            and r["replica"] == 1}
    assert kept == {lr: (False, True, True, True) for lr in (4, 5, 6, 7)}, kept


def widths(nodes: FourNodes) -> dict[int, list[int]]:
    return {r["iteration"]: r["tp_per_replica"] for r in nodes.records() if r.get("kind") == "iteration"}


def test_a_killed_node_is_one_failure_and_a_replacement_node_brings_its_replica_back(tmp_path, reference):
    nodes = FourNodes(tmp_path / "run")
    try:
        nodes.wait_iteration(AT)
        old_pids = nodes.rank_pids(1)
        nodes.nodes[1].kill()  # its ranks die with it (the parent-death signal)
        killed = time.time()
        wait_until(lambda: nodes.events("node_lost"), 30, "node 1 declared lost")
        [lost] = nodes.events("node_lost")
        assert (lost["node"], lost["launch_ranks"]) == (1, [2, 3]), lost
        print(f"node 1 declared lost {lost['time'] - killed:.3f} s after the kill")
        assert lost["time"] - killed < 1.0, f"node 1 declared lost {lost['time'] - killed:.2f} s after the kill"
        wait_until(lambda: any(r["generation"] == 1 for r in nodes.events("reformed")), 60, "replica 0 re-formed")
        nodes.replace_node_1()
        wait_until(lambda: any(w == [4, 4] and i > AT for i, w in widths(nodes).items())
                   or nodes.nodes[0].poll() is not None, 240, "replica 0 back at TP4")
        codes = nodes.finish()
    finally:
        nodes.close()
    err0 = nodes.err(0)
    assert codes == {0: 0, 1: -signal.SIGKILL, 2: 0, 3: 0, "1r": 0}, (codes, err0[-3000:], nodes.err("1r")[-3000:])
    said = [line for line in err0.splitlines() if line.startswith("ntp-launch: node 1 lost (")]
    assert said == ["ntp-launch: node 1 lost (its launcher's connection to node 0 closed): launch ranks 2..3"], said
    published = {r["generation"]: r for r in nodes.events("generation_published")}
    assert sorted(published[1]["dead_ranks"]) == [2, 3] and published[1]["base"] == 0  # one generation for both
    by_iteration = widths(nodes)  # TP4 × 2, then replica 0 at TP2 (the redone iteration at least), then TP4 again
    order = [w for i, w in sorted(by_iteration.items()) if i == 1 or w != by_iteration[i - 1]]
    assert order == [[4, 4], [2, 4], [4, 4]], by_iteration
    assert sorted(map(tuple, published[2]["joined"])) == [(0, 2), (0, 3)], published[2]  # back in one generation
    assert "ntp-launch: node 1 was lost before this launcher started: its launch ranks 2, 3 start as replacements" \
        in nodes.err("1r")
    assert_replica_1_kept_its_objects(nodes, 1)
    assert_failure_free(nodes, reference)
    assert alive(old_pids + [pid for n in (0, 1, 2, 3) for pid in nodes.rank_pids(n)]) == []


def test_a_stopped_node_is_lost_after_the_node_timeout_and_fenced_when_it_resumes(tmp_path, reference):
    nodes = FourNodes(tmp_path / "run")
    try:
        nodes.wait_iteration(AT)
        launcher, ranks = nodes.nodes[1], nodes.rank_pids(1)
        os.killpg(launcher.pid, signal.SIGSTOP)  # the host stops: its launcher (with its fork server) and ranks
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(lambda: "ntp-launch: node 1 lost (" in nodes.err(0), 60, "node 1 declared lost")
        took = time.monotonic() - stopped
        wait_until(lambda: any(r["generation"] == 1 for r in nodes.events("reformed")), 60, "replica 0 re-formed")
        for pid in ranks:  # the ranks first: the worst case, they run before their launcher fences them
            os.kill(pid, signal.SIGCONT)
        os.killpg(launcher.pid, signal.SIGCONT)
        resumed = time.monotonic()
        old_code = launcher.wait(timeout=30)
        fenced_in = time.monotonic() - resumed
        codes = nodes.finish()
    finally:
        for pid in nodes.rank_pids(1):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        nodes.close()
    print(f"node 1 declared lost {took:.2f} s after it stopped; the resumed launcher exited {fenced_in:.2f} s after "
          "SIGCONT")
    err0, err1 = nodes.err(0), nodes.err(1)
    assert codes == {0: 0, 1: 1, 2: 0, 3: 0}, (codes, err0[-3000:], err1[-3000:])
    # Declared lost once node 0 had not heard from it for the timeout (its last beat came up to a quarter of it
    # before the stop), plus a loaded machine's delay.
    assert NODE_TIMEOUT_S * 0.7 < took < NODE_TIMEOUT_S + 5.0, took
    [lost] = nodes.events("node_lost")
    assert lost["launch_ranks"] == [2, 3] and "has not heard from its launcher" in lost["reason"], lost
    said = [line for line in err1.splitlines() if line.startswith("ntp-launch: ")]
    assert said[-1].startswith("ntp-launch: node 1 was declared lost by node 0 (node 0 has not heard from its "
                               "launcher for ") and said[-1].endswith(
        "and the job went on without its launch ranks 2..3: killing this node's ranks"), said[-3:]
    assert sum("was declared lost" in line for line in said) == 1 and old_code == 1
    assert fenced_in < 10.0, fenced_in
    assert widths(nodes)[ITERS] == [2, 4]
    assert_replica_1_kept_its_objects(nodes, 1)
    assert_failure_free(nodes, reference)
    assert alive(ranks + [pid for n in (0, 2, 3) for pid in nodes.rank_pids(n)]) == []


def test_without_ntp_a_lost_node_ends_the_job_naming_it(tmp_path):
    """NTP off, TP2 × DP2 on two launchers: node 1's launcher SIGKILLed at iteration 2. Node 0 says the node is lost,
    node 0 stops the job naming one of its ranks and exits 1, and no process is left."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    args = ["--nnodes", "2", *TINY, "--set", "parallel.tensor_model_parallel_size=2",
            "--set", "parallel.data_parallel_size=2", "--set", "training.train_iters=400",
            "--set", "parallel.timeout_s=60"]
    Forked.ready(2, run_dir.parent)
    nodes = [launch_node(0, run_dir, [*args, "--store-port", "0", "--metrics-file", str(metrics)])]
    try:
        nodes.append(launch_node(1, run_dir, [*args, "--store-port", str(store_port(run_dir, nodes[0]))]))
        wait_until(lambda: any(r.get("kind") == "iteration" for r in read_records(metrics))
                   or nodes[0].poll() is not None, 240, "node 0's first iteration")
        pids = [pid for node in (0, 1) for history in json.loads((run_dir / f"ranks.node{node}.json").read_text())
                .values() for pid in history]
        nodes[1].kill()
        code = nodes[0].wait(timeout=60)
    finally:
        kill_remaining(nodes)
    err0 = (run_dir / "node0.stderr").read_text()
    assert code == 1, err0[-3000:]
    said = [line for line in err0.splitlines() if line.startswith("ntp-launch: ")]
    assert "ntp-launch: node 1 lost (its launcher's connection to node 0 closed): launch ranks 2..3" in said, said
    [failed] = [r for r in read_records(metrics) if r.get("event") == "rank_failed"]
    assert failed["launch_rank"] in (2, 3) and "was lost with node 1" in failed["cause"], failed
    assert alive(pids) == []
