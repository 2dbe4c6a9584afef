"""The one seam between the training loop and the live path.

The loop calls a :class:`Session` and nothing else of :mod:`ntp_megatron.elastic`: start, begin an iteration,
commit it, run each collective action (a step, an evaluation, a save) with recovery from an interruption, the
admission move at an iteration boundary, end; and the few records the live path keeps for it in the launcher's
store (an evaluation or a save completed by some rank of a generation that then failed, the consumed samples a
replacement starts from). With NTP off it is a :class:`NullSession`, which does nothing: an exception in an
action is the caller's to handle. Under NTP it is an :class:`ElasticSession`: one generation after another, an
iteration committed exactly once (:mod:`ntp_megatron.elastic.commit`), a failed generation left for the next one
(:mod:`ntp_megatron.elastic.reform`), and a rank's own error told apart from a peer's failure
(:mod:`ntp_megatron.elastic.errors`) and raised.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from ntp_megatron import phases
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.elastic import commit, keys
from ntp_megatron.elastic.commit import COMMIT_REFORM, COMMITTED_DECISIONS, IterationAborted
from ntp_megatron.elastic.errors import OWN_OR_PEER, caused_by_peer
from ntp_megatron.elastic.generation import ElasticRank
from ntp_megatron.elastic.interfaces import Builder, Training
from ntp_megatron.elastic.reform import Reformer

T = TypeVar("T")


class Session(ABC):
    """What the training loop asks of the live path."""

    @property
    @abstractmethod
    def reporting(self) -> bool:
        """This rank prints the job's log lines (rank 0 of the current generation)."""

    @abstractmethod
    def start(self, training: Training) -> None:
        """Take part in the job: under NTP, form the first generation (which builds ``training.parts``)."""

    @abstractmethod
    def begin(self, iteration: int) -> None:
        """Iteration ``iteration`` (1-based) begins."""

    @abstractmethod
    def commit(self, iteration: int) -> None:
        """The commit point of ``iteration``: returns when it is committed (every cross-rank reduction of it is
        done; the optimizer step may follow); raises :class:`IterationAborted` if it was aborted."""

    @abstractmethod
    def guarded(self, action: Callable[[], T]) -> Optional[T]:
        """Run a collective action. Under NTP, a peer's failure in it sends this rank to the next generation and
        the result is None; its own error is raised."""

    @abstractmethod
    def boundary(self) -> None:
        """An iteration boundary after the work of the committed iteration: move to the next generation if the
        commit asked for it (repaired ranks are admitted)."""

    @abstractmethod
    def end(self) -> None:
        """This process is done with the job (the run ended, or its replica was dropped)."""

    @abstractmethod
    def mark_evaluated(self, generation: int, iteration: int, split: str, final: bool, record: dict) -> None:
        """This rank completed the evaluation (before it can take part in a later generation)."""

    @abstractmethod
    def evaluated_elsewhere(self, generation: int, iteration: int, split: str, final: bool) -> Optional[dict]:
        """The record of an evaluation some rank completed in ``generation``, if one did."""

    @abstractmethod
    def mark_saved(self, iteration: int) -> None:
        """This rank returned from the checkpoint save of ``iteration``."""

    @abstractmethod
    def saved_elsewhere(self, iteration: int) -> bool:
        """Some rank returned from the save of ``iteration`` (so it is complete)."""

    @abstractmethod
    def record_progress(self, consumed_samples: int) -> None:
        """Samples consumed up to the newest committed iteration (what a replacement process starts from)."""

    @abstractmethod
    def resources(self) -> dict[str, Any]:
        """The live path's share of a resource report: sockets of the current and of left generations, and
        process groups of ended generations still held."""


class NullSession(Session):
    """NTP off: one process group for the whole run, nothing to commit, recover or record."""

    def __init__(self, launch_rank: int) -> None:
        self.launch_rank = launch_rank

    @property
    def reporting(self) -> bool:
        return self.launch_rank == 0

    def start(self, training: Training) -> None:
        pass

    def begin(self, iteration: int) -> None:
        pass

    def commit(self, iteration: int) -> None:
        pass

    def guarded(self, action: Callable[[], T]) -> Optional[T]:
        return action()

    def boundary(self) -> None:
        pass

    def end(self) -> None:
        pass

    def mark_evaluated(self, generation: int, iteration: int, split: str, final: bool, record: dict) -> None:
        pass

    def evaluated_elsewhere(self, generation: int, iteration: int, split: str, final: bool) -> Optional[dict]:
        return None

    def mark_saved(self, iteration: int) -> None:
        pass

    def saved_elsewhere(self, iteration: int) -> bool:
        return False

    def record_progress(self, consumed_samples: int) -> None:
        pass

    def resources(self) -> dict[str, Any]:
        return {}


