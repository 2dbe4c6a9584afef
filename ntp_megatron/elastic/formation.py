"""Forming one generation on a surviving rank: its objects, and the state it lacks, from peers.

A formation is decided once, when it begins, and then carried out (:class:`Formation`). The decision is

- **a strategy** (:func:`choose`), from where the state this rank lacks comes from:

  - :class:`OwnStart`: no iteration committed yet; every rank builds its initial state itself, from the seed:
    nothing moves, nothing is gathered;
  - :class:`LoadedStart`: the same, from the checkpoint the run resumes from (every rank builds new objects and
    reads it into them);
  - :class:`UnitMoves`: units, from the ranks that hold them (:func:`ntp_megatron.core.unit_moves.plan_transfers`);
  - :class:`ShardMoves`: under the distributed optimizer, shards from a surviving holder
    (:func:`ntp_megatron.core.unit_moves.plan_shard_transfers`); no units move;

- **whether this rank's objects are kept or rebuilt** (:meth:`Formation.rebuilds`): *kept* if its units do not change
  (the model, DDP buffers and optimizer it holds take the new groups), *rebuilt* by the strategy if its replica lost
  or regained a rank, it is new to the job, the run starts from a checkpoint, or, under the distributed optimizer,
  its replica is degraded (a degraded rank's optimizer steps shadows of the groups it was built in).

Every strategy has the same steps (:class:`Strategy`), which :meth:`Formation.run` takes in the same order on every
rank, kept or rebuilt, so that their collectives match: the peers' progress, the objects, the moves, the gather of
every rank's parameters from the shards in the new groups (a failure in the last step's gather left them partial;
nothing to do without the distributed optimizer), what moved; then every rank votes that it is done.
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
    strategy: Strategy
    """The formation's strategy (:func:`choose`): it also sets rebuilt objects' schedule when they are adopted."""
    memory: dict = field(default_factory=dict)
    """What the rank held at the re-formation's steps (bytes, for its ``memory`` record)."""
    progress: Optional[Progress] = None
    """The steps the optimizer and the schedule of the ranks that hold state took (None before the first
    committed iteration)."""

    @property
    def fresh(self) -> bool:
        """No iteration committed yet: every rank built the initial weights itself."""
        return self.strategy.fresh


# -- the strategies ---------------------------------------------------------------------------------------------------

class Strategy:
    """How a formation fills this rank's objects with the state they lack: one per source of that state. Its steps
    take the :class:`Formation` they serve (what the rank holds and what it has built so far) and run on every rank
    of the generation in :meth:`Formation.run`'s order. The base is a formation after the run's first committed
    iteration: the peers' progress is taken and every rank's parameters are gathered."""

    fresh = False
    """No iteration committed yet: every rank builds its initial state itself."""
    keeps = True
    """A rank whose units do not change keeps its objects (else every rank rebuilds)."""

    def progress(self, f: Formation) -> Optional[Progress]:
        """The steps of the ranks that hold state (collective; :func:`peers_progress`)."""
        return peers_progress(f.old)

    def build(self, f: Formation) -> None:
        """New objects for the new layout (``f.new_parts``, set as soon as they exist: an error after that discards
        them), their state initialised from what this rank holds."""
        raise NotImplementedError

    def move(self, f: Formation) -> int:
        """Receive what the rank lacks and send what others lack (collective); returns the bytes received."""
        return 0

    def gather(self, f: Formation) -> None:
        """Every rank's parameters from the committed shards, in the new groups (a failure in the gather of the
        last step, or in this one, leaves partial buffers; nothing to do without the distributed optimizer)."""
        (f.new_parts or f.old).param_gather()

    def account(self, f: Formation) -> None:
        """Beyond the bytes received: what the re-formation's report needs from this rank (in the store)."""

    def schedule(self, new: RankObjects, old: Optional[RankObjects], progress: Optional[Progress]) -> None:
        """When rebuilt objects ``new`` are adopted, before ``old`` (None for a process new to the job) are
        released: the learning-rate schedule the rank's old objects followed, else its peers' (``progress``)."""
        if old is not None:
            new.scheduler.load_state_dict(old.scheduler.state_dict())
        else:
            new.scheduler.step(increment=progress.scheduler_steps)


class OwnStart(Strategy):
    """No iteration committed yet: every rank builds its initial weights from the seed; nothing moves."""

    fresh = True

    def progress(self, f: Formation) -> Optional[Progress]:
        return None

    def build(self, f: Formation) -> None:
        f.new_parts = f.builder.build(f.setup, True, adopt_from=None)

    def gather(self, f: Formation) -> None:
        pass

    def schedule(self, new: RankObjects, old: Optional[RankObjects], progress: Optional[Progress]) -> None:
        if old is not None:  # without old objects the schedule is at its start, as every rank's is
            new.scheduler.load_state_dict(old.scheduler.state_dict())


