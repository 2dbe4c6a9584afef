"""The controller: turns rank deaths into the next generation (launcher side, node 0).

It lives in the launcher, which owns the store and outlives every rank (launch rank 0 included). For each
batch of deaths it

1. decides what the survivors hold: the newest generation whose re-formation completed (if a newer one was
   still forming, it is marked incomplete and its survivors fall back to the layout they had);
2. settles the iteration in flight exactly once (:func:`ntp_megatron.elastic.commit.settle`);
3. computes the next topology — a pure function of that layout and the dead slots
   (:func:`ntp_megatron.plan.succession.succession`) — or, when NTP cannot absorb the failure under
   ``ntp.on_unrecoverable: stop``, stops the job with a clear message;
4. publishes generation ``g+1`` (its topology and why it exists: :mod:`ntp_megatron.elastic.publication`), then
   marks ``g`` over, which sends every survivor's watchdog to close ``g``'s sockets; the failure's report waits for
   the survivors in a thread (:mod:`ntp_megatron.elastic.failure_report`).

Admissions and rebalances, published at an iteration boundary, are :mod:`ntp_megatron.elastic.boundary`'s.

A second failure during a re-formation is just the next batch of deaths: generation ``g+2`` builds on the
last completed layout with every death since then.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from ntp_megatron.elastic import commit, keys, publication
from ntp_megatron.elastic.boundary import Boundary
from ntp_megatron.elastic.commit import abandon_formation, settle
from ntp_megatron.elastic.errors import cause_behind_echoes, own_error_cause, reported_error
from ntp_megatron.elastic.failure_report import FailureReports, injected_failure
from ntp_megatron.plan.optimizer_shards import shard_holders
from ntp_megatron.plan.rebalance import Decision
from ntp_megatron.plan.stages import JobTopology, replica_widths, with_generation
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


class Controller:
    def __init__(self, store: dist.Store, topology: JobTopology, min_tp: int, policy: str,
                 say: Callable[[str], None], emit: Callable[[dict], None],
                 dump_stacks: Callable[[list[int]], None] = lambda ranks: None,
                 hold: Callable[[], None] = lambda: None, release: Callable[[], None] = lambda: None,
                 start_iteration: int = 0, start_consumed: int = 0,
                 sharded: Optional[ShardedOptimizer] = None) -> None:
        """``start_iteration`` / ``start_consumed``: where a run resumed from a checkpoint begins (the store's
        committed iteration starts there, so settling and re-forming after a resume work as in a fresh run).
        ``sharded``: the job trains with the distributed optimizer (what its shards are; None otherwise).
        ``hold`` / ``release``: hold the ranks' output back while a failure's report waits for the survivors, so
        that what they print about the failure (a re-formation) comes after its "rank failed" line."""
        self.store = store
        self.latest = topology
        self.completed = topology
        self.published: dict[int, JobTopology] = {0: topology}
        self.min_tp, self.policy = min_tp, policy
        self.sharded = sharded
        self.say, self.emit = say, emit
        self.identity = {rank: topology.slot_of(rank) for rank in range(topology.world_size)}
        """Launch rank -> (replica, slot), fixed for the run (generation 0's ranks are the launch ranks)."""
        self.dead_since_completed: dict[int, tuple[int, int]] = {}
        self.dead: set[int] = set()
        self.failures = 0
        self.unfit: set[int] = set()
        """Replicas dropped because a rank of theirs ran out of memory in a degraded layout: they come back only
        whole (every slot admitted at once: the launch layout, which fitted)."""
        self.settled: Optional[dict] = None
        self.boundary = Boundary(self)
        self.reports = FailureReports(store, self.identity, self.dead, policy, say, emit, dump_stacks, hold, release)
        # Generation 0 is formed by its ranks like any other (COMPLETED once it is).
        self._publish(topology, {"base": 0, "dead": [], "settled": None, "failure_time": time.time(), "deaths": []},
                      base=None, dead_ranks=[])
        self.start_iteration = commit.init_progress(store, start_iteration, start_consumed)

    def live_launch_ranks(self) -> list[int]:
        """Launch ranks with a slot in the newest generation."""
        return [lr for lr, slot in self.identity.items() if self.latest.rank_of(*slot) is not None]

    def close(self) -> None:
        """Wait (bounded) for the failure reports still waiting on survivors, before the store goes away."""
        self.reports.close()

    # -- deaths -------------------------------------------------------------------------------------------------------

    def handle(self, deaths: list[Death]) -> Optional[str]:
        """Absorb ``deaths`` into a new generation; returns None, or why the job must stop."""
        deaths = [d for d in deaths if d.launch_rank not in self.dead]
        if not deaths:
            return None
        errors = self._own_errors(deaths)
        retired: list[int] = []
        if errors and all(error.get("out_of_memory") for _, error in errors):
            dropping = self._out_of_memory(errors, {d.launch_rank for d in deaths})
            if dropping is not None:  # absorbed: the replicas whose layouts did not fit are dropped below
                errors, retired = [], dropping
        if errors:  # the rank's own error (ntp_megatron.elastic.errors): no re-formation gets past it
            return self._stop_on_error(*errors[0])
        old, running, base, dead_ranks, in_flight = self._absorb(deaths, retired)
        # Before the run's first commit every rank builds any unit from the seed or the loaded checkpoint.
        moves_needed = in_flight is None or in_flight[0] > self.start_iteration + 1
        decided = succession(base, dead_ranks, self.min_tp, self.policy, self.sharded, moves_needed)
        if decided.topology is None:
            self._shards_lost(base, decided.lost_shards)
            self._stop(decided.reason, {running, old.generation})
            self.reports.report(deaths, old, self.settled, [], wait_s=0.0)  # nobody re-forms: report now
            return decided.reason
        self.reports.start(deaths, old, self.settled)
        new = with_generation(decided.topology, old.generation + 1)
        failed_at = min((injected_failure(self.store, d.launch_rank) or {}).get("time", d.time) for d in deaths)
        info = {"base": base.generation, "dead": [list(s) for s in self.dead_since_completed.values()],
                "settled": self.settled, "failure_time": failed_at,
                "deaths": [dataclasses.asdict(d) for d in deaths]}
        self._publish(new, info, base=base.generation, dead_ranks=dead_ranks, ends=sorted({running, old.generation}))
        return None

    def _own_errors(self, deaths: list[Death]) -> list[tuple[Death, dict]]:
        """The errors the dying ranks reported of their own, the cause first: not a rank that only echoes it, and an
        error of the program before running out of memory."""
        errors = [(d, e) for d in deaths if (e := reported_error(self.store, d.launch_rank)) is not None]
        errors.sort(key=lambda de: (bool(de[1].get("echo")), bool(de[1].get("out_of_memory"))))
        if errors and errors[0][1].get("echo"):  # the rank with the cause may exit a moment later
            others = [lr for lr in self.identity if lr not in self.dead and lr not in {d.launch_rank for d in deaths}]
            found = cause_behind_echoes(self.store, others)
            if found is not None:
                errors.insert(0, (Death(found[0], found[1]["time"], own_error_cause(found[1]),
                                        error=found[1]["error"]), found[1]))
        return errors

    def _stop_on_error(self, d: Death, error: dict) -> str:
        reason = (f"launch rank {d.launch_rank} failed with an error of its own (iteration {error['iteration']}, "
                  f"phase {error['phase']}): {error['error']}")
        replica, slot = self.identity[d.launch_rank][:2]
        self.emit({"kind": "event", "event": "rank_failed", "launch_rank": d.launch_rank, "replica": replica,
                   "slot": slot, **self.reports.stage(d.launch_rank), "generation": self.latest.generation,
                   "iteration": error["iteration"], "phase": error["phase"], "cause": d.cause, "detect_s": None,
                   "time": d.time})
        self._refresh_completed()
        self._stop(reason, {self.completed.generation, self.latest.generation})
        return reason

    def _stop(self, reason: str, generations: set[int]) -> None:
        """End the job: the stop, then the end of every generation a rank may be in."""
        keys.stop(self.store, reason)
        for g in generations:
            keys.end(self.store, g, "stop")

    def _absorb(self, deaths: list[Death], retired: list[int]):
        """Book the deaths and settle the iteration in flight. Returns (the newest published generation, the one
        ranks trained in, the layout the survivors hold, its ranks that died since, the iteration settled)."""
        self.dead.update(d.launch_rank for d in deaths)
        self.dead.update(retired)
        self.failures += len(deaths)
        old = self.latest
        if self._completed_generation() != old.generation and not abandon_formation(self.store, old.generation):
            # It completed just now: its last rank wrote the verdict and had not yet recorded the generation.
            commit.record_completed(self.store, old.generation)
        self._refresh_completed()
        # Where ranks train: ``old`` itself, or the newest completed generation before it when a re-formation or an
        # admission was pending (with an admission pending, ranks train there until the boundary). Both end now.
        running = self.completed.generation
        # Ranks only train in a completed generation: settle the iteration in flight there (none if they had all
        # left it at an admission boundary; the same one again if a re-formation after a failure was interrupted).
        in_flight = settle(self.store, self.completed.generation)
        if in_flight is not None:
            self.settled = {"generation": self.completed.generation, "iteration": in_flight[0],
                            "decision": in_flight[1], "started": in_flight[2]}
        for launch_rank in [d.launch_rank for d in deaths] + retired:
            self.dead_since_completed[launch_rank] = self.identity[launch_rank]
        base = self.completed
        dead_ranks = [base.rank_of(*slot) for slot in self.dead_since_completed.values()
                      if base.rank_of(*slot) is not None]
        return old, running, base, dead_ranks, in_flight

    def _shards_lost(self, base: JobTopology, lost: tuple[tuple[int, int], ...]) -> None:
        """A ``shard_lost`` event per distributed-optimizer shard every holder of which died
        (``ntp.on_unrecoverable`` decides what follows: a restart from the newest checkpoint, or a stop)."""
        if not lost:
            return
        dp, k = self.sharded.data_parallel_size, self.sharded.instances
        launch_of = {base.rank_of(*slot): lr for lr, slot in self.identity.items() if base.rank_of(*slot) is not None}
        for block, position in lost:
            holders = shard_holders(base.only_stage, dp, k, (block, position))
            self.emit({"kind": "event", "event": "shard_lost", "generation": base.generation, "block": block,
                       "position": position, "holders": sorted(launch_of[r] for r in holders),
                       "numel": self.sharded.shard_numel(block, position), "time": time.time()})

    def _out_of_memory(self, errors: list[tuple[Death, dict]], dying: set[int]) -> Optional[list[int]]:
        """Ranks ran out of memory (``errors``: every error reported in this batch of deaths). On a rank of a
        degraded replica (re-forming into it, or training in it) its layout does not fit that device: under policy
        ``drop_replica`` the replica is dropped. If every one of them can be, the launch ranks of the dropped
        replicas' other live slots are returned (they retire with them) and the job goes on; otherwise (None: a
        healthy replica, whose layout is the launch's own, or policy ``stop`` / ``restart``, where a restart would
        meet the same layout) the job stops naming the error. Either way an ``oom`` event per rank says which
        policy was taken."""
        decided = []
        self._refresh_completed()
        for death, report in errors:
            replica, slot = self.identity[death.launch_rank][:2]
            # The layout the rank ran out of memory in: the one it was forming, or the one it trained in (a newer
            # generation may be published and not formed yet, e.g. a rebalance at the next boundary).
            layout = self.latest if report.get("phase") == "reform" else self.completed
            widths = replica_widths(layout, replica) or []  # one per stage
            stage = self.reports.stage(death.launch_rank).get("stage", 0)
            stage_topology = layout.stages[stage]
            # A canonical stage has the launch layout, which fitted; a degraded or rebalanced one has not.
            degraded = bool(widths) and not stage_topology.is_healthy(replica)
            decided.append((death, report, replica, slot, widths, degraded))
        # Never under the distributed optimizer: with one instance the dropped ranks' shards are lost, with more the
        # instances' positions would renumber (_check_shards).
        drop = self.policy == "drop_replica" and all(d[-1] for d in decided) and self.sharded is None
        retired: set[int] = set()
        for death, report, replica, slot, widths, degraded in decided:
            others = [lr for lr, s in self.identity.items() if s[0] == replica and lr not in dying
                      and lr not in self.dead and self.latest.rank_of(*s) is not None] if drop else []
            retired.update(others)
            self.emit({"kind": "event", "event": "oom", "launch_rank": death.launch_rank, "replica": replica,
                       "slot": slot, "generation": self.latest.generation, "iteration": report["iteration"],
                       "phase": report["phase"], "degraded": degraded, "policy": "drop_replica" if drop else "stop",
                       "retired": others, "time": time.time()})
            if drop:
                self.unfit.add(replica)
                where = "".join(f", stage {p}" for p in self.reports.stage(death.launch_rank).values())
                self.say(f"launch rank {death.launch_rank} (replica {replica}, slot {slot}{where}) ran out of memory "
                         f"at iteration {report['iteration']}, phase {report['phase']}, in degraded replica {replica} "
                         f"(TP{widths[stage]}{where}): dropping replica {replica} (ntp.on_unrecoverable: drop_replica)")
        return sorted(retired) if drop else None

    def _refresh_completed(self) -> None:
        """Catch up with the newest completed generation: survivors hold its layout, and deaths before it are
        part of it."""
        g = self._completed_generation()
        if g > self.completed.generation:
            self.completed, self.dead_since_completed, self.settled = self.published[g], {}, None

    def forming(self) -> bool:
        """A published generation has not completed its re-formation yet."""
        self._refresh_completed()
        return self._completed_generation() != self.latest.generation

    def _completed_generation(self) -> int:
        """The newest generation whose formation completed; -1 while generation 0 is still forming."""
        return commit.completed(self.store)

    def admit(self, launch_ranks: list[int]) -> bool:
        """Admit replacement processes at the next iteration boundary (:meth:`Boundary.admit`)."""
        return self.boundary.admit(launch_ranks)

    def rebalance(self, decisions: list[Decision]) -> bool:
        """Rebalance TP groups at the next iteration boundary (:meth:`Boundary.rebalance`)."""
        return self.boundary.rebalance(decisions)

    def _decided(self, generation: int) -> list[tuple[str, str]]:
        """What ``generation`` decided that a rank may still wait for as it ends (its formation's verdict, the last
        committed iteration's decision, the next one's), for the nodes' relays to copy with its end."""
        return commit.decided(self.store, generation)

    # -- publication ----------------------------------------------------------------------------------------------

    def _publish(self, new: JobTopology, info: dict, base: Optional[int], dead_ranks: list[int],
                 boundary_of: Optional[int] = None, ends: list[int] = ()) -> None:
        """Publish ``new`` (:func:`ntp_megatron.elastic.publication.publish`), end the generations ``ends`` naming the
        dead (groups without one may go on), and record a ``generation_published`` event: the new topology, the
        generation it builds on, the ranks of that generation that died and the slots that join, so a reader can
        work out what a re-formation had to move without asking the ranks."""
        published = publication.publish(self.store, new, info, boundary_of)
        dead = [self.identity[lr] for lr in self.dead]
        for ended in ends:
            # In a node's store as here: the decisions before the new generation (a survivor reads the decision
            # on the iteration it voted once it sees the new generation).
            keys.end(self.store, ended, keys.abort_value(dead, self._decided(ended) + published))
        self.latest = self.published[new.generation] = new
        self.emit({"kind": "event", "event": "generation_published", "generation": new.generation,
                   "base": base, "dead_ranks": sorted(dead_ranks), "joined": [list(s) for s in info.get("joined", [])],
                   "topology": new.to_json(), "time": time.time()})
