"""The training loop: one Megatron-Core forward/backward + optimizer step per iteration, logged; under NTP,
each step is committed exactly once and a failed generation is left for the next one without stopping.

Per iteration ``k``: forward/backward (Megatron's schedule; the gradient sync and the token count run in
``finalize_model_grads``), the loss for the log and the grad norm — every cross-rank reduction of the step —
then the commit point (:mod:`ntp_megatron.elastic.commit`), then the local optimizer step. Under NTP a
collective that fails (a peer died, or the watchdog closed the generation's sockets) sends the rank to
:meth:`Trainer.recover`: it rolls a committed step forward or drops an aborted one, leaves the old generation,
joins the new one, keeps or rebuilds its model for the new layout (units it lacks come from peers), and
training goes on at the settled iteration.

Evaluation (``training.eval_interval``): after every ``eval_interval`` iterations and at the end, a forward-only
pass over ``eval_iters`` global batches of the validation split (and, at the end, the test split), whose loss is
the per-token mean over all of them, the same under every layout. Under NTP it is a collective phase like the
others: a failure in it is absorbed and the evaluation done again in the new generation.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from ntp_megatron import faults, metrics
from ntp_megatron.elastic import keys
from ntp_megatron.config import JobConfig
from ntp_megatron.training import checkpoint
from ntp_megatron.training.components import Components
from ntp_megatron.training.data import Datasets, evaluation_batches, evaluation_window, microbatches, \
    replica_sample_range

logger = logging.getLogger(__name__)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss: the sum over this micro-batch and its token count; Megatron divides by the
    global token count after the DP reduction, so the gradient is the mean over the global batch."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    tokens = mask.sum()
    return loss_sum, tokens.to(torch.int), {"lm loss": torch.stack([loss_sum.detach(), tokens.detach()])}


class _ForwardStep:
    """Megatron's ``forward_step_func``, with the ``forward`` and ``backward`` failure-injection points at the
    middle micro-batch of the iteration."""

    def __init__(self, num_microbatches: int) -> None:
        self.middle = num_microbatches // 2
        self.index = 0

    def __call__(self, data_iterator, model):
        batch = next(data_iterator)
        middle = self.index == self.middle
        self.index += 1
        if middle:
            faults.point("forward")
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
        if middle and output.requires_grad:
            output.register_hook(_backward_point)
        return output, lambda out: loss_func(batch["loss_mask"], out)


def _evaluation_step(data_iterator, model):
    """Megatron's ``forward_step_func`` for evaluation (forward only, no failure-injection points)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, lambda out: loss_func(batch["loss_mask"], out)


def _resources() -> dict[str, Any]:
    """This process's threads (native and Python), open file descriptors and resident memory."""
    status = Path("/proc/self/status").read_text()
    field_of = {line.split(":")[0]: line.split(":")[1].strip() for line in status.splitlines() if ":" in line}
    import threading

    return {"threads": int(field_of.get("Threads", "0")), "python_threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")), "rss_mb": int(field_of.get("VmRSS", "0 kB").split()[0]) / 1024}


def _backward_point(grad: torch.Tensor) -> torch.Tensor:
    faults.point("backward")
    return grad


