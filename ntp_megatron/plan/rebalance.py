"""Slow ranks: which tensor-parallel group to rebalance, and to which weights. Pure Python, no torch.distributed.

A slow GPU (thermal throttling, a bad link, a noisy neighbour) costs a synchronous job as much as a dead one:
every rank of its TP group waits for it in every layer's collective, and every replica waits for that group at
the gradient sync. Under NTP the group can give the slow rank fewer units instead
(:func:`ntp_megatron.plan.layout.rebalanced_topology`).

Each rank measures its compute time per iteration (its forward and backward passes, minus its waits on peers:
:mod:`ntp_megatron.speed.compute_time`) and sends its last iterations' times with its heartbeat, which its launcher reads
anyway: no collective and no request of its own. :class:`RebalanceMonitor` compares the members of each TP group
(one replica's stage) iteration by iteration. A member's *speed* is the work it holds (its units' parameter
elements, :func:`groups_of`) per second of compute; its *relative speed* is that over the group's median speed (the
higher median: with two members, the faster one), and ``100 * relative speed`` is the weight it should have. A
member whose weight that way is off its current one by more than ``threshold`` (lower for a newly slow rank or one
that slowed further; higher, or within ``threshold`` of normal, for a weighted one whose slowdown ended) in each
of the last ``window`` iterations it measured in the group's current layout gets its window's mean (within 1..100,
and 100 when that is within ``threshold`` of it); the others keep theirs. A group whose weights all come out alike is even again (canonical
when every slot is live: the units go home). The controller publishes only decisions that move units
(:meth:`ntp_megatron.elastic.controller.Controller.rebalance`).

Times of a group's iterations before its current layout took effect do not count (:meth:`RebalanceMonitor.reset`
when a new generation completes).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from ntp_megatron.plan.stages import JobTopology, identity_stage, rebalanced_topology

NORMAL = 100
"""The weight of a rank at normal speed."""


@dataclass(frozen=True)
class Decision:
    """Rebalance one TP group: ``weights`` (live slot -> weight; empty: alike again) for replica ``replica``'s stage
    ``stage``, because of the measured ``slowness`` (slot -> mean compute time over the group's median)."""

    replica: int
    stage: int
    weights: Mapping[int, int]
    slowness: Mapping[int, float]
    iterations: tuple[int, ...]
    """The iterations measured."""

    def to_json(self) -> dict:
        return {"replica": self.replica, "stage": self.stage, "weights": [[s, w] for s, w in self.weights.items()],
                "slowness": [[s, v] for s, v in self.slowness.items()], "iterations": list(self.iterations)}

    @classmethod
    def from_json(cls, d: dict) -> "Decision":
        return cls(d["replica"], d["stage"], {s: w for s, w in d["weights"]}, {s: v for s, v in d["slowness"]},
                   tuple(d["iterations"]))


@dataclass
class Group:
    """One TP group as the monitor sees it: its members' launch ranks by slot, and its current weights."""

    replica: int
    stage: int
    members: Mapping[int, int]
    """Live slot -> launch rank."""
    weights: Mapping[int, int] = field(default_factory=dict)
    """Live slot -> weight as the current layout has them (empty: alike)."""
    work: Mapping[int, float] = field(default_factory=dict)
    """Live slot -> the work it holds in the current layout (its units' parameter elements); empty: in proportion
    to the weights."""


class RebalanceMonitor:
    def __init__(self, threshold: float, window: int) -> None:
        if threshold <= 1.0 or window < 1:
            raise ValueError(f"threshold must be > 1 and window >= 1, got {threshold}, {window}")
        self.threshold, self.window = threshold, window
        self.times: dict[int, dict[int, float]] = {}
        """Launch rank -> iteration -> compute seconds, since its group's layout took effect."""
        self.since = 0
        """Iterations up to this one do not count (they ran in an earlier layout)."""

    def reset(self, after_iteration: int) -> None:
        """A new layout took effect: only iterations after ``after_iteration`` count from now on."""
        self.since = max(self.since, after_iteration)
        self.times.clear()

    def observe(self, launch_rank: int, measured: Iterable[tuple[int, float]]) -> None:
        """``(iteration, seconds)`` pairs a rank reported (its heartbeat repeats some: kept once)."""
        mine = self.times.setdefault(launch_rank, {})
        for iteration, seconds in measured:
            if iteration > self.since:
                mine[int(iteration)] = float(seconds)
        for old in sorted(mine)[:-4 * self.window]:  # bounded: a window's worth is all a decision reads
            del mine[old]

    def decide(self, groups: Iterable[Group]) -> list[Decision]:
        """The groups to rebalance now, and how. A decision takes effect two iterations after its window at the
        earliest: until then iterations run in the layout it replaces, and no later decision may read them (one
        did, and weighed a rank by its speed before the first decision's effect: an over-correction)."""
        decisions = [d for g in groups if (d := self._decide(g)) is not None]
        for d in decisions:
            self.since = max(self.since, max(d.iterations) + 2)
        for mine in self.times.values():
            for iteration in [k for k in mine if k <= self.since]:
                del mine[iteration]
        return decisions

    def _decide(self, group: Group) -> Decision | None:
        slots = sorted(group.members)
        if len(slots) < 2:
            return None
        common = set.intersection(*(set(self.times.get(group.members[s], {})) for s in slots))
        window = sorted(common)[-self.window:]
        if len(window) < self.window:
            return None
        current = {s: group.weights.get(s, NORMAL) if group.weights else NORMAL for s in slots}
        work = {s: group.work[s] for s in slots} if group.work else current
        speeds = {s: [] for s in slots}  # slot -> its speed over the group's median speed, per iteration
        for k in window:
            times = {s: self.times[group.members[s]][k] for s in slots}
            if min(times.values()) <= 0:
                return None
            speed = {s: work[s] / times[s] for s in slots}  # the work it holds per second
            median = statistics.median_high(speed.values())
            for s in slots:
                speeds[s].append(speed[s] / median)
        # A member whose speed implies a weight off its current one by more than the threshold, in every iteration
        # of the window: slower (a newly slow rank, or one that slowed further) or faster (its slowdown ended).
        # A weighted member counts as faster also when its speed is within the threshold of normal: work that does
        # not shrink with the units it holds (norms, embeddings, launches) keeps its measured speed below its
        # weight's, so "faster than its weight by the threshold" may never come once its slowdown ended.
        changed = [s for s in slots
                   if all(NORMAL * v < current[s] / self.threshold for v in speeds[s])
                   or (current[s] < NORMAL and all(min(NORMAL, NORMAL * v) > current[s] * self.threshold
                                                   or v * self.threshold >= 1 for v in speeds[s]))]
        if not changed:
            return None
        weights = {s: _weight(statistics.fmean(speeds[s]), self.threshold) if s in changed else current[s]
                   for s in slots}
        even = len(set(weights.values())) == 1
        return Decision(group.replica, group.stage, {} if even else weights,
                        {s: round(1 / statistics.fmean(speeds[s]), 3) for s in slots}, tuple(window))


def _weight(relative_speed: float, threshold: float) -> int:
    """The weight of a member at ``relative_speed``: in proportion, within 1..100, and 100 for one within the
    threshold of a normal speed (what is as fast as the others within the threshold is treated as such)."""
    if relative_speed * threshold >= 1:
        return NORMAL
    return max(1, min(NORMAL, round(NORMAL * relative_speed)))


def groups_of(topology: JobTopology, identity: Mapping[int, tuple[int, ...]],
              unit_costs: Optional[Mapping[int, Mapping[str, int]]] = None) -> list[Group]:
    """Every TP group of ``topology`` (with or without pipeline stages) whose members are all in ``identity``
    (launch rank -> (replica, slot[, stage]): the controller's, or a node's own ranks), with their launch ranks and,
    given each stage's parameter elements per unit of each family (``unit_costs[stage]``,
    :func:`ntp_megatron.plan.memory_plan.unit_cost`), the work each member holds."""
    stages = topology.stages
    by_place = {(ident[0], ident[1], identity_stage(ident)): lr for lr, ident in identity.items()}
    out = []
    for p, stage in enumerate(stages):
        for rep in stage.replicas:
            if not all((rep.index, s, p) in by_place for s in rep.slots):
                continue
            work: dict[int, float] = {}
            if unit_costs is not None:
                for family in stage.units:
                    for s, units in zip(rep.slots, stage.layout(family, rep.index)):
                        work[s] = work.get(s, 0.0) + unit_costs[p][family] * len(units)
            out.append(Group(rep.index, p, {s: by_place[rep.index, s, p] for s in rep.slots}, dict(rep.weights),
                             work))
    return out


def refusal(old: JobTopology, decision: Decision, min_tp: int) -> Optional[str]:
    """Why ``decision`` is not worth a re-formation of ``old`` (a job's topology), None if it is: "" when its weights
    give the layout ``old`` already has; a sentence when a rank would hold more of a family than at ``min_tp`` (what
    the memory plan and ``ntp.memory_budget_gib`` vouch for)."""
    where = (decision.replica, decision.stage)
    new = rebalanced_topology(old, {where: dict(decision.weights)}).stages[decision.stage]
    before, after = old.stages[decision.stage].replica(decision.replica), new.replica(decision.replica)
    most = {f: max(len(units) for units in new.layout(f, decision.replica)) for f in new.units}
    over = {f: n for f, n in most.items() if n > -(-new.units[f] // min_tp)}
    if over:
        return (f"not rebalancing replica {decision.replica} to weights {dict(decision.weights)}: a rank would "
                f"hold {over} units, more than at ntp.min_tp ({min_tp}), which the memory plan vouches for")
    return None if after.dealt != before.dealt else ""