class ElasticSession(Session):
    """NTP on: this process in the job's generations (:class:`ElasticRank`), re-formed by a :class:`Reformer`
    whose objects the training code builds (``builder``)."""

    def __init__(self, cfg: JobConfig, elastic: ElasticRank, builder: Builder, joining: bool) -> None:
        self.elastic = elastic
        self.reformer = Reformer(cfg, elastic, builder)
        self.joining = joining
        self.move_pending = False
        """The last commit was ``commit+reform``: move to the next generation at the coming boundary."""
        self._training: Optional[Training] = None

    @property
    def ctl(self) -> dist.Store:
        return self.elastic.ctl

    @property
    def reporting(self) -> bool:
        generation = self.reformer.generation
        return generation.rank == 0 if generation is not None else self.elastic.launch_rank == 0

    def start(self, training: Training) -> None:
        # A rank (re)starting joins the newest generation that has its slot; a failure before training began is
        # handled like any other (the next generation), since the initial weights depend on the seed alone.
        self._training = training
        self.reformer.start(training, joining=self.joining)

    def begin(self, iteration: int) -> None:
        self.elastic.release_held()
        self.reformer.generation.commit.begin(iteration)  # the controller's measure of whether an aborted
        # iteration cost work

    def commit(self, iteration: int) -> None:
        decision = self.reformer.generation.commit.vote(iteration)
        if decision not in COMMITTED_DECISIONS:
            raise IterationAborted(f"iteration {iteration} aborted by the controller")
        self.move_pending = decision == COMMIT_REFORM

    def guarded(self, action: Callable[[], T]) -> Optional[T]:
        """Recovery runs after the ``except`` block: the exception's traceback pins the failed step's frames — the
        old model, its autograd graph, its process groups — until it is dropped."""
        generation = self.reformer.generation.number
        try:
            return action()
        except OWN_OR_PEER as exc:  # noqa: BLE001
            with phases.waiting():  # on the controller's verdict: the launcher must not take this rank for stuck
                peer = caused_by_peer(exc, lambda s: self.elastic.marked_over(generation, s))
            if not peer:
                raise
            cause = f"{type(exc).__name__}: {str(exc)[:300]}"  # text only: the exception would pin the frames
        with phases.waiting():  # on the next generation, then on the peers it re-forms with
            self._recover(cause)
        return None

    def _recover(self, cause: str) -> None:
        """Leave the failed generation and re-form in the newest one. A move the failed generation had decided is
        void: the controller built the new one without it. ``cause``: what failed here, reported if no new
        generation comes."""
        self.move_pending = False
        try:
            self.reformer.recover(self._training)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; this rank had left its generation after {cause}") from None

    def boundary(self) -> None:
        if self.move_pending:
            self.move_pending = False
            self.guarded(self._move)

    def _move(self) -> None:
        """Admit repaired ranks: everyone finished this generation's work, then re-forms in the next."""
        dist.barrier()
        self.reformer.move(self._training)

    def end(self) -> None:
        self.reformer.leave()
        self.elastic.park_held()
        self.elastic.heartbeat.stop()

    def mark_evaluated(self, generation: int, iteration: int, split: str, final: bool, record: dict) -> None:
        keys.mark_evaluated(self.ctl, generation, iteration, split, final, record)

    def evaluated_elsewhere(self, generation: int, iteration: int, split: str, final: bool) -> Optional[dict]:
        return keys.evaluation_record(self.ctl, generation, iteration, split, final)

    def mark_saved(self, iteration: int) -> None:
        keys.mark_saved(self.ctl, iteration)

    def saved_elsewhere(self, iteration: int) -> bool:
        return keys.is_saved(self.ctl, iteration)

    def record_progress(self, consumed_samples: int) -> None:
        if self.reporting:
            commit.record_consumed(self.ctl, consumed_samples)

    def resources(self) -> dict[str, Any]:
        generation = self.reformer.generation
        # The generation's own sockets, its groups' (kept ones included) and what they hold open.
        held = set(generation.watchdog.sockets.values()) | self.elastic.pinned_sockets() if generation else set()
        return {"generation_sockets": len(held),
                "stale_sockets": self.elastic.stale_sockets(), "held_generations": self.elastic.release_held(),
                **self.elastic.store_connections()}
