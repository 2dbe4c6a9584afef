"""Two launchers on one host: NTP with a dead slot, a kill on node 1 absorbed, its replacement started on node 1
and admitted (the placement math itself is in ``tests/unit/plan/test_placement.py``)."""

from __future__ import annotations

import json
import signal
import time

from tests.harness import TINY, Forked
from tests.jobs.live.test_multi_node import launch_node, store_port


def test_two_launchers_on_one_host_with_a_dead_slot_and_a_rejoin(tmp_path):
    """Two nodes on one host (one launcher each, one store): TP2 × DP2 with slot 1 of replica 0 dead. Node 0 runs
    launch rank 0 alone (its device 1 idle), node 1 runs replica 1's two ranks. Launch rank 2 (node 1) is killed;
    node 1's launcher starts its replacement, node 0's controller admits it, and replica 1 trains at TP2 again.
    The run is long; once it trains rejoined, Ctrl-C stops both nodes (no wait on a replacement's boot time)."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    common = ["--nnodes", "2", *TINY,
              "--set", "ntp.enabled=true", "--set", "parallel.tensor_model_parallel_size=2",
              "--set", "parallel.data_parallel_size=2", "--set", "ntp.dead_slots=[0:1]",
              "--set", "training.train_iters=100000", "--set", "ntp.rejoin_after_s=0", "--set", "parallel.timeout_s=60",
              "--inject-failure", "kill:rank=2,iter=3,phase=backward"]
    Forked.ready(2, tmp_path)  # the nodes' zygotes are up first: node 0's wait for node 1 counts no import
    nodes = [launch_node(0, run_dir, [*common, "--store-port", "0", "--metrics-file", str(metrics)])]
    try:
        nodes.append(launch_node(1, run_dir, [*common, "--store-port", str(store_port(run_dir, nodes[0]))]))
        deadline = time.monotonic() + 240
        records: list[dict] = []
        while not any(r.get("kind") == "iteration" and r["generation"] == 2 for r in records):
            assert time.monotonic() < deadline, "replica 1 did not train rejoined within 240 s"
            assert all(n.poll() is None for n in nodes), (run_dir / "node0.stderr").read_text()[-3000:]
            time.sleep(0.1)  # the poll of a file another process appends to
            if metrics.exists():
                records = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.send_signal(signal.SIGINT)
        codes = [n.wait(timeout=60) for n in nodes]
    assert codes == [130, 130]
    err0, err1 = ((run_dir / f"node{n}.stderr").read_text() for n in (0, 1))
    assert json.loads((run_dir / "ranks.node0.json").read_text()).keys() == {"0"}
    pids1 = json.loads((run_dir / "ranks.node1.json").read_text())
    assert pids1.keys() == {"1", "2"} and len(pids1["2"]) == 2, pids1  # the replacement started on node 1
    assert "ntp-launch: started ranks 0 of 3 on node 0, devices 0 (device 1 idle)" in err0
    assert "ntp-launch: started ranks 1..2 of 3 on node 1, devices 0..1 " in err1
    assert "ntp-launch: starting a replacement for launch rank 2" in err1
    assert "ntp-launch: admitting launch rank 2 (replica 1, slot 1)" in err0
    widths = [(r["iteration"], r["generation"], r["tp_per_replica"]) for r in records if r.get("kind") == "iteration"]
    assert widths[0] == (1, 0, [1, 2])
    assert {(g, tuple(w)) for _, g, w in widths} == {(0, (1, 2)), (1, (1, 1)), (2, (1, 2))}
    assert [i for i, _, _ in widths] == sorted({i for i, _, _ in widths})  # the failed iteration redone once
