"""A healthy replica does not pay for a degraded one: its ranks issue the same torch.distributed calls with the same
payload bytes, iteration by iteration (``logging.comm_stats``), whether the other replica is healthy, degraded
from the start, or degraded by a live failure in the middle of the run (before, during and after its
re-formation)."""

from __future__ import annotations

import pytest

from tests.harness import TINY, JobResult, assert_ok

ITERS = 4


def args(*extra: str) -> list[str]:
    return [*TINY, "--set", "ntp.enabled=true", "--set", "parallel.tensor_model_parallel_size=2",
            "--set", "parallel.data_parallel_size=2", "--set", f"training.train_iters={ITERS}",
            "--set", "logging.comm_stats=true", "--set", "parallel.timeout_s=60", *extra]


def replica0_comm(result: JobResult) -> dict[tuple[int, int], dict]:
    """(iteration, TP rank) -> that rank's calls and payload bytes by function, for replica 0."""
    assert_ok(result)
    out = {}
    for r in result.records:
        if r.get("kind") == "comm_stats" and r["replica"] == 0:
            key = (r["iteration"], r["tp_rank"])
            assert key not in out, f"iteration {key[0]}, TP rank {key[1]}: two comm_stats records"
            out[key] = {"calls": r["calls"], "bytes": r["bytes"]}
    assert set(out) == {(i, t) for i in range(1, ITERS + 1) for t in (0, 1)}, sorted(out)
    return out


@pytest.fixture(scope="module")
def healthy(jobs) -> dict:
    return replica0_comm(jobs.run("comm-healthy", args()))


@pytest.mark.parametrize("other", ["degraded from the start", "degraded by a kill in iteration 3"])
def test_healthy_replica_issues_the_same_collectives_and_bytes(jobs, healthy, other):
    extra = {"degraded from the start": ("--set", "ntp.dead_slots=[1:1]"),
             "degraded by a kill in iteration 3": ("--inject-failure", "kill:rank=3,iter=3,phase=backward")}[other]
    result = jobs.run(f"comm-{other.split()[-1]}", args(*extra))
    degraded = replica0_comm(result)
    widths = {r["iteration"]: r["tp_per_replica"] for r in result.records if r.get("kind") == "iteration"}
    assert widths[ITERS] == [2, 1]
    assert any(healthy[key]["calls"] for key in healthy)  # something to compare: the gradient all-reduces
    for key in sorted(healthy):
        assert degraded[key] == healthy[key], (
            f"iteration {key[0]}, replica 0 TP rank {key[1]} ({other}): {degraded[key]} instead of {healthy[key]}")