class LoadedStart(OwnStart):
    """No iteration committed yet, the run resumes from a checkpoint: every rank builds new objects and reads it
    (its schedule too)."""

    keeps = False

    def build(self, f: Formation) -> None:
        f.new_parts = parts = f.builder.build(f.setup, False, adopt_from=None)
        iteration = f.builder.load_start(parts)
        if iteration != f.training.iteration:
            raise SystemExit(f"checkpoint.load: {f.cfg.checkpoint.load} holds iteration {iteration}, but the "
                             f"launcher started the run at iteration {f.training.iteration}")

    def schedule(self, new: RankObjects, old: Optional[RankObjects], progress: Optional[Progress]) -> None:
        pass


class UnitMoves(Strategy):
    """Units (parameters and optimizer state) from the ranks that hold them; a rebuilt rank copies those it kept."""

    def __init__(self, old: Optional[RankObjects], state: tuple[str, ...]) -> None:
        self.old_tensors = UnitTensors(old.model.module, old.optimizer, state, True) if old is not None else None
        self.new_tensors: Optional[UnitTensors] = None

    def build(self, f: Formation) -> None:
        old = f.old
        f.free_old_gradients()
        f.new_parts = new = f.builder.build(f.setup, False, adopt_from=None)
        self.new_tensors = UnitTensors(new.model.module, new.optimizer, f.state, True)
        f.built(new)
        init_state(new.model.module, self.new_tensors)
        if old is not None:
            copy_kept(self.old_tensors, self.new_tensors, old.model.module, new.model.module)
        elif f.cfg.training.optimizer == "adam":
            write_step(self.new_tensors.optimizer, f.progress.adam_step)

    def move(self, f: Formation) -> int:
        return f.exchange(plan_transfers(f.base, f.topology, f.dead), self.old_tensors, self.new_tensors)

    def account(self, f: Formation) -> None:
        """What this rank lacks, with its own stage's sizes: summed over the ranks."""
        tensors = self.old_tensors or self.new_tensors
        kept = f.old_rank if f.old_rank is not None and f.old_rank not in f.dead else None
        keys.add_lower_bound(f.elastic.ctl, f.topology.generation, own_lower_bound_bytes(
            f.base, f.topology, kept, f.generation.rank, {u: tensors.unit_numel(u) for u in f.topology.units},
            tensors.replicated_numel()))


class ShardMoves(Strategy):
    """Under the distributed optimizer: shards of the optimizer state from a surviving holder, its twin in the other
    instance; a rebuilt rank takes over the buffers of every block it keeps serving (it adopts them: never a block
    twice) and copies any other shard it held."""

    def __init__(self) -> None:
        self.moves: list[list[int]] = []
        """[block, position, bytes] of every shard this rank received."""

    def build(self, f: Formation) -> None:
        old, memory = f.old, f.training.memory
        if f.free_old_gradients():
            stage = f.base.stage_of(f.old_rank)
            if not stage.is_healthy(stage.replica_of(f.old_rank).index):
                # A degraded rank's model parameters are dead too: the new objects gather theirs from the shards, and
                # these objects are rebuilt by every later formation (a degraded replica's always are), never
                # trained with again.
                f.held["freed_parameter_bytes"] = memory.free_parameters(old)
        # The new objects take over the old buffers of blocks they keep serving, with their optimizer state: the
        # rank never holds a block twice.
        f.new_parts = new = f.builder.build(f.setup, False, adopt_from=old)
        f.built(new)
        init_shard_state(new.optimizer, f.state, f.progress.adam_step if f.cfg.training.optimizer == "adam" else None,
                         adopted=frozenset().union(*new.adopted.values()))

    def move(self, f: Formation) -> int:
        """A rebuilt rank copies the shards it held locally, from its old objects, and receives the others (each from
        a surviving holder, :func:`plan_shard_transfers`), while every rank sends what others need; under bf16 the
        received main params are then rounded into the model's shard."""
        p, rank, old, new = f.cfg.parallel, f.generation.rank, f.old, f.new_parts
        transfers = plan_shard_transfers(f.base.only_stage, f.topology.only_stage, f.dead,
                                         p.data_parallel_size, p.num_distributed_optimizer_instances)
        old_shards = ShardTensors(old.optimizer, old.shard_sources(), f.state) if old is not None else None
        new_shards = ShardTensors(new.optimizer, new.shard_sources(), f.state) if new is not None else None
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
        received = f.exchange(transfers, old_shards, new_shards)
        if new is not None:
            copy_main_params_to_model(new.optimizer)
        self.moves = [[block, position, 4 * len(new_shards.keys) * new_shards.numel(block)]
                      for t in transfers if t.dst == rank for block, position in t.shards]
        return received

    def account(self, f: Formation) -> None:
        if self.moves:
            keys.record_shards(f.elastic.ctl, f.topology.generation, f.generation.rank, self.moves)


