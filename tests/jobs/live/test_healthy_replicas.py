"""A healthy replica does not pay for a degraded one, and keeps what it has.

- Its ranks issue the same torch.distributed calls with the same payload bytes, iteration by iteration
  (``logging.comm_stats``), whether the other replica is healthy, degraded from the start, or degraded by a live
  failure in the middle of the run (before, during and after its re-formation).
- It keeps its model, DDP wrapper and optimizer at a re-formation, and its tensor-parallel group: only the sync
  groups that cross into the replica the event reached are made anew. After adopting each generation every rank
  emits a ``reform_rank`` record (rebuilt or not, whether the objects it trains with are the very objects it held
  before, which groups it made and kept, the generation that made each, how many references its objects hold to
  its TP group). Which ranks must have kept their objects, and which groups each rank must make, is worked out
  from the published topologies (``ntp_megatron.plan.group_plan.event_plan``), not from the ranks' claims: every rank
  whose units are the same in the generation a re-formation built on and in the one it formed keeps its objects
  (every rank of a healthy replica, and of a degraded one the failure did not touch); every other rank rebuilds.
"""

from __future__ import annotations

import pytest

from ntp_megatron.plan.layout import Topology
from tests.harness import TINY, JobResult, assert_groups_as_planned, assert_ok, assert_replicas_agree, run_job
from tests.jobs.live.test_live_failure import leftover_processes, ntp_args
from tests.jobs.equivalence.test_state_checks import published

ITERS = 4
REJOIN_ITERS = 150
"""Long enough for the replacements to start: fresh interpreters (no warm spare), so the first one rejoins well after
the second failure and replica 1 is degraded and untouched when replica 2 re-forms."""


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


def units(topology: Topology, slot: tuple[int, int]) -> dict[str, list[int]]:
    rank = topology.rank_of(*slot)
    return {f: topology.units_of(rank, f) for f in topology.units} if rank is not None else {}


def test_healthy_replicas_keep_their_objects_at_every_re_formation(tmp_path):
    """TP2 x 3: replica 1 loses slot 1, then replica 2 loses slot 1 (replica 1 degraded and untouched then);
    replacements for both come back while training goes on."""
    args = ntp_args(2, 3, iters=REJOIN_ITERS, extra=("--set", "ntp.rejoin_after_s=0", "--set", "ntp.max_rejoin_attempts=1"))
    args += ["--inject-failure", "kill:rank=3,iter=3,phase=backward", "--inject-failure", "kill:rank=5,iter=6,phase=start"]
    result = run_job(tmp_path / "run", args, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    assert leftover_processes(result) == []
    generations = published(result)
    base_of = {e["generation"]: e["base"] for e in result.events("generation_published")}
    start = generations[0][0]
    launch_rank = {start.slot_of(lr): lr for lr in range(start.world_size)}
    records = {(r["generation"], r["launch_rank"]): r for r in result.records if r.get("kind") == "reform_rank"}
    reformed = result.events("reformed")
    assert len(reformed) >= 2, "the two failures re-formed the job"
    checked = {"kept": 0, "healthy": 0, "rebuilt": 0, "groups": 0}
    for event in reformed:
        g = event["generation"]
        base, new = generations[base_of[g]][0], generations[g][0]
        for rep in new.replicas:
            for slot in rep.slots:
                lr = launch_rank[(rep.index, slot)]
                record = records.get((g, lr))
                assert record is not None, f"generation {g}: no reform_rank record from launch rank {lr}"
                in_base = any(b.index == rep.index for b in base.replicas)
                if not event["joined"] and in_base and base.is_healthy(rep.index) and new.is_healthy(rep.index):
                    # A kill in the backward pass or at an iteration's start: the failed replica's survivors never
                    # reach the grad sync, so a healthy rank makes exactly its sync group (left half-matched, or
                    # with another member), and nothing else.
                    assert record["groups_made"] == [f"sync[0, {slot}]"], (g, lr, record)
                    checked["groups"] += 1
                assert (record["replica"], record["tp_rank"]) == (rep.index, new.local_rank(new.rank_of(rep.index,
                                                                                                          slot)))
                kept = units(base, (rep.index, slot)) == units(new, (rep.index, slot))
                if kept:
                    what = (record["rebuilt"], record["same_model"], record["same_ddp"], record["same_optimizer"])
                    assert what == (False, True, True, True), (
                        f"generation {g}: launch rank {lr} (replica {rep.index}, slot {slot}) kept its units but "
                        f"reports rebuilt/same model/DDP/optimizer = {what}")
                    checked["kept"] += 1
                    in_base = any(b.index == rep.index for b in base.replicas)
                    checked["healthy"] += in_base and base.is_healthy(rep.index) and new.is_healthy(rep.index)
                else:
                    assert record["rebuilt"] and not record["same_optimizer"], (g, lr, record)
                    checked["rebuilt"] += 1
    # Both failures leave a healthy replica 0 and rebuild one rank each; a degraded, untouched replica keeps too.
    assert checked["healthy"] >= 4 and checked["rebuilt"] >= 2 and checked["kept"] > checked["healthy"], checked
    # Kills in the backward pass and at the start of an iteration, rejoins at a boundary: nothing strands a collective
    # of a healthy replica's TP group, so each keeps it.
    kept = assert_groups_as_planned(result, dp=3, healthy_tp_kept=True)
    assert kept >= 4 and checked["groups"] >= 4, (kept, checked)
    assert_replicas_agree(result, REJOIN_ITERS)
