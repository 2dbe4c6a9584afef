"""The training loop: one Megatron-Core forward/backward + optimizer step per iteration, logged.

Per iteration ``k``: forward/backward (Megatron's schedule; the gradient sync and the token count run in
``finalize_model_grads``), the loss for the log and the grad norm — every cross-rank reduction of the step —
then the commit point, then the local optimizer step (after which the iteration counts as done), and under the
distributed optimizer the parameter all-gather as a step of its own (phase ``param_gather``;
:meth:`ntp_megatron.training.components.Components.param_gather`). The live path is one object, the
:class:`ntp_megatron.elastic.session.Session`: under NTP each step is committed exactly once and a collective
action a peer's failure interrupts is left for the next generation without stopping (the rank rolls a committed
step forward or drops an aborted one, and training goes on at the settled iteration); with NTP off the session
does nothing. Evaluation (:mod:`.evaluation`), checkpoint saves (:mod:`.saving`) and state checks
(:mod:`.verification`) are actions of the loop at an iteration boundary.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ntp_megatron import metrics, phases

from ntp_megatron.speed import compute_time, device_model
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.elastic.session import Session
from ntp_megatron.training import checkpoint
from ntp_megatron.training.comm_stats import CommStats
from ntp_megatron.training.components import Components
from ntp_megatron.training.data import Datasets, microbatches, replica_sample_range
from ntp_megatron.training.evaluation import Evaluations
from ntp_megatron.training.memory import RankMemory
from ntp_megatron.training.parallel import ParallelSetup
from ntp_megatron.training.saving import Checkpoints
from ntp_megatron.training.steps import ForwardStep, loss_of, run_schedule
from ntp_megatron.training.verification import StateChecks


MEMORY_PHASES = ("first_iteration", "steady")
"""The ``memory`` records of a generation's first two iterations: the first one's peak (after a re-formation:
the first degraded iteration; in the run's first, Adam's moments are allocated in its step), and a steady one."""


def _resources() -> dict[str, Any]:
    """This process's threads (native and Python), open file descriptors and resident memory."""
    status = Path("/proc/self/status").read_text()
    field_of = {line.split(":")[0]: line.split(":")[1].strip() for line in status.splitlines() if ":" in line}
    return {"threads": int(field_of.get("Threads", "0")), "python_threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")), "rss_mb": int(field_of.get("VmRSS", "0 kB").split()[0]) / 1024}


