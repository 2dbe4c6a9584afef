"""A slow rank gets a smaller share live, and its block back when it is fast again; the loss curve is the run's
without the slowdown, the replicas agree, the healthy replica keeps everything.

Every rank computes on the emulated device (``ntp.emulated_device_ms``, ntp_megatron/speed/device_model.py): on this
2-core machine a sleeping rank would otherwise hand its CPU to its peers and hardly slow them."""

from __future__ import annotations

import pytest

from tests.harness import assert_groups_as_planned, run_job
from tests.jobs.live.test_live_failure import assert_replicas_agree, assert_same_run, ntp_args, widths_by_iteration

# Asserts a rank's measured slowness against its peers': scripts/test.sh runs it alone.
pytestmark = pytest.mark.timed

ITERS = 20
SLOW_FROM, SLOW_UNTIL = 3, 11
DEVICE = ("--set", "ntp.emulated_device_ms=300", "--set", "ntp.rebalance_window=3", "--set", "ntp.rebalance=true")


def test_a_slow_rank_is_rebalanced_and_gets_its_block_back(tmp_path, jobs):
    reference = jobs.run("slow-ref", ntp_args(2, 2, iters=ITERS))
    args = ntp_args(2, 2, iters=ITERS, extra=DEVICE) + [
        "--inject-failure", f"slow:rank=1,factor=3,iter={SLOW_FROM}",
        "--inject-failure", f"slow:rank=1,factor=1,iter={SLOW_UNTIL}"]
    result = run_job(tmp_path / "run", args, timeout=400)
    assert_same_run(result, reference, ITERS)
    assert_replicas_agree(result, ITERS)
    rebalanced = result.events("rebalanced")
    assert len(rebalanced) >= 2, [e for e in result.records if e.get("kind") == "event"]
    first, last = rebalanced[0], rebalanced[-1]
    assert first["replica"] == 0 and first["launch_ranks"]["1"] == 1
    assert int(first["weights"]["1"]) < 100 and first["weights"]["0"] == 100  # the slow rank's share shrinks
    assert min(first["iterations"]) >= SLOW_FROM
    assert last["weights"] == {} and min(last["iterations"]) >= SLOW_UNTIL  # alike again: its block goes back
    published = {e["generation"]: e["topology"] for e in result.events("generation_published")}
    slow_layout = published[first["generation"]]["replicas"][0]
    assert slow_layout["slots"] == [0, 1] and slow_layout["weights"] and slow_layout["dealt"]["heads"]
    final = published[max(published)]["replicas"][0]
    assert final["dealt"] == {} and "weights" not in final  # canonical again
    reformed = result.events("reformed")
    assert all(e["tp_per_replica"] == [2, 2] for e in reformed)  # nobody died
    assert all(e["moved_bytes"] == e["lower_bound_bytes"] > 0 for e in reformed)  # only what changed moves
    assert assert_groups_as_planned(result, healthy_tp_kept=True) == 2 * len(reformed)  # replica 1 keeps all
    kept = [r for r in result.records if r.get("kind") == "reform_rank" and r["replica"] == 1 and r["generation"]]
    assert kept and all(r["same_model"] and r["same_optimizer"] and not r["rebuilt"] for r in kept)
    assert all(w == [2, 2] for w in widths_by_iteration(result).values())


def test_power_boost_of_a_degraded_replica_is_recorded_and_ends_when_it_heals(tmp_path, jobs):
    """Replica 1 loses launch rank 3 in iteration 3 and goes on at TP1: its survivor holds twice a healthy rank's
    work, so on the linear curve (alpha 1) it needs twice the power; with no GPU here that is a dry run that says
    so. A warm spare rejoins, the replica is healthy again, and the survivor's limit goes back to the default. The
    boost changes no arithmetic: the loss is the run's without it (its own failure and rejoin, no boost)."""
    failure = ["--inject-failure", "kill:rank=3,iter=3,phase=backward", "--set", "ntp.rejoin_after_s=1",
               "--set", "ntp.warm_spares=1"]
    reference = jobs.run("boost-ref", ntp_args(2, 2, iters=12, extra=tuple(failure)))
    args = ntp_args(2, 2, iters=12, extra=(*failure, "--set", "ntp.boost=true", "--set", "ntp.boost_alpha=1",
                                           "--set", "ntp.boost_max_power=3", "--set", "ntp.emulated_device_ms=200"))
    result = run_job(tmp_path / "run", args, timeout=400)
    assert_same_run(result, reference, 12)
    boosts = result.events("boost")
    assert [b["launch_rank"] for b in boosts] == [2, 2], boosts  # only the survivor's power changes
    degraded, healed = boosts
    assert degraded["load"] == pytest.approx(2.0) and degraded["power"] == pytest.approx(2.0)
    assert degraded["perf"] == pytest.approx(2.0) and not degraded["short"] and degraded["emulated"]
    assert not degraded["applied"] and "no GPU" in degraded["reason"]
    assert healed["power"] == 1.0 and not healed["applied"] and "no GPU" in healed["reason"]
    assert healed["generation"] > degraded["generation"]
    assert "boost | generation" in result.stdout and "not applied: no GPU (CPU run): dry run" in result.stdout


def test_a_slow_rank_on_another_node_is_rebalanced_through_node_0(tmp_path):
    """Two launchers on one host: replica 1 is node 1's. Its launcher reads its ranks' heartbeats, finds launch rank
    3 slow and asks node 0's controller (one request through the root store), which publishes the rebalanced
    generation; both nodes finish the run."""
    from tests.jobs.live.test_multi_node import _two_nodes

    (code0, err0), node1, records = _two_nodes(tmp_path, [
        "--set", "ntp.enabled=true", "--train-iters", "14", "--inject-failure", "slow:rank=3,factor=3,iter=3",
        "--set", "ntp.emulated_device_ms=400", "--set", "ntp.rebalance_window=3", "--set", "ntp.rebalance=true"])
    assert code0 == 0 and node1[0] == 0, err0[-3000:] + node1[2][-3000:]
    [rebalanced] = [r for r in records if r.get("event") == "rebalanced"]
    assert rebalanced["replica"] == 1 and rebalanced["launch_ranks"] == {"0": 2, "1": 3}
    assert int(rebalanced["weights"]["1"]) < 100 and min(rebalanced["iterations"]) >= 3
    widths = [r["tp_per_replica"] for r in records if r.get("kind") == "iteration"]
    assert widths and all(w == [2, 2] for w in widths)
    assert any(r.get("event") == "reformed" and r.get("weights") for r in records)
