"""The controller: turns rank deaths into the next generation (launcher side, node 0).

It lives in the launcher, which owns the store and outlives every rank (launch rank 0 included). For each
batch of deaths it

1. decides what the survivors hold: the newest generation whose re-formation completed (if a newer one was
   still forming, it is marked incomplete and its survivors fall back to the layout they had);
2. settles the iteration in flight exactly once (:func:`ntp_megatron.elastic.commit.settle`);
3. computes the next topology — a pure function of that layout and the dead slots
   (:func:`ntp_megatron.plan.layout.next_topology`) — or, when NTP cannot absorb the failure under
   ``ntp.on_unrecoverable: stop``, stops the job with a clear message;
4. publishes generation ``g+1`` (its topology and why it exists), then marks ``g`` over, which sends every
   survivor's watchdog to close ``g``'s sockets.

A second failure during a re-formation is just the next batch of deaths: generation ``g+2`` builds on the
last completed layout with every death since then.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Optional

import torch.distributed as dist

from ntp_megatron.elastic import keys
from ntp_megatron.elastic.commit import abandon_formation, settle
from ntp_megatron.elastic.errors import cause_behind_echoes, own_error_cause, reported_error
from ntp_megatron.plan.layout import Topology, TopologyError
from ntp_megatron.plan.stages import PipelineTopology, join_topology, live_widths, next_topology, replica_widths, \
    reweight_topology, transition_plan, weights_to_json, with_generation
from ntp_megatron.plan.rebalance import Decision
from ntp_megatron.plan import memory_plan
from ntp_megatron.plan.optimizer_shards import buffer_layout, lost_shards, shard_holders, shard_numel

AWARE_WAIT_S = 10.0


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
    def __init__(self, store: dist.Store, topology: Topology, min_tp: int, policy: str,
                 say: Callable[[str], None], emit: Callable[[dict], None],
                 dump_stacks: Callable[[list[int]], None] = lambda ranks: None,
                 hold: Callable[[], None] = lambda: None, release: Callable[[], None] = lambda: None,
                 start_iteration: int = 0, start_consumed: int = 0,
                 sharded: Optional["ShardedOptimizer"] = None) -> None:
        """``start_iteration`` / ``start_consumed``: where a run resumed from a checkpoint begins (the store's
        committed iteration starts there, so settling and re-forming after a resume work as in a fresh run).
        ``sharded``: the job trains with the distributed optimizer (what its shards are; None otherwise).
        ``hold`` / ``release``: hold the ranks' output back while a failure's report waits for the survivors, so
        that what they print about the failure (a re-formation) comes after its "rank failed" line."""
        self.store = store
        self.latest = topology
        self.completed = topology
        self.published: dict[int, Topology] = {0: topology}
        self.min_tp, self.policy = min_tp, policy
        self.sharded = sharded
        self.say, self.emit = say, emit
        self.dump_stacks = dump_stacks
        self.hold, self.release = hold, release
        self.identity = {rank: topology.slot_of(rank) for rank in range(topology.world_size)}
        """Launch rank -> (replica, slot), fixed for the run (generation 0's ranks are the launch ranks)."""
        self.dead_since_completed: dict[int, tuple[int, int]] = {}
        self.dead: set[int] = set()
        self.failures = 0
        self.unfit: set[int] = set()
        """Replicas dropped because a rank of theirs ran out of memory in a degraded layout: they come back only
        whole (every slot admitted at once: the launch layout, which fitted)."""
        self._not_rebalanced: set[tuple] = set()
        """Rebalances refused in a generation ((generation, replica, stage, weights)): not worked out again, said
        once."""
        self._not_admitted: Optional[tuple[list[int], str]] = None
        """The last admission refused (launch ranks, why): said once, not at every poll."""
        self.settled: Optional[dict] = None
        self._threads: list[threading.Thread] = []
        store.set(keys.topology(0), json.dumps(topology.to_json()))
        store.set(keys.info(0), json.dumps({"base": 0, "dead": [], "settled": None, "failure_time": time.time(),
                                            "deaths": []}))
        store.set(keys.LATEST, "0")  # generation 0 is formed by its ranks like any other (COMPLETED once it is)
        self._published(topology, base=None, dead=[], joined=[])
        if not store.check([keys.COMMITTED]):
            store.set(keys.START, str(start_iteration))
            store.set(keys.COMMITTED, str(start_iteration))
            store.set(keys.CONSUMED, str(start_consumed))
        self.start_iteration = int(store.get(keys.START).decode())

    def live_launch_ranks(self) -> list[int]:
        """Launch ranks with a slot in the newest generation."""
        return [lr for lr, slot in self.identity.items() if self.latest.rank_of(*slot) is not None]

    def handle(self, deaths: list[Death]) -> Optional[str]:
        """Absorb ``deaths`` into a new generation; returns None, or why the job must stop."""
        deaths = [d for d in deaths if d.launch_rank not in self.dead]
        if not deaths:
            return None
        errors = [(d, e) for d in deaths if (e := reported_error(self.store, d.launch_rank)) is not None]
        # Name the cause, not a rank that only echoes it; and an error of the program before running out of memory.
        errors.sort(key=lambda de: (bool(de[1].get("echo")), bool(de[1].get("out_of_memory"))))
        if errors and errors[0][1].get("echo"):  # the rank with the cause may exit a moment later
            others = [lr for lr in self.identity if lr not in self.dead and lr not in {d.launch_rank for d in deaths}]
            found = cause_behind_echoes(self.store, others)
            if found is not None:
                errors.insert(0, (Death(found[0], found[1]["time"], own_error_cause(found[1]),
                                        error=found[1]["error"]), found[1]))
        retired: list[int] = []
        if errors and all(error.get("out_of_memory") for _, error in errors):
            dropping = self._out_of_memory(errors, {d.launch_rank for d in deaths})
            if dropping is not None:  # absorbed: the replicas whose layouts did not fit are dropped below
                errors, retired = [], dropping
        if errors:  # the rank's own error (ntp_megatron.elastic.errors): no re-formation gets past it
            d, error = errors[0]
            reason = (f"launch rank {d.launch_rank} failed with an error of its own (iteration {error['iteration']}, "
                      f"phase {error['phase']}): {error['error']}")
            replica, slot = self.identity[d.launch_rank][:2]
            self.emit({"kind": "event", "event": "rank_failed", "launch_rank": d.launch_rank, "replica": replica,
                       "slot": slot, **self._stage(d.launch_rank), "generation": self.latest.generation,
                       "iteration": error["iteration"],
                       "phase": error["phase"], "cause": d.cause, "detect_s": None, "time": d.time})
            self._refresh_completed()
            self.store.set(keys.STOP, reason)
            for g in {self.completed.generation, self.latest.generation}:
                self.store.set(keys.abort(g), "stop")
            return reason
        self.dead.update(d.launch_rank for d in deaths)
        self.dead.update(retired)
        self.failures += len(deaths)
        old = self.latest
        if self._completed_generation() != old.generation and not abandon_formation(self.store, old.generation):
            # It completed just now: its last rank wrote the verdict and had not yet recorded the generation.
            self.store.set(keys.COMPLETED, str(old.generation))
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
        settled = self.settled
        for launch_rank in [d.launch_rank for d in deaths] + retired:
            self.dead_since_completed[launch_rank] = self.identity[launch_rank]
        base = self.completed
        dead_ranks = [base.rank_of(*slot) for slot in self.dead_since_completed.values()
                      if base.rank_of(*slot) is not None]
        try:
            new = next_topology(base, dead_ranks, min_tp=self.min_tp, policy=self.policy)
            if self.sharded is not None:  # before the first commit too: a drop would cut the shards anew
                self._check_no_drop(base, new)
            # Before the run's first commit every rank builds any unit from the seed or the loaded checkpoint.
            if in_flight is None or in_flight[0] > self.start_iteration + 1:
                if self.sharded is not None:  # the state is the shards (units are gathered from them)
                    self._check_shards(base, dead_ranks)
                transition_plan(base, new, dead_ranks)  # every lost unit must have a surviving holder somewhere
        except TopologyError as exc:
            reason = f"NTP cannot absorb the failure: {exc}"
            self.store.set(keys.STOP, reason)
            for g in {running, old.generation}:
                self.store.set(keys.abort(g), "stop")
            self._report(deaths, old, settled, [], wait_s=0.0)  # nobody re-forms: report now
            return reason
        self._report_deaths(deaths, old, settled)
        new = with_generation(new, old.generation + 1)
        failed_at = min((injected_failure(self.store, d.launch_rank) or {}).get("time", d.time) for d in deaths)
        info = {"base": base.generation, "dead": [list(s) for s in self.dead_since_completed.values()],
                "settled": settled, "failure_time": failed_at,
                "deaths": [dataclasses.asdict(d) for d in deaths]}
        g = new.generation
        self.store.set(keys.info(g), json.dumps(info))
        self.store.set(keys.topology(g), json.dumps(new.to_json()))
        self.store.set(keys.LATEST, str(g))
        dead = [self.identity[lr] for lr in self.dead]
        published = [(keys.info(g), json.dumps(info)), (keys.LATEST, str(g))]
        for ended in sorted({running, old.generation}):  # naming the dead: groups without one may go on
            # In a node's store as here: the decisions before the new generation (a survivor reads the decision
            # on the iteration it voted once it sees the new generation).
            self.store.set(keys.abort(ended), keys.abort_value(dead, self._decided(ended) + published))
        self.latest = self.published[g] = new
        self._published(new, base=base.generation, dead=dead_ranks, joined=[])
        return None

    def _decided(self, generation: int) -> list[tuple[str, str]]:
        """What ``generation`` decided that a rank may still wait for as it ends (its formation's verdict, the last
        committed iteration's decision, the next one's), for the nodes' relays to copy with its end."""
        committed = int(self.store.get(keys.COMMITTED).decode())
        out = []
        for key in (keys.formed(generation), keys.decision(generation, committed),
                    keys.decision(generation, committed + 1)):
            if self.store.check([key]):
                out.append((key, self.store.get(key).decode()))
        return out

    def _check_shards(self, base: Topology, dead_ranks: list[int]) -> None:
        """Under the distributed optimizer: every optimizer shard must keep a surviving holder, else a
        ``shard_lost`` event per lost shard and a :class:`TopologyError` (``ntp.on_unrecoverable`` decides: a
        restart from the newest checkpoint, or a stop)."""
        dp, k = self.sharded.data_parallel_size, self.sharded.instances
        lost = lost_shards(base, dead_ranks, dp, k)
        if lost:
            launch_of = {base.rank_of(*slot): lr for lr, slot in self.identity.items()
                         if base.rank_of(*slot) is not None}
            for block, position in lost:
                holders = shard_holders(base, dp, k, (block, position))
                self.emit({"kind": "event", "event": "shard_lost", "generation": base.generation, "block": block,
                           "position": position, "holders": sorted(launch_of[r] for r in holders),
                           "numel": self.sharded.shard_numel(block, position), "time": time.time()})
            one = " (one instance: every shard has a single holder)" if k == 1 else ""
            raise TopologyError(f"distributed-optimizer shards (block, position) {lost} lost: every holder died"
                                f"{one}; nothing live holds them any more")

    def _check_no_drop(self, base: Topology, new: Topology) -> None:
        """Under the distributed optimizer with several instances no replica may be dropped, before the first
        commit as after it: each instance shards over its replicas' positions, which a drop would renumber (the
        shards would have to be cut anew, and the instances would shard differently), which nothing does live.
        Raises :class:`TopologyError` (``ntp.on_unrecoverable`` decides)."""
        k = self.sharded.instances
        dropped = sorted({rep.index for rep in base.replicas} - {rep.index for rep in new.replicas})
        if dropped and k > 1:
            raise TopologyError(
                f"replica{'s' if len(dropped) > 1 else ''} {', '.join(map(str, dropped))} would be dropped, which "
                f"parallel.use_distributed_optimizer with {k} instances does not support live (the instances' "
                "shards would be cut anew)")

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
            stage = self._stage(death.launch_rank).get("stage", 0)
            stage_topology = layout.stages[stage] if isinstance(layout, PipelineTopology) else layout
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
                where = "".join(f", stage {p}" for p in self._stage(death.launch_rank).values())
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
        return int(self.store.get(keys.COMPLETED).decode()) if self.store.check([keys.COMPLETED]) else -1

    def admit(self, launch_ranks: list[int]) -> bool:
        """Admit replacement processes at the next iteration boundary: publish the next generation with their
        slots back (:func:`ntp_megatron.plan.layout.join_topology`) and ask the running generation to move to it after
        its next committed iteration. False if a re-formation is in progress (try again later)."""
        if self.forming():
            return False
        old = self.latest
        launch_ranks = [lr for lr in launch_ranks if old.rank_of(*self.identity[lr]) is None]
        slots_per_replica = old.tp_base * (old.num_stages if isinstance(old, PipelineTopology) else 1)
        partial = {r for r in self.unfit if sum(self.identity[lr][0] == r for lr in launch_ranks) < slots_per_replica}
        launch_ranks = [lr for lr in launch_ranks if self.identity[lr][0] not in partial]  # they wait
        slots = [self.identity[lr] for lr in launch_ranks]
        if not slots:
            return False
        try:
            new = join_topology(old, slots, min_tp=self.min_tp)
        except TopologyError as exc:  # e.g. one slot of a dropped replica: not enough to bring it back yet
            if self._not_admitted != (launch_ranks, str(exc)):
                self._not_admitted = (launch_ranks, str(exc))
                self.say(f"not admitting launch ranks {launch_ranks} yet: {exc}")
            return False
        self.unfit.difference_update(s[0] for s in slots)
        self._not_admitted = None
        new = self._at_boundary(new, {"joined": [list(s) for s in slots]})
        self.dead.difference_update(launch_ranks)
        joined = ", ".join(f"launch rank {lr} (replica {self.identity[lr][0]}, slot {self.identity[lr][1]}"
                           + "".join(f", stage {p}" for p in self._stage(lr).values()) + ")" for lr in launch_ranks)
        self.say(f"admitting {joined} at the next iteration boundary: generation {new.generation}, tp per replica "
                 f"{live_widths(new)}")
        return True

    def rebalance(self, decisions: list[Decision]) -> bool:
        """Reweight TP groups whose ranks run at different speeds (:mod:`ntp_megatron.plan.rebalance`) at the next
        iteration boundary: publish the next generation, in which each slow rank holds a share of the units in
        proportion to its speed (:func:`ntp_megatron.plan.stages.reweight_topology`; nothing dies, no other group
        changes). False if a re-formation is in progress (decide again later)."""
        if self.forming() or not decisions:
            return False
        old = self.latest
        decisions = [d for d in decisions if self._worth_it(old, d)]
        if not decisions:
            return False
        weights = {(d.replica, d.stage): dict(d.weights) for d in decisions}
        new = self._at_boundary(reweight_topology(old, weights), {"weights": weights_to_json(weights)})
        stages = isinstance(old, PipelineTopology)
        for d in decisions:
            where = f"replica {d.replica}" + (f" stage {d.stage}" if stages else "")
            launch = {ident[1]: lr for lr, ident in self.identity.items()
                      if ident[0] == d.replica and (ident[2] if len(ident) > 2 else 0) == d.stage}
            self.emit({"kind": "event", "event": "rebalanced", "generation": new.generation, "replica": d.replica,
                       "stage": d.stage, "weights": {str(s): w for s, w in d.weights.items()},
                       "slowness": {str(s): v for s, v in d.slowness.items()},
                       "launch_ranks": {str(s): lr for s, lr in launch.items()},
                       "iterations": list(d.iterations), "time": time.time()})
            shares = (", ".join(f"slot {s} (launch rank {launch.get(s)})"
                                + (f" {d.slowness[s]:.2f}x slower" if s in d.slowness else "") + f": weight {w}"
                                for s, w in sorted(d.weights.items()) if w < 100)
                      or "its ranks run alike again: units back to their own slots")
            self.say(f"rebalancing {where} at the next iteration boundary: {shares} (iterations "
                     f"{d.iterations[0]}..{d.iterations[-1]}); generation {new.generation}")
        return True

    def _worth_it(self, old: Topology, decision: Decision) -> bool:
        """Whether ``decision`` changes where units are (new weights that give the same layout are not worth a
        re-formation), and gives no rank more of a family than it would hold at ``ntp.min_tp`` (what the memory
        plan and ``ntp.memory_budget_gib`` vouch for); said once when it does."""
        key = (old.generation, decision.replica, decision.stage, tuple(sorted(decision.weights.items())))
        if key in self._not_rebalanced:  # a refused decision the monitor makes again: not worked out again
            return False
        stage_of = (lambda t: t.stages[decision.stage]) if isinstance(old, PipelineTopology) else (lambda t: t)
        new = stage_of(reweight_topology(old, {(decision.replica, decision.stage): dict(decision.weights)}))
        before, after = stage_of(old).replica(decision.replica), new.replica(decision.replica)
        most = {f: max(len(units) for units in new.layout(f, decision.replica)) for f in new.units}
        over = {f: n for f, n in most.items() if n > -(-new.units[f] // self.min_tp)}
        if after.dealt != before.dealt and not over:
            return True
        self._not_rebalanced.add(key)
        if over:
            self.say(f"not rebalancing replica {decision.replica} to weights {dict(decision.weights)}: a rank would "
                     f"hold {over} units, more than at ntp.min_tp ({self.min_tp}), which the memory plan vouches for")
        return False

    def _at_boundary(self, new: Topology, change: dict) -> Topology:
        """Publish ``new`` (what ``change`` says changed: slots joined, or weights) as the next generation, which the
        running one moves to after its next committed iteration."""
        old = self.latest
        new = with_generation(new, old.generation + 1)
        info = {"base": old.generation, "dead": [], "joined": [], **change, "settled": None,
                "failure_time": time.time(), "deaths": []}
        g = new.generation
        self.store.set(keys.info(g), json.dumps(info))
        self.store.set(keys.topology(g), json.dumps(new.to_json()))
        self.store.set(keys.LATEST, str(g))
        self.store.set(keys.reform_requested(old.generation), str(g))
        self.latest = self.published[g] = new
        self._published(new, base=old.generation, dead=[], joined=[tuple(s) for s in info["joined"]])
        return new

    def _stage(self, launch_rank: int) -> dict:
        """``{"stage": p}`` for a launch rank of a job with pipeline stages (its identity names it), else empty."""
        identity = self.identity[launch_rank]
        return {"stage": identity[2]} if len(identity) > 2 else {}

    def _published(self, topology: Topology, base: Optional[int], dead: list[int], joined: list) -> None:
        """A ``generation_published`` event: the new topology as published, the generation it builds on, the ranks
        of that generation that died (its process-group ranks) and the slots that join, so a reader can work out
        what a re-formation had to move without asking the ranks."""
        self.emit({"kind": "event", "event": "generation_published", "generation": topology.generation,
                   "base": base, "dead_ranks": sorted(dead), "joined": [list(s) for s in joined],
                   "topology": topology.to_json(), "time": time.time()})

    def _report_deaths(self, deaths: list[Death], old: Topology, settled: Optional[dict]) -> None:
        """One ``rank_failed`` event and log line per death, once the survivors of ``old`` noticed (so the
        detection latency is known); from a thread, so the controller moves on at once."""
        survivors = [lr for lr, slot in self.identity.items()
                     if old.rank_of(*slot) is not None and lr not in self.dead]

        def report() -> None:
            try:
                self._report(deaths, old, settled, survivors)
            finally:
                self.release()

        self.hold()
        thread = threading.Thread(target=report, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        """Wait (bounded) for the failure reports still waiting on survivors, before the store goes away."""
        deadline = time.monotonic() + AWARE_WAIT_S
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _aware(self, generation: int, survivors: list[int]) -> Optional[list[float]]:
        """When each survivor noted that ``generation`` is over, if every one did (one request each way)."""
        names = [keys.aware(generation, lr) for lr in survivors]
        if not self.store.check(names):
            return None
        return [float(raw.decode()) for raw in self.store.multi_get(names)] if names else []

    def _report(self, deaths: list[Death], old: Topology, settled: Optional[dict], survivors: list[int],
                wait_s: float = AWARE_WAIT_S) -> None:
        deadline = time.monotonic() + wait_s
        aware: list[float] = []
        stopped = False
        full_check_at = 0.0  # a full check that failed (the count includes the dead) is not repeated every pass
        while time.monotonic() < deadline and survivors:
            survivors = [lr for lr in survivors if lr not in self.dead]  # one that died meanwhile cannot notice
            try:
                if self.store.check([keys.STOP]):  # the job stops: the survivors are being ended, not noticing
                    stopped = True
                    break
                # Two small requests per pass (one per survivor would load the root with the job's size every
                # 10 ms just after a failure); the count may include ranks that noted and died since, so every
                # survivor's note is checked (one request) once it says all are in.
                if (int(self.store.add(keys.aware_count(old.generation), 0)) >= len(survivors)
                        and time.monotonic() >= full_check_at):
                    got = self._aware(old.generation, survivors)
                    if got is not None:
                        aware = got
                        break
                    full_check_at = time.monotonic() + 0.5
            except Exception:  # noqa: BLE001 - the store is shutting down with the job
                return
            time.sleep(0.01)
        missing: list[int] = []
        if survivors and not aware and not stopped and wait_s > 0:  # out of time: name the ranks that did not notice
            try:
                missing = [lr for lr in survivors if not self.store.check([keys.aware(old.generation, lr)])]
                if not missing:  # all noted, the count short of them (a note's count lost with its rank's request)
                    aware = self._aware(old.generation, survivors) or []
            except Exception:  # noqa: BLE001 - as above
                return
        if missing:
            self.say(f"launch ranks {missing} did not notice the failure within {AWARE_WAIT_S:.0f} s; "
                     "their stacks follow")
            self.dump_stacks(missing)
        for d in deaths:
            replica, slot = self.identity[d.launch_rank][:2]
            record = injected_failure(self.store, d.launch_rank)
            failed_at = record["time"] if record else d.time
            if aware:
                # The failure happened no later than the first survivor noticed it. A death known only from its
                # exit is stamped when the launcher reaped it, which can be after its direct peers saw their
                # connections close (and clocks of other nodes differ).
                failed_at = min(failed_at, min(aware))
            detect_s = (max(aware) - failed_at) if aware else None
            iteration = record["iteration"] if record else (settled or {}).get("iteration")
            phase = record["phase"] if record else "unknown"
            event = {"kind": "event", "event": "rank_failed", "launch_rank": d.launch_rank, "replica": replica,
                     "slot": slot, **self._stage(d.launch_rank), "generation": old.generation, "iteration": iteration,
                     "phase": phase,
                     "cause": d.cause, "detect_s": detect_s, "time": failed_at}
            self.emit(event)
            stamp = datetime.fromtimestamp(failed_at).strftime("%Y-%m-%d %H:%M:%S")
            ending = f"beyond NTP (policy {self.policy!r})"
            aware_text = (f"{len(aware)} survivors aware in {detect_s:.3f} s" if aware
                          else "survivors not all aware" if survivors else ending)
            where = f"replica {replica}, slot {slot}" + "".join(f", stage {p}" for p in self._stage(d.launch_rank).values())
            self.say(f"[{stamp}] rank failed | launch rank {d.launch_rank} ({where}) | "
                     f"iteration {iteration}, phase {phase} | {d.cause} | {aware_text}")


@dataclass(frozen=True)
class ShardedOptimizer:
    """What the controller knows of a job's distributed-optimizer shards: the launch data-parallel size, the
    instances (Megatron's ``num_distributed_optimizer_instances``), and per block the parameter elements of each
    position's shard (``numel[block][position]``: :func:`ntp_megatron.plan.optimizer_shards.shard_numel` over that
    block's buffers), for the ``shard_lost`` event."""

    data_parallel_size: int
    instances: int
    numel: tuple[tuple[int, ...], ...] = ()

    def shard_numel(self, block: int, position: int) -> Optional[int]:
        return self.numel[block][position] if block < len(self.numel) else None

    @classmethod
    def of(cls, cfg) -> Optional["ShardedOptimizer"]:
        """A :class:`ntp_megatron.config.schema.JobConfig`'s, None without the distributed optimizer."""
        p = cfg.parallel
        if not p.use_distributed_optimizer:
            return None
        if p.pipeline_model_parallel_size > 1:  # refused by the config (JobConfig._check_pipeline) for now
            raise ValueError("the distributed optimizer's shards are planned for one pipeline stage")
        dims, training = memory_plan.ModelDims.of(cfg.model), memory_plan.training_of(cfg)
        topology = cfg.topology()
        params = memory_plan.gpt_params(dims)
        numel = []
        for block in range(topology.tp_base):
            units = {family: len(topology.block(family, block)) for family in dims.units}
            layout = buffer_layout(memory_plan.param_specs(params, units), training.bucket_size,
                                   training.shard_over, True)
            numel.append(tuple(shard_numel(layout, training.shard_over, j) for j in range(training.shard_over)))
        return cls(p.data_parallel_size, p.num_distributed_optimizer_instances, tuple(numel))


def injected_failure(store: dist.Store, launch_rank: int) -> Optional[dict]:
    """What an injected failure recorded just before it happened (spec, phase, iteration, time), if any."""
    try:
        if store.check([keys.failure(launch_rank)]):
            return json.loads(store.get(keys.failure(launch_rank)).decode())
    except Exception:  # noqa: BLE001
        pass
    return None
