"""The benchmark's sizes (ntp_megatron/bench/sizes.py): the default run is a part of the full one (nothing it
measures that ``--full`` does not), keeps every part and each part's headline, and ``--full`` is the benchmark as
docs/benchmarks.md measured it. No job runs: the presets are compared with each other."""

from __future__ import annotations

from dataclasses import fields

import pytest

from ntp_megatron.bench import cli
from ntp_megatron.bench.sizes import DEFAULT, FULL, SLOW_DEFAULT, SLOW_FULL, SMOKE, Sizes, SlowSizes, choose


def test_full_is_the_benchmark_as_documented():
    assert FULL == Sizes() and FULL.slow_rank == SLOW_FULL == SlowSizes()
    assert (FULL.iters, FULL.warmup, FULL.rounds) == (12, 3, 2)
    assert (FULL.comm_tp, FULL.recovery_tps, FULL.init_tps, FULL.memory_instances, FULL.reform_tp) == (
        4, (2, 4), (1, 2, 4, 8), (1, 2), 3)
    assert (FULL.control_plane_ranks, FULL.control_plane_iters) == ((1000, 4000, 10000), 8)
    assert SLOW_FULL == SlowSizes(tp=4, iters=40, slow_at=10, slow_end=28, factor=2.0, window=4, device_ms=6000.0,
                                  boost_max_power=1.8)


def test_the_default_runs_a_part_of_the_full_benchmark():
    """Every case list is a non-empty part of the full one, every count at most the full one's, the same models:
    no row of the default run that ``--full`` does not measure too."""
    for f in fields(Sizes):
        small, full = getattr(DEFAULT, f.name), getattr(FULL, f.name)
        if f.name == "init_model":
            assert small == full
        elif isinstance(full, tuple):
            assert small and set(small) <= set(full), f.name
        elif isinstance(full, SlowSizes):
            assert small.iters <= full.iters and small.device_ms <= full.device_ms, f.name
        elif f.name == "reform_tp":
            assert small in (None, full), f.name
        else:
            assert small <= full, f.name


def test_the_default_keeps_every_part_and_its_headline():
    assert 1 in DEFAULT.init_tps and max(DEFAULT.init_tps) > 1  # the "x TP1's" columns
    assert min(FULL.control_plane_ranks) in DEFAULT.control_plane_ranks  # both designs where both are on time
    assert set(DEFAULT.memory_instances) & {1}
    slow = DEFAULT.slow_rank
    assert (slow.tp, slow.factor, slow.boost_max_power) == (SLOW_FULL.tp, SLOW_FULL.factor, SLOW_FULL.boost_max_power)
    # Every stretch of the full schedule, at least two iterations each: slow, measured over the window and
    # rebalanced (re-formed the iteration after), the slowdown's end, the units back.
    rebalanced_from = slow.slow_at + slow.window + 2
    back_from = slow.slow_end + slow.window + 2
    assert slow.slow_end - 1 - rebalanced_from >= 1 and slow.iters - back_from >= 1
    assert slow == SLOW_DEFAULT


def test_the_command_line_chooses_the_default_full_or_smoke():
    assert choose() == DEFAULT and choose(full=True) == FULL and choose(smoke=True) == SMOKE
    assert choose(full=True, rounds=3) == Sizes(rounds=3)
    assert choose(iters=20, warmup=5) == Sizes(**{**{f.name: getattr(DEFAULT, f.name) for f in fields(Sizes)},
                                                   "iters": 20, "warmup": 5})
    args = cli.parser().parse_args(["--full", "--only", "control-plane"])
    assert choose(args.smoke, args.full, args.iters, args.warmup, args.rounds) == FULL
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--full", "--smoke"])
    assert [part.name for part in cli.PARTS][-1] == "checkpoint-stall"
    assert {"step-time", "recovery", "control-plane", "slow-rank", "init", "memory"} < {p.name for p in cli.PARTS}
