"""What the controller does about a batch of deaths, decided without the store (pure).

The controller (:mod:`ntp_megatron.elastic.controller`) reads the facts into plain inputs and applies the decisions;
nothing here reads or writes the store, emits an event, says a line or changes the controller's bookkeeping. A batch
is decided in two steps, because the iteration in flight is settled through the store between them (its outcome is a
first-writer-wins race, not a fact to be known beforehand):

1. :func:`triage` over a :class:`Batch` (the deaths, the errors their ranks reported, the layouts): the job stops on a
   rank's own error, or goes on — dropping the replicas whose degraded layout ran out of memory, under
   ``ntp.on_unrecoverable: drop_replica`` — with an ``oom`` event (and a line when dropped) per such rank;
2. :func:`successor` over what the deaths left (:class:`Absorbed`: the layout the survivors hold, every death since,
   the iteration settled): the next generation to publish and the generations that end, or why the job stops and
   the distributed-optimizer shards lost (the next topology itself is
   :func:`ntp_megatron.plan.succession.succession`'s).

Events are returned without their ``time``; the controller adds it as it emits them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional

from ntp_megatron.elastic.errors import own_error_cause
from ntp_megatron.plan.optimizer_shards import shard_holders
from ntp_megatron.plan.stages import JobTopology, named_stage, replica_widths, with_generation
from ntp_megatron.plan.succession import ShardedOptimizer, succession


@dataclass(frozen=True)
class Death:
    launch_rank: int
    time: float
    """When the process died or stopped responding (wall clock): the injected failure's own record when there
    is one, else when the launcher killed it, else when it was reaped."""
    cause: str
    """How it ended, e.g. "was killed by signal SIGKILL", "hung: fenced after 3.0 s without a heartbeat"."""
    pid: int = 0
    error: Optional[str] = None
    """What the rank reported of an error of its own before it exited (``keys.rank_error``), if it did: no
    re-formation or restart gets past it, so every policy stops the job naming it."""
    echo: bool = False
    """The reported error only echoes another rank's (:func:`ntp_megatron.elastic.errors.reported_error`)."""


# -- 1. triage: stop on an own error, or go on (dropping what did not fit) ---------------------------------------------

@dataclass(frozen=True)
class Batch:
    """What :func:`triage` decides over (read by the controller)."""

    deaths: tuple[Death, ...]
    """The batch: ranks not already counted dead."""
    reported: tuple[tuple[Death, dict], ...]
    """The errors the dying ranks reported of their own (:func:`ntp_megatron.elastic.errors.reported_error`), in
    the order of ``deaths``."""
    cause_behind: Optional[tuple[int, dict]]
    """When every reported error is an echo (:func:`only_echoes`): the launch rank that reported the cause, and its
    report (:func:`ntp_megatron.elastic.errors.cause_behind_echoes`), if one did in time."""
    latest: JobTopology
    """The newest published generation."""
    completed: JobTopology
    """The newest completed one, caught up with the store when every error ran out of memory
    (:func:`out_of_memory_only`): the layout such a rank trained in."""
    identity: Mapping[int, tuple[int, ...]]
    """Launch rank -> (replica, slot[, stage])."""
    dead: frozenset[int]
    """Launch ranks dead before this batch."""
    policy: str
    sharded: bool
    """The job trains with the distributed optimizer."""


@dataclass(frozen=True)
class OutOfMemory:
    """A rank that ran out of memory: its ``oom`` event, and when its replica is dropped, that and the line."""

    event: dict
    replica: int
    dropped: bool
    line: Optional[str] = None


@dataclass(frozen=True)
class ErrorStop:
    """The job stops on a rank's own error: why, and what its ``job_stopped`` event says of the rank (an own error is
    no ``rank_failed`` event: docs/metrics.md)."""

    reason: str
    details: dict


@dataclass(frozen=True)
class Triage:
    out_of_memory: tuple[OutOfMemory, ...] = ()
    """In the order of their events."""
    stop: Optional[ErrorStop] = None
    retired: tuple[int, ...] = ()
    """Launch ranks that leave with the replicas dropped (their other live slots), sorted; the deaths are absorbed."""


def only_echoes(reported: tuple[tuple[Death, dict], ...]) -> bool:
    """Every reported error echoes another rank's: the rank with the cause may exit a moment later (wait for it)."""
    return bool(reported) and all(error.get("echo") for _, error in reported)


def echo_sources(identity: Mapping[int, tuple[int, ...]], dead: frozenset[int], deaths: tuple[Death, ...]) -> list[int]:
    """The launch ranks that may still report the cause behind echoes: neither dead nor dying."""
    dying = {d.launch_rank for d in deaths}
    return [lr for lr in identity if lr not in dead and lr not in dying]


