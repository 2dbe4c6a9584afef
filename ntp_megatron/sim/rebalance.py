"""A slowed GPU in one TP group, as the runtime handles it: its step time not rebalanced, rebalanced (and boosted),
from the same layout math the runtime uses, so a benchmark's measurement and the model meet on the same case.

A TP group's step is ``1 - compute_fraction`` of work that no rank's speed changes (collectives, the optimizer
step, the host) and ``compute_fraction`` of compute, which every rank does in parallel on its own units and the
group waits for the slowest. A rank's compute time is its work (the parameter elements of the units it holds: the
GEMMs' cost is in proportion) over its speed (1, or ``1 / factor`` for the slowed GPU), over its performance
under power boost. Healthy, every rank holds the canonical blocks: one ``tp``-th of the work.

* not rebalanced: the slowed rank holds its block and takes ``factor`` times as long;
* rebalanced: the runtime weighs it ``round(100 / factor)`` (:mod:`ntp_megatron.plan.rebalance` measures its speed)
  and deals every family by weight (:func:`ntp_megatron.plan.layout.rebalanced_topology`): the step is the slowest rank's;
* boosted: each rank draws the power its load needs on the curve, capped (:func:`ntp_megatron.plan.power_curve.plan`).

``python -m ntp_megatron.sim.rebalance --config configs/tiny_cpu.yaml --tp 4 --factor 2`` prints the three.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Sequence

from ntp_megatron.config.files import EXIT_CONFIG_ERROR, ConfigError, load_config
from ntp_megatron.config.schema import DEFAULT_CONFIG, JobConfig
from ntp_megatron.plan.layout import make_topology, rebalanced_topology
from ntp_megatron.plan.memory_plan import ModelDims, unit_cost
from ntp_megatron.plan.power_curve import Boost, plan


@dataclass(frozen=True)
class RebalanceCase:
    not_rebalanced: float
    rebalanced: float
    rebalanced_boosted: Optional[float]
    weight: int
    """The slowed slot's weight in the rebalanced layout."""
    shares: tuple[float, ...]
    """Each slot's share of the work, rebalanced."""


def group_step(dims: ModelDims, tp: int, factor: float, compute_fraction: float = 1.0, slot: int = 1,
               boost: Optional[Boost] = None) -> RebalanceCase:
    """Step time over a healthy group's of a TP ``tp`` group whose slot ``slot`` is ``factor`` times slower."""
    if not 0 <= compute_fraction <= 1 or factor < 1 or not 0 <= slot < tp:
        raise ValueError(f"need 0 <= compute_fraction <= 1, factor >= 1 and 0 <= slot < tp, got {compute_fraction}, "
                         f"{factor}, {slot}")
    cost = unit_cost(dims)
    whole = sum(cost[f] * n for f, n in dims.units.items())
    weight = max(1, min(100, round(100 / factor)))
    weights = {s: (weight if s == slot else 100) for s in range(tp)}
    topo = rebalanced_topology(make_topology(tp, 1, dims.units), {0: weights})
    shares = tuple(sum(cost[f] * len(topo.units_of(s, f)) for f in dims.units) / whole for s in range(tp))
    speed = {s: (1 / factor if s == slot else 1.0) for s in range(tp)}

    def step(compute: float) -> float:
        return 1 - compute_fraction + compute_fraction * compute

    rebalanced = max(shares[s] * tp / speed[s] for s in range(tp))
    boosted = None
    if boost is not None:
        boosted = max(shares[s] * tp / speed[s] / plan(boost, shares[s], tp, weights[s]).perf for s in range(tp))
    return RebalanceCase(step(factor), step(rebalanced), step(boosted) if boosted is not None else None, weight,
                         shares)


def degraded_step(dims: ModelDims, tp: int, dead_slot: int, compute_fraction: float = 1.0,
                  boost: Optional[Boost] = None) -> tuple[float, Optional[float]]:
    """Step time over a healthy group's of a TP ``tp`` group that lost ``dead_slot`` (it runs at ``tp - 1``, the dead
    block dealt by the runtime's rules): without power boost, and with it (None without a curve)."""
    cost = unit_cost(dims)
    whole = sum(cost[f] * n for f, n in dims.units.items())
    topo = make_topology(tp, 1, dims.units, dead_slots=[(0, dead_slot)])
    shares = [sum(cost[f] * len(topo.units_of(r, f)) for f in dims.units) / whole for r in range(tp - 1)]
    plain = max(shares) * tp
    boosted = None
    if boost is not None:
        boosted = max(s * tp / plan(boost, s, tp).perf for s in shares)
    frame = 1 - compute_fraction
    return frame + compute_fraction * plain, (frame + compute_fraction * boosted) if boosted is not None else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ntp_megatron.sim.rebalance", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="a job config: its model section is the model "
                   "(default: configs/tiny_cpu.yaml)")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--compute-fraction", type=float, default=1.0,
                   help="the share of a healthy step that is the ranks' own compute (the rest no speed changes)")
    p.add_argument("--boost-max-power", type=float, default=None, help="also with power boost at this cap")
    args = p.parse_args(argv)
    try:
        cfg = load_config(JobConfig, args.config, [])
        case = group_step(ModelDims.of(cfg.model), args.tp, args.factor, args.compute_fraction,
                          boost=cfg.ntp.boost_model().model_copy(update={"max_power": args.boost_max_power})
                          if args.boost_max_power else None)
    except (ConfigError, ValueError) as exc:
        print(f"rebalance: {exc}")
        return EXIT_CONFIG_ERROR
    print(f"TP{args.tp}, slot 1 at {args.factor:g}x, compute {args.compute_fraction:.0%} of a step: step time over "
          f"healthy: not rebalanced {case.not_rebalanced:.3f}, rebalanced {case.rebalanced:.3f} (weight "
          f"{case.weight}, shares {', '.join(f'{s:.3f}' for s in case.shares)})"
          + (f", rebalanced and boosted {case.rebalanced_boosted:.3f}" if case.rebalanced_boosted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
