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
through :class:`ntp_megatron.elastic.host.Builder`; the loop's state is read and set through
:class:`ntp_megatron.elastic.host.Training`. After adopting each generation every rank emits a ``reform_rank``
record: whether it rebuilt its objects or kept them (and that the kept ones are the same objects).
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ntp_megatron import metrics, phases
from ntp_megatron.core.adam_step import read_step, write_step
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.commit import COMMITTED_DECISIONS, COMPLETE, CommitProtocol
from ntp_megatron.plan.succession import ShardedOptimizer
from ntp_megatron.elastic.errors import OWN_OR_PEER, GenerationEnded, caused_by_peer
from ntp_megatron.elastic.generation import ElasticRank, Generation
from ntp_megatron.elastic.host import Builder, RankObjects, Training
from ntp_megatron.plan.group_plan import GroupKey, rank_group_keys
from ntp_megatron.core.groups import references_to
from ntp_megatron.plan import stages
from ntp_megatron.plan.layout import Topology
from ntp_megatron.patches import torch_distributed_c10d as c10d_patch
from ntp_megatron.core.unit_moves import ShardTensors, UnitTensors, copy_kept, \
    copy_main_params_to_model, exchange, init_shard_state, init_state, largest_piece_bytes, \
    own_lower_bound_bytes, plan_shard_transfers, plan_transfers, state_keys

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
        self.completed: Topology = elastic.topology(0)
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
            self.elastic.leave(self.generation, ended=False)
            self.generation = None

    def _advance(self, training: Training, first: Optional[tuple[Topology, dict]] = None) -> None:
        seen = self.generation.number if self.generation is not None else -1
        offered = False
        while True:
            if first is not None:
                (topology, info), first = first, None
            else:
                topology, info = self.elastic.await_newer(seen)  # bounded: a timeout ends this process
            seen = topology.generation
            if self.generation is not None:
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

    def _wanted(self, topology: Topology) -> list[GroupKey]:
        """The groups this process is a member of in ``topology`` (none if it has no slot there)."""
        rank = self.elastic.rank_in(topology)
        if rank is None:
            return []
        p = self.cfg.parallel
        return rank_group_keys(topology, rank, p.data_parallel_size, p.num_distributed_optimizer_instances)

    # -- forming one generation ------------------------------------------------------------------------------
    def _reform(self, training: Training, topology: Topology, info: dict) -> "_Staged":
        """Join ``topology``'s generation and build (or keep) this rank's objects for it; returns them once every
        rank finished, without adopting them yet. Raises if the formation did not complete.

        Before the run's first committed iteration every rank builds its initial state itself and nothing moves:
        from the seed alone, or, in a run that resumes from ``checkpoint.load``, from that checkpoint, read into
        this generation's layout whatever it is (the load is collective, so every rank rebuilds and reads).
        After it, a rank keeps what it holds and receives the rest from peers."""
        started = time.time()
        phases.enter("reform")
        cfg, elastic = self.cfg, self.elastic
        base = self.completed
        if info["base"] != base.generation:
            raise RuntimeError(f"generation {topology.generation} builds on generation {info['base']}, but this "
                               f"process holds generation {base.generation}")
        dead = [base.rank_of(*slot) for slot in info["dead"] if base.rank_of(*slot) is not None]
        generation = elastic.join(topology)
        self.generation = generation
        elastic.offer(generation, self._wanted(topology))
        with elastic.scope(generation):
            setup = self.builder.setup(topology, generation.rank, generation.pool)
        elastic.drain_kept(generation)
        old: Optional[RankObjects] = training.parts
        if old is None:  # a fresh process resumes after the newest committed iteration
            training.iteration = int(elastic.ctl.get(keys.COMMITTED).decode())
            training.consumed_samples = int(elastic.ctl.get(keys.CONSUMED).decode())
        # The re-formation counts as the iteration it resumes at, in every rank alike: a rank that had not begun
        # the failed iteration yet (still stepping the one before when the failure came) counts it too.
        phases.at_iteration(training.iteration + 1)
        fresh = training.iteration == self.start_iteration
        from_checkpoint = fresh and cfg.checkpoint.load is not None
        old_rank = base.rank_of(*elastic.identity)
        sharded = cfg.parallel.use_distributed_optimizer
        # Under the distributed optimizer a degraded rank's optimizer steps the shadows of the groups it was built
        # in: it builds anew in every generation (its shards are copied over locally).
        changed = from_checkpoint or old is None or old_rank is None or any(
            base.units_of(old_rank, f) != topology.units_of(generation.rank, f) for f in topology.units) or (
            sharded and not topology.is_healthy(topology.replica_of(generation.rank).index))
        state = state_keys(cfg.training.optimizer)
        adam = cfg.training.optimizer == "adam"
        old_tensors = UnitTensors(old.model.module, old.optimizer, state, not fresh) if old is not None else None
        new_parts, new_tensors = None, None
        received = 0
        memory = training.memory
        memory.begin()
        memory.sample(old)
        held: dict[str, int] = {}
        progress = None
        moves: list[dict] = []
        try:
            if not fresh:
                progress = peers_progress(old)
            if not changed:
                # Kept objects take the new groups now: the parameter gather below runs in them.
                self.builder.rebind(old, setup)
            if changed:
                if old is not None and not fresh:
                    # The iteration that filled the old gradients was settled: they are dead. Freed before the
                    # new objects exist, so the two never hold gradients at once (restored if old is kept).
                    held["freed_gradient_bytes"] = memory.free_gradients(old)
                    if sharded and not base.is_healthy(base.replica_of(old_rank).index):
                        # Under the distributed optimizer a degraded rank's model parameters are dead too: the new
                        # objects gather theirs from the shards, and these objects are rebuilt by every later
                        # formation (a degraded replica's always are), never trained with again.
                        held["freed_parameter_bytes"] = memory.free_parameters(old)
                # Under the distributed optimizer the new objects take over the old buffers of blocks they keep
                # serving, with their optimizer state: the rank never holds a block twice.
                new_parts = self.builder.build(setup, fresh and not from_checkpoint,
                                               adopt_from=old if sharded and not fresh else None)
                if from_checkpoint:
                    self._load_start(training, new_parts)
                new_tensors = UnitTensors(new_parts.model.module, new_parts.optimizer, state, not fresh)
                if not fresh:
                    held["held_after_build_bytes"] = memory.sample(old, new_parts)
                    # Nothing fills the new gradients before the first iteration: allocated when adopted.
                    memory.free_gradients(new_parts)
                    if sharded:
                        init_shard_state(new_parts.optimizer, state, progress.adam_step if adam else None,
                                         adopted=frozenset().union(*new_parts.adopted.values()))
                    else:
                        init_state(new_parts.model.module, new_tensors)
                        if old is not None:
                            copy_kept(old_tensors, new_tensors, old.model.module, new_parts.model.module)
                        elif adam:
                            write_step(new_tensors.optimizer, progress.adam_step)
            phases.point("reform")  # objects built (or rebound), nothing moved yet
            if not fresh and sharded:
                received, moves = self._move_shards(topology, base, dead, old, new_parts, state, held, memory)
            elif not fresh:
                received = _measured_exchange(plan_transfers(base, topology, dead), generation.rank, old_tensors,
                                              new_tensors, memory, held, old, new_parts)
            if not fresh:
                # Every rank's parameters from the committed shards, in the new groups (a failure in the gather
                # of the last step, or in this one, leaves partial buffers; nothing to do without the
                # distributed optimizer).
                (new_parts or old).param_gather()
            elastic.ctl.add(keys.moved(topology.generation), received)
            if not fresh and not sharded:  # what this rank lacks, with its own stage's sizes: summed over the ranks
                tensors = old_tensors or new_tensors
                kept = old_rank if old_rank is not None and old_rank not in dead else None
                elastic.ctl.add(keys.lower_bound(topology.generation), own_lower_bound_bytes(
                    base, topology, kept, generation.rank, {f: tensors.unit_numel(f) for f in topology.units},
                    tensors.replicated_numel()))
            if moves:
                elastic.ctl.set(keys.shards_received(topology.generation, generation.rank), json.dumps(moves))
            if generation.commit.form() != COMPLETE:
                raise GenerationEnded(f"forming generation {topology.generation} did not complete")
        except BaseException:
            if new_parts is not None:
                new_parts.discard()
            raise
        return _Staged(topology, info, setup, new_parts, base, dead, started, fresh, loaded=from_checkpoint,
                       memory=held, progress=progress)

    def _move_shards(self, topology: Topology, base: Topology, dead: list[int], old: Optional[RankObjects],
                     new_parts: Optional[RankObjects], state: tuple[str, ...], held: dict,
                     memory) -> tuple[int, list[list[int]]]:
        """Under the distributed optimizer: a rebuilt rank copies the shards it held locally, from its old
        objects, and receives the others (each from a surviving holder, :func:`plan_shard_transfers`), while
        every rank sends what others need; under bf16 the received main params are then rounded into the model's
        shard. Returns the bytes received, and per shard received [block, position, bytes]."""
        p = self.cfg.parallel
        rank = self.generation.rank
        transfers = plan_shard_transfers(base, topology, dead, p.data_parallel_size,
                                         p.num_distributed_optimizer_instances)
        old_shards = ShardTensors(old.optimizer, old.shard_sources(), state) if old is not None else None
        new_shards = (ShardTensors(new_parts.optimizer, new_parts.shard_sources(), state)
                      if new_parts is not None else None)
        incoming = {block for t in transfers if t.dst == rank for block, _ in t.shards}
        if incoming and new_shards is None:
            raise RuntimeError(f"rank {rank} keeps its objects but is to receive shards of blocks {sorted(incoming)}")
        if new_shards is not None:
            for block in new_shards.buckets:
                if block in incoming or block in new_parts.adopted:  # adopted: the old tensors themselves
                    continue
                if old_shards is None or block not in old_shards.buckets:
                    raise RuntimeError(f"rank {rank}: its shard of block {block} neither moves nor was held")
                new_shards.copy_from(old_shards, block)
        received = _measured_exchange(transfers, rank, old_shards, new_shards, memory, held, old, new_parts)
        if new_parts is not None:
            copy_main_params_to_model(new_parts.optimizer)
        moves = [[block, position, 4 * len(new_shards.keys) * new_shards.numel(block)]
                 for t in transfers if t.dst == rank for block, position in t.shards]
        return received, moves

    @property
    def start_iteration(self) -> int:
        """The iteration this run started from (0, or the loaded checkpoint's), as the controller published it."""
        if self._start_iteration is None:
            self._start_iteration = int(self.elastic.ctl.get(keys.START).decode())
        return self._start_iteration

    def _load_start(self, training: Training, parts: RankObjects) -> None:
        """Read the checkpoint the run resumes from into ``parts`` (this generation's layout)."""
        iteration = self.builder.load_start(parts)
        if iteration != training.iteration:
            raise SystemExit(f"checkpoint.load: {self.cfg.checkpoint.load} holds iteration {iteration}, but the "
                             f"launcher started the run at iteration {training.iteration}")

    def _adopt(self, training: Training, staged: "_Staged") -> None:
        """Switch to the new generation's objects (local only: nothing here can be interrupted by a peer)."""
        old: Optional[RankObjects] = training.parts
        memory = training.memory
        if staged.new_parts is not None:
            if old is not None:
                if not staged.loaded:
                    staged.new_parts.scheduler.load_state_dict(old.scheduler.state_dict())
                old.release()
            elif staged.progress is not None and not staged.loaded:  # a process new to the job: its peers' schedule
                staged.new_parts.scheduler.step(increment=staged.progress.scheduler_steps)
            training.parts = staged.new_parts
            staged.new_parts.settle()
        else:
            memory.restore_gradients(old)  # freed by a re-formation that did not complete (rebound in _reform)
        self._report_rank(old, training.parts, staged, training)
        del old
        self.completed = staged.topology
        gc.collect()
        memory.restore_gradients(training.parts)  # the old objects are gone: the new gradients' turn
        if not staged.fresh:
            memory.report("reform", training.parts, iteration=training.iteration + 1,
                          rebuilt=staged.new_parts is not None, **staged.memory)
        if self.generation.rank == 0 and (staged.info.get("deaths") or staged.info.get("joined")
                                          or staged.info.get("weights")):
            self._report(training, staged)

    def _report_rank(self, old: Optional[RankObjects], new: RankObjects, staged: "_Staged",
                     training: Training) -> None:
        """Every rank, every generation adopted: whether it rebuilt its objects, and whether the model, its DDP
        wrapper and the optimizer it trains with now are the very objects it held before."""
        topology, rank = staged.topology, self.generation.rank
        metrics.emit({"kind": "reform_rank", "launch_rank": self.elastic.launch_rank,
                      "generation": topology.generation, "replica": topology.replica_of(rank).index,
                      "tp_rank": topology.local_rank(rank), "stage": training.parts.setup.stage,
                      "rebuilt": staged.new_parts is not None,
                      "same_model": old is not None and new.model.module is old.model.module,
                      "same_ddp": old is not None and new.model is old.model,
                      "same_optimizer": old is not None and new.optimizer is old.optimizer,
                      "adopted_blocks": sorted(new.adopted) if staged.new_parts is not None else [],
                      **_group_record(self.generation.pool),
                      "tp_references": references_to([new.model, new.optimizer], new.setup.groups.tp),
                      "time": time.time()}, sys.stdout)

    def _report(self, training: Training, staged: "_Staged") -> None:
        topology, info = staged.topology, staged.info
        moved = int(self.elastic.ctl.add(keys.moved(topology.generation), 0))
        joined = [tuple(slot) for slot in info.get("joined", [])]
        shard_moves = self._shard_moves(staged) if self.cfg.parallel.use_distributed_optimizer else None
        if staged.fresh:
            bound = 0  # before the first step every rank draws its initial weights: nothing has to move
        elif shard_moves is not None:  # every shard a new holder lacked, from the geometry of the layout
            sharded = ShardedOptimizer.of(self.cfg)
            per_element = 4 * (1 + len(state_keys(self.cfg.training.optimizer)))
            bound = sum(per_element * sharded.shard_numel(m["block"], m["position"]) for m in shard_moves)
        else:  # every rank's own lack, from the layouts alone (own_lower_bound_bytes)
            bound = int(self.elastic.ctl.add(keys.lower_bound(topology.generation), 0))
        settled = info.get("settled") or {}
        redone = 1 if settled.get("decision") == "abort" and settled.get("started") else 0
        recovery_s = time.time() - info["failure_time"]
        widths = stages.tp_per_replica(topology, self.cfg.parallel.data_parallel_size)
        resume = training.iteration + 1
        event = {"kind": "event", "event": "reformed", "generation": topology.generation, "tp_per_replica": widths,
                 "recovery_s": recovery_s, "moved_bytes": moved, "lower_bound_bytes": bound,
                 "iterations_redone": redone, "resume_iteration": resume, "time": time.time(),
                 "reform_s": time.time() - staged.started, "joined": [list(j) for j in joined],
                 "weights": info.get("weights", [])}
        if shard_moves is not None:
            event["shard_moves"] = shard_moves
        metrics.emit(event, sys.stdout)
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        if joined:
            what = "rejoined: " + ", ".join(f"replica {j[0]} slot {j[1]}" + "".join(f" stage {p}" for p in j[2:])
                                            for j in joined)
        elif info.get("weights"):
            what = "rebalanced: " + "; ".join(
                f"replica {r}" + (f" stage {p}" if stages.has_stages(topology) else "") + " "
                + (", ".join(f"slot {slot} weight {w}" for slot, w in pairs) or "even") for r, p, pairs in info["weights"])
        else:
            what = f"recovered in {recovery_s:.2f} s"
        redo = f"iteration {resume} redone" if redone else f"resuming at iteration {resume}"
        print(f" [{stamp}] re-formed | generation {topology.generation} | tp per replica: {widths} | {what} | "
              f"moved {_size(moved)} (lower bound {_size(bound)}) | {redo} |", flush=True)

    def _shard_moves(self, staged: "_Staged") -> list[dict]:
        """The distributed-optimizer shards the re-formation moved: block, position, the launch ranks of source and
        destination, and the bytes the destination received."""
        if staged.fresh:
            return []
        topology, p = staged.topology, self.cfg.parallel
        launch = self.elastic.topology(0)

        def launch_rank(rank: int) -> int:
            return launch.rank_of(*topology.slot_of(rank))

        out = []
        transfers = plan_shard_transfers(staged.base, topology, staged.dead, p.data_parallel_size,
                                         p.num_distributed_optimizer_instances)
        for dst in sorted({t.dst for t in transfers}):
            received = {(b, j): n for b, j, n in json.loads(self.elastic.ctl.get(
                keys.shards_received(topology.generation, dst)).decode())}
            for t in transfers:
                if t.dst == dst:
                    out += [{"block": b, "position": j, "src": launch_rank(t.src), "dst": launch_rank(dst),
                             "bytes": received[b, j]} for b, j in t.shards]
        return out


