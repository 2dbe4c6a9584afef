"""Evaluation (``training.eval_interval``): after every ``eval_interval`` iterations and at the end, a forward-only
pass over ``eval_iters`` global batches of the validation split (and, at the end, the test split), whose loss is
the per-token mean over all of them, the same under every layout. Under NTP it is a collective phase like the
others: a failure in it is absorbed and the evaluation done again in the new generation."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from ntp_megatron import metrics, phases
from ntp_megatron.training.data import evaluation_batches, evaluation_window, microbatches
from ntp_megatron.training.loop_state import LoopState
from ntp_megatron.training.steps import evaluation_step, loss_of, run_schedule


class Evaluations:
    """The evaluations of one run, each done and reported once per (iteration, split, final)."""

    def __init__(self, trainer: LoopState) -> None:
        self.trainer = trainer
        self.done: set[tuple[int, str, bool]] = set()
        """``(iteration, split, final)`` of the evaluations done (or not due: the iteration the run started from)."""

    def due(self) -> bool:
        t, k = self.trainer.cfg.training, self.trainer.iteration
        return t.evaluates and k % t.eval_interval == 0 and (k, "validation", False) not in self.done

    def evaluate(self, split: str, final: bool) -> dict[str, Any]:
        """Forward-only over this replica's shares of ``eval_iters`` global batches of ``split`` (collective over
        the job): the per-token mean loss of all of them; returns the evaluation's record. Which samples: a
        function of the iteration and the replica's shares only (:func:`evaluation_window`), so a resumed or
        re-formed run reads the same ones."""
        trainer = self.trainer
        t, s, parts = trainer.cfg.training, trainer.setup, trainer.parts
        phases.at_iteration(trainer.iteration)
        phases.enter("eval")
        window = evaluation_window(trainer.cfg, trainer.iteration, split, final)
        batches = evaluation_batches(window, t.eval_iters, s.shares, s.num_replicas, t.global_batch_size)
        dataset = getattr(trainer.datasets, split)
        start = time.perf_counter()
        total = torch.zeros(2, dtype=torch.float64)  # loss sum, tokens
        parts.model.eval()
        try:
            with torch.no_grad():
                for b, samples in enumerate(batches):
                    if b == len(batches) // 2:
                        phases.point("eval")
                    reported = run_schedule(s, parts.tf_config, parts.model, evaluation_step,
                                            microbatches(dataset, samples, t.micro_batch_size, trainer.device),
                                            len(samples) // t.micro_batch_size, trainer.cfg.model.seq_length,
                                            t.micro_batch_size, forward_only=True)
                    total += loss_of(reported, torch.float64)
        finally:
            parts.model.train()
        loss_sum, tokens = s.loss_over_replicas(total).tolist()
        loss = loss_sum / tokens
        record = {"kind": "evaluation", "split": split, "iteration": trainer.iteration, "final": final,
                  "lm_loss": loss, "ppl": math.exp(min(20.0, loss)), "eval_iters": t.eval_iters,
                  "samples": t.eval_iters * t.global_batch_size, "tokens": int(tokens),
                  "consumed_samples": trainer.consumed_samples, "tp_per_replica": s.tp_per_replica,
                  "generation": s.generation, "elapsed_ms": (time.perf_counter() - start) * 1e3, "time": time.time()}
        # Before this rank can take part in a later generation:
        trainer.session.mark_evaluated(s.generation, trainer.iteration, split, final, record)
        return record

    def until_done(self, split: str, final: bool = False) -> None:
        """Evaluate and report, once per (iteration, split, final). Under NTP a failure midway is absorbed and the
        re-formed job evaluates again, unless some rank had completed the evaluation (a collective can end on some
        of its members and fail on others): then its record stands for everyone, and every rank of the new
        generation moves on alike."""
        trainer = self.trainer
        done = (trainer.iteration, split, final)
        while done not in self.done:
            generation = trainer.setup.generation
            record = trainer.session.guarded(lambda: self.evaluate(split, final))
            if record is None:
                record = trainer.session.evaluated_elsewhere(generation, trainer.iteration, split, final)
                if record is None:
                    continue
            self.done.add(done)
            self.report(record)

    def report(self, record: dict[str, Any]) -> None:
        """Every rank sends the record (the launcher keeps one); the reporting rank prints Megatron's lines."""
        metrics.emit(record, sys.stdout)
        if self.trainer.session.reporting:
            line = metrics.evaluation_line(record)
            print("-" * len(line), line, "-" * len(line), sep="\n", flush=True)