@dataclass
class Trainer:
    cfg: JobConfig
    parts: Components
    datasets: Datasets
    device: torch.device
    launch_rank: int
    failures: Optional[faults.FailureTrigger] = None
    comm_stats: Any = None  # training.comm_stats.CommStats with logging.comm_stats
    elastic: Any = None     # ntp_megatron.elastic.generation.ElasticRank under NTP
    generation: Any = None  # its current Generation
    reformer: Any = None    # ntp_megatron.training.reform.Reformer under NTP
    iteration: int = 0
    """Completed (committed and stepped) iterations; the next one is 1-based ``iteration + 1``."""
    consumed_samples: int = 0
    pending: Optional[dict] = field(default=None, repr=False)
    """The record of the iteration voted on and not yet stepped."""
    _resources_reported: Optional[int] = field(default=None, repr=False)
    move_after_step: bool = False
    """The last commit was ``commit+reform``: move to the next generation before the next iteration."""
    last_saved: int = 0
    """The iteration whose state is on disk: the last checkpoint saved, or the one this run started from. With
    ``checkpoint.async_save``, the last one whose save was started (its writer may still be writing)."""
    async_saves: Any = None
    """With ``checkpoint.async_save``: Megatron-Core's ``AsyncCallsQueue`` of saves not yet finalized."""
    _recent_ms: list = field(default_factory=list, repr=False)
    pending_saves: list = field(default_factory=list, repr=False)
    """Iterations of the async saves started and not yet finalized, oldest first."""
    evaluated: set = field(default_factory=set, repr=False)
    """``(iteration, split, final)`` of the evaluations done (or not due: the iteration the run started from)."""

    @property
    def setup(self):
        return self.parts.setup

    @property
    def coords(self) -> checkpoint.ParallelCoords:
        """This rank's place for per-rank checkpoint state, in the current layout."""
        return checkpoint.ParallelCoords.of(self.setup, self.cfg.parallel)

    @property
    def is_reporting_rank(self) -> bool:
        return self.generation.rank == 0 if self.generation is not None else self.launch_rank == 0

    # -- one iteration --------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """Run iteration ``self.iteration + 1`` up to its commit point, then step; returns its record."""
        t, s, parts = self.cfg.training, self.setup, self.parts
        k = self.iteration + 1
        if self.failures is not None:
            self.failures.iteration = k
        faults.point("start")
        if self.generation is not None:  # the controller's measure of whether an aborted iteration cost work
            self.elastic.ctl.add(keys.started(self.generation.number, k), 1)
        if self.comm_stats is not None:
            self.comm_stats.take()  # count this iteration's step only
        start = time.perf_counter()
        parts.model.zero_grad_buffer()
        parts.optimizer.zero_grad()
        samples: list[int] = []
        per_share = s.microbatches_per_share * t.micro_batch_size
        for share in s.shares:
            samples += list(replica_sample_range(k - 1, share, s.num_replicas, t.global_batch_size))[:per_share]
        lr = parts.optimizer.param_groups[0]["lr"]
        reported = get_forward_backward_func()(
            forward_step_func=_ForwardStep(s.microbatches),
            data_iterator=microbatches(self.datasets.train, samples, t.micro_batch_size, self.device),
            model=[parts.model],
            num_microbatches=s.microbatches,
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=t.micro_batch_size,
            forward_only=False,
            pg_collection=s.pg,
        )
        loss_and_tokens = s.sum_over_replicas(torch.stack([r["lm loss"] for r in reported]).sum(dim=0))
        grad_norm = None
        if s.grad_sync is not None and t.clip_grad > 0:
            grad_norm = s.grad_sync.compute_grad_norm()  # the last reduction before the commit point
        self.pending = {
            "kind": "iteration", "iteration": k, "train_iters": t.train_iters,
            "global_batch_size": s.samples_per_iteration,
            "lm_loss": float(loss_and_tokens[0] / loss_and_tokens[1]),
            "grad_norm": grad_norm, "lr": lr, "tp_per_replica": s.tp_per_replica, "generation": s.generation,
            "_start": start,
        }
        if self.generation is not None:
            from ntp_megatron.elastic.commit import COMMIT_REFORM, COMMITTED_DECISIONS, IterationAborted

            decision = self.generation.commit.vote(k)
            if decision not in COMMITTED_DECISIONS:
                raise IterationAborted(f"iteration {k} aborted by the controller")
            self.move_after_step = decision == COMMIT_REFORM
        faults.point("optimizer")
        return self._step()

    def _step(self) -> dict[str, Any]:
        """The local part of a committed iteration: the optimizer step; returns the iteration's record."""
        record = self.pending
        self.pending = None
        parts = self.parts
        update_ok, grad_norm, _ = parts.optimizer.step()
        parts.scheduler.step(increment=self.cfg.training.global_batch_size)
        self.iteration = record["iteration"]
        self.consumed_samples += record["global_batch_size"]
        record["consumed_samples"] = self.consumed_samples
        elapsed = time.perf_counter() - record.pop("_start")
        if record["grad_norm"] is None and grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        record.update(elapsed_ms=elapsed * 1e3, skipped=0 if update_ok else 1, time=time.time(),
                      tokens_per_s=record["global_batch_size"] * self.cfg.model.seq_length / elapsed)
        return record

    # -- evaluation ---------------------------------------------------------------------------------------------
    def evaluate(self, split: str, final: bool) -> dict[str, Any]:
        """Forward-only over this replica's shares of ``eval_iters`` global batches of ``split`` (collective over
        the job): the per-token mean loss of all of them; returns the evaluation's record. Which samples: a
        function of the iteration and the replica's shares only (:func:`evaluation_window`), so a resumed or
        re-formed run reads the same ones."""
        t, s, parts = self.cfg.training, self.setup, self.parts
        if self.failures is not None:
            self.failures.iteration = self.iteration
        window = evaluation_window(self.cfg, self.iteration, split, final)
        batches = evaluation_batches(window, t.eval_iters, s.shares, s.num_replicas, t.global_batch_size)
        dataset = getattr(self.datasets, split)
        start = time.perf_counter()
        total = torch.zeros(2, dtype=torch.float64)  # loss sum, tokens
        parts.model.eval()
        try:
            with torch.no_grad():
                for b, samples in enumerate(batches):
                    if b == len(batches) // 2:
                        faults.point("eval")
                    reported = get_forward_backward_func()(
                        forward_step_func=_evaluation_step,
                        data_iterator=microbatches(dataset, samples, t.micro_batch_size, self.device),
                        model=[parts.model],
                        num_microbatches=len(samples) // t.micro_batch_size,
                        seq_length=self.cfg.model.seq_length,
                        micro_batch_size=t.micro_batch_size,
                        forward_only=True,
                        pg_collection=s.pg,
                    )
                    total += torch.stack([r["lm loss"] for r in reported]).double().sum(dim=0)
        finally:
            parts.model.train()
        loss_sum, tokens = s.sum_over_replicas(total).tolist()
        loss = loss_sum / tokens
        record = {"kind": "evaluation", "split": split, "iteration": self.iteration, "final": final,
                  "lm_loss": loss, "ppl": math.exp(min(20.0, loss)), "eval_iters": t.eval_iters,
                  "samples": t.eval_iters * t.global_batch_size, "tokens": int(tokens),
                  "consumed_samples": self.consumed_samples, "tp_per_replica": s.tp_per_replica,
                  "generation": s.generation, "elapsed_ms": (time.perf_counter() - start) * 1e3, "time": time.time()}
        if self.generation is not None:  # before this rank can take part in a later generation
            self.elastic.ctl.set(keys.evaluated(s.generation, self.iteration, split, final), json.dumps(record))
        return record

    def _evaluate_until_done(self, split: str, final: bool = False) -> None:
        """Evaluate and report, once per (iteration, split, final). Under NTP a failure midway is absorbed and the
        re-formed job evaluates again, unless some rank had completed the evaluation (a collective can end on some
        of its members and fail on others): then its record stands for everyone, and every rank of the new
        generation moves on alike."""
        done = (self.iteration, split, final)
        while done not in self.evaluated:
            generation = self.setup.generation
            record = self._guarded(lambda: self.evaluate(split, final))
            if record is None:
                key = keys.evaluated(generation, self.iteration, split, final)
                if not self.elastic.ctl.check([key]):
                    continue
                record = json.loads(self.elastic.ctl.get(key))
            self.evaluated.add(done)
            self.report_evaluation(record)

    def evaluation_due(self) -> bool:
        t = self.cfg.training
        return t.evaluates and self.iteration % t.eval_interval == 0 and \
            (self.iteration, "validation", False) not in self.evaluated

    def report_evaluation(self, record: dict[str, Any]) -> None:
        """Every rank sends the record (the launcher keeps one); the reporting rank prints Megatron's lines."""
        metrics.emit(record, sys.stdout)
        if self.is_reporting_rank:
            line = metrics.evaluation_line(record)
            print("-" * len(line), line, "-" * len(line), sep="\n", flush=True)

    # -- reporting --------------------------------------------------------------------------------------------
    def _eta(self, record: dict[str, Any]) -> float:
        """Seconds until the run's last iteration at the mean pace of the last (up to) 20 iterations."""
        self._recent_ms.append(record["elapsed_ms"])
        del self._recent_ms[:-20]
        return (record["train_iters"] - record["iteration"]) * sum(self._recent_ms) / len(self._recent_ms) / 1e3

    def report(self, record: dict[str, Any]) -> None:
        held = self.elastic.release_held() if self.generation is not None else 0
        if record["generation"] != self._resources_reported:
            # The first iteration of each generation, on every rank: threads, descriptors and memory must not
            # grow from one generation to the next (unless an ended generation's groups are still held).
            self._resources_reported = record["generation"]
            sockets = {}
            if self.generation is not None:
                sockets = {"generation_sockets": len(self.generation.watchdog.sockets),
                           "stale_sockets": self.elastic.stale_sockets(), "held_generations": held}
            metrics.emit({"kind": "resources", "launch_rank": self.launch_rank, "iteration": record["iteration"],
                          "generation": record["generation"], **sockets, **_resources()}, sys.stdout)
        if self.comm_stats is not None:
            metrics.emit({"kind": "comm_stats", "iteration": record["iteration"], "replica": self.setup.replica,
                          "tp_rank": self.setup.tp_rank, **self.comm_stats.take()}, sys.stdout)
        # Every rank sends the record (the launcher keeps one per iteration and generation): the record of a
        # committed iteration survives the death of any rank right after its step.
        metrics.emit(record, sys.stdout)
        if not self.is_reporting_rank:
            return
        if self.generation is not None:
            self.elastic.ctl.set(keys.CONSUMED, str(self.consumed_samples))  # what a replacement starts from
        eta_s = self._eta(record)
        if record["iteration"] % self.cfg.logging.log_interval == 0 or record["iteration"] == record["train_iters"]:
            print(metrics.iteration_line(record, eta_s=eta_s), flush=True)

    def full_state(self) -> dict[str, torch.Tensor]:
        from ntp_megatron.training.inspect_state import full_state

        p = self.parts
        return full_state(p.model, p.optimizer, p.tf_config, self.cfg.unit_counts(), self.setup.pg.tp,
                          self.setup.tp_rank)

    def verify_state(self, record: Optional[dict[str, Any]] = None, final: bool = False) -> None:
        """The verification aids of the ``logging`` section: after each iteration every rank (every TP rank
        of every replica) reports checksums of its replica's full state — TP-split tensors gathered in unit
        order, replicated ones as this rank holds them — and the bits of the grad norm it clipped with; at
        the end TP rank 0 of each replica dumps the full state."""
        lg = self.cfg.logging
        if not (lg.state_checksums or (final and lg.dump_state)):
            return
        state = self.full_state()
        if lg.state_checksums and not final:
            from ntp_megatron.training.inspect_state import checksums

            grad_norm = record.get("grad_norm") if record else None
            metrics.emit({"kind": "state_checksums", "iteration": self.iteration, "replica": self.setup.replica,
                          "tp_rank": self.setup.tp_rank, "generation": self.setup.generation,
                          "checksums": checksums(state),
                          "grad_norm": float(grad_norm).hex() if grad_norm is not None else None}, sys.stdout)
        if final and lg.dump_state and self.setup.tp_rank == 0:
            Path(lg.dump_state).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(lg.dump_state) / f"replica{self.setup.replica}.pt")

    def dump_initial_state(self) -> None:
        """With ``logging.dump_state``: each replica's full state before its first step, ``replica<r>.init.pt``
        (what an update is measured against)."""
        if not self.cfg.logging.dump_state:
            return
        state = self.full_state()
        if self.setup.tp_rank == 0:
            Path(self.cfg.logging.dump_state).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(self.cfg.logging.dump_state) / f"replica{self.setup.replica}.init.pt")

    def save_due(self) -> bool:
        ck = self.cfg.checkpoint
        return ck.save is not None and ck.save_interval is not None and self.iteration % ck.save_interval == 0

    def save(self) -> Path:
        """Checkpoint the state after ``self.iteration`` (collective over the job, or its current generation).
        With ``checkpoint.async_save`` the earlier save is finalized first, and this one only started: it is
        finalized by a later :meth:`finalize_saves`."""
        p = self.parts
        iteration, started, clock = self.iteration, time.time(), time.perf_counter()
        queue = None
        if self.cfg.checkpoint.async_save:
            if self.async_saves is None:
                from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

                self.async_saves = AsyncCallsQueue(persistent=False)  # a forked writer per save
            self.finalize_saves(blocking=True)
            queue = self.async_saves
            clock = time.perf_counter()  # the wait for the previous save is counted there

        def saved(path: Path) -> None:
            if self.generation is not None:  # for peers that did not see the save complete (_save_until_written)
                self.elastic.ctl.set(keys.saved(iteration), "1")
            if self.is_reporting_rank:
                how = "in the background, " if queue is not None else ""
                print(f" successfully saved checkpoint from iteration {iteration:>8d} to {path} "
                      f"({how}{time.time() - started:.2f} s)", flush=True)
                metrics.emit({"kind": "event", "event": "checkpoint_saved", "iteration": iteration,
                              "path": str(path), "generation": self.setup.generation,
                              "tp_per_replica": self.setup.tp_per_replica, "async": queue is not None,
                              "started": started, "time": time.time()}, sys.stdout)

        path = checkpoint.save_checkpoint(Path(self.cfg.checkpoint.save), iteration, p.model, p.optimizer,
                                          p.scheduler, self.coords, self.consumed_samples, async_queue=queue,
                                          on_finalized=saved)
        if queue is not None:
            self.pending_saves.append(iteration)
        self._report_stall(iteration, "save", time.perf_counter() - clock)
        return path

    def _report_stall(self, iteration: int, phase: str, seconds: float) -> None:
        """Measurement: how long training waited on the save of ``iteration`` (``save``: the call; ``finalize``:
        checks and finalization of an async one), a ``checkpoint_stall`` record (``scripts/bench.sh``)."""
        if self.is_reporting_rank:
            metrics.emit({"kind": "checkpoint_stall", "iteration": iteration, "phase": phase, "seconds": seconds},
                         sys.stdout)

    def finalize_saves(self, blocking: bool = False) -> None:
        """Complete the async saves whose writers have finished on every rank (``blocking``: wait for all of
        them): upstream's metadata, then ``latest`` (collective; only while a save is pending, so the same on
        every rank)."""
        if self.async_saves is not None and self.async_saves.get_num_unfinalized_calls():
            clock, oldest = time.perf_counter(), self.pending_saves[0]
            done = self.async_saves.maybe_finalize_async_calls(blocking=blocking)
            del self.pending_saves[:len(done)]
            self._report_stall(oldest, "finalize", time.perf_counter() - clock)

    def _save_until_written(self) -> None:
        """Save; under NTP a failure midway is absorbed like any other (``latest`` still names the previous
        checkpoint) and the re-formed job writes this iteration's checkpoint again, in its new layout.

        Whether the failed save had completed is read from the store once the re-formation is done: a rank that
        returned from a save marks it before it can take part in any later generation, so every rank of the new
        one decides alike (a death in the save's last barrier can let some ranks return and fail others)."""
        while self.last_saved != self.iteration:
            if self._guarded(self.save) is not None or self.elastic.ctl.check([keys.saved(self.iteration)]):
                self.last_saved = self.iteration

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self) -> None:
        t = self.cfg.training
        self.last_saved = self.iteration  # where this run started: the seed's state, or a checkpoint on disk
        self.evaluated.add((self.iteration, "validation", False))  # evaluated by the run that saved it, if due
        self._guarded(self.dump_initial_state)
        while True:
            while self.iteration < t.train_iters:
                # None: a failed generation; recovered, the iteration is redone (or was rolled forward)
                record = self._guarded(self.train_step)
                if record is not None:
                    self.report(record)
                    self._guarded(lambda: self.verify_state(record))
                if self.evaluation_due():  # a rolled-forward iteration's too; before its checkpoint, as Megatron
                    self._evaluate_until_done("validation")
                self.finalize_saves()  # an async save whose writers are done everywhere moves `latest`
                if self.save_due():  # a rolled-forward iteration's too
                    self._save_until_written()
                if self.move_after_step:
                    self.move_after_step = False
                    self._guarded(self._move)
            if self._guarded(self._finish):
                return

    def _move(self) -> None:
        """Admit repaired ranks: everyone finished this generation's work, then re-forms in the next."""
        torch.distributed.barrier()
        self.reformer.move(self)

    def _finish(self) -> bool:
        if self.cfg.checkpoint.save is not None:
            self._save_until_written()  # the final checkpoint, unless this iteration's is on disk already
        if self.cfg.training.evaluates:
            for split in ("validation", "test"):
                if getattr(self.datasets, split) is not None:
                    self._evaluate_until_done(split, final=True)
        self.finalize_saves(blocking=True)  # no async save left behind
        self.verify_state(final=True)
        torch.distributed.barrier()
        return True

    def _guarded(self, action: Callable[[], Any]) -> Any:
        """Run a collective action; under NTP a failed generation sends the rank to recovery instead (and the
        action's result is None). Recovery runs after the ``except`` block: the exception's traceback pins the
        failed step's frames — the old model, its autograd graph, its process groups — until it is dropped."""
        from ntp_megatron.training.inspect_state import UncoveredState

        try:
            return action()
        except (KeyboardInterrupt, SystemExit, UncoveredState):  # a verification gap is no peer's failure
            raise
        except Exception as exc:  # noqa: BLE001
            if self.generation is None:
                raise
            cause = f"{type(exc).__name__}: {str(exc)[:300]}"  # text only: the exception would pin the frames
        self.recover(cause)
        return None

    def recover(self, cause: str = "") -> None:
        """Leave the failed generation and re-form in the newest one (see :mod:`ntp_megatron.training.reform`).
        A move the failed generation had decided is void: the controller built the new one without it.
        ``cause``: what failed here, reported if no new generation comes (then it was no peer's failure)."""
        self.move_after_step = False
        try:
            self.reformer.recover(self)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; this rank had left its generation after {cause}") from None
