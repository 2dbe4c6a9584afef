"""Changes published at an iteration boundary (launcher side, node 0): replacement processes admitted back into their
slots, and TP groups rebalanced for ranks that run at different speeds.

Nothing died: the controller publishes the next generation and asks the running one to move to it after its next
committed iteration (:func:`ntp_megatron.elastic.publication.publish` with ``boundary_of``). Deaths are the
controller's own (:mod:`ntp_megatron.elastic.controller`), whose state (the newest generation, who is dead) this
reads and updates.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from ntp_megatron.plan.layout import TopologyError
from ntp_megatron.plan.rebalance import Decision, refusal
from ntp_megatron.plan.stages import JobTopology, identity_stage, join_topology, live_widths, rebalanced_topology, \
    weights_to_json, with_generation


class Boundary:
    """Admissions and rebalances of one controller."""

    def __init__(self, controller: Any) -> None:
        """``controller``: the :class:`ntp_megatron.elastic.controller.Controller` that owns this (typed loosely: it
        imports this module)."""
        self.controller = controller
        self._not_admitted: Optional[tuple[list[int], str]] = None
        """The last admission refused (launch ranks, why): said once, not at every poll."""
        self._not_rebalanced: set[tuple] = set()
        """Rebalances refused in a generation ((generation, replica, stage, weights)): not worked out again, said
        once."""

    def admit(self, launch_ranks: list[int]) -> bool:
        """Admit replacement processes at the next iteration boundary: publish the next generation with their
        slots back (:func:`ntp_megatron.plan.layout.join_topology`) and ask the running generation to move to it after
        its next committed iteration. False if a re-formation is in progress (try again later)."""
        c = self.controller
        if c.forming():
            return False
        old = c.latest
        launch_ranks = [lr for lr in launch_ranks if old.rank_of(*c.identity[lr]) is None]
        slots_per_replica = old.tp_base * old.num_stages
        partial = {r for r in c.unfit if sum(c.identity[lr][0] == r for lr in launch_ranks) < slots_per_replica}
        launch_ranks = [lr for lr in launch_ranks if c.identity[lr][0] not in partial]  # they wait
        slots = [c.identity[lr] for lr in launch_ranks]
        if not slots:
            return False
        try:
            new = join_topology(old, slots, min_tp=c.min_tp)
        except TopologyError as exc:  # e.g. one slot of a dropped replica: not enough to bring it back yet
            if self._not_admitted != (launch_ranks, str(exc)):
                self._not_admitted = (launch_ranks, str(exc))
                c.say(f"not admitting launch ranks {launch_ranks} yet: {exc}")
            return False
        c.unfit.difference_update(s[0] for s in slots)
        self._not_admitted = None
        new = self._at_boundary(new, {"joined": [list(s) for s in slots]})
        c.dead.difference_update(launch_ranks)
        joined = ", ".join(f"launch rank {lr} (replica {c.identity[lr][0]}, slot {c.identity[lr][1]}"
                           + "".join(f", stage {p}" for p in c.reports.stage(lr).values()) + ")" for lr in launch_ranks)
        c.say(f"admitting {joined} at the next iteration boundary: generation {new.generation}, tp per replica "
              f"{live_widths(new)}")
        return True

    def rebalance(self, decisions: list[Decision]) -> bool:
        """Rebalance TP groups whose ranks run at different speeds (:mod:`ntp_megatron.plan.rebalance`) at the next
        iteration boundary: publish the next generation, in which each slow rank holds a share of the units in
        proportion to its speed (:func:`ntp_megatron.plan.stages.rebalanced_topology`; nothing dies, no other group
        changes). False if a re-formation is in progress (decide again later)."""
        c = self.controller
        if c.forming() or not decisions:
            return False
        old = c.latest
        decisions = [d for d in decisions if self._worth_it(old, d)]
        if not decisions:
            return False
        weights = {(d.replica, d.stage): dict(d.weights) for d in decisions}
        new = self._at_boundary(rebalanced_topology(old, weights), {"weights": weights_to_json(weights)})
        stages = old.num_stages > 1  # lines name the stage only in a job with stages
        for d in decisions:
            where = f"replica {d.replica}" + (f" stage {d.stage}" if stages else "")
            launch = {ident[1]: lr for lr, ident in c.identity.items()
                      if ident[0] == d.replica and identity_stage(ident) == d.stage}
            c.emit({"kind": "event", "event": "rebalanced", "generation": new.generation, "replica": d.replica,
                    "stage": d.stage, "weights": {str(s): w for s, w in d.weights.items()},
                    "slowness": {str(s): v for s, v in d.slowness.items()},
                    "launch_ranks": {str(s): lr for s, lr in launch.items()},
                    "iterations": list(d.iterations), "time": time.time()})
            shares = (", ".join(f"slot {s} (launch rank {launch.get(s)})"
                                + (f" {d.slowness[s]:.2f}x slower" if s in d.slowness else "") + f": weight {w}"
                                for s, w in sorted(d.weights.items()) if w < 100)
                      or "its ranks run alike again: units back to their own slots")
            c.say(f"rebalancing {where} at the next iteration boundary: {shares} (iterations "
                  f"{d.iterations[0]}..{d.iterations[-1]}); generation {new.generation}")
        return True

    def _worth_it(self, old: JobTopology, decision: Decision) -> bool:
        """Whether ``decision`` is worth a re-formation (:func:`ntp_megatron.plan.rebalance.refusal`); a refusal is
        said once, and a refused decision the monitor makes again is not worked out again."""
        c = self.controller
        key = (old.generation, decision.replica, decision.stage, tuple(sorted(decision.weights.items())))
        if key in self._not_rebalanced:
            return False
        why = refusal(old, decision, c.min_tp)
        if why is None:
            return True
        self._not_rebalanced.add(key)
        if why:
            c.say(why)
        return False

    def _at_boundary(self, new: JobTopology, change: dict) -> JobTopology:
        """Publish ``new`` (what ``change`` says changed: slots joined, or weights) as the next generation, which the
        running one moves to after its next committed iteration."""
        c = self.controller
        old = c.latest
        new = with_generation(new, old.generation + 1)
        info = {"base": old.generation, "dead": [], "joined": [], **change, "settled": None,
                "failure_time": time.time(), "deaths": []}
        c._publish(new, info, base=old.generation, dead_ranks=[], boundary_of=old.generation)
        return new
