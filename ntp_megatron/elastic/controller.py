"""The controller: turns rank deaths into the next generation (launcher side, node 0).

It lives in the launcher, which owns the store and outlives every rank (launch rank 0 included). For each
batch of deaths it

0. stops the job on a rank's own error, unless every one ran out of memory in a degraded replica it can drop (the
   error is the ``job_stopped`` event's, :attr:`Controller.error_stop`: no ``rank_failed`` event, docs/metrics.md);
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

What to do is decided without the store (:mod:`ntp_megatron.elastic.triage`: steps 0 and 3, over plain inputs this
reads); this applies the decisions — events, lines, store writes — in the order above.

A second failure during a re-formation is just the next batch of deaths: generation ``g+2`` builds on the
last completed layout with every death since then.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch.distributed as dist

from ntp_megatron.elastic import commit, keys, publication
from ntp_megatron.elastic.boundary import Boundary
from ntp_megatron.elastic.commit import abandon_formation, settle
from ntp_megatron.elastic.errors import cause_behind_echoes, reported_error
from ntp_megatron.elastic.failure_report import FailureReports, injected_failure
from ntp_megatron.elastic.triage import Absorbed, Batch, Death, ErrorStop, echo_sources, only_echoes, \
    out_of_memory_only, own_errors, successor, triage
from ntp_megatron.plan.rebalance import Decision
from ntp_megatron.plan.stages import JobTopology
from ntp_megatron.plan.succession import ShardedOptimizer


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
        self.error_stop: dict = {}
        """What the ``job_stopped`` event says of the rank whose own error stopped the job (empty: none did)."""
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
        """Absorb ``deaths`` into a new generation; returns None, or why the job must stop. The decisions are
        :mod:`ntp_megatron.elastic.triage`'s; this reads what they need and applies them, in this order."""
        deaths = [d for d in deaths if d.launch_rank not in self.dead]
        if not deaths:
            return None
        triaged = triage(self._batch(deaths))
        for oom in triaged.out_of_memory:
            self.emit({**oom.event, "time": time.time()})
            if oom.dropped:  # they come back only whole
                self.unfit.add(oom.replica)
                self.say(oom.line)
        if triaged.stop is not None:
            return self._stop_on_error(triaged.stop)
        absorbed = self._absorb(deaths, list(triaged.retired))
        decided = successor(absorbed)
        if decided.topology is None:
            for event in decided.shards_lost:
                self.emit({**event, "time": time.time()})
            self._stop(decided.reason, set(decided.ends))
            self.reports.report(deaths, absorbed.latest, self.settled, [], wait_s=0.0)  # nobody re-forms: report now
            return decided.reason
        self.reports.start(deaths, absorbed.latest, self.settled)
        self._publish(decided.topology, decided.info, base=absorbed.base.generation,
                      dead_ranks=list(decided.dead_ranks), ends=list(decided.ends))
        return None

    def _batch(self, deaths: list[Death]) -> Batch:
        """What :func:`triage` needs: the errors the dying ranks reported of their own (waiting a moment for the cause
        when all are echoes), and the newest completed layout when every error ran out of memory."""
        reported = tuple((d, e) for d in deaths if (e := reported_error(self.store, d.launch_rank, d.pid)) is not None)
        cause = None
        if only_echoes(reported):  # the rank with the cause may exit a moment later
            cause = cause_behind_echoes(self.store, echo_sources(self.identity, frozenset(self.dead), tuple(deaths)))
        if out_of_memory_only(own_errors(reported, cause)):
            self._refresh_completed()
        return Batch(tuple(deaths), reported, cause, self.latest, self.completed, dict(self.identity),
                     frozenset(self.dead), self.policy, self.sharded is not None)

    def _stop_on_error(self, stop: ErrorStop) -> str:
        self.error_stop = stop.details
        self._refresh_completed()
        self._stop(stop.reason, {self.completed.generation, self.latest.generation})
        return stop.reason

    def _stop(self, reason: str, generations: set[int]) -> None:
        """End the job: the stop, then the end of every generation a rank may be in."""
        keys.stop(self.store, reason)
        for g in generations:
            keys.end(self.store, g, "stop")

    def _absorb(self, deaths: list[Death], retired: list[int]) -> Absorbed:
        """Book the deaths (and the ranks ``retired`` with them) and settle the iteration in flight; returns what
        :func:`successor` needs."""
        self.dead.update(d.launch_rank for d in deaths)
        self.dead.update(retired)
        self.failures += len(deaths)
        old = self.latest
        if self._completed_generation() != old.generation and not abandon_formation(self.store, old.generation):
            # It completed just now: its last rank wrote the verdict and had not yet recorded the generation.
            commit.record_completed(self.store, old.generation)
        self._refresh_completed()
        # Ranks train in the newest completed generation: ``old`` itself, or one before it when a re-formation or an
        # admission was pending (with an admission pending, ranks train there until the boundary). Both end now
        # (the successor's ``ends``). Ranks only train in a completed generation: settle the iteration in flight there (none if they had all
        # left it at an admission boundary; the same one again if a re-formation after a failure was interrupted).
        in_flight = settle(self.store, self.completed.generation)
        if in_flight is not None:
            self.settled = {"generation": self.completed.generation, "iteration": in_flight[0],
                            "decision": in_flight[1], "started": in_flight[2]}
        for launch_rank in [d.launch_rank for d in deaths] + retired:
            self.dead_since_completed[launch_rank] = self.identity[launch_rank]
        injected = {d.launch_rank: found for d in deaths
                    if (found := injected_failure(self.store, d.launch_rank, d.pid)) is not None}
        return Absorbed(tuple(deaths), old, self.completed, dict(self.dead_since_completed), in_flight, self.settled,
                        self.start_iteration, injected, dict(self.identity), self.min_tp, self.policy, self.sharded)

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
