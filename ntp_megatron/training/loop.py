"""The training loop: one Megatron-Core forward/backward + optimizer step per iteration, logged."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from ntp_megatron import faults, metrics
from ntp_megatron.config import JobConfig
from ntp_megatron.training import checkpoint
from ntp_megatron.training.data import microbatches, replica_sample_range
from ntp_megatron.training.parallel import ParallelSetup

logger = logging.getLogger(__name__)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss: the sum over this micro-batch and its token count; Megatron divides by the
    global token count after the DP reduction, so the gradient is the mean over the global batch."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    tokens = mask.sum()
    return loss_sum, tokens.to(torch.int), {"lm loss": torch.stack([loss_sum.detach(), tokens.detach()])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"]
    )
    return output, lambda out: loss_func(batch["loss_mask"], out)


@dataclass
class Trainer:
    cfg: JobConfig
    model: Any  # DistributedDataParallel
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    dataset: Any
    setup: ParallelSetup
    device: torch.device
    coords: checkpoint.ParallelCoords
    is_reporting_rank: bool
    tf_config: Any = None
    failures: faults.FailureTrigger | None = None
    comm_stats: Any = None  # training.comm_stats.CommStats with logging.comm_stats
    iteration: int = 0
    """Completed iterations; the next step is 0-based iteration ``self.iteration``."""

    def train_step(self) -> dict[str, Any]:
        """Run 0-based iteration ``self.iteration`` and return its record (lm loss over the global batch)."""
        t = self.cfg.training
        if self.comm_stats is not None:
            self.comm_stats.take()  # count this iteration's step only
        start = time.perf_counter()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        s = self.setup
        samples = replica_sample_range(self.iteration, s.replica, s.num_replicas, t.global_batch_size)
        samples = samples[: s.microbatches * t.micro_batch_size]
        lr = self.optimizer.param_groups[0]["lr"]
        reported = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=microbatches(self.dataset, samples, t.micro_batch_size, self.device),
            model=[self.model],
            num_microbatches=s.microbatches,
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=t.micro_batch_size,
            forward_only=False,
            pg_collection=s.pg,
        )
        update_ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=t.global_batch_size)
        self.iteration += 1

        loss_and_tokens = s.sum_over_replicas(torch.stack([r["lm loss"] for r in reported]).sum(dim=0))
        elapsed = time.perf_counter() - start
        return {
            "kind": "iteration",
            "iteration": self.iteration,
            "train_iters": t.train_iters,
            "consumed_samples": self.iteration * s.samples_per_iteration,
            "global_batch_size": s.samples_per_iteration,
            "lm_loss": float(loss_and_tokens[0] / loss_and_tokens[1]),
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "lr": lr,
            "elapsed_ms": elapsed * 1e3,
            "tokens_per_s": s.samples_per_iteration * self.cfg.model.seq_length / elapsed,
            "skipped": 0 if update_ok else 1,
            "tp_per_replica": s.tp_per_replica,
        }

    def report(self, record: dict[str, Any]) -> None:
        if not self.is_reporting_rank:
            return
        metrics.emit(record, sys.stdout)
        if record["iteration"] % self.cfg.logging.log_interval == 0 or record["iteration"] == record["train_iters"]:
            print(metrics.iteration_line(record), flush=True)

    def full_state(self) -> dict[str, torch.Tensor]:
        from ntp_megatron.training.inspect_state import full_state

        return full_state(self.model, self.optimizer, self.tf_config, self.cfg.unit_counts(), self.setup.pg.tp,
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
                          "tp_rank": self.setup.tp_rank, "checksums": checksums(state),
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

    def maybe_save(self, final: bool = False) -> Optional[Path]:
        ck = self.cfg.checkpoint
        if ck.save is None:
            return None
        due = ck.save_interval is not None and self.iteration % ck.save_interval == 0
        if not (due or final):
            return None
        path = checkpoint.save_checkpoint(
            Path(ck.save), self.iteration, self.model, self.optimizer, self.scheduler, self.coords
        )
        if self.is_reporting_rank:
            metrics.emit({"kind": "event", "event": "checkpoint_saved", "iteration": self.iteration,
                          "path": str(path)}, sys.stdout)
        return path

    def run(self) -> None:
        t = self.cfg.training
        last_saved = None
        self.dump_initial_state()
        while self.iteration < t.train_iters:
            if self.failures is not None:
                self.failures.before_iteration(self.iteration + 1)
            record = self.train_step()
            if self.comm_stats is not None:
                metrics.emit({"kind": "comm_stats", "iteration": self.iteration, "replica": self.setup.replica,
                              "tp_rank": self.setup.tp_rank, **self.comm_stats.take()}, sys.stdout)
            self.report(record)
            self.verify_state(record)
            if self.maybe_save():
                last_saved = self.iteration
        if last_saved != self.iteration:
            self.maybe_save(final=True)
        self.verify_state(final=True)
