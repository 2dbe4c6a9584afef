"""The controller's decisions, called directly (:mod:`ntp_megatron.elastic.triage`): no store, no events, no lines.

Rules under test: a plain death is absorbed into the next generation; a rank's own error stops the job naming it,
and an echo of another rank's error names that rank's; running out of memory in a degraded replica drops it under
``drop_replica`` (its other live ranks retire with it) and stops the job under ``stop``; falling below ``min_tp``
stops the job or drops the replica as the policy says; a death while a re-formation was still forming builds on the
last completed generation with every death since.
"""

from __future__ import annotations

from ntp_megatron.elastic.triage import Absorbed, Batch, Death, echo_sources, only_echoes, successor, triage
from ntp_megatron.plan.layout import make_topology
from ntp_megatron.plan.stages import JobTopology, next_topology, with_generation

UNITS = {"heads": 4, "ffn": 8, "vocab": 16}


def _launch(tp: int, dp: int) -> JobTopology:
    return JobTopology.one_stage(make_topology(tp, dp, UNITS))


def _identity(topology: JobTopology) -> dict:
    return {rank: topology.slot_of(rank) for rank in range(topology.world_size)}


def _after(topology: JobTopology, *dead_ranks: int, policy: str = "drop_replica") -> JobTopology:
    return with_generation(next_topology(topology, list(dead_ranks), policy=policy), topology.generation + 1)


def _batch(launch: JobTopology, deaths, reported=(), cause_behind=None, latest=None, completed=None, dead=(),
           policy="drop_replica", sharded=False) -> Batch:
    return Batch(tuple(deaths), tuple(reported), cause_behind, latest or launch, completed or latest or launch,
                 _identity(launch), frozenset(dead), policy, sharded)


def _absorbed(launch: JobTopology, deaths, dead_since, base=None, latest=None, in_flight=(2, "abort", 0),
              injected=None, min_tp=1, policy="drop_replica") -> Absorbed:
    identity = _identity(launch)
    base = base or launch
    settled = None if in_flight is None else {"generation": base.generation, "iteration": in_flight[0],
                                              "decision": in_flight[1], "started": in_flight[2]}
    return Absorbed(tuple(deaths), latest or base, base, {lr: identity[lr] for lr in dead_since}, in_flight, settled,
                    0, injected or {}, identity, min_tp, policy, None)


def _error(text: str, iteration: int = 3, phase: str = "forward", echo: bool = False, oom: bool = False) -> dict:
    return {"error": text, "iteration": iteration, "phase": phase, "time": 50.0, "echo": echo, "out_of_memory": oom}


# -- a plain death --------------------------------------------------------------------------------------------------

def test_a_plain_death_is_absorbed_into_the_next_generation():
    launch = _launch(2, 2)
    d = Death(3, 100.0, "was killed by signal SIGKILL")
    triaged = triage(_batch(launch, [d]))
    assert triaged.stop is None and triaged.out_of_memory == () and triaged.retired == ()

    decided = successor(_absorbed(launch, [d], [3], injected={3: {"time": 99.5}}))
    assert decided.reason is None and decided.topology == _after(launch, 3)
    assert decided.topology.generation == 1 and decided.dead_ranks == (3,) and decided.ends == (0,)
    assert decided.info["base"] == 0 and decided.info["dead"] == [list(launch.slot_of(3))]
    assert decided.info["failure_time"] == 99.5, "the injected failure's own record comes first"
    assert decided.info["settled"] == {"generation": 0, "iteration": 2, "decision": "abort", "started": 0}
    assert [x["launch_rank"] for x in decided.info["deaths"]] == [3]


# -- own errors -----------------------------------------------------------------------------------------------------

def test_an_own_error_stops_the_job_naming_it():
    launch = _launch(2, 2)
    plain, failing = Death(3, 100.0, "exited"), Death(1, 101.0, "exited with code 3")
    triaged = triage(_batch(launch, [plain, failing], reported=[(failing, _error("ValueError: bad batch"))]))
    assert triaged.stop is not None and triaged.retired == ()
    assert triaged.stop.reason == ("launch rank 1 failed with an error of its own (iteration 3, phase forward): "
                                   "ValueError: bad batch")
    said = triaged.stop.details  # the job_stopped event's: an own error is no rank_failed (docs/metrics.md)
    assert (said["launch_rank"], said["replica"], said["slot"], said["generation"], said["iteration"]) == (1, 0, 1, 0, 3)
    assert "event" not in said and said["error_time"] == 101.0