def choose(cfg: JobConfig, fresh: bool, old: Optional[RankObjects], state: tuple[str, ...]) -> Strategy:
    """The strategy of a formation (see the module's docstring); ``fresh``: no iteration committed yet."""
    if fresh:
        return LoadedStart() if cfg.checkpoint.load is not None else OwnStart()
    return ShardMoves() if cfg.parallel.use_distributed_optimizer else UnitMoves(old, state)


# -- the formation ----------------------------------------------------------------------------------------------------

class Formation:
    """This rank's part in forming ``generation`` (joined, its setup made) from ``base``, the layout it holds: the
    strategy and whether the rank keeps its objects are decided here, once."""

    def __init__(self, cfg: JobConfig, elastic: ElasticRank, builder: Builder, training: Training,
                 generation: Generation, info: dict, base: JobTopology, dead: list[int], setup: Any,
                 start_iteration: int) -> None:
        self.cfg, self.elastic, self.builder, self.training = cfg, elastic, builder, training
        self.generation, self.topology, self.info, self.setup = generation, generation.topology, info, setup
        self.base, self.dead = base, dead
        self.old: Optional[RankObjects] = training.parts
        self.old_rank = base.rank_of(*elastic.identity)
        self.state = state_keys(cfg.training.optimizer)
        self.strategy = choose(cfg, training.iteration == start_iteration, self.old, self.state)
        self.rebuilt = self.rebuilds()
        self.new_parts: Optional[RankObjects] = None
        self.progress: Optional[Progress] = None
        self.held: dict[str, int] = {}

    def rebuilds(self) -> bool:
        """Whether this rank builds new objects (see the module's docstring) rather than keep its own."""
        topology, rank = self.topology, self.generation.rank
        if not self.strategy.keeps or self.old is None or self.old_rank is None:
            return True
        if any(self.base.units_of(self.old_rank, f) != topology.units_of(rank, f) for f in topology.units):
            return True
        stage = topology.stage_of(rank)
        return self.cfg.parallel.use_distributed_optimizer and not stage.is_healthy(stage.replica_of(rank).index)

    def run(self, started: float) -> Staged:
        """The strategy's steps, in order: progress, objects (built, or kept and rebound), moves, gather, what
        moved; then the vote. The staged result once every rank completed."""
        memory, strategy = self.training.memory, self.strategy
        memory.begin()
        memory.sample(self.old)
        try:
            self.progress = strategy.progress(self)
            if self.rebuilt:
                strategy.build(self)
            else:
                self.builder.rebind(self.old, self.setup)  # kept objects take the new groups: the gather runs there
            phases.point("reform")  # objects built (or rebound), nothing moved yet
            received = strategy.move(self)
            strategy.gather(self)
            keys.add_moved(self.elastic.ctl, self.topology.generation, received)
            strategy.account(self)
            if self.generation.commit.form() != COMPLETE:
                raise GenerationEnded(f"forming generation {self.topology.generation} did not complete")
        except BaseException:
            if self.new_parts is not None:
                self.new_parts.discard()
            raise
        return Staged(self.topology, self.info, self.setup, self.new_parts, self.base, self.dead, started, strategy,
                      memory=self.held, progress=self.progress)

    # -- what the strategies share --------------------------------------------------------------------------------

    def free_old_gradients(self) -> bool:
        """Before a rebuilt rank's new objects exist: the iteration that filled the old gradients was settled, so
        they are dead; freed now, the two never hold gradients at once (restored if the old objects are kept).
        Whether the rank held objects."""
        if self.old is None:
            return False
        self.held["freed_gradient_bytes"] = self.training.memory.free_gradients(self.old)
        return True

    def built(self, new: RankObjects) -> None:
        """After a rebuilt rank's new objects exist: what it holds now, and their gradients freed (nothing fills
        them before the first iteration: allocated when adopted)."""
        memory = self.training.memory
        self.held["held_after_build_bytes"] = memory.sample(self.old, new)
        memory.free_gradients(new)

    def exchange(self, transfers: list, old_side, new_side) -> int:
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
