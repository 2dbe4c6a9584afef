"""What the loop's helpers (evaluation, checkpoint saves, state checks) read of the trainer: its configuration,
the objects it trains with now (a re-formation may replace them), its progress, and the session."""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from ntp_megatron.config.schema import JobConfig
from ntp_megatron.elastic.session import Session
from ntp_megatron.training.checkpoint import ParallelCoords
from ntp_megatron.training.components import Components
from ntp_megatron.training.data import Datasets
from ntp_megatron.training.parallel import ParallelSetup


class LoopState(Protocol):
    cfg: JobConfig
    datasets: Datasets
    device: torch.device
    session: Session
    parts: Optional[Components]
    iteration: int
    consumed_samples: int

    @property
    def setup(self) -> ParallelSetup:
        """The current objects' parallel setup."""

    @property
    def coords(self) -> ParallelCoords:
        """This rank's place for per-rank checkpoint state, in the current layout."""