def test_an_echo_names_the_rank_whose_error_it_echoes():
    launch = _launch(2, 2)
    echoing = Death(1, 100.0, "exited with code 3")
    reported = [(echoing, _error("checkpoint write failed on another rank", echo=True))]
    assert only_echoes(tuple(reported))
    assert echo_sources(_identity(launch), frozenset({0}), (echoing,)) == [2, 3], "neither dead nor dying"

    triaged = triage(_batch(launch, [echoing], reported=reported, dead={0},
                            cause_behind=(2, _error("OSError: disk full", phase="save"))))
    assert triaged.stop.reason.startswith("launch rank 2 failed with an error of its own")
    assert "OSError: disk full" in triaged.stop.reason and triaged.stop.details["launch_rank"] == 2

    alone = triage(_batch(launch, [echoing], reported=reported))  # nobody reported the cause in time
    assert alone.stop.reason.startswith("launch rank 1 failed")


# -- out of memory --------------------------------------------------------------------------------------------------

def _degraded():
    """TP3 x 2: launch rank 2 (replica 0, slot 2) died; generation 1 runs replica 0 at TP2 and has completed."""
    launch = _launch(3, 2)
    return launch, _after(launch, 2)


def test_out_of_memory_in_a_degraded_replica_drops_it_under_drop_replica():
    launch, degraded = _degraded()
    d = Death(0, 100.0, "exited with code 3")
    triaged = triage(_batch(launch, [d], reported=[(d, _error("OutOfMemoryError: injected", oom=True))],
                            latest=degraded, dead={2}))
    assert triaged.stop is None and triaged.retired == (1,), "replica 0's other live rank retires with it"
    [oom] = triaged.out_of_memory
    assert oom.dropped and oom.replica == 0
    assert (oom.event["event"], oom.event["policy"], oom.event["degraded"], oom.event["retired"]) == \
        ("oom", "drop_replica", True, [1])
    assert "in degraded replica 0 (TP2): dropping replica 0" in oom.line


def test_out_of_memory_in_a_degraded_replica_stops_the_job_under_stop():
    launch, degraded = _degraded()
    d = Death(0, 100.0, "exited with code 3")
    triaged = triage(_batch(launch, [d], reported=[(d, _error("OutOfMemoryError: injected", oom=True))],
                            latest=degraded, dead={2}, policy="stop"))
    [oom] = triaged.out_of_memory
    assert not oom.dropped and oom.line is None and oom.event["policy"] == "stop" and oom.event["retired"] == []
    assert triaged.stop is not None and "launch rank 0" in triaged.stop.reason and triaged.retired == ()
    assert "OutOfMemoryError" in triaged.stop.reason


def test_out_of_memory_in_a_healthy_replica_stops_the_job_even_under_drop_replica():
    launch, degraded = _degraded()
    d = Death(3, 100.0, "exited with code 3")  # replica 1: the launch layout, which fitted
    triaged = triage(_batch(launch, [d], reported=[(d, _error("OutOfMemoryError: injected", oom=True))],
                            latest=degraded, dead={2}))
    [oom] = triaged.out_of_memory
    assert not oom.event["degraded"] and oom.event["policy"] == "stop" and triaged.stop is not None


# -- min_tp ---------------------------------------------------------------------------------------------------------

def test_falling_below_min_tp_stops_the_job_under_stop():
    launch = _launch(2, 2)
    d = Death(3, 100.0, "exited")
    decided = successor(_absorbed(launch, [d], [3], min_tp=2, policy="stop"))
    assert decided.topology is None and decided.info is None
    assert "ntp.min_tp" in decided.reason and decided.ends == (0, 0) and decided.shards_lost == ()


def test_falling_below_min_tp_drops_the_replica_under_drop_replica():
    launch = _launch(2, 2)
    d = Death(3, 100.0, "exited")
    decided = successor(_absorbed(launch, [d], [3], min_tp=2))
    assert decided.reason is None and decided.topology.replica_indices == [0]


# -- a death while a re-formation was forming -----------------------------------------------------------------------

def test_a_death_while_forming_builds_on_the_last_completed_generation_with_every_death_since():
    launch = _launch(2, 3)
    forming = _after(launch, 1)  # generation 1, not completed
    first, second = Death(1, 90.0, "exited"), Death(4, 100.0, "exited")
    decided = successor(_absorbed(launch, [second], [1, 4], base=launch, latest=forming))
    assert decided.topology == with_generation(next_topology(launch, [1, 4]), 2)
    assert decided.info["base"] == 0 and decided.info["dead"] == [list(launch.slot_of(1)), list(launch.slot_of(4))]
    assert decided.dead_ranks == (1, 4) and decided.ends == (0, 1), "where ranks trained, and the one forming"
    assert decided.info["failure_time"] == 100.0 and first.launch_rank not in \
        [x["launch_rank"] for x in decided.info["deaths"]], "the batch's deaths only"
