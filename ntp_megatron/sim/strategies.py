"""Recovery strategies as small models: a rate table, a placement policy and what a failure costs.

| strategy           | rate table (rates.py)            | spares, shrinking minibatch | per interrupting failure |
|--------------------|----------------------------------|-----------------------------|--------------------------|
| checkpoint_restart | 1 if k == 0 else 0               | swapped in on restart       | rollback + restart       |
| dp_drop            | 1 if k == 0 else 0               | unused                      | live re-formation        |
| hot_spares         | 1 if k == 0 else 0               | swapped in while they last  | live re-formation        |
| ntp                | integer batch at tp_eff (or 1/ratio) | unused                  | live re-formation        |
| ntp_boost          | full batch at the least power, else integer batch at max power | unused | live re-formation |

Placement (placement.py): ``fixed`` ties each replica to its TP groups; ``packed`` re-places every TP group
whenever that changes the packed optimum, worst groups together; ``packed_on_restart`` re-packs only when the
job restarts (at t = 0 and every ``strategies.restart_every_h``). A live re-formation cannot move a replica's
domains, a restart can: so a ``packed`` strategy pays ``max(pause, repack_pause)`` (``repack_pause`` is a
restart unless configured otherwise) per interrupting failure and ``repack_pause`` at every other step that
changes its optimum (a repair that lets it run faster or need fewer spares); each planned restart of a
``packed_on_restart`` strategy pauses the job for ``repack_pause`` too. Repairs rejoin in place otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from ntp_megatron.sim.calibration import StepTimeRatios
from ntp_megatron.sim.config import SimConfig
from ntp_megatron.sim.rates import RateTable, boost_table, drop_table, ntp_table, reduced_tp


@dataclass(frozen=True)
class Strategy:
    name: str
    table: RateTable
    covers_with_spares: bool  # swaps spare domains in even when the minibatch may shrink
    pause_h: float  # job-wide pause per interrupting failure (restart, or live re-formation)
    rollback: bool  # an interrupting failure loses the work since the last checkpoint
    placement: str
    repack_pause_h: float  # pause whenever domains move between replicas
    restart_every_h: float | None  # planned re-packing restarts (packed_on_restart only)

    @property
    def failure_pause_h(self) -> float:
        """A packed re-formation moves domains, which takes a restart: the longer of the two pauses."""
        return max(self.pause_h, self.repack_pause_h) if self.placement == "packed" else self.pause_h

    @property
    def planned_restarts(self) -> bool:
        return self.placement == "packed_on_restart" and self.restart_every_h is not None

    def state_key(self) -> tuple:
        """Strategies with equal keys see the same replica speeds and share one time line."""
        every = self.restart_every_h if self.placement == "packed_on_restart" else None
        return self.table.rate.tobytes(), self.placement, every


def build_strategies(cfg: SimConfig, ratios: StepTimeRatios) -> list[Strategy]:
    tp = cfg.cluster.tp
    s = cfg.strategies
    tp_eff = reduced_tp(tp, s.ntp.min_tp, s.ntp.allowed_tp)
    reconf_h = ratios.reconfigure_s(s.reconfigure_s) / 3600.0
    restart_h = cfg.checkpoint.restart_min / 60.0
    repack_h = restart_h if s.repack_pause_s is None else s.repack_pause_s / 3600.0
    drop = drop_table(tp)
    tables = {
        "checkpoint_restart": (drop, True, restart_h, True),
        "dp_drop": (drop, False, reconf_h, False),
        "hot_spares": (drop, True, reconf_h, False),
        "ntp": (ntp_table(tp, tp_eff, ratios, s.degraded_speed), False, reconf_h, False),
        "ntp_boost": (boost_table(tp, tp_eff, ratios, s.boost, s.degraded_speed), False, reconf_h, False),
    }
    out = []
    for name in s.enabled:
        table, covers, pause, rollback = tables[name]
        placement = getattr(s.placement, name)
        out.append(Strategy(name, table, covers, pause, rollback, placement, repack_h, s.restart_every_h))
    return out
