"""The controller (:mod:`ntp_megatron.elastic.controller`) in one process on an in-memory store, with its ranks'
protocol calls: what each batch of deaths publishes and builds on, a failure while a generation forms (every
order of the last ready rank's ``complete`` against the controller's ``incomplete``), admissions and a failure at
their boundary, a failure before the first commit, a resumed run.

Rules under test: a new generation builds on the newest *completed* one, with every death since; a formation is
adopted by the ranks exactly when the controller counts it completed; a lost unit needs a surviving holder once
an iteration after the start has committed, and not before; an admission waits for no re-formation and happens
at one iteration boundary for every rank.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from ntp_megatron.elastic import commit, keys, publication
from ntp_megatron.elastic.commit import ABORT, COMMIT, COMMIT_REFORM, COMPLETE, INCOMPLETE
from ntp_megatron.plan.layout import next_topology
from tests.unit.elastic.elastic_job import Job, admission_pending, death, former, voter
from tests.unit.elastic.interleavings import Interleaving, every_order, hash_store


def _job(tp: int, dp: int, **kw) -> Job:
    return Job(hash_store(), tp, dp, **kw)


def _slots(job: Job, *launch_ranks: int) -> list[list[int]]:
    return sorted(list(job.controller.identity[lr]) for lr in launch_ranks)


def _published(job: Job, generation: int) -> dict:
    return next(e for e in job.events if e.get("event") == "generation_published" and e["generation"] == generation)


# -- one failure, then another ----------------------------------------------------------------------------------

def test_a_failure_publishes_the_next_generation_and_ends_the_current_one():
    job = _job(2, 2)
    job.form(0)
    job.commit(0, 1)
    assert job.die(3) is None
    assert job.latest() == 1 and job.controller.forming()
    assert job.layout(1) == next_topology(job.layout(0), [3])
    info = job.info(1)
    assert info["base"] == 0 and sorted(info["dead"]) == _slots(job, 3)
    assert info["settled"] == {"generation": 0, "iteration": 2, "decision": ABORT, "started": 0}
    assert [d["launch_rank"] for d in info["deaths"]] == [3]
    assert job.store.check([keys.abort(0)])
    event = _published(job, 1)
    assert event["base"] == 0 and event["dead_ranks"] == [3] and event["joined"] == []
    failed = [e for e in job.events if e.get("event") == "rank_failed"]
    assert [(e["launch_rank"], e["replica"], e["slot"], e["generation"]) for e in failed] == [(3, 1, 1, 0)]
    assert job.die(3) is None and job.latest() == 1, "a death handled once is not handled again"


def test_a_second_failure_while_forming_builds_on_the_last_completed_generation_with_every_death():
    """Launch rank 5 dies, generation 1 is published; rank 3 dies before generation 1 formed. Generation 2 builds
    on generation 0 (what every survivor still holds) without both ranks; generation 1 is marked incomplete and
    over. Once generation 2 formed, the next failure builds on it with that death alone."""
    job = _job(2, 3)
    job.form(0)
    job.commit(0, 1)
    job.die(5)
    formed_early = former(job.protocol(1))  # one survivor finished forming generation 1, the others did not
    assert job.die(3) is None
    assert formed_early.outcome() == INCOMPLETE
    assert job.store.get(commit.formed_key(1)).decode() == INCOMPLETE and job.store.check([keys.abort(1)])
    info = job.info(2)
    assert info["base"] == 0 and sorted(info["dead"]) == _slots(job, 3, 5)
    assert job.layout(2).replicas == next_topology(job.layout(0), [3, 5]).replicas
    assert _published(job, 2)["dead_ranks"] == [3, 5]
    assert info["settled"] == {"generation": 0, "iteration": 2, "decision": ABORT, "started": 0}, \
        "the same iteration of generation 0 is still the one in flight"

    assert job.form(2) == [COMPLETE] * 4
    assert not job.controller.forming()
    assert job.die(2) is None
    info = job.info(3)
    assert info["base"] == 2 and sorted(info["dead"]) == _slots(job, 2)
    assert job.layout(3).replicas == next_topology(job.layout(2), [job.layout(2).rank_of(1, 0)]).replicas
    assert _published(job, 3)["dead_ranks"] == [job.topology(2).rank_of(1, 0)]


def test_deaths_in_one_batch_make_one_generation():
    job = _job(2, 2)
    job.form(0)
    job.commit(0, 1)
    assert job.die(1, 2) is None
    assert job.latest() == 1 and sorted(job.info(1)["dead"]) == _slots(job, 1, 2)


def test_a_failure_before_generation_0_formed_builds_on_it():
    """Before the launch ranks finished forming generation 0 nobody holds anything to fall back to but its
    layout: generation 1 builds on generation 0, whose formation is marked incomplete."""
    job = _job(1, 3)
    formed_early = former(job.protocol(0))
    assert job.completed() == -1 and job.controller.forming()
    assert job.die(2) is None
    assert formed_early.outcome() == INCOMPLETE
    assert job.info(1)["base"] == 0 and job.store.get(commit.formed_key(0)).decode() == INCOMPLETE
    assert job.info(1)["settled"]["iteration"] == 1


# -- a failure while a generation forms: every order --------------------------------------------------------------

@pytest.mark.parametrize("tp, dp", [(1, 3), (2, 2)])
def test_last_ready_rank_against_the_controllers_incomplete_in_every_order(tp, dp):
    """Rank A died, generation 1 is forming; one of its ranks (B) reported ready and died; the last ready rank's
    ``complete`` races the controller's ``incomplete``. In every order: every rank of generation 1 has the same
    verdict; ``COMPLETED`` says the same; the next generation builds on generation 1 (without B) if it completed,
    else on generation 0 (without A and B)."""
    world = tp * dp
    a, b = world - 1, 0
    verdicts = set()

    def trial(il: Interleaving) -> None:
        job = Job(il.store, tp, dp, controller_store=il.proxy("controller"))
        job.form(0)
        job.commit(0, 1)
        job.die(a)
        members = job.members(1)
        last = members[-1]
        early = [former(job.protocol(1)) for lr in members if lr != last]  # b among them
        job.alive.discard(b)
        job.notice(1)
        job.notice(0)
        results = il.run({"controller": lambda: job.controller.handle([death(b)]),
                          "last": lambda: job.protocol(1, il.proxy("last")).form()})
        job.controller.close()
        outcome = {f.outcome() for f in early} | {results["last"]}
        assert len(outcome) == 1 and outcome <= {COMPLETE, INCOMPLETE}, (outcome, il.trace)
        verdict = outcome.pop()
        verdicts.add(verdict)
        info = job.info(2)
        if verdict == COMPLETE:
            assert job.completed() == 1, il.trace
            assert info["base"] == 1 and sorted(info["dead"]) == _slots(job, b), il.trace
            assert info["settled"] == {"generation": 1, "iteration": 2, "decision": ABORT, "started": 0}
        else:
            assert job.completed() == 0, il.trace
            assert info["base"] == 0 and sorted(info["dead"]) == _slots(job, a, b), il.trace
            assert info["settled"] == {"generation": 0, "iteration": 2, "decision": ABORT, "started": 0}
        assert job.controller.completed.generation == info["base"]

    watched = {commit.formed_key(1), commit.COMPLETED, keys.abort(1)}.__contains__
    orders = every_order(trial, watched)
    assert verdicts == {COMPLETE, INCOMPLETE}
    assert len(orders) >= 5, len(orders)


# -- admissions ---------------------------------------------------------------------------------------------------

def _admitting() -> Job:
    """TP2 x DP2; a new process for launch rank 3 is being admitted (:func:`admission_pending`)."""
    job = _job(2, 2)
    admission_pending(job, 3)
    return job


def test_an_admission_happens_at_one_iteration_boundary_and_waits_for_no_reformation():
    job = _admitting()
    assert job.latest() == 2 and job.store.check([publication.reform_requested_key(1)])
    info = job.info(2)
    assert info["base"] == 1 and info["joined"] == _slots(job, 3) and sorted(info["dead"]) == []
    assert _published(job, 2)["joined"] == _slots(job, 3)
    assert job.layout(2).replicas == job.layout(0).replicas, "the replacement takes its slot back"
    assert job.controller.forming()
    assert not job.controller.admit([3]), "one admission at a time"
    assert any("admitting launch rank 3" in line for line in job.said)

    assert job.commit(1, 3) == [COMMIT_REFORM] * 3  # every rank moves after the same iteration
    assert job.committed() == 3
    assert job.form(2) == [COMPLETE] * 4
    assert not job.controller.forming() and job.completed() == 2
    assert job.controller.live_launch_ranks() == [0, 1, 2, 3]
    assert job.die(3) is None  # the replacement can fail like any rank
    assert job.info(3)["base"] == 2 and sorted(job.info(3)["dead"]) == _slots(job, 3)


def test_no_admission_while_a_reformation_is_pending():
    job = _job(2, 2)
    job.form(0)
    job.commit(0, 1)
    job.die(3)
    job.alive.add(3)
    assert not job.controller.admit([3])
    assert job.latest() == 1
    job.form(1)
    assert job.controller.admit([3]) and job.latest() == 2


@pytest.mark.parametrize("when", ["before the boundary", "at the boundary"])
def test_a_failure_while_an_admission_is_pending(when):
    """Rank 0 dies while generation 2 (the admission) is pending: before the boundary (it never voted for
    iteration 3, which is aborted), or after every rank voted ``commit+reform`` and moved on (nothing is in flight,
    generation 2 never forms). Either way generation 3 builds on generation 1 without rank 0, generation 2 is
    marked incomplete, and the replacement is not in generation 3 (it must be admitted again)."""
    job = _admitting()
    if when == "at the boundary":
        assert job.commit(1, 3) == [COMMIT_REFORM] * 3
        waiting = [former(job.protocol(2)) for _ in (1, 2, 3)]
        voting = []
    else:
        waiting = []
        voting = [voter(job.protocol(1), 3) for _ in (1, 2)]
    assert job.die(0) is None
    info = job.info(3)
    assert info["base"] == 1 and sorted(info["dead"]) == _slots(job, 0) and "joined" not in info
    assert job.store.get(commit.formed_key(2)).decode() == INCOMPLETE
    assert job.store.check([keys.abort(1)]) and job.store.check([keys.abort(2)])
    assert job.topology(3).rank_of(*job.controller.identity[3]) is None
    if when == "at the boundary":
        assert info["settled"] is None and job.committed() == 3
        assert [f.outcome() for f in waiting] == [INCOMPLETE] * 3
    else:
        assert info["settled"] == {"generation": 1, "iteration": 3, "decision": ABORT, "started": 0}
        assert [v.outcome() for v in voting] == [ABORT, ABORT]
    assert job.form(3) == [COMPLETE] * 2
    assert job.controller.admit([3]) and job.info(4)["joined"] == _slots(job, 3)


# -- what NTP can absorb, and when --------------------------------------------------------------------------------

@pytest.mark.parametrize("start", [0, 10], ids=["fresh", "resumed"])
def test_a_lost_unit_needs_a_surviving_holder_only_after_the_first_commit(start):
    """One TP2 replica loses slot 1: its units exist nowhere else. Before the run's first commit (of a fresh or
    a resumed run) every rank builds its state from the seed or the checkpoint, so the job goes on at TP1; after
    it, the job stops with the reason, and every rank is told."""
    job = _job(2, 1, start=start)
    job.form(0)
    assert job.die(1) is None
    assert job.info(1)["settled"]["iteration"] == start + 1
    assert job.topology(1).world_size == 1

    job = _job(2, 1, start=start)
    job.form(0)
    job.commit(0, start + 1)
    reason = job.die(1)
    assert reason is not None and "no surviving holder" in reason, reason
    assert job.store.get(keys.STOP).decode() == reason
    assert job.store.get(keys.abort(0)).decode() == "stop"
    assert job.latest() == 0, "nothing is published"
    assert any("rank failed | launch rank 1" in line for line in job.said)


def test_a_replica_below_min_tp_stops_the_job_or_is_dropped_by_the_policy():
    job = _job(2, 2, min_tp=2, policy="stop")
    job.form(0)
    job.commit(0, 1)
    reason = job.die(3)
    assert reason is not None and "ntp.min_tp" in reason
    assert job.store.check([keys.STOP])

    job = _job(2, 2, min_tp=2, policy="drop_replica")
    job.form(0)
    job.commit(0, 1)
    assert job.die(3) is None
    assert [rep.index for rep in job.layout(1).replicas] == [0]
    assert job.controller.live_launch_ranks() == [0, 1]


def test_a_resumed_run_starts_counting_at_its_checkpoint():
    job = _job(1, 2, start=10)
    assert job.committed() == 10 and job.store.get(commit.START).decode() == "10"
    job.form(0)
    assert job.commit(0, 11) == [COMMIT, COMMIT]
    assert job.die(1) is None
    assert job.info(1)["settled"]["iteration"] == 12


# -- out of memory ----------------------------------------------------------------------------------------------

def _run_out_of_memory(job: Job, launch_rank: int, phase: str = "reform", iteration: int = 3) -> None:
    """``launch_rank`` reports ``torch.OutOfMemoryError`` as its own error (``errors.report``'s record)."""
    job.store.set(keys.rank_error(launch_rank), json.dumps(
        {"error": "OutOfMemoryError: injected", "iteration": iteration, "phase": phase, "time": time.time(),
         "echo": False, "out_of_memory": True}))


def _oom_event(job: Job) -> dict:
    [event] = [e for e in job.events if e.get("event") == "oom"]
    return event


def test_out_of_memory_in_a_degraded_replica_drops_it_and_the_job_goes_on():
    """Launch rank 1 of replica 0 (TP2 x 3) died; replica 0 re-forms at TP1 and its survivor runs out of memory
    doing it: replica 0 is dropped and the next generation builds on generation 0 without both of its slots."""
    job = _job(2, 3)
    job.form(0)
    job.commit(0, 1)
    assert job.die(1) is None
    assert [r.width for r in job.layout(1).replicas] == [1, 2, 2]
    _run_out_of_memory(job, 0)
    assert job.die(0) is None
    assert [r.index for r in job.layout(2).replicas] == [1, 2]
    assert job.info(2)["base"] == 0 and sorted(job.info(2)["dead"]) == _slots(job, 0, 1)
    event = _oom_event(job)
    assert (event["launch_rank"], event["replica"], event["phase"], event["policy"], event["degraded"]) == \
        (0, 0, "reform", "drop_replica", True)
    assert any("dropping replica 0" in line for line in job.said)


def test_out_of_memory_retires_the_other_live_ranks_of_the_dropped_replica():
    """TP3 x 2: launch rank 2 died, replica 0 re-formed at TP2 and trains; its rank 0 runs out of memory in the
    first iteration: replica 0 goes, rank 1 (alive) with it, and no replacement brings it back but whole."""
    job = _job(3, 2)
    job.form(0)
    job.commit(0, 1)
    job.die(2)
    job.form(1)
    job.commit(1, 2)
    _run_out_of_memory(job, 0, phase="forward", iteration=3)
    assert job.die(0) is None
    assert [r.index for r in job.layout(2).replicas] == [1]
    assert _oom_event(job)["retired"] == [1]
    assert 1 in job.controller.dead
    job.form(2)
    job.alive.update({0, 2})
    assert not job.controller.admit([0, 2]), "two of replica 0's three slots: it stays dropped"
    assert job.controller.admit([0, 1, 2]) and [r.width for r in job.layout(3).replicas] == [3, 3]


@pytest.mark.parametrize("policy", ["stop", "restart"])
def test_out_of_memory_in_a_degraded_replica_stops_the_job_under_another_policy(policy):
    job = _job(2, 2, policy=policy)
    job.form(0)
    job.commit(0, 1)
    job.die(1)
    _run_out_of_memory(job, 0)
    reason = job.die(0)
    assert reason is not None and "OutOfMemoryError" in reason and "launch rank 0" in reason
    assert _oom_event(job)["policy"] == "stop" and job.latest() == 1


def test_out_of_memory_in_a_degraded_stage_drops_its_replica_from_every_stage():
    """PP2 x TP2 x 2 (ranks stage by stage: 4..7 are stage 1): launch rank 6 (replica 1, slot 0, stage 1) died,
    replica 1's stage 1 re-forms at TP1 and its survivor, launch rank 7, runs out of memory doing it. Replica 1 is
    degraded (in one stage): it is dropped from both stages, and its stage 0 ranks (launch ranks 2 and 3) retire
    with it; replica 0 trains on."""
    job = Job(hash_store(), 2, 2, pp=2)
    job.form(0)
    job.commit(0, 1)
    assert job.die(6) is None
    assert job.topology(1).widths(1) == [2, 1]
    _run_out_of_memory(job, 7)
    assert job.die(7) is None
    assert job.topology(2).replica_indices == [0] and job.topology(2).widths(0) == [2, 2]
    event = _oom_event(job)
    assert (event["launch_rank"], event["replica"], event["policy"], event["degraded"], event["retired"]) == \
        (7, 1, "drop_replica", True, [2, 3])


def test_an_admission_refused_again_for_the_same_reason_is_said_once():
    """TP2 x 2 with ntp.min_tp 2: launch rank 1 died, replica 0 was dropped (its rank 0 retires). A replacement
    for rank 1 alone cannot bring replica 0 back; the launcher asks at every poll, the controller says so once."""
    job = _job(2, 2, min_tp=2)
    job.form(0)
    job.commit(0, 1)
    assert job.die(1) is None
    job.form(1)
    job.alive.add(1)
    for _ in range(3):
        assert not job.controller.admit([1])
    assert sum("not admitting launch ranks [1] yet" in line for line in job.said) == 1


def test_out_of_memory_in_a_stage_at_the_launch_width_stops_the_job_though_another_stage_is_degraded():
    """PP2 x TP2 x 2: replica 1's stage 1 lost launch rank 6 and trains at TP1; launch rank 2 (replica 1, stage 0,
    still TP2: the launch's own layout) runs out of memory. That is no layout to drop: the job stops."""
    job = Job(hash_store(), 2, 2, pp=2)
    job.form(0)
    job.commit(0, 1)
    assert job.die(6) is None
    job.form(1)
    job.commit(1, 2)
    _run_out_of_memory(job, 2, phase="forward", iteration=3)
    reason = job.die(2)
    assert reason is not None and "OutOfMemoryError" in reason
    event = _oom_event(job)
    assert (event["policy"], event["degraded"], event["retired"]) == ("stop", False, [])


def test_out_of_memory_in_a_healthy_replica_stops_the_job():
    """A healthy replica runs the launch's own layout: running out of memory there is no layout to drop."""
    job = _job(2, 2)
    job.form(0)
    job.commit(0, 1)
    _run_out_of_memory(job, 3, phase="backward", iteration=2)
    reason = job.die(3)
    assert reason is not None and "OutOfMemoryError" in reason
    event = _oom_event(job)
    assert event["policy"] == "stop" and not event["degraded"]


def test_out_of_memory_is_judged_in_the_layout_the_rank_trained_in():
    """A rebalance of replica 0 is published, not formed yet; its rank runs out of memory while still training in
    the launch layout (generation 0): no layout to drop, the job stops. Once the rebalanced layout formed, the same
    error drops the replica (its layout is not the launch's, which fitted)."""
    from ntp_megatron.plan.rebalance import Decision

    half = Decision(0, 0, {0: 100, 1: 40}, {1: 2.5}, (1,))
    job = _job(2, 2)
    job.form(0)
    job.commit(0, 1)
    assert job.controller.rebalance([half]) and job.controller.forming()
    _run_out_of_memory(job, 0, phase="forward", iteration=2)
    assert job.die(0) is not None and _oom_event(job)["policy"] == "stop" and not _oom_event(job)["degraded"]
    formed = _job(2, 2)
    formed.form(0)
    formed.commit(0, 1)
    assert formed.controller.rebalance([half])
    formed.commit(0, 2)
    formed.form(1)
    _run_out_of_memory(formed, 0, phase="forward", iteration=3)
    assert formed.die(0) is None and _oom_event(formed)["degraded"]
    assert [r.index for r in formed.layout(2).replicas] == [1]


def test_out_of_memory_in_two_degraded_replicas_at_once_drops_both():
    job = _job(2, 3)
    job.form(0)
    job.commit(0, 1)
    job.die(1, 3)  # replicas 0 and 1 re-form at TP1
    _run_out_of_memory(job, 0)
    _run_out_of_memory(job, 2)
    assert job.die(0, 2) is None
    assert [r.index for r in job.layout(2).replicas] == [2]
    assert sorted((e["launch_rank"], e["policy"]) for e in job.events if e.get("event") == "oom") == \
        [(0, "drop_replica"), (2, "drop_replica")]


@pytest.mark.parametrize("other", ["a bug", "out of memory in a healthy replica"])
def test_out_of_memory_with_another_own_error_in_the_same_batch_stops_the_job(other):
    """Nothing in one batch of deaths is re-formed around: a rank's bug is named before a rank out of memory, and
    an out-of-memory error no replica drop absorbs stops the job for both."""
    job = _job(2, 3)
    job.form(0)
    job.commit(0, 1)
    job.die(1)  # replica 0 re-forms at TP1
    _run_out_of_memory(job, 0)
    if other == "a bug":
        job.store.set(keys.rank_error(4), json.dumps({"error": "KeyError: 'bug'", "iteration": 3, "phase": "forward",
                                                      "time": time.time(), "echo": False, "out_of_memory": False}))
    else:
        _run_out_of_memory(job, 4, phase="forward")
    reason = job.die(0, 4)
    assert reason is not None and job.latest() == 1
    assert ("KeyError" in reason and "launch rank 4" in reason) if other == "a bug" else "OutOfMemoryError" in reason
    assert all(e["policy"] == "stop" for e in job.events if e.get("event") == "oom")


# -- rebalancing a slow rank --------------------------------------------------------------------------------------

def test_a_rebalance_is_published_for_the_next_iteration_boundary():
    from ntp_megatron.plan.layout import rebalanced_topology
    from ntp_megatron.plan.rebalance import Decision

    job = _job(2, 2)
    job.form(0)
    job.commit(0, 1)
    slow = Decision(0, 0, {0: 100, 1: 40}, {0: 1.0, 1: 2.5}, (1, 2, 3))
    assert Decision.from_json(json.loads(json.dumps(slow.to_json()))) == slow
    assert job.controller.rebalance([slow])
    assert job.latest() == 1 and job.store.check([publication.reform_requested_key(0)])
    assert job.layout(1) == dataclasses.replace(rebalanced_topology(job.layout(0), {0: {0: 100, 1: 40}}),
                                                  generation=1)
    assert job.info(1)["weights"] == [[0, 0, [[0, 100], [1, 40]]]] and job.info(1)["dead"] == []
    [event] = [e for e in job.events if e.get("event") == "rebalanced"]
    assert event["launch_ranks"] == {"0": 0, "1": 1} and event["weights"] == {"0": 100, "1": 40}
    assert not job.controller.rebalance([slow]), "one re-formation at a time"
    assert job.commit(0, 2) == [COMMIT_REFORM] * 4
    assert job.form(1) == [COMPLETE] * 4 and job.completed() == 1


def test_a_rebalance_that_moves_nothing_or_exceeds_min_tp_is_not_published():
    from ntp_megatron.plan.rebalance import Decision

    half = Decision(0, 0, {0: 100, 1: 50, 2: 100, 3: 100}, {1: 2.0}, (1,))
    strict = _job(4, 1, min_tp=4)  # no rank may ever hold more than its canonical block
    strict.form(0)
    strict.commit(0, 1)
    assert not strict.controller.rebalance([half]) and strict.latest() == 0
    assert any("not rebalancing replica 0" in line and "ntp.min_tp (4)" in line for line in strict.said)
    worked = []
    import ntp_megatron.plan.rebalance as rebalance_module  # where a decision is worked out
    real = rebalance_module.rebalanced_topology
    rebalance_module.rebalanced_topology = lambda *a, **k: worked.append(1) or real(*a, **k)
    try:  # the monitor makes the refused decision again at every pass: not worked out again, not said again
        assert not strict.controller.rebalance([half]) and not strict.controller.rebalance([half])
    finally:
        rebalance_module.rebalanced_topology = real
    assert worked == [] and sum("not rebalancing" in line for line in strict.said) == 1
    job = _job(4, 1)
    job.form(0)
    job.commit(0, 1)
    # Weight 95: every count is within one unit of its share as it is: nothing would move, so no re-formation.
    assert not job.controller.rebalance([Decision(0, 0, {0: 100, 1: 95, 2: 100, 3: 100}, {1: 1.05}, (1,))])
    assert job.latest() == 0
    assert job.controller.rebalance([half]) and job.latest() == 1
