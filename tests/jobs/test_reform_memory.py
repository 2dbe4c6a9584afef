"""What a rank holds while its replica re-forms after a live failure, from the ``memory`` records of a real job
(:mod:`ntp_megatron.training.memory`): TP3 x 2, the last rank of replica 1 killed, so replica 1 re-forms at TP2
with one proxy (the sync-group member of the dead slot's block too) and one survivor.

Every record's measured state equals the plan (:mod:`ntp_megatron.memory_plan`); the old gradient buffers were
freed before the new objects were built; and every rank's peak while re-forming stays within 1.5x the state it
holds at steady state in the new generation."""

from __future__ import annotations

from collections import defaultdict

from tests.harness import TINY, assert_ok, run_job

PEAK_OVER_STEADY = 1.5


def test_a_re_forming_rank_holds_at_most_one_and_a_half_times_its_steady_state(tmp_path):
    result = run_job(tmp_path / "run", [
        *TINY, "--set", "parallel.tensor_model_parallel_size=3", "--set", "parallel.data_parallel_size=2",
        "--set", "training.train_iters=4", "--set", "ntp.enabled=true", "--set", "parallel.timeout_s=60",
        "--inject-failure", "kill:rank=5,iter=3,phase=backward"])
    assert_ok(result)
    records = [r for r in result.records if r.get("kind") == "memory"]
    by = defaultdict(dict)
    for r in records:
        by[r["launch_rank"]][(r["generation"], r["phase"])] = r
        assert {k: v for k, v in r["state"].items() if k != "total"} == r["planned"], r
    assert sorted(by) == list(range(6))
    roles = {}
    for launch_rank, seen in by.items():
        if launch_rank == 5:  # killed in iteration 3
            assert set(seen) == {(0, "first_iteration"), (0, "steady")}
            continue
        before, reform, after = seen[(0, "steady")], seen[(1, "reform")], seen[(1, "steady")]
        assert (0, "first_iteration") in seen and (1, "first_iteration") in seen
        roles[launch_rank] = reform["role"]
        ratio = reform["peak_bytes"] / after["state"]["total"]
        assert ratio <= PEAK_OVER_STEADY, (launch_rank, reform["role"], ratio, reform)
        assert reform["peak_bytes"] >= max(after["state"]["total"], reform.get("held_after_exchange_bytes", 0))
        if reform["rebuilt"]:  # the settled iteration's gradients went before anything new was built
            old = before["state"]
            assert reform["freed_gradient_bytes"] == old["grads"] + old["shadow_grads"] > 0
    assert roles == {0: "healthy", 1: "healthy", 2: "healthy", 3: "proxy", 4: "survivor"}
