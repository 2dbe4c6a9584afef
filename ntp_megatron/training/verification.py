"""The verification aids of the ``logging`` section: checksums of every replica's full state (``state_checksums``)
and dumps of it (``dump_state``).

Checksums are taken after every committed iteration and again after every re-formation, in the generation
adopted, by every TP rank of every replica: TP-split tensors gathered in unit order, replicated ones as the rank
holds them. The gather is collective over the replica's TP group, so whether it runs is a function of what every
rank of a generation shares — its (iteration, generation) differs from the last one checked — never of what
happened to one rank: a failure that cut a rank's check short (the check of iteration k runs after k's step, and
a failure in another replica ends every rank's collectives of the generation) is made up in the next generation.
A rank reports the checksums of iteration k only if it stepped k itself (with the bits of the grad norm it
clipped with); a replacement process takes part in the gather at its admission but reports from its first step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch

from ntp_megatron import metrics, phases
from ntp_megatron.training.inspect_state import checksums, full_state, shard_checksums
from ntp_megatron.training.loop_state import LoopState
from ntp_megatron.training.model import layer_offset


class StateChecks:
    def __init__(self, trainer: LoopState) -> None:
        self.trainer = trainer
        self.checked: Optional[tuple[int, int]] = None
        """(iteration, generation) of the last check this rank took part in."""
        self.stepped: Optional[tuple[int, Optional[float]]] = None
        """The last iteration this rank stepped itself, and its grad norm."""

    def full_state(self) -> dict[str, torch.Tensor]:
        p, s = self.trainer.parts, self.trainer.setup
        source = s.grad_sync.replicated_state_source() if s.grad_sync is not None else None
        return full_state(p.model, p.optimizer, p.tf_config, self.trainer.cfg.unit_counts(), s.pg.tp, s.tp_rank,
                          replicated_state_source=source, layer_offset=layer_offset(p.tf_config, s.stage))

    def step_done(self, record: dict[str, Any]) -> None:
        self.stepped = (record["iteration"], record["grad_norm"])

    def due(self) -> bool:
        trainer = self.trainer
        return trainer.cfg.logging.state_checksums and self.checked != (trainer.iteration, trainer.setup.generation)

    def check(self) -> None:
        """Checksums of the state after the trainer's iteration (collective over the replica's TP group)."""
        trainer = self.trainer
        phases.enter("verify")
        state = self.full_state()
        iteration, s = trainer.iteration, trainer.setup
        if self.stepped is not None and self.stepped[0] == iteration:
            grad_norm = self.stepped[1]
            shards = (shard_checksums(trainer.parts.optimizer, s.grad_sync.shard_sources())
                      if s.grad_sync is not None and s.grad_sync.distributed_optimizer else None)
            metrics.emit({"kind": "state_checksums", "iteration": iteration, "replica": s.replica,
                          "tp_rank": s.tp_rank, "stage": s.stage, "generation": s.generation, "checksums": checksums(state),
                          "grad_norm": float(grad_norm).hex() if grad_norm is not None else None,
                          **({"shards": shards} if shards is not None else {})}, sys.stdout)
        self.checked = (iteration, s.generation)

    def dump(self, initial: bool) -> None:
        """With ``logging.dump_state``: TP rank 0 of each replica saves its replica's full state, before the first
        step (``replica<r>.init.pt``: what an update is measured against) or at the end (``replica<r>.pt``); with
        pipeline stages, each stage its own part (``replica<r>.stage<p>[.init].pt``, tensors named as in the whole
        model)."""
        where = self.trainer.cfg.logging.dump_state
        if not where:
            return
        phases.enter("verify")
        state = self.full_state()
        s = self.trainer.setup
        if s.tp_rank == 0:
            Path(where).mkdir(parents=True, exist_ok=True)
            stage = f".stage{s.stage}" if s.stages > 1 else ""
            torch.save(state, Path(where) / f"replica{s.replica}{stage}{'.init' if initial else ''}.pt")