def own_errors(reported: tuple[tuple[Death, dict], ...],
               cause_behind: Optional[tuple[int, dict]]) -> list[tuple[Death, dict]]:
    """The errors reported, the cause first: not a rank that only echoes it (the rank behind the echoes first of all),
    nor one that gave up waiting on its peers, and an error of the program before running out of memory."""
    errors = sorted(reported, key=lambda de: (bool(de[1].get("echo")), bool(de[1].get("waited")),
                                              bool(de[1].get("out_of_memory"))))
    if errors and errors[0][1].get("echo") and cause_behind is not None:
        launch_rank, report = cause_behind
        errors.insert(0, (Death(launch_rank, report["time"], own_error_cause(report), error=report["error"]), report))
    return errors


def out_of_memory_only(errors: list[tuple[Death, dict]]) -> bool:
    return bool(errors) and all(error.get("out_of_memory") for _, error in errors)


def triage(batch: Batch) -> Triage:
    """Stop on the first of the batch's own errors (:func:`own_errors`), unless every one ran out of memory in a
    degraded replica that can be dropped (:func:`out_of_memory`): then, as without any error, the deaths are
    absorbed."""
    errors = own_errors(batch.reported, batch.cause_behind)
    triaged: tuple[OutOfMemory, ...] = ()
    if out_of_memory_only(errors):
        triaged = out_of_memory(batch, errors)
        if all(oom.dropped for oom in triaged):  # absorbed: the replicas whose layouts did not fit are dropped
            retired = sorted({lr for oom in triaged for lr in oom.event["retired"]})
            return Triage(triaged, retired=tuple(retired))
    if errors:  # the rank's own error (ntp_megatron.elastic.errors): no re-formation gets past it
        return Triage(triaged, stop=error_stop(batch, *errors[0]))
    return Triage()


def error_stop(batch: Batch, d: Death, error: dict) -> ErrorStop:
    reason = f"launch rank {d.launch_rank} {own_error_cause(error)}"
    replica, slot = batch.identity[d.launch_rank][:2]
    return ErrorStop(reason, {"launch_rank": d.launch_rank, "replica": replica, "slot": slot,
                              **_stage(batch, d.launch_rank), "generation": batch.latest.generation,
                              "iteration": error["iteration"], "phase": error["phase"], "cause": d.cause,
                              "error_time": d.time})


def out_of_memory(batch: Batch, errors: list[tuple[Death, dict]]) -> tuple[OutOfMemory, ...]:
    """Ranks ran out of memory (``errors``: every error reported in the batch). On a rank of a degraded replica
    (re-forming into it, or training in it) its layout does not fit that device: under policy ``drop_replica`` the
    replica is dropped. If every one of them can be, each is dropped, and with it the launch ranks of its other live
    slots (its event's ``retired``); otherwise (a healthy replica, whose layout is the launch's own, or policy
    ``stop`` / ``restart``, where a restart would meet the same layout) none is and the job stops naming the error.
    Either way an ``oom`` event per rank says which policy was taken."""
    judged = []
    for death, report in errors:
        replica, slot = batch.identity[death.launch_rank][:2]
        # The layout the rank ran out of memory in: the one it was forming, or the one it trained in (a newer
        # generation may be published and not formed yet, e.g. a rebalance at the next boundary).
        layout = batch.latest if report.get("phase") == "reform" else batch.completed
        widths = replica_widths(layout, replica) or []  # one per stage
        stage = _stage(batch, death.launch_rank).get("stage", 0)
        # A canonical stage has the launch layout, which fitted; a degraded or rebalanced one has not.
        degraded = bool(widths) and not layout.stages[stage].is_healthy(replica)
        judged.append((death, report, replica, slot, widths, stage, degraded))
    # Never under the distributed optimizer: with one instance the dropped ranks' shards are lost, with more the
    # instances' positions would renumber (_check_shards).
    drop = batch.policy == "drop_replica" and all(j[-1] for j in judged) and not batch.sharded
    dying = {d.launch_rank for d in batch.deaths}
    out = []
    for death, report, replica, slot, widths, stage, degraded in judged:
        others = [lr for lr, s in batch.identity.items() if s[0] == replica and lr not in dying
                  and lr not in batch.dead and batch.latest.rank_of(*s) is not None] if drop else []
        event = {"kind": "event", "event": "oom", "launch_rank": death.launch_rank, "replica": replica, "slot": slot,
                 "generation": batch.latest.generation, "iteration": report["iteration"], "phase": report["phase"],
                 "degraded": degraded, "policy": "drop_replica" if drop else "stop", "retired": others}
        line = None
        if drop:
            where = "".join(f", stage {p}" for p in _stage(batch, death.launch_rank).values())
            line = (f"launch rank {death.launch_rank} (replica {replica}, slot {slot}{where}) ran out of memory "
                    f"at iteration {report['iteration']}, phase {report['phase']}, in degraded replica {replica} "
                    f"(TP{widths[stage]}{where}): dropping replica {replica} (ntp.on_unrecoverable: drop_replica)")
        out.append(OutOfMemory(event, replica, drop, line))
    return tuple(out)


