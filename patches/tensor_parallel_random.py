"""CPU RNG for Megatron-Core's RNG tracker (upstream: ``megatron.core.tensor_parallel.random``).

``CudaRNGStatesTracker`` keeps one generator state per name (data-parallel, model-parallel, expert) and
forks into them around dropout. Upstream it stores CUDA generator states; on a CPU build
``torch.cuda.manual_seed`` is silently queued and never runs, so the model-parallel state would be left
unseeded. Here ``add`` and ``fork`` keep CPU generator states instead, with the same semantics.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron.core.tensor_parallel import random as upstream


def _add(self: upstream.CudaRNGStatesTracker, name: str, seed: int) -> None:
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    generator = torch.Generator()
    generator.manual_seed(seed)
    self.states_[name] = generator.get_state()


@contextlib.contextmanager
def _fork(
    self: upstream.CudaRNGStatesTracker, name: str = upstream._MODEL_PARALLEL_RNG_TRACKER_NAME
) -> Iterator[None]:
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer_state = torch.get_rng_state()
    outer_name = self._current_state_name
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer_state)
        self._current_state_name = outer_name


def apply() -> None:
    upstream.CudaRNGStatesTracker.add = _add
    upstream.CudaRNGStatesTracker.fork = _fork
