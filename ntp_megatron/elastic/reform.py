"""Re-formation on a surviving rank: from a failed generation to the newest one, without stopping.

1. *Settle.* The controller decided the iteration in flight before publishing the new generation: a rank that
   voted for a committed iteration and had not stepped yet steps now (its gradients are final); an aborted one
   is dropped and redone by everyone.
2. *Leave* the old generation: its process groups, Megatron's globals, its store client, its watchdog.
3. *Join* the new one (default group on ``gen<g>/``, NTP groups).
4. *Reshape.* A rank whose units do not change keeps its model, DDP buffers and optimizer; every reference to
   an old process group in them is pointed at the new one. A rank whose units change (its replica lost a
   rank) builds new ones, copies what it kept, and receives the dead rank's units — parameters and optimizer
   state — from the ranks that hold them (:mod:`ntp_megatron.core.unit_moves`). Under the distributed optimizer the
   state is the shards: a rebuilt rank (also every rank of a degraded replica, whose optimizer steps shadows
   of its old groups) takes over the buffers of every block it keeps serving with their shard state (it adopts
   them: never a block twice), copies any other shard it held, and receives the rest from a surviving holder,
   its twin in the other instance; no units move. Then every rank, kept or rebuilt, gathers its parameters from
   the shards in the new groups (a failure in the last step's gather left them partial). A process new to the
   job takes Adam's step and the schedule from its peers.
5. *Complete.* Every rank votes that it is done; only a complete re-formation is adopted (a failure in the
   middle of it leaves every rank on its old layout, and the controller bases the next generation on that).

A peer's failure at any step sends the rank back to 1 for the newest generation; the rank's own error ends it
(:mod:`ntp_megatron.elastic.errors`). Every wait is bounded. The rank's objects are made by the training code
through :class:`ntp_megatron.elastic.interfaces.Builder`; the loop's state is read and set through
:class:`ntp_megatron.elastic.interfaces.Training`. After adopting each generation every rank emits a ``reform_rank``
record: whether it rebuilt its objects or kept them (and that the kept ones are the same objects).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable, Optional

import torch

from ntp_megatron import phases
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.elastic import commit, sequences
from ntp_megatron.elastic.commit import COMMITTED_DECISIONS, CommitProtocol
from ntp_megatron.elastic.errors import OWN_OR_PEER, caused_by_peer
from ntp_megatron.elastic.formation import Formation, Staged
from ntp_megatron.elastic.generation import ElasticRank, Generation
from ntp_megatron.elastic.interfaces import Builder, RankObjects, Training
from ntp_megatron.elastic.reform_report import report_rank, report_reformed
from ntp_megatron.patches import torch_distributed_c10d as c10d_patch
from ntp_megatron.plan.group_plan import GroupKey, rank_group_keys
from ntp_megatron.plan.stages import JobTopology

logger = logging.getLogger(__name__)


class Retired(SystemExit):
    """This process has no slot in the new generation (its replica was dropped): it ends cleanly."""


def settle_voted(training: Training, commit: CommitProtocol, await_newer: Callable[[], object]) -> None:
    """After a failure: step the iteration this rank voted for if it was committed (roll forward), drop it if it
    was aborted. The decision is read once the next generation is published (``await_newer``): the controller
    decides the iteration in flight before it publishes, so every survivor reads the same."""
    iteration = training.pending_iteration()
    if iteration is None:
        return
    await_newer()
    committed = commit.decision(iteration) in COMMITTED_DECISIONS
    training.settle(committed)
    if committed:
        logger.info("iteration %d was committed before the failure: stepped it", iteration)


class Reformer:
    def __init__(self, cfg: JobConfig, elastic: ElasticRank, builder: Builder) -> None:
        self.cfg = cfg
        self.elastic = elastic
        self.builder = builder
        self.completed: JobTopology = elastic.topology(0)
        """The layout this process holds: the newest generation whose re-formation completed."""
        self.generation: Optional[Generation] = None
        """The generation this process is in (None between two)."""
        self._start_iteration: Optional[int] = None
        self.joining = False
        """A replacement process, waiting to be admitted (rather than a rank of the launch)."""
        self.keep_groups = cfg.ntp.keep_groups and c10d_patch.supported()
        """Groups a re-formation did not touch go on (``ntp.keep_groups``, where this torch allows it)."""
        if cfg.ntp.keep_groups and not self.keep_groups:
            logger.warning("ntp.keep_groups: torch %s is not the one keeping process groups was written for (%s): "
                           "every group is made anew in every generation", torch.__version__,
                           ", ".join(v + "x" for v in c10d_patch.TESTED_TORCH))

    # -- the four ways into a generation -------------------------------------------------------------------------
    def start(self, training: Training, joining: bool) -> None:
        """This process's first generation: at launch, the newest published one (generation 0 unless ranks
        failed before this one got here); for a replacement process, the one that admits it."""
        self.joining = joining
        if joining:
            self.elastic.aware_upto = self.elastic.latest()  # generations before this process are not its own
            self.elastic.announce()
            self._advance(training)
            return
        latest = self.elastic.latest()
        self._advance(training, first=(self.elastic.topology(latest), self.elastic.info(latest)))

    def recover(self, training: Training) -> None:
        """After a failure: settle the iteration in flight, then re-form in the newest generation."""
        failed = self.generation
        _try(lambda: self.elastic.note_aware(failed.number))
        settle_voted(training, failed.commit, lambda: self.elastic.await_newer(failed.number))
        self._advance(training)

    def move(self, training: Training) -> None:
        """At an admission boundary (decision ``commit+reform``): every rank finished the generation's work
        (the caller passed a barrier), so end it and re-form in the one the controller published."""
        self.elastic.end_generation(self.generation)
        self._advance(training)

    def leave(self) -> None:
        """At the end of the run: leave the generation without marking it over (nobody needs to)."""
        if self.generation is not None:
            sequences.untrack()
            self.elastic.leave(self.generation, ended=False)
            self.generation = None

    def _advance(self, training: Training, first: Optional[tuple[JobTopology, dict]] = None) -> None:
        seen = self.generation.number if self.generation is not None else -1
        offered = False
        while True:
            if first is not None:
                (topology, info), first = first, None
            else:
                topology, info = self.elastic.await_newer(seen)  # bounded: a timeout ends this process
            seen = topology.generation
            if self.generation is not None:
                sequences.untrack()  # the heartbeat reports no group of a generation being left
                self.elastic.leave(self.generation, keep=self._wanted(topology) if self.keep_groups else ())
                self.generation = None
            _try(lambda: self.elastic.note_aware(topology.generation - 1))
            if self.elastic.rank_in(topology) is None:
                if training.parts is None and self.joining:
                    if offered:  # admitted, but a failure cut the admission short: ask again
                        self.elastic.announce()
                        offered = False
                    continue  # a replacement not admitted in this generation: wait for the next
                raise Retired(f"launch rank {self.elastic.launch_rank}: replica {self.elastic.identity[0]} "
                              f"was dropped in generation {topology.generation}; this process ends")
            offered = True
            if training.parts is None:
                self.completed = self.elastic.topology(info["base"])
            try:
                staged = self._reform(training, topology, info)
            except (KeyboardInterrupt, SystemExit):
                raise
            except OWN_OR_PEER as exc:  # noqa: BLE001 - another failure while re-forming: go again, unless our own
                if not caused_by_peer(exc, lambda s: self.elastic.marked_over(topology.generation, s)):
                    raise
                logger.info("forming generation %d interrupted (%s: %s); waiting for the next",
                            topology.generation, type(exc).__name__, str(exc)[:200])
                staged = None
            if staged is not None:
                break
            gc.collect()
        self._adopt(training, staged)

    def _wanted(self, topology: JobTopology) -> list[GroupKey]:
        """The groups this process is a member of in ``topology`` (none if it has no slot there)."""
        rank = self.elastic.rank_in(topology)
        if rank is None:
            return []
        p = self.cfg.parallel
        return rank_group_keys(topology, rank, p.data_parallel_size, p.num_distributed_optimizer_instances)

    # -- forming one generation ------------------------------------------------------------------------------
    def _reform(self, training: Training, topology: JobTopology, info: dict) -> Staged:
        """Join ``topology``'s generation and build (or keep) this rank's objects for it
        (:class:`ntp_megatron.elastic.formation.Formation`); returns them once every rank finished, without adopting
        them yet. Raises if the formation did not complete."""
        started = time.time()
        phases.enter("reform")
        elastic, base = self.elastic, self.completed
        if info["base"] != base.generation:
            raise RuntimeError(f"generation {topology.generation} builds on generation {info['base']}, but this "
                               f"process holds generation {base.generation}")
        dead = [base.rank_of(*slot) for slot in info["dead"] if base.rank_of(*slot) is not None]
        if training.parts is None:  # not trained yet: until the formation says, the iteration after the last committed
            phases.at_iteration(commit.committed(elastic.ctl) + 1)  # (for the phase points of the join)
        generation = elastic.join(topology)
        self.generation = generation
        elastic.offer(generation, self._wanted(topology))
        with elastic.scope(generation):
            setup = self.builder.setup(topology, generation.rank, generation.pool)
        elastic.drain_kept(generation)
        sequences.track(sequences.tracked_of(generation.pool))  # what the heartbeat counts collectives on
        if training.parts is None:  # a fresh process resumes after the newest committed iteration
            training.iteration = commit.committed(elastic.ctl)
            training.consumed_samples = commit.consumed(elastic.ctl)
        # The re-formation counts as the iteration it resumes at, in every rank alike: a rank that had not begun
        # the failed iteration yet (still stepping the one before when the failure came) counts it too.
        phases.at_iteration(training.iteration + 1)
        return Formation(self.cfg, elastic, self.builder, training, generation, info, base, dead, setup,
                         self.start_iteration).run(started)

    @property
    def start_iteration(self) -> int:
        """The iteration this run started from (0, or the loaded checkpoint's), as the controller published it."""
        if self._start_iteration is None:
            self._start_iteration = commit.start_iteration(self.elastic.ctl)
        return self._start_iteration

    def _adopt(self, training: Training, staged: Staged) -> None:
        """Switch to the new generation's objects (local only: nothing here can be interrupted by a peer)."""
        old: Optional[RankObjects] = training.parts
        memory = training.memory
        if staged.new_parts is not None:
            staged.strategy.schedule(staged.new_parts, old, staged.progress)
            if old is not None:
                old.release()
            training.parts = staged.new_parts
            staged.new_parts.settle()
        else:
            memory.restore_gradients(old)  # freed by a re-formation that did not complete (rebound in _reform)
        report_rank(self.elastic, self.generation.rank, old, training.parts, staged, self.generation.pool)
        del old
        self.completed = staged.topology
        gc.collect()
        memory.restore_gradients(training.parts)  # the old objects are gone: the new gradients' turn
        if not staged.fresh:
            memory.report("reform", training.parts, iteration=training.iteration + 1,
                          rebuilt=staged.new_parts is not None, **staged.memory)
        if self.generation.rank == 0 and (staged.info.get("deaths") or staged.info.get("joined")
                                          or staged.info.get("weights")):
            report_reformed(self.cfg, self.elastic, training, staged)


def _try(action: Callable[[], None]) -> None:
    try:
        action()
    except Exception:  # noqa: BLE001 - reporting only
        pass
