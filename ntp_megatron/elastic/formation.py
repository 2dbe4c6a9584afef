"""Forming one generation on a surviving rank: its objects, and the state it lacks, from peers.

A formation is decided once, on two axes, and then carried out (:class:`Formation`):

- **its objects**: *kept* (its units do not change: the model, DDP buffers and optimizer it holds take the new
  groups) or *rebuilt* (its replica lost or regained a rank, it is new to the job, the run starts from a checkpoint,
  or, under the distributed optimizer, its replica is degraded: a degraded rank's optimizer steps shadows of the groups
  it was built in);
- **where the state it lacks comes from**: *its own* (before the run's first committed iteration every rank builds
  its initial state itself, from the seed or the checkpoint the run resumes from: nothing moves), *units* from the
  ranks that hold them (:func:`ntp_megatron.core.unit_moves.plan_transfers`), or *shards* of the distributed
  optimizer from a surviving holder (:func:`ntp_megatron.core.unit_moves.plan_shard_transfers`).

Then every rank, kept or rebuilt, gathers its parameters from the shards in the new groups (a failure in the last
step's gather left them partial; nothing to do without the distributed optimizer), and votes that it is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ntp_megatron import phases
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.core.adam_step import read_step, write_step
from ntp_megatron.core.unit_moves import ShardTensors, UnitTensors, copy_kept, copy_main_params_to_model, exchange, \
    init_shard_state, init_state, largest_piece_bytes, own_lower_bound_bytes, plan_shard_transfers, plan_transfers, \
    state_keys
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.commit import COMPLETE
from ntp_megatron.elastic.errors import GenerationEnded
from ntp_megatron.elastic.generation import ElasticRank, Generation
from ntp_megatron.elastic.interfaces import Builder, RankObjects, Training
from ntp_megatron.plan.stages import JobTopology

OWN, UNITS, SHARDS = "own", "units", "shards"
"""Where a formation's missing state comes from."""


@dataclass(frozen=True)
class Progress:
    adam_step: int
    """Adam's step counter (-1 without Adam state)."""
    scheduler_steps: int
    """The learning-rate schedule's ``num_steps`` (samples)."""


@dataclass
class Staged:
    """A completed formation, not yet adopted."""

    topology: JobTopology
    info: dict
    setup: Any
    """The parallel setup the builder made for the new generation (opaque here)."""
    new_parts: Optional[RankObjects]
    """Rebuilt objects for a rank whose units changed; None for a rank that keeps its own."""
    base: JobTopology
    dead: list[int]
    started: float
    fresh: bool
    """No iteration committed yet: every rank built the initial weights itself."""
    loaded: bool = False
    """Every rank read its state (scheduler included) from the checkpoint the run resumes from."""
    memory: dict = field(default_factory=dict)
    """What the rank held at the re-formation's steps (bytes, for its ``memory`` record)."""
    progress: Optional[Progress] = None
    """The steps the optimizer and the schedule of the ranks that hold state took (None before the first
    committed iteration)."""


