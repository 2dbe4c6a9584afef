"""Re-formation on a surviving rank: from a failed generation to the newest one, without stopping.

1. *Settle.* The controller decided the iteration in flight before publishing the new generation: a rank that
   voted for a committed iteration and had not stepped yet steps now (its gradients are final); an aborted one
   is dropped and redone by everyone.
2. *Leave* the old generation: its process groups, Megatron's globals, its store client, its watchdog.
3. *Join* the new one (default group on ``gen<g>/``, NTP groups).
4. *Reshape.* A rank whose units do not change keeps its model, DDP buffers and optimizer; every reference to
   an old process group in them is pointed at the new one. A rank whose units change (its replica lost a
   rank) builds new ones, copies what it kept, and receives the dead rank's units — parameters and optimizer
   state — from the ranks that hold them (:mod:`ntp_megatron.reshard`).
5. *Complete.* Every rank votes that it is done; only a complete re-formation is adopted (a failure in the
   middle of it leaves every rank on its old layout, and the controller bases the next generation on that).

A failure at any step sends the rank back to 1 for the newest generation. Every wait is bounded.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

from ntp_megatron import faults, metrics
from ntp_megatron.config import JobConfig
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.commit import COMMITTED_DECISIONS, COMPLETE
from ntp_megatron.elastic.generation import ElasticRank
from ntp_megatron.groups import rebind_process_groups
from ntp_megatron.layout import Topology
from ntp_megatron.reshard import UnitTensors, copy_kept, exchange, init_state, join_lower_bound_bytes, \
    lower_bound_bytes, plan_transfers, set_step, state_keys
from ntp_megatron.training import checkpoint
from ntp_megatron.training.components import Components, attach_grad_sync
from ntp_megatron.training.parallel import ParallelSetup, ntp_parallel

logger = logging.getLogger(__name__)


class Retired(SystemExit):
    """This process has no slot in the new generation (its replica was dropped): it ends cleanly."""


class Reformer:
    def __init__(self, cfg: JobConfig, elastic: ElasticRank, completed: Topology,
                 build: Callable[[ParallelSetup, bool], Components]) -> None:
        """``build(setup, initialize)``: this rank's objects for a layout; ``initialize`` draws the initial
        weights (a function of the seed alone), else the caller fills them."""
        self.cfg = cfg
        self.elastic = elastic
        self.completed = completed
        """The layout this process holds: the newest generation whose re-formation completed."""
        self.build = build
        self._start_iteration: Optional[int] = None
        self.joining = False
        """A replacement process, waiting to be admitted (rather than a rank of the launch)."""

    # -- the four ways into a generation -------------------------------------------------------------------------
    def start(self, trainer, joining: bool) -> None:
        """This process's first generation: at launch, the newest published one (generation 0 unless ranks
        failed before this one got here); for a replacement process, the one that admits it."""
        self.joining = joining
        if joining:
            self.elastic.aware_upto = self.elastic.latest()  # generations before this process are not its own
            self.elastic.announce()
            self._advance(trainer)
            return
        latest = self.elastic.latest()
        self._advance(trainer, first=(self.elastic.topology(latest), self.elastic.info(latest)))

    def recover(self, trainer) -> None:
        """After a failure: settle the iteration in flight, then re-form in the newest generation."""
        self._try(lambda: self.elastic.note_aware(trainer.generation.number))
        self._settle(trainer, trainer.generation)
        self._advance(trainer)

    def move(self, trainer) -> None:
        """At an admission boundary (decision ``commit+reform``): every rank finished the generation's work
        (the caller passed a barrier), so end it and re-form in the one the controller published."""
        self.elastic.end_generation(trainer.generation.number)
        self._advance(trainer)

    def _advance(self, trainer, first: Optional[tuple[Topology, dict]] = None) -> None:
        seen = trainer.generation.number if trainer.generation is not None else -1
        offered = False
        while True:
            if first is not None:
                (topology, info), first = first, None
            else:
                topology, info = self.elastic.await_newer(seen)  # bounded: a timeout ends this process
            seen = topology.generation
            if trainer.generation is not None:
                self.elastic.leave(trainer.generation)
                trainer.generation = None
            self._try(lambda: self.elastic.note_aware(topology.generation - 1))
            if self.elastic.rank_in(topology) is None:
                if trainer.parts is None and self.joining:
                    if offered:  # admitted, but a failure cut the admission short: ask again
                        self.elastic.announce()
                        offered = False
                    continue  # a replacement not admitted in this generation: wait for the next
                raise Retired(f"launch rank {self.elastic.launch_rank}: replica {self.elastic.identity[0]} "
                              f"was dropped in generation {topology.generation}; this process ends")
            offered = True
            if trainer.parts is None:
                self.completed = self.elastic.topology(info["base"])
            try:
                staged = self._reform(trainer, topology, info)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as exc:  # noqa: BLE001 - another failure while re-forming: go again
                logger.info("forming generation %d interrupted (%s: %s); waiting for the next",
                            topology.generation, type(exc).__name__, str(exc)[:200])
                staged = None
            if staged is not None:
                break
            gc.collect()
        self._adopt(trainer, staged)

    @staticmethod
    def _try(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # noqa: BLE001 - reporting only
            pass

    def _settle(self, trainer, failed) -> None:
        """Step a committed iteration this rank voted for; drop an aborted one."""
        if trainer.pending is None:
            return
        iteration = trainer.pending["iteration"]
        self.elastic.await_newer(failed.number)  # the controller decides before it publishes
        if failed.commit.decision(iteration) in COMMITTED_DECISIONS:
            record = trainer._step()
            trainer.report(record)
            logger.info("iteration %d was committed before the failure: stepped it", iteration)
        else:
            trainer.pending = None

    # -- forming one generation ------------------------------------------------------------------------------
    def _reform(self, trainer, topology: Topology, info: dict) -> "_Staged":
        """Join ``topology``'s generation and build (or keep) this rank's objects for it; returns them once every
        rank finished, without adopting them yet. Raises if the formation did not complete.

        Before the run's first committed iteration every rank builds its initial state itself and nothing moves:
        from the seed alone, or, in a run that resumes from ``checkpoint.load``, from that checkpoint, read into
        this generation's layout whatever it is (the load is collective, so every rank rebuilds and reads).
        After it, a rank keeps what it holds and receives the rest from peers."""
        started = time.time()
        cfg, elastic = self.cfg, self.elastic
        base = self.completed
        if info["base"] != base.generation:
            raise RuntimeError(f"generation {topology.generation} builds on generation {info['base']}, but this "
                               f"process holds generation {base.generation}")
        dead = [base.rank_of(r, s) for r, s in info["dead"] if base.rank_of(r, s) is not None]
        generation = elastic.join(topology)
        trainer.generation = generation
        with elastic.scope(generation):
            setup = ntp_parallel(cfg, topology, generation.rank)
        old: Optional[Components] = trainer.parts
        if old is None:  # a fresh process resumes after the newest committed iteration
            trainer.iteration = int(elastic.ctl.get(keys.COMMITTED).decode())
            trainer.consumed_samples = int(elastic.ctl.get(keys.CONSUMED).decode())
            if trainer.failures is not None:
                trainer.failures.iteration = trainer.iteration + 1
        fresh = trainer.iteration == self.start_iteration
        from_checkpoint = fresh and cfg.checkpoint.load is not None
        faults.point("reform")
        old_rank = base.rank_of(*elastic.identity)
        changed = from_checkpoint or old is None or old_rank is None or any(
            base.units_of(old_rank, f) != topology.units_of(generation.rank, f) for f in topology.units)
        state = state_keys(cfg.training.optimizer)
        old_tensors = UnitTensors(old.model.module, old.optimizer, state, not fresh) if old is not None else None
        new_parts, new_tensors = None, None
        received = 0
        try:
            if changed:
                new_parts = self.build(setup, fresh and not from_checkpoint)
                if from_checkpoint:
                    self._load_start(trainer, new_parts)
                new_tensors = UnitTensors(new_parts.model.module, new_parts.optimizer, state, not fresh)
                if not fresh:
                    init_state(new_parts.model.module, new_tensors)
                    if old is not None:
                        copy_kept(old_tensors, new_tensors, old.model.module, new_parts.model.module)
                    elif cfg.training.optimizer == "adam":
                        set_step(new_tensors, trainer.iteration)  # every committed iteration was one Adam step
            if not fresh:
                transfers = plan_transfers(base, topology, dead)
                received = exchange(transfers, generation.rank, old_tensors, new_tensors)
            elastic.ctl.add(keys.moved(topology.generation), received)
            if generation.commit.form() != COMPLETE:
                raise RuntimeError(f"forming generation {topology.generation} did not complete")
        except BaseException:
            if new_parts is not None:
                new_parts.release()
            raise
        tensors = old_tensors or new_tensors
        unit_numel = {f: tensors.unit_numel(f) for f in topology.units}
        return _Staged(topology, info, setup, new_parts, base, dead, unit_numel, started, fresh,
                       replicated_bytes=tensors.replicated_numel() * 4, loaded=from_checkpoint)

    @property
    def start_iteration(self) -> int:
        """The iteration this run started from (0, or the loaded checkpoint's), as the controller published it."""
        if self._start_iteration is None:
            self._start_iteration = int(self.elastic.ctl.get(keys.START).decode())
        return self._start_iteration

    def _load_start(self, trainer, parts: Components) -> None:
        """Read the checkpoint the run resumes from into ``parts`` (this generation's layout)."""
        coords = checkpoint.ParallelCoords.of(parts.setup, self.cfg.parallel)
        iteration = checkpoint.load_checkpoint(Path(self.cfg.checkpoint.load), parts.model, parts.optimizer,
                                               parts.scheduler, coords).iteration
        if iteration != trainer.iteration:
            raise SystemExit(f"checkpoint.load: {self.cfg.checkpoint.load} holds iteration {iteration}, but the "
                             f"launcher started the run at iteration {trainer.iteration}")

    def _adopt(self, trainer, staged: "_Staged") -> None:
        """Switch to the new generation's objects (local only: nothing here can be interrupted by a peer)."""
        old: Optional[Components] = trainer.parts
        if staged.new_parts is not None:
            if old is not None:
                if not staged.loaded:
                    staged.new_parts.scheduler.load_state_dict(old.scheduler.state_dict())
                old.release()
            elif trainer.iteration and not staged.loaded:
                staged.new_parts.scheduler.step(increment=trainer.iteration * self.cfg.training.global_batch_size)
            trainer.parts = staged.new_parts
        else:
            rebind_process_groups([old.model, old.optimizer], old.setup.groups, staged.setup.groups)
            old.setup.grad_sync.close()
            old.setup = staged.setup
            attach_grad_sync(self.cfg, old)
        del old
        self.completed = staged.topology
        gc.collect()
        if trainer.is_reporting_rank and (staged.info.get("deaths") or staged.info.get("joined")):
            self._report(trainer, staged)

    def _report(self, trainer, staged: "_Staged") -> None:
        topology, info = staged.topology, staged.info
        moved = int(self.elastic.ctl.add(keys.moved(topology.generation), 0))
        joined = [tuple(slot) for slot in info.get("joined", [])]
        if staged.fresh:
            bound = 0  # before the first step every rank draws its initial weights: nothing has to move
        elif joined:  # the new processes' canonical blocks, and the replicated parameters they have none of
            bound = (join_lower_bound_bytes(topology, joined, staged.unit_numel)
                     + len(joined) * staged.replicated_bytes)
        else:
            bound = lower_bound_bytes(staged.base, topology, staged.dead, staged.unit_numel)
        settled = info.get("settled") or {}
        redone = 1 if settled.get("decision") == "abort" and settled.get("started") else 0
        recovery_s = time.time() - info["failure_time"]
        widths = trainer.setup.tp_per_replica
        event = {"kind": "event", "event": "reformed", "generation": topology.generation, "tp_per_replica": widths,
                 "recovery_s": recovery_s, "moved_bytes": moved, "lower_bound_bytes": bound,
                 "iterations_redone": redone, "resume_iteration": trainer.iteration + 1, "time": time.time(),
                 "reform_s": time.time() - staged.started, "joined": [list(j) for j in joined]}
        metrics.emit(event, sys.stdout)
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        what = ("rejoined: " + ", ".join(f"replica {r} slot {s}" for r, s in joined)) if joined else (
            f"recovered in {recovery_s:.2f} s")
        redo = f"iteration {trainer.iteration + 1} redone" if redone else f"resuming at iteration {trainer.iteration + 1}"
        print(f" [{stamp}] re-formed | generation {topology.generation} | tp per replica: {widths} | {what} | "
              f"moved {_size(moved)} (lower bound {_size(bound)}) | {redo} |", flush=True)


@dataclass
class _Staged:
    """A completed re-formation, not yet adopted."""

    topology: Topology
    info: dict
    setup: ParallelSetup
    new_parts: Optional[Components]
    """Rebuilt objects for a rank whose units changed; None for a rank that keeps its own."""
    base: Topology
    dead: list[int]
    unit_numel: dict[str, int]
    started: float
    fresh: bool
    """No iteration committed yet: every rank built the initial weights itself."""
    replicated_bytes: int = 0
    loaded: bool = False
    """Every rank read its state (scheduler included) from the checkpoint the run resumes from."""


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