def _group_record(pool) -> dict:
    """Which of the generation's groups this rank made and which it kept (role and place), and the generation
    that made each group it is in (a kept group's incarnation is older than the generation)."""
    return {"groups_made": sorted(k.name() for k in pool.made), "groups_kept": sorted(k.name() for k in pool.kept),
            "groups_made_in": {k.name(): pooled.made_in for k, pooled in sorted(pool.groups.items())}}


def _measured_exchange(transfers: list, rank: int, old_side, new_side, memory, held: dict,
                       old: Optional[RankObjects], new_parts: Optional[RankObjects]) -> int:
    """:func:`ntp_megatron.core.unit_moves.exchange` of units or shards, with what the rank holds sampled around it
    (``exchange`` holds one piece in flight at a time: the largest is the message part of the peak) into
    ``held``; returns the bytes received."""
    message = largest_piece_bytes(transfers, rank, old_side, new_side)
    memory.sample(old, new_parts, transient=message)
    received = exchange(transfers, rank, old_side, new_side)
    held["held_after_exchange_bytes"] = memory.sample(old, new_parts)
    held["largest_message_bytes"] = message
    return received



@dataclass
class _Staged:
    """A completed re-formation, not yet adopted."""

    topology: Topology
    info: dict
    setup: Any
    """The parallel setup the builder made for the new generation (opaque here)."""
    new_parts: Optional[RankObjects]
    """Rebuilt objects for a rank whose units changed; None for a rank that keeps its own."""
    base: Topology
    dead: list[int]
    started: float
    fresh: bool
    """No iteration committed yet: every rank built the initial weights itself."""
    loaded: bool = False
    """Every rank read its state (scheduler included) from the checkpoint the run resumes from."""
    memory: dict = field(default_factory=dict)
    """What the rank held at the re-formation's steps (bytes, for its ``memory`` record)."""
    progress: Optional["Progress"] = None
    """The steps the optimizer and the schedule of the ranks that hold state took (None before the first
    committed iteration)."""