def _stage(batch: Batch, launch_rank: int) -> dict:
    """``{"stage": p}`` for a launch rank of a job with pipeline stages, else empty (as failure reports name it)."""
    stage = named_stage(batch.identity[launch_rank])
    return {} if stage is None else {"stage": stage}


# -- 2. the successor: the next generation, or why the job stops ------------------------------------------------------

@dataclass(frozen=True)
class Absorbed:
    """What :func:`successor` decides over: the deaths booked and the iteration in flight settled (read by the
    controller)."""

    deaths: tuple[Death, ...]
    latest: JobTopology
    """The newest published generation (it ends now)."""
    base: JobTopology
    """The newest completed generation, after the settle: the layout the survivors hold, where ranks trained."""
    dead_since_base: Mapping[int, tuple[int, ...]]
    """Launch rank -> identity of every rank dead since ``base`` (this batch and the ranks it retires included)."""
    in_flight: Optional[tuple[int, str, int]]
    """What :func:`ntp_megatron.elastic.commit.settle` settled in ``base`` (None: no iteration was in flight)."""
    settled: Optional[dict]
    """The controller's record of the iteration settled since ``base`` completed, for the publication."""
    start_iteration: int
    injected: Mapping[int, dict]
    """Launch rank -> what its injected failure recorded (:func:`ntp_megatron.elastic.failure_report.injected_failure`),
    for the deaths that have one."""
    identity: Mapping[int, tuple[int, ...]]
    min_tp: int
    policy: str
    sharded: Optional[ShardedOptimizer]


@dataclass(frozen=True)
class Successor:
    """The next generation (``topology`` set: publish it with ``info``, ending ``ends``), or why the job stops
    (``reason``: stop it, ending ``ends``, after the ``shards_lost`` events)."""

    topology: Optional[JobTopology]
    dead_ranks: tuple[int, ...]
    """``base``'s ranks that died since it completed."""
    ends: tuple[int, ...]
    """The generations a rank may be in, which end now: where ranks trained, and the newest published."""
    info: Optional[dict] = None
    reason: Optional[str] = None
    shards_lost: tuple[dict, ...] = ()


def successor(a: Absorbed) -> Successor:
    """The generation after ``a.latest``, built on the layout the survivors hold with every death since; or why NTP
    cannot absorb the deaths."""
    base = a.base
    dead_ranks = tuple(base.rank_of(*slot) for slot in a.dead_since_base.values() if base.rank_of(*slot) is not None)
    # Before the run's first commit every rank builds any unit from the seed or the loaded checkpoint.
    moves_needed = a.in_flight is None or a.in_flight[0] > a.start_iteration + 1
    decided = succession(base, list(dead_ranks), a.min_tp, a.policy, a.sharded, moves_needed)
    if decided.topology is None:
        return Successor(None, dead_ranks, (base.generation, a.latest.generation), reason=decided.reason,
                         shards_lost=shards_lost(a, decided.lost_shards))
    new = with_generation(decided.topology, a.latest.generation + 1)
    failed_at = min(a.injected.get(d.launch_rank, {}).get("time", d.time) for d in a.deaths)
    info = {"base": base.generation, "dead": [list(s) for s in a.dead_since_base.values()], "settled": a.settled,
            "failure_time": failed_at, "deaths": [dataclasses.asdict(d) for d in a.deaths]}
    return Successor(new, dead_ranks, tuple(sorted({base.generation, a.latest.generation})), info=info)


def shards_lost(a: Absorbed, lost: tuple[tuple[int, int], ...]) -> tuple[dict, ...]:
    """A ``shard_lost`` event per distributed-optimizer shard every holder of which died (``ntp.on_unrecoverable``
    decides what follows: a restart from the newest checkpoint, or a stop)."""
    if not lost:
        return ()
    dp, k = a.sharded.data_parallel_size, a.sharded.instances
    base = a.base
    launch_of = {base.rank_of(*slot): lr for lr, slot in a.identity.items() if base.rank_of(*slot) is not None}
    return tuple({"kind": "event", "event": "shard_lost", "generation": base.generation, "block": block,
                  "position": position, "holders": sorted(launch_of[r] for r in shard_holders(base.only_stage, dp, k,
                                                                                               (block, position))),
                  "numel": a.sharded.shard_numel(block, position)} for block, position in lost)
