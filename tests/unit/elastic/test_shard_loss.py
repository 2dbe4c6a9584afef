"""The controller under the distributed optimizer (:meth:`ntp_megatron.elastic.controller.Controller._check_shards`):
a failure that leaves every optimizer shard a surviving holder is absorbed live; one that takes every holder of a
shard (both twins with two instances, any sync member with one) goes to ``ntp.on_unrecoverable`` with a
``shard_lost`` event naming the shard and its holders; and with two instances no replica is dropped live (its
instance's positions would renumber), on a death or an out-of-memory error alike (with one, a drop loses the
dropped ranks' shards)."""

from __future__ import annotations

import json
import time

import pytest

from ntp_megatron.elastic import keys
from ntp_megatron.plan.succession import ShardedOptimizer
from tests.unit.elastic.elastic_job import Job
from tests.unit.elastic.interleavings import hash_store

# 2 x TP2, two instances (replica 0 | replica 1): shard (block b, position 0) is held by slot b of replica 0 and by
# replica 1's member of block b. The element counts are the event's only.
TWO = ShardedOptimizer(data_parallel_size=2, instances=2, numel=((110,), (120,)))
ONE = ShardedOptimizer(data_parallel_size=2, instances=1, numel=((50, 60), (70, 80)))


def _job(sharded: ShardedOptimizer, **kw) -> Job:
    job = Job(hash_store(), 2, 2, sharded=sharded, **kw)
    job.form(0)
    job.commit(0, 1)
    job.commit(0, 2)
    return job


def _lost(job: Job) -> list[dict]:
    return [e for e in job.events if e.get("event") == "shard_lost"]


def test_a_shard_with_a_surviving_twin_is_absorbed_live():
    job = _job(TWO)
    assert job.die(3) is None and job.latest() == 1  # (1, 0): replica 1's holder died, replica 0's lives
    job.form(1)
    job.commit(1, 3)
    assert job.die(1) is None and job.latest() == 2  # (1, 0) now: launch rank 1 died, replica 1's proxy lives
    assert [r.width for r in job.layout(2).replicas] == [1, 1]
    assert _lost(job) == []


def test_both_holders_of_a_shard_lost_go_to_the_policy_with_the_event():
    job = _job(TWO, policy="stop")
    reason = job.die(1, 3)
    assert reason is not None and "distributed-optimizer shards (block, position) [(1, 0)] lost" in reason
    assert job.store.check([keys.STOP]) and job.latest() == 0
    [event] = _lost(job)
    assert (event["block"], event["position"], event["holders"], event["numel"]) == (1, 0, [1, 3], 120)


def test_with_one_instance_every_death_loses_a_shard():
    job = _job(ONE, policy="restart")
    reason = job.die(2)  # replica 1, slot 0: the only holder of (block 0, position 1)
    assert reason is not None and "one instance: every shard has a single holder" in reason
    [event] = _lost(job)
    assert (event["block"], event["position"], event["holders"], event["numel"]) == (0, 1, [2], 60)


@pytest.mark.parametrize("commits", [2, 0])
def test_no_replica_is_dropped_live_with_two_instances(commits):
    """After the run's first commit and before it (where units and shards are not checked: every rank builds its
    state from the seed or the checkpoint, but the instances would still shard over different positions)."""
    job = Job(hash_store(), 2, 2, sharded=TWO, min_tp=2, policy="drop_replica")
    job.form(0)
    for iteration in range(1, commits + 1):
        job.commit(0, iteration)
    reason = job.die(3)
    assert reason is not None and "replica 1 would be dropped" in reason and "2 instances" in reason
    assert _lost(job) == [] and job.latest() == 0


@pytest.mark.parametrize("sharded, dropped", [(TWO, False), (None, True)])
def test_out_of_memory_drops_no_replica_under_the_distributed_optimizer(sharded, dropped):
    job = _job(sharded, policy="drop_replica")
    assert job.die(3) is None
    job.store.set(keys.rank_error(2), json.dumps(
        {"error": "OutOfMemoryError: injected", "iteration": 3, "phase": "reform", "time": time.time(),
         "echo": False, "out_of_memory": True}))
    reason = job.die(2)
    [oom] = [e for e in job.events if e.get("event") == "oom"]
    assert oom["policy"] == ("drop_replica" if dropped else "stop")
    assert (reason is None) == dropped