@dataclass(frozen=True)
class Progress:
    adam_step: int
    """Adam's step counter (-1 without Adam state)."""
    scheduler_steps: int
    """The learning-rate schedule's ``num_steps`` (samples)."""


def peers_progress(old: Optional[RankObjects]) -> Progress:
    """The optimizer's and the schedule's progress, from the ranks that hold state (every one of them has taken the
    same steps: one per committed iteration since the run's optimizer state began — at iteration 0, at a loaded
    checkpoint's, or fresh after ``checkpoint.no_load_optim``), for a process that holds none (a replacement).
    Taken from them rather than derived, since only they know where their state began. A maximum over the
    generation (collective): a process without state contributes -1; the minimum over the holders comes with it,
    and holders that disagree are an error (a step taken twice or missed), never papered over."""
    step, scheduled = -1.0, -1.0
    if old is not None:
        found = read_step(old.optimizer.optimizer)
        step = float(found) if found is not None else -1.0
        scheduled = float(old.scheduler.num_steps)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    # [max step, max schedule, -min step, -min schedule]; a process without state leaves the minimum alone
    missing = float("-inf")
    both = torch.tensor([step, scheduled, -step if step >= 0 else missing, -scheduled if old is not None else missing],
                        dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = both[:2].tolist(), (-both[2:]).tolist()
    for what, h, lo in zip(("Adam step", "schedule steps"), high, low):
        if h >= 0 and lo != h:
            raise RuntimeError(f"the ranks holding optimizer state disagree on the {what}: {lo:g} to {h:g}")
    return Progress(adam_step=int(high[0]), scheduler_steps=int(high[1]))


def _try(action: Callable[[], None]) -> None:
    try:
        action()
    except Exception:  # noqa: BLE001 - reporting only
        pass


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
