"""How long each part of ``scripts/bench.sh`` runs: ``FULL`` (the benchmark as docs/benchmarks.md measured it) and
``SMOKE`` (``--smoke``: every part once at its smallest, what the test suite runs; its figures mean nothing).

Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional


@dataclass(frozen=True)
class SlowSizes:
    """The slow-rank part (:mod:`ntp_megatron.bench.slow_rank`): TP ``tp`` x DP2 on the emulated device."""

    tp: int = 4
    iters: int = 40
    slow_at: int = 10
    slow_end: int = 28
    """``factor=1`` from this iteration on: the slowdown ends."""
    factor: float = 2.0
    window: int = 4
    device_ms: float = 6000.0
    """The emulated device's time for a whole replica's micro-batch (each rank sleeps its share)."""
    boost_max_power: float = 1.8
    """Enough on the default curve (performance = power ** 0.58) for a TP4 -> TP3 survivor's load (about 1.39)."""


SLOW_FULL = SlowSizes()
SLOW_SMOKE = SlowSizes(tp=2, iters=7, slow_at=2, slow_end=6, factor=3.0, window=2, device_ms=100.0)


@dataclass(frozen=True)
class Sizes:
    """How long every part runs (the presets below)."""

    iters: int = 12
    warmup: int = 3
    rounds: int = 2
    comm_iters: int = 3
    comm_tp: int = 4
    """The communication jobs: TP ``comm_tp`` x 2, healthy, and with replica 1's last slot dead."""
    fail_iters: int = 16
    fail_at: int = 11
    ckpt_interval: int = 4
    stall_iters: int = 14
    stall_interval: int = 3
    stall_warmup: int = 2
    init_model: tuple[str, ...] = ("model.num_layers=4", "model.hidden_size=2048", "model.num_attention_heads=16",
                                   "model.ffn_hidden_size=8192", "model.vocab_size=32768", "model.seq_length=1024")
    init_tps: tuple[int, ...] = (1, 2, 4, 8)
    memory_tp: int = 2
    memory_dp: int = 4
    memory_instances: tuple[int, ...] = (1, 2)
    memory_iters: int = 8
    memory_micro_batch: int = 1
    """Of the global batch of 12 samples, a multiple of micro-batch x DP."""
    reform_tp: Optional[int] = 3
    """The memory part's own failure job: TP ``reform_tp`` x 2, the last rank killed (None: the failure part's
    job alone)."""
    recovery_tps: tuple[int, ...] = (2, 4)
    """The recovery part: TP k x DP2 for each k, the last rank killed, groups kept against every group made anew."""
    control_plane_ranks: tuple[int, ...] = (1000, 4000, 10000)
    control_plane_iters: int = 8
    """The control-plane load test (:mod:`ntp_megatron.bench.control_plane`): simulated ranks, iterations."""
    slow_rank: SlowSizes = field(default=SLOW_FULL)


FULL = Sizes()
SMOKE = Sizes(iters=2, warmup=1, rounds=1, comm_iters=2, comm_tp=2, fail_iters=4, fail_at=3, ckpt_interval=2,
              stall_iters=5, stall_interval=2, stall_warmup=1,
              init_model=("model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=4",
                          "model.ffn_hidden_size=128", "model.vocab_size=256", "model.seq_length=32"),
              init_tps=(1, 2), memory_dp=1, memory_instances=(1,), memory_iters=2, memory_micro_batch=2,
              reform_tp=None, recovery_tps=(2,), control_plane_ranks=(16,), control_plane_iters=2,
              slow_rank=SLOW_SMOKE)

