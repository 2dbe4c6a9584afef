"""The topology of a job: one NTP layout per pipeline stage (:class:`JobTopology`). Pure Python, no torch.

A job's topology is always a :class:`JobTopology`; a job without pipeline stages is a job of one stage. This
module is the only place that knows how the stages are represented: everything else asks a :class:`JobTopology`
(``stages``, ``num_stages``, ``stage_of(rank)``, ``slot_of``/``rank_of``) or calls this module's job-level
functions, which have one code path for any number of stages.

A replica is a TP × PP grid. Each stage of it has its own live slots, dead blocks, proxies and dealt units: one
:class:`ntp_megatron.plan.layout.Topology` per stage, all of one generation, ``tp_base``, unit counts and set of
replicas (a replica dropped is dropped in every stage). A process is identified across generations by
``(replica, slot, stage)``; in a job of one stage by ``(replica, slot)`` (the identity rule of
:meth:`JobTopology.slot_of`: what the store, the published ``dead``/``joined`` lists, the events and the rejoin
requests have always said there). Ranks are numbered stage by stage, as Megatron numbers its grid (stage
slowest): stage ``p``'s live slots get the ranks after every earlier stage's, in (replica, slot) order, so each
stage's topology holds its own ranks (``rank_base .. rank_base + world_size - 1``) and everything that works inside one stage (TP
groups, sync groups per (stage, block), units, transition plans) reads its stage's topology unchanged.

Stage boundaries
----------------
Without sequence parallelism the activation a stage sends on, and the gradient it sends back, are the full
tensor on every TP rank of the sending stage, so any one of them can serve a rank of the next stage. Between
stage A (width ``w_a`` in a replica) and the next stage B (width ``w_b``):

- forward: B's TP rank ``j`` receives from A's TP rank ``j mod w_a``; A's rank ``i`` sends to every ``j`` with
  ``j mod w_a == i`` (maybe none: a wider A has ranks whose copy no one needs);
- backward: A's TP rank ``i`` receives the gradient from B's TP rank ``i mod w_b``; B's rank ``j`` sends to every
  ``i`` with ``i mod w_b == j`` (every rank of A runs the backward together, so each needs the gradient).

Every rank receives exactly one tensor per boundary and direction, from a live rank of its own replica; at equal
widths this is Megatron's own pairing (TP rank ``i`` with TP rank ``i``).

Transitions
-----------
A failure re-forms the stages that lost ranks, each by :func:`ntp_megatron.plan.layout.next_topology`'s rules; every
other stage keeps its layout (its ranks are renumbered only when an earlier stage lost some). A replica that falls
below ``min_tp`` in one stage is dropped from every stage (``drop_replica``), or the failure is unrecoverable.
A rejoin widens the stages its slots belong to; a dropped replica comes back only with slots in every stage. Units
move only inside a stage (:func:`transition_plan`). :func:`next_topology`, :func:`join_topology`,
:func:`rebalanced_topology` and :func:`transition_plan` are those of one stage's layout for a job of one stage.

Serialised, a job of one stage is its stage's plain :class:`Topology` JSON (what every published generation of such
a job has always been); a job of several is ``{"stages": [...]}``. :meth:`JobTopology.from_json` reads both.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping, Optional

from ntp_megatron.plan import layout
from ntp_megatron.plan.layout import Move, Replica, Topology, TopologyError, make_topology


@dataclass(frozen=True)
class JobTopology:
    """Generation ``generation`` of a job: the layout of each pipeline stage (``stages[p]`` is a :class:`Topology`
    with ``stage == p``, its ranks following stage ``p - 1``'s); one stage for a job without pipeline stages."""

    stages: tuple[Topology, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError("a job topology has at least one stage, got none")
        first = self.stages[0]
        base = 0
        for p, stage in enumerate(self.stages):
            if not isinstance(stage, Topology):
                raise ValueError(f"stage {p} must be a Topology, got {type(stage).__name__}")
            if stage.stage != p or stage.rank_base != base:
                raise ValueError(f"stage {p}'s topology says stage {stage.stage} with ranks from {stage.rank_base}; "
                                 f"expected stage {p} with ranks from {base}")
            if (stage.generation, stage.tp_base, dict(stage.units)) != (first.generation, first.tp_base,
                                                                        dict(first.units)):
                raise ValueError(f"stage {p} differs from stage 0 in generation, tp_base or unit counts")
            if [rep.index for rep in stage.replicas] != [rep.index for rep in first.replicas]:
                raise ValueError(f"stage {p} has replicas {[rep.index for rep in stage.replicas]}, stage 0 "
                                 f"{[rep.index for rep in first.replicas]}: a replica is dropped in every stage")
            base += stage.world_size

    @classmethod
    def one_stage(cls, topology: Topology) -> "JobTopology":
        """The topology of a job without pipeline stages whose layout is ``topology``."""
        return cls((topology,))

    # -- the job as a whole -----------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self.stages[0].generation

    @property
    def tp_base(self) -> int:
        return self.stages[0].tp_base

    @property
    def units(self) -> Mapping[str, int]:
        return self.stages[0].units

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @cached_property
    def world_size(self) -> int:
        return sum(stage.world_size for stage in self.stages)

    @property
    def only_stage(self) -> Topology:
        """The layout of a job without pipeline stages (what works for one stage only, such as the distributed
        optimizer's shards, which the config refuses with stages); ValueError for a job with stages."""
        if self.num_stages != 1:
            raise ValueError(f"this needs a job without pipeline stages; the job has {self.num_stages}")
        return self.stages[0]

    @property
    def ranks(self) -> range:
        """The generation's process-group ranks, every stage's."""
        return range(self.world_size)

    @property
    def replica_indices(self) -> list[int]:
        return [rep.index for rep in self.stages[0].replicas]

    @cached_property
    def _bases(self) -> list[int]:
        return [stage.rank_base for stage in self.stages]

    def stage_of(self, rank: int) -> Topology:
        """The layout of the stage process-group rank ``rank`` belongs to."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is not live in generation {self.generation} "
                             f"(ranks 0..{self.world_size - 1})")
        return self.stages[bisect.bisect_right(self._bases, rank) - 1]

    def slot_of(self, rank: int) -> tuple[int, ...]:
        """The identity of a process across generations: ``(replica, slot, stage)`` of a rank, ``(replica, slot)`` in
        a job of one stage (the identity rule, module docstring)."""
        stage = self.stage_of(rank)
        return stage.slot_of(rank) if self.num_stages == 1 else (*stage.slot_of(rank), stage.stage)

    def rank_of(self, replica: int, slot: int, stage: int = 0) -> Optional[int]:
        """Process-group rank of ``(replica, slot, stage)`` (``(replica, slot)`` in a job of one stage) in this
        generation, None if that slot is not live."""
        if not isinstance(stage, int) or not 0 <= stage < self.num_stages:
            return None
        return self.stages[stage].rank_of(replica, slot)

    # what a rank's own stage says of it (the rank-addressed queries of a Topology)
    def replica_of(self, rank: int) -> Replica:
        """``rank``'s replica in its stage."""
        return self.stage_of(rank).replica_of(rank)

    def local_rank(self, rank: int) -> int:
        """``rank``'s TP rank in its stage."""
        return self.stage_of(rank).local_rank(rank)

    def units_of(self, rank: int, family: str) -> list[int]:
        return self.stage_of(rank).units_of(rank, family)

    def widths(self, replica: int) -> list[int]:
        """The TP degree of each stage of replica ``replica``."""
        return [stage.replica(replica).width for stage in self.stages]

    def replica_ranks(self, replica: int) -> list[int]:
        """Every rank of replica ``replica``, stage by stage (its model-parallel group)."""
        return [r for stage in self.stages for r in stage.replica(replica).ranks]

    # -- stage boundaries -------------------------------------------------------------------------------------

    def _neighbour(self, rank: int, step: int) -> Optional[tuple[Topology, Replica, Replica, int]]:
        stage = self.stage_of(rank)
        other = stage.stage + step
        if not 0 <= other < self.num_stages:
            return None
        replica = stage.replica_of(rank)
        return stage, replica, self.stages[other].replica(replica.index), stage.local_rank(rank)

    def receives_from(self, rank: int, direction: str) -> Optional[int]:
        """The rank ``rank`` receives its ``"forward"`` activation from (the previous stage) or its ``"backward"``
        gradient from (the next stage); None at the first stage's forward and the last stage's backward."""
        found = self._neighbour(rank, -1 if _step(direction) > 0 else 1)
        if found is None:
            return None
        _, _, peer, tp_rank = found
        return peer.ranks[tp_rank % peer.width]

    def sends_to(self, rank: int, direction: str) -> list[int]:
        """The ranks ``rank`` sends its ``"forward"`` activation to (the next stage) or its ``"backward"`` gradient
        to (the previous stage), ascending; empty at the ends, and where no rank of the neighbour needs its copy."""
        found = self._neighbour(rank, _step(direction))
        if found is None:
            return []
        _, mine, peer, tp_rank = found
        return [r for j, r in enumerate(peer.ranks) if j % mine.width == tp_rank]

    # -- serialisation ------------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """``{"stages": [...]}``; a job of one stage is its stage's plain :class:`Topology` JSON."""
        if self.num_stages == 1:
            return self.stages[0].to_json()
        return {"stages": [stage.to_json() for stage in self.stages]}

    @classmethod
    def from_json(cls, d: dict) -> "JobTopology":
        """Either form of :meth:`to_json`."""
        if not (isinstance(d, dict) and "stages" in d):
            return cls.one_stage(Topology.from_json(d))
        if set(d) != {"stages"} or not isinstance(d["stages"], list):
            raise ValueError("pipeline topology JSON must be an object with exactly the key 'stages' (a list)")
        return cls(tuple(Topology.from_json(stage) for stage in d["stages"]))


def named_stage(identity: tuple[int, ...]) -> Optional[int]:
    """The stage a process identity (:meth:`JobTopology.slot_of`) names: None in a job of one stage, whose
    identities are ``(replica, slot)``."""
    return identity[2] if len(identity) > 2 else None


def identity_stage(identity: tuple[int, ...]) -> int:
    """The stage of a process identity: 0 in a job of one stage."""
    stage = named_stage(identity)
    return 0 if stage is None else stage


def tp_per_replica(topology: JobTopology, num_replicas: int) -> list:
    """The TP width of every replica index of the launch (0 for a dropped replica), as the records give it; with
    pipeline stages a list per replica, one width per stage."""
    present = set(topology.replica_indices)
    widths = [topology.widths(r) if r in present else [0] * topology.num_stages for r in range(num_replicas)]
    return widths if topology.num_stages > 1 else [w[0] for w in widths]


def replica_widths(topology: JobTopology, replica: int) -> Optional[list[int]]:
    """The TP width of each stage of replica ``replica`` (one entry without stages), None if it was dropped."""
    return topology.widths(replica) if replica in topology.replica_indices else None


def live_widths(topology: JobTopology) -> list:
    """The TP width of every live replica, in replica order (with stages, a list of widths per replica)."""
    widths = [topology.widths(r) for r in topology.replica_indices]
    return widths if topology.num_stages > 1 else [w[0] for w in widths]


def _step(direction: str) -> int:
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    return 1 if direction == "forward" else -1


def make_pipeline_topology(tp_base: int, dp: int, pp: int, units: Mapping[str, int],
                           dead_slots: Iterable[tuple[int, int, int]] = (), generation: int = 0, min_tp: int = 1,
                           dropped: Iterable[int] = ()) -> JobTopology:
    """The starting topology of ``pp`` stages: each stage's :func:`make_topology` with its own dead slots
    (``(replica, slot, stage)`` triples), the same ``dropped`` replicas, ranks numbered stage by stage."""
    if not isinstance(pp, int) or pp < 2:
        raise ValueError(f"pipeline stages must be at least 2, got {pp!r}")
    dead: dict[int, list[tuple[int, int]]] = {p: [] for p in range(pp)}
    for item in dead_slots:
        replica, slot, stage = item
        for what, value, count in (("stage", stage, pp), ("replica", replica, dp), ("slot", slot, tp_base)):
            if not isinstance(value, int) or not 0 <= value < count:
                raise ValueError(f"dead slot {replica}:{slot}@{stage}: {what} {value} out of range 0..{count - 1}")
        dead[stage].append((replica, slot))
    dropped = list(dropped)
    stages, base = [], 0
    for p in range(pp):
        try:
            stage = make_topology(tp_base, dp, units, dead[p], generation=generation, min_tp=min_tp,
                                  dropped=dropped)
        except ValueError as exc:  # name the stage (a TopologyError stays one)
            raise type(exc)(f"stage {p}: {exc}") from None
        stages.append(stage.placed(p, base))
        base += stage.world_size
    return JobTopology(tuple(stages))


def _renumbered(stages: Iterable[Topology]) -> JobTopology:
    """Stages of one generation with their ranks numbered stage after stage."""
    placed, base = [], 0
    for p, stage in enumerate(stages):
        placed.append(stage.placed(p, base))
        base += stage.world_size
    return JobTopology(tuple(placed))


def with_generation(topology: JobTopology, generation: int) -> JobTopology:
    """The same layout as generation ``generation``."""
    return JobTopology(tuple(dataclasses.replace(stage, generation=generation) for stage in topology.stages))


def published_topology(base: JobTopology, info: dict, generation: int, min_tp: int = 1,
                       policy: layout.Policy = "drop_replica") -> JobTopology:
    """The topology of ``generation`` from what its publication says changed (the controller's ``info``): the
    generation it builds on is ``base``; ``info["joined"]`` slots are admitted, or the ``info["dead"]`` identities
    (slots of ``base``) died. What every rank computes instead of reading the whole topology from the root store
    (the two-level control plane, :mod:`ntp_megatron.elastic.relay`); the controller computes it the same way."""
    if info.get("joined"):
        new = join_topology(base, [tuple(slot) for slot in info["joined"]], min_tp=min_tp)
    elif info.get("weights"):
        new = rebalanced_topology(base, weights_from_json(info["weights"]))
    else:
        dead = [base.rank_of(*identity) for identity in info["dead"]]
        new = next_topology(base, [rank for rank in dead if rank is not None], min_tp=min_tp, policy=policy)
    return with_generation(new, generation)


def next_topology(current: JobTopology, dead_ranks: Iterable[int], min_tp: int = 1,
                  policy: layout.Policy = "drop_replica") -> JobTopology:
    """:func:`ntp_megatron.plan.layout.next_topology`, stage by stage (module docstring); a job of one stage's is its
    stage's."""
    dead = set(dead_ranks)
    for rank in dead:
        current.stage_of(rank)  # a ValueError for a rank that is not live
    dropped = set()
    for stage in current.stages if current.num_stages > 1 else ():  # one stage drops (or refuses) on its own
        for rep in stage.replicas:
            left = sum(r not in dead for r in rep.ranks)
            if left < min_tp:
                if policy != "drop_replica":
                    raise TopologyError(f"replica {rep.index} fell below ntp.min_tp ({min_tp}) in stage "
                                        f"{stage.stage}: {left} live slots left (policy {policy!r})")
                dropped.add(rep.index)
    stages = []
    for stage in current.stages:
        gone = {r for r in stage.ranks if r in dead} | {r for rep in stage.replicas if rep.index in dropped
                                                        for r in rep.ranks}
        stages.append(layout.next_topology(stage, gone, min_tp=min_tp, policy=policy))  # none gone: as it was
    return _renumbered(stages)


def _by_stage(current: JobTopology, identities: Iterable[tuple[int, ...]], what: str) -> dict[int, list]:
    """Identities (``(replica, slot, stage)``; ``(replica, slot)`` in a job of one stage, passed on as given) as
    ``(replica, slot)`` items per stage."""
    out: dict[int, list] = {p: [] for p in range(current.num_stages)}
    for item in identities:
        if current.num_stages == 1 and len(item) == 2:  # the identity rule of a job of one stage
            out[0].append(item)
            continue
        replica, slot, stage = item
        if not 0 <= stage < current.num_stages:
            raise ValueError(f"{what} {item!r}: stage {stage} out of range 0..{current.num_stages - 1}")
        out[stage].append((replica, slot))
    return out


def join_topology(current: JobTopology, joined_slots: Iterable[tuple[int, ...]], min_tp: int = 1) -> JobTopology:
    """:func:`ntp_megatron.plan.layout.join_topology`, stage by stage (``(replica, slot, stage)`` triples with stages,
    ``(replica, slot)`` pairs in a job of one stage)."""
    joining = _by_stage(current, joined_slots, "joined slot")
    present = set(current.replica_indices)
    returning = [{r for r, _ in joining[p]} - present for p in range(current.num_stages)]
    if any(back != returning[0] for back in returning):
        raise TopologyError(f"a dropped replica comes back only with slots in every stage (returning per stage: "
                            f"{[sorted(b) for b in returning]})")
    return _renumbered(layout.join_topology(stage, joining[p], min_tp=min_tp) for p, stage in enumerate(current.stages))


def rebalanced_topology(current: JobTopology, weights: Mapping[tuple[int, int], Mapping[int, int]]) -> JobTopology:
    """:func:`ntp_megatron.plan.layout.rebalanced_topology` stage by stage: ``weights`` maps ``(replica, stage)``
    (stage 0 without stages) to that stage's slot weights; other stages keep their layout."""
    per_stage: dict[int, dict[int, Mapping[int, int]]] = {}
    stages = current.num_stages
    for (replica, stage), given in weights.items():
        if not 0 <= stage < stages:
            raise ValueError(f"weights for replica {replica}: stage {stage} out of range 0..{stages - 1}")
        per_stage.setdefault(stage, {})[replica] = given
    return _renumbered(layout.rebalanced_topology(stage, per_stage.get(p, {}))
                       for p, stage in enumerate(current.stages))


def weights_to_json(weights: Mapping[tuple[int, int], Mapping[int, int]]) -> list:
    """``[[replica, stage, [[slot, weight], ...]], ...]``: a generation's rebalance as it is published."""
    return [[replica, stage, [[slot, w] for slot, w in sorted(given.items())]]
            for (replica, stage), given in sorted(weights.items())]


def weights_from_json(items: list) -> dict[tuple[int, int], dict[int, int]]:
    return {(replica, stage): {slot: w for slot, w in pairs} for replica, stage, pairs in items}


def transition_plan(old: JobTopology, new: JobTopology, dead_ranks: Iterable[int] = ()) -> list[Move]:
    """:func:`ntp_megatron.plan.layout.transition_plan` stage by stage: each stage's own (units never cross stages),
    in stage order."""
    dead = set(dead_ranks)
    for rank in dead:
        old.stage_of(rank)  # a ValueError for a rank that is not live
    return [move for before, after in zip(old.stages, new.stages)
            for move in layout.transition_plan(before, after, [r for r in before.ranks if r in dead])]


def restart_layout(tp_base: int, dp: int, live_slots: Iterable[tuple[int, ...]], min_tp: int = 1, pp: int = 1
                   ) -> tuple[list[int], list[tuple[int, ...]]]:
    """:func:`ntp_megatron.plan.layout.restart_layout` with ``pp`` stages (``(replica, slot, stage)`` live slots): a
    replica below ``min_tp`` in any stage is dropped from every stage; the dead slots are triples."""
    if pp == 1:
        return layout.restart_layout(tp_base, dp, [slot[:2] for slot in live_slots], min_tp)
    by_stage: dict[int, list[tuple[int, int]]] = {p: [] for p in range(pp)}
    for replica, slot, stage in live_slots:
        by_stage[stage].append((replica, slot))
    dropped: set[int] = set()
    dead: list[tuple[int, int, int]] = []
    for p in range(pp):
        gone, missing = layout.restart_layout(tp_base, dp, by_stage[p], min_tp)
        dropped.update(gone)
        dead += [(replica, slot, p) for replica, slot in missing]
    if len(dropped) == dp:
        raise TopologyError(f"no replica keeps ntp.min_tp ({min_tp}) live slots in every stage")
    return sorted(dropped), [d for d in dead if d[0] not in dropped]
