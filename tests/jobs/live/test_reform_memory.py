"""What a rank holds while its replica re-forms after a live failure, from the ``memory`` records of a real job
(:mod:`ntp_megatron.training.memory`): TP3 x 2, the last rank of replica 1 killed, so replica 1 re-forms at TP2
with one proxy (the sync-group member of the dead slot's block too) and one survivor.

Every record's measured state equals the plan (:mod:`ntp_megatron.plan.memory_plan`); the old gradient buffers were
freed before the new objects were built; and every rank's peak while re-forming stays within 1.5x the state it
holds at steady state in the new generation."""

from __future__ import annotations

from collections import defaultdict

from tests.harness import TINY, assert_ok, run_job
from tests.jobs.live.test_live_failure import assert_same_run

PEAK_OVER_STEADY = 1.5


def memory_records(result) -> dict[int, dict[tuple[int, str], dict]]:
    """Launch rank -> (generation, phase) -> its ``memory`` record; every record's measured state is the plan."""
    by = defaultdict(dict)
    for r in result.records:
        if r.get("kind") == "memory":
            by[r["launch_rank"]][(r["generation"], r["phase"])] = r
            assert {k: v for k, v in r["state"].items() if k != "total"} == r["planned"], r
    return by


def test_a_re_forming_rank_holds_at_most_one_and_a_half_times_its_steady_state(tmp_path):
    result = run_job(tmp_path / "run", [
        *TINY, "--set", "parallel.tensor_model_parallel_size=3", "--set", "parallel.data_parallel_size=2",
        "--set", "training.train_iters=4", "--set", "ntp.enabled=true", "--set", "parallel.timeout_s=60",
        "--inject-failure", "kill:rank=5,iter=3,phase=backward"])
    assert_ok(result)
    by = memory_records(result)
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


def test_under_the_distributed_optimizer_a_re_forming_rank_holds_only_its_new_state(tmp_path):
    """Under the distributed optimizer (two instances) a rank of the degraded replica takes over the DDP of every
    block it keeps serving — its healthy DDP, or after a second failure its old shadows — with the optimizer state
    of its shard by reference, and frees its old model's parameters (dead: the new model's are gathered from the
    shards). Once its messages are in, it holds exactly its new objects' state, bar the gradients (allocated when it
    adopts them): nothing of its old objects beside, where building beside them held its old model and its
    moments twice; and once the new objects are adopted they let go of the old ones (their generation's groups
    too). TP3 x 2: launch rank 5 killed in iteration 3 (replica 1 at TP2: a proxy and a survivor), then
    launch rank 4 in iteration 5 (replica 1 at TP1: the proxy alone, re-formed from its two shadows); the loss is
    the failure-free run's."""
    args = [*TINY, "--set", "parallel.tensor_model_parallel_size=3", "--set", "parallel.data_parallel_size=2",
            "--set", "training.train_iters=7", "--set", "ntp.enabled=true", "--set", "parallel.timeout_s=60",
            "--set", "parallel.use_distributed_optimizer=true",
            "--set", "parallel.num_distributed_optimizer_instances=2"]
    reference = run_job(tmp_path / "reference", args)
    result = run_job(tmp_path / "run", args + ["--inject-failure", "kill:rank=5,iter=3,phase=backward",
                                               "--inject-failure", "kill:rank=4,iter=5,phase=optimizer"])
    assert_same_run(result, reference, iters=7)
    by = memory_records(result)
    adopted = {(r["launch_rank"], r["generation"]): r["adopted_blocks"] for r in result.records
               if r.get("kind") == "reform_rank" and r["rebuilt"] and r["generation"] > 0}
    assert adopted == {(3, 1): [0], (4, 1): [1], (3, 2): [0, 2]}, adopted
    for (launch_rank, generation), blocks in adopted.items():
        before, reform = by[launch_rank][(generation - 1, "steady")], by[launch_rank][(generation, "reform")]
        after = by[launch_rank][(generation, "steady")]["state"]
        assert reform["held_after_exchange_bytes"] == after["total"] - after["grads"] - after["shadow_grads"], (
            launch_rank, generation, reform, after)
        assert reform["peak_bytes"] / after["total"] <= PEAK_OVER_STEADY, (launch_rank, generation, reform)
        old = before["state"]
        assert reform["freed_gradient_bytes"] == old["grads"] + old["shadow_grads"] > 0
        if generation == 2:  # a degraded rank's own model: its parameters went before the new ones were built
            assert reform["freed_parameter_bytes"] == old["params"] > 0
        else:  # a healthy rank's model is the DDP it adopted
            assert "freed_parameter_bytes" not in reform
    # Once adopted, the new objects let go of the old ones: no socket of an ended generation stays open (a
    # generation held by a collective gloo never woke is released later, as in test_live_failure.py).
    resources = [r for r in result.records if r.get("kind") == "resources" and not r["held_generations"]]
    assert {r["generation"] for r in resources if r["launch_rank"] == 3} == {0, 1, 2}
    assert all(r["stale_sockets"] == 0 for r in resources), [
        (r["launch_rank"], r["generation"], r["stale_sockets"]) for r in resources if r["stale_sockets"]]