@dataclass
class Trainer:
    cfg: JobConfig
    parts: Optional[Components]
    """The objects this rank trains with (under NTP built, and rebuilt, by the session's re-formations)."""
    datasets: Datasets
    device: torch.device
    launch_rank: int
    session: Session
    comm_stats: Optional[CommStats] = None
    """With ``logging.comm_stats``: counts of this rank's collectives and their bytes, per iteration."""
    joining: bool = False
    """A replacement process admitted into the running job: its first state is not the run's initial one."""
    booster: Optional[Any] = None
    """With ``ntp.boost``: the :class:`ntp_megatron.training.boosting.Booster` of this rank."""
    clock: Any = field(default_factory=compute_time.HostClock)
    """How this rank measures its compute time (:mod:`ntp_megatron.speed.compute_time`: the host's clock, or CUDA
    events)."""
    iteration: int = 0
    """Completed (committed and stepped) iterations; the next one is 1-based ``iteration + 1``."""
    consumed_samples: int = 0
    pending: Optional[dict] = field(default=None, repr=False)
    """The record of the iteration voted on and not yet stepped."""
    unreported: Optional[dict] = field(default=None, repr=False)
    """The record of an iteration stepped whose parameter all-gather a peer's failure interrupted: reported
    after the re-formation (which gathers again)."""
    _resources_reported: Optional[int] = field(default=None, repr=False)
    _memory_reported: dict[int, int] = field(default_factory=dict, repr=False)
    """Per generation: how many of its iterations had a ``memory`` record (its first two do)."""
    _recent_ms: list[float] = field(default_factory=list, repr=False)
    _device_generation: Optional[int] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.evaluations = Evaluations(self)
        self.checkpoints = Checkpoints(self)
        self.checks = StateChecks(self)
        self.memory = RankMemory(self.cfg, self.device, self.launch_rank)

    @property
    def setup(self) -> ParallelSetup:
        return self.parts.setup

    @property
    def coords(self) -> checkpoint.ParallelCoords:
        """This rank's place for per-rank checkpoint state, in the current layout."""
        return checkpoint.ParallelCoords.of(self.setup, self.cfg.parallel)

    # -- one iteration --------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """Run iteration ``self.iteration + 1`` up to its commit point, then step; returns its record."""
        t, s, parts = self.cfg.training, self.setup, self.parts
        k = self.iteration + 1
        phases.at_iteration(k)
        phases.point("start")
        self.session.begin(k)
        if self.comm_stats is not None:
            self.comm_stats.take()  # count this iteration's step only
        measured = self._memory_reported.get(s.generation, 0)
        if measured < len(MEMORY_PHASES):
            self.memory.begin()
        if self._device_generation != s.generation:  # this generation's layout: its device share, its power
            self._device_generation = s.generation
            device_model.hold(parts.model.parameters(), s.pg.tp.size())
            if self.booster is not None:
                self.booster.layout(parts, s)
        start = time.perf_counter()
        self.clock.begin()
        parts.model.zero_grad_buffer()
        parts.optimizer.zero_grad()
        samples: list[int] = []
        per_share = s.microbatches_per_share * t.micro_batch_size
        for share in s.shares:
            samples += list(replica_sample_range(k - 1, share, s.num_replicas, t.global_batch_size))[:per_share]
        lr = parts.optimizer.param_groups[0]["lr"]
        reported = run_schedule(s, parts.tf_config, parts.model, ForwardStep(s.microbatches),
                                microbatches(self.datasets.train, samples, t.micro_batch_size, self.device),
                                s.microbatches, self.cfg.model.seq_length, t.micro_batch_size, forward_only=False)
        loss_and_tokens = s.loss_over_replicas(loss_of(reported, torch.float32))
        compute_s = self.clock.seconds()  # the forward and backward passes, waits excluded (after the loss's sync)
        phases.record_compute(k, compute_s)
        grad_norm = None
        if s.grad_sync is not None and t.clip_grad > 0:
            grad_norm = s.grad_sync.compute_grad_norm()  # the last reduction before the commit point
        self.pending = {
            "kind": "iteration", "iteration": k, "train_iters": t.train_iters,
            "global_batch_size": s.samples_per_iteration,
            "lm_loss": float(loss_and_tokens[0] / loss_and_tokens[1]),
            "grad_norm": grad_norm, "lr": lr, "tp_per_replica": s.tp_per_replica, "generation": s.generation,
            "compute_ms": compute_s * 1e3,
            "_start": start, "_memory": MEMORY_PHASES[measured] if measured < len(MEMORY_PHASES) else None,
        }
        self.session.commit(k)
        phases.point("optimizer")
        return self.complete_step()

    def complete_step(self, gather: bool = True) -> dict[str, Any]:
        """A committed iteration after its commit point: the optimizer step (local), then, as a step of its own,
        the parameter all-gather the distributed optimizer needs under NTP (``gather=False``: left to the
        re-formation that follows a roll-forward, in its new groups); returns the iteration's record.

        The iteration counts as done (iteration, schedule, samples, record) as soon as the local step is: the
        gather is collective, and a peer's failure in it must not make this rank redo the iteration (its
        optimizer would step twice). The re-formation that follows re-gathers every rank's parameters from the
        committed shards; the record is reported then (:attr:`unreported`)."""
        record = self.pending
        self.pending = None
        parts = self.parts
        update_ok, grad_norm, _ = parts.optimizer.step()
        parts.scheduler.step(increment=self.cfg.training.global_batch_size)
        self.iteration = record["iteration"]
        self.consumed_samples += record["global_batch_size"]
        record["consumed_samples"] = self.consumed_samples
        if record["grad_norm"] is None and grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        phase = record.pop("_memory")
        start = record.pop("_start")
        record.update(skipped=0 if update_ok else 1)
        self._finish_record(record, start)
        self.checks.step_done(record)
        if gather:
            self.unreported = record
            phases.point("param_gather")
            parts.param_gather()
            self.unreported = None
            self._finish_record(record, start)  # the gather's time counts too
        if phase is not None:
            self._memory_reported[record["generation"]] = self._memory_reported.get(record["generation"], 0) + 1
            self.memory.report(phase, parts, iteration=record["iteration"])
        return record

    def _finish_record(self, record: dict[str, Any], start: float) -> None:
        elapsed = time.perf_counter() - start
        record.update(elapsed_ms=elapsed * 1e3, time=time.time(),
                      tokens_per_s=record["global_batch_size"] * self.cfg.model.seq_length / elapsed)

    # -- the loop's side of a re-formation (ntp_megatron.elastic.interfaces.Training) ------------------------------------
    def pending_iteration(self) -> Optional[int]:
        return self.pending["iteration"] if self.pending is not None else None

    def settle(self, committed: bool) -> None:
        if committed:
            self.report(self.complete_step(gather=False))  # the old generation's groups are broken
        else:
            self.pending = None

    # -- reporting --------------------------------------------------------------------------------------------
    def _eta(self, record: dict[str, Any]) -> float:
        """Seconds until the run's last iteration at the mean pace of the last (up to) 20 iterations."""
        self._recent_ms.append(record["elapsed_ms"])
        del self._recent_ms[:-20]
        return (record["train_iters"] - record["iteration"]) * sum(self._recent_ms) / len(self._recent_ms) / 1e3

    def report(self, record: dict[str, Any]) -> None:
        if record["generation"] != self._resources_reported:
            # The first iteration of each generation, on every rank: threads, descriptors and memory must not
            # grow from one generation to the next (unless an ended generation's groups are still held).
            self._resources_reported = record["generation"]
            metrics.emit({"kind": "resources", "launch_rank": self.launch_rank, "iteration": record["iteration"],
                          "generation": record["generation"], **self.session.resources(), **_resources()},
                         sys.stdout)
        if self.comm_stats is not None:
            metrics.emit({"kind": "comm_stats", "iteration": record["iteration"], "replica": self.setup.replica,
                          "tp_rank": self.setup.tp_rank, **self.comm_stats.take()}, sys.stdout)
        # Every rank sends the record (the launcher keeps one per iteration and generation): the record of a
        # committed iteration survives the death of any rank right after its step.
        metrics.emit(record, sys.stdout)
        if record.get("compute_ms") is not None:  # this rank's own, for the run plot's per-replica compute
            metrics.emit({"kind": "compute", "iteration": record["iteration"], "launch_rank": self.launch_rank,
                          "replica": self.setup.replica, "stage": self.setup.stage, "tp_rank": self.setup.tp_rank,
                          "generation": record["generation"], "compute_ms": record["compute_ms"]}, sys.stdout)
        if not self.session.reporting:
            return
        self.session.record_progress(self.consumed_samples)  # what a replacement starts from
        eta_s = self._eta(record)
        if record["iteration"] % self.cfg.logging.log_interval == 0 or record["iteration"] == record["train_iters"]:
            print(metrics.iteration_line(record, eta_s=eta_s), flush=True)

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self) -> None:
        t, session = self.cfg.training, self.session
        session.start(self)
        self.checkpoints.last_saved = self.iteration  # where this run started: the seed's state, or a checkpoint
        self.evaluations.done.add((self.iteration, "validation", False))  # evaluated by the run that saved it
        if not self.joining:
            session.guarded(lambda: self.checks.dump(initial=True))
        while True:
            self._check_state()  # a replacement process takes part in its new generation's check
            while self.iteration < t.train_iters:
                # None: a failed generation; recovered, the iteration is redone (or was rolled forward)
                record = session.guarded(self.train_step)
                if record is None and self.unreported is not None:  # stepped, its gather interrupted
                    record, self.unreported = self.unreported, None
                if record is not None:
                    self.report(record)
                self._boundary()
            if session.guarded(self._finish):
                break
        session.end()

    def _boundary(self) -> None:
        """The work after an iteration (also after one rolled forward, or one to be redone)."""
        self._check_state()
        if self.evaluations.due():  # before the iteration's checkpoint, as Megatron
            self.evaluations.until_done("validation")
        self.checkpoints.finalize()  # an async save whose writers are done everywhere moves `latest`
        if self.checkpoints.due():
            self.checkpoints.until_written()
        self.session.boundary()
        self._check_state()  # after a re-formation in any of the above

    def _check_state(self) -> None:
        while self.checks.due():
            self.session.guarded(self.checks.check)

    def _finish(self) -> bool:
        if self.cfg.checkpoint.save is not None:
            self.checkpoints.until_written()  # the final checkpoint, unless this iteration's is on disk already
        if self.cfg.training.evaluates:
            for split in ("validation", "test"):
                if getattr(self.datasets, split) is not None:
                    self.evaluations.until_done(split, final=True)
        self.checkpoints.finalize(blocking=True)  # no async save left behind
        self.checks.dump(initial=False)
        phases.enter("end")
        torch.distributed.barrier()
        return True
