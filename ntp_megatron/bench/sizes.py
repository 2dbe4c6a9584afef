"""How long each part of ``scripts/bench.sh`` runs: the default (a coffee break), ``--full`` and ``--smoke``.

``FULL`` is the benchmark as docs/benchmarks.md measured it: more than 20 minutes here, most of it in two parts
(the slow-rank part's five 40-iteration jobs at 6 s a step, 19 minutes; the one-store design's control plane at
4,000 and 10,000 simulated ranks, over 8 minutes). ``DEFAULT`` (no flag) runs every part, each with its headline
ratio, in about 10 minutes on this 2-core machine; what it leaves out is what ``--full`` adds:

- every part: one round instead of two interleaved ones (each case still runs next to the one it is compared
  with; a second round narrows the spread, it does not change what is compared);
- communication: a healthy replica's collectives at TP2 x 2 (4 ranks) instead of TP4 x 2 (8);
- recovery, groups kept against made anew: TP2 x DP2 (``--full`` adds TP4 x DP2);
- control plane: two levels against one store at 1,000 simulated ranks (``--full`` adds 4,000 and 10,000);
- a slow rank: the same five jobs (healthy; slow, not rebalanced; rebalanced; degraded; boosted) on a shorter
  schedule, 15 iterations at 1.5 s of emulated device per replica micro-batch instead of 40 at 6 s
  (:data:`SLOW_DEFAULT`; the CPU's own compute then weighs more, so the ratios are lower than the full run's);
- initial weights: TP1 and TP8 (``--full`` adds TP2 and TP4);
- memory: one distributed-optimizer instance (``--full`` adds two) and the re-forming ranks' peaks of the failure
  part's job only (``--full`` adds TP3 x 2 jobs of its own, so ``--only memory`` shows peaks only with ``--full``).

``--only PART`` runs one part at the chosen sizes: ``--only PART --full`` is what ``--only PART`` ran before.
``SMOKE`` runs every part once at its smallest (what the test suite runs); its figures mean nothing.

Pure: no torch, so that the unit tests can check the presets against each other without a job.
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
SLOW_DEFAULT = SlowSizes(iters=15, slow_at=3, slow_end=10, window=2, device_ms=1500.0)
"""Slow from iteration 3, measured over 2 iterations, rebalanced from iteration 6, the slowdown's end at 10 and the
units back from iteration 13: every stretch of the full schedule, each a few iterations long. Most of each job is
its eight ranks' start (about 12 s here) and the checksums of every iteration, not its steps."""
SLOW_SMOKE = SlowSizes(tp=2, iters=5, slow_at=2, slow_end=4, factor=3.0, window=1, device_ms=40.0)


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
DEFAULT = Sizes(rounds=1, comm_tp=2, init_tps=(1, 8), memory_instances=(1,), reform_tp=None, recovery_tps=(2,),
                control_plane_ranks=(1000,), slow_rank=SLOW_DEFAULT)
SMOKE = Sizes(iters=2, warmup=1, rounds=1, comm_iters=2, comm_tp=2, fail_iters=4, fail_at=3, ckpt_interval=2,
              stall_iters=5, stall_interval=2, stall_warmup=1,
              init_model=("model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=4",
                          "model.ffn_hidden_size=128", "model.vocab_size=256", "model.seq_length=32"),
              init_tps=(1, 2), memory_dp=1, memory_instances=(1,), memory_iters=2, memory_micro_batch=2,
              reform_tp=None, recovery_tps=(2,), control_plane_ranks=(16,), control_plane_iters=2,
              slow_rank=SLOW_SMOKE)


def choose(smoke: bool = False, full: bool = False, iters: Optional[int] = None, warmup: Optional[int] = None,
           rounds: Optional[int] = None) -> Sizes:
    """The command line's sizes: ``SMOKE`` as it is (``--iters`` and the like do not apply to it), else ``FULL`` or
    ``DEFAULT`` with what ``--iters``, ``--warmup`` and ``--rounds`` set."""
    if smoke:
        return SMOKE
    base = FULL if full else DEFAULT
    given = {"iters": iters, "warmup": warmup, "rounds": rounds}
    return replace(base, **{name: value for name, value in given.items() if value is not None})