class Formation:
    """This rank's part in forming ``generation`` (joined, its setup made) from ``base``, the layout it holds."""

    def __init__(self, cfg: JobConfig, elastic: ElasticRank, builder: Builder, training: Training,
                 generation: Generation, info: dict, base: JobTopology, dead: list[int], setup: Any,
                 start_iteration: int) -> None:
        self.cfg, self.elastic, self.builder, self.training = cfg, elastic, builder, training
        self.generation, self.topology, self.info, self.setup = generation, generation.topology, info, setup
        self.base, self.dead = base, dead
        self.old: Optional[RankObjects] = training.parts
        self.fresh = training.iteration == start_iteration
        self.loaded = self.fresh and cfg.checkpoint.load is not None
        self.sharded = cfg.parallel.use_distributed_optimizer
        self.old_rank = base.rank_of(*elastic.identity)
        self.rebuilt = self._rebuilds()
        self.source = OWN if self.fresh else SHARDS if self.sharded else UNITS
        self.state = state_keys(cfg.training.optimizer)
        self.old_tensors = UnitTensors(self.old.model.module, self.old.optimizer, self.state, not self.fresh) \
            if self.old is not None else None
        self.new_parts: Optional[RankObjects] = None
        self.new_tensors: Optional[UnitTensors] = None
        self.progress: Optional[Progress] = None
        self.held: dict[str, int] = {}
        self.received = 0
        self.moves: list[list[int]] = []

    def _rebuilds(self) -> bool:
        """Whether this rank builds new objects (see the module's docstring) rather than keep its own."""
        topology, rank = self.topology, self.generation.rank
        if self.loaded or self.old is None or self.old_rank is None:
            return True
        if any(self.base.units_of(self.old_rank, f) != topology.units_of(rank, f) for f in topology.units):
            return True
        stage = topology.stage_of(rank)
        return self.sharded and not stage.is_healthy(stage.replica_of(rank).index)

    def run(self, started: float) -> Staged:
        """Build or keep, move what is missing, gather, vote; the staged result once every rank completed."""
        memory = self.training.memory
        memory.begin()
        memory.sample(self.old)
        try:
            if not self.fresh:
                self.progress = peers_progress(self.old)
            if self.rebuilt:
                self._rebuild()
            else:
                self.builder.rebind(self.old, self.setup)  # kept objects take the new groups: the gather runs there
            phases.point("reform")  # objects built (or rebound), nothing moved yet
            if self.source == SHARDS:
                self._move_shards()
            elif self.source == UNITS:
                self.received = self._exchange(plan_transfers(self.base, self.topology, self.dead), self.old_tensors,
                                               self.new_tensors)
            if not self.fresh:
                # Every rank's parameters from the committed shards, in the new groups (a failure in the gather of the
                # last step, or in this one, leaves partial buffers; nothing to do without the distributed optimizer).
                (self.new_parts or self.old).param_gather()
            self._account()
            if self.generation.commit.form() != COMPLETE:
                raise GenerationEnded(f"forming generation {self.topology.generation} did not complete")
        except BaseException:
            if self.new_parts is not None:
                self.new_parts.discard()
            raise
        return Staged(self.topology, self.info, self.setup, self.new_parts, self.base, self.dead, started, self.fresh,
                      loaded=self.loaded, memory=self.held, progress=self.progress)

    # -- the objects ------------------------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """New objects for the new layout, their state initialised from what this rank holds (or its own)."""
        old, memory, moving = self.old, self.training.memory, not self.fresh
        if old is not None and moving:
            # The iteration that filled the old gradients was settled: they are dead. Freed before the new objects
            # exist, so the two never hold gradients at once (restored if old is kept).
            self.held["freed_gradient_bytes"] = memory.free_gradients(old)
            base = self.base.stage_of(self.old_rank)
            if self.sharded and not base.is_healthy(base.replica_of(self.old_rank).index):
                # Under the distributed optimizer a degraded rank's model parameters are dead too: the new objects
                # gather theirs from the shards, and these objects are rebuilt by every later formation (a degraded
                # replica's always are), never trained with again.
                self.held["freed_parameter_bytes"] = memory.free_parameters(old)
        # Under the distributed optimizer the new objects take over the old buffers of blocks they keep serving,
        # with their optimizer state: the rank never holds a block twice.
        new = self.new_parts = self.builder.build(self.setup, self.fresh and not self.loaded,
                                                  adopt_from=old if self.sharded and moving else None)
        if self.loaded:
            self._load_start(new)
        self.new_tensors = UnitTensors(new.model.module, new.optimizer, self.state, moving)
        if not moving:
            return
        self.held["held_after_build_bytes"] = memory.sample(old, new)
        memory.free_gradients(new)  # nothing fills the new gradients before the first iteration: allocated when adopted
        adam = self.cfg.training.optimizer == "adam"
        if self.sharded:
            init_shard_state(new.optimizer, self.state, self.progress.adam_step if adam else None,
                             adopted=frozenset().union(*new.adopted.values()))
            return
        init_state(new.model.module, self.new_tensors)
        if old is not None:
            copy_kept(self.old_tensors, self.new_tensors, old.model.module, new.model.module)
        elif adam:
            write_step(self.new_tensors.optimizer, self.progress.adam_step)

    def _load_start(self, parts: RankObjects) -> None:
        """Read the checkpoint the run resumes from into ``parts`` (this generation's layout)."""
        iteration = self.builder.load_start(parts)
        if iteration != self.training.iteration:
            raise SystemExit(f"checkpoint.load: {self.cfg.checkpoint.load} holds iteration {iteration}, but the "
                             f"launcher started the run at iteration {self.training.iteration}")

    # -- the missing state ------------------------------------------------------------------------------------------

    def _move_shards(self) -> None:
        """Under the distributed optimizer: a rebuilt rank copies the shards it held locally, from its old objects,
        and receives the others (each from a surviving holder, :func:`plan_shard_transfers`), while every rank sends
        what others need; under bf16 the received main params are then rounded into the model's shard."""
        p, rank, old, new = self.cfg.parallel, self.generation.rank, self.old, self.new_parts
        transfers = plan_shard_transfers(self.base.only_stage, self.topology.only_stage, self.dead,
                                         p.data_parallel_size, p.num_distributed_optimizer_instances)
        old_shards = ShardTensors(old.optimizer, old.shard_sources(), self.state) if old is not None else None
        new_shards = ShardTensors(new.optimizer, new.shard_sources(), self.state) if new is not None else None
        incoming = {block for t in transfers if t.dst == rank for block, _ in t.shards}
        if incoming and new_shards is None:
            raise RuntimeError(f"rank {rank} keeps its objects but is to receive shards of blocks {sorted(incoming)}")
        if new_shards is not None:
            for block in new_shards.buckets:
                if block in incoming or block in new.adopted:  # adopted: the old tensors themselves
                    continue
                if old_shards is None or block not in old_shards.buckets:
                    raise RuntimeError(f"rank {rank}: its shard of block {block} neither moves nor was held")
                new_shards.copy_from(old_shards, block)
        self.received = self._exchange(transfers, old_shards, new_shards)
        if new is not None:
            copy_main_params_to_model(new.optimizer)
        self.moves = [[block, position, 4 * len(new_shards.keys) * new_shards.numel(block)]
                      for t in transfers if t.dst == rank for block, position in t.shards]

    def _exchange(self, transfers: list, old_side, new_side) -> int:
        """:func:`ntp_megatron.core.unit_moves.exchange` of units or shards, with what the rank holds sampled around it
        (``exchange`` holds one piece in flight at a time: the largest is the message part of the peak); returns the
        bytes received."""
        memory, rank = self.training.memory, self.generation.rank
        message = largest_piece_bytes(transfers, rank, old_side, new_side)
        memory.sample(self.old, self.new_parts, transient=message)
        received = exchange(transfers, rank, old_side, new_side)
        self.held["held_after_exchange_bytes"] = memory.sample(self.old, self.new_parts)
        self.held["largest_message_bytes"] = message
        return received

    def _account(self) -> None:
        """What moved, against the bound, in the store for generation rank 0's report."""
        ctl, g, rank = self.elastic.ctl, self.topology.generation, self.generation.rank
        keys.add_moved(ctl, g, self.received)
        if self.source == UNITS:  # what this rank lacks, with its own stage's sizes: summed over the ranks
            tensors = self.old_tensors or self.new_tensors
            kept = self.old_rank if self.old_rank is not None and self.old_rank not in self.dead else None
            keys.add_lower_bound(ctl, g, own_lower_bound_bytes(
                self.base, self.topology, kept, rank, {f: tensors.unit_numel(f) for f in self.topology.units},
                tensors.replicated_numel()))
        if self.moves:
            keys.record_shards(ctl, g, rank, self.moves)


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
