"""Which process groups a rank makes in a generation, and which it keeps, makes and lets go of when the generation
changes (pure: no torch).

:func:`rank_group_calls` is the one enumeration of a generation's groups: every ``new_group`` call a rank makes, in
the order every rank makes them. :func:`ntp_megatron.core.groups.build_groups` makes exactly that list, and
everything that asks which groups a rank is in (:func:`rank_group_keys`, the re-formation's offers, the tests'
checks) reads the same list.

A group is named by what it is, not by the ranks that number it in one generation: its role, its place (stage,
block, instance) and its members' identities — (replica, slot), or (replica, slot, stage) with pipeline stages —
in group-rank order (:class:`GroupKey`). Ranks are numbered anew in every generation; identities never change.

A group whose key is the same in the generation a rank leaves and in the one it joins can go on as the same
object, with the same communicator (:func:`plan`): a healthy replica's tensor-parallel group across a kill in
another replica, a rejoin or a dropped replica; the rank by itself; with pipeline stages, the sync groups and
model-parallel groups of stages and replicas the event did not reach. Whether it really does is decided when
the new generation forms, by its members together (:func:`keep_verdict`): a group goes on only if every member
still holds the same incarnation of it and has issued as many collectives on it as every other, so nothing is
left half-matched in it (a rank that left a generation while a peer was already blocked in the group's next
collective would otherwise meet that stale collective with its first new one).

What each kind of event makes a rank rebuild, at TP ``T`` (with one distributed-optimizer instance):

- *kill* of a rank of replica ``r`` (stage ``p``): the ranks of replica ``r`` (stage ``p``) make their new
  tensor-parallel group and the sync groups they serve; every other rank keeps its tensor-parallel group and
  makes only the sync groups of stage ``p`` whose members changed (the dead slot's block) or that were left
  half-matched (any sync group whose replica-``r`` member was blocked on the dead rank when its partner
  entered the group's collective: after a kill in the forward or backward pass, every sync group of the stage).
- *rejoin* of a slot of replica ``r``: replica ``r`` (that stage) makes its tensor-parallel group; the sync
  group of the returning slot's block is made anew (its member goes back from the proxy to the slot); the
  other sync groups keep their members and are kept (the admission is at an iteration boundary: nothing is
  half-matched).
- *dropped replica* ``r``: every sync group loses a member and is made anew; every tensor-parallel group is kept.

A degraded replica of two ranks or more makes its tensor-parallel group anew at every re-formation: its proxies
gather the dead blocks' gradients by point-to-point messages over it, which torch counts per message, so its
members' counts differ by design. On NCCL every group is made anew after a death
(:mod:`ntp_megatron.elastic.group_backend`).

The default group is made anew in every generation (it numbers the ranks; torch makes every group under it);
it is not counted here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from ntp_megatron.plan import optimizer_shards
from ntp_megatron.plan.layout import Topology
from ntp_megatron.plan.stages import JobTopology

Identity = tuple[int, ...]


@dataclass(frozen=True, order=True)
class GroupKey:
    role: str
    """``tp`` (a replica's stage), ``alone`` (a rank by itself), ``mp`` (a replica, every stage), ``sync`` (a
    stage's block), ``intra`` (a block's members in one distributed-optimizer instance), ``inter`` (the twins
    of one shard)."""
    place: tuple[int, ...]
    """Which one of its role: (stage,) for ``tp``, (replica,) for ``mp``, (stage, block) for ``sync``, (block,
    instance) for ``intra``, (block, position) for ``inter``, () for ``alone``."""
    members: tuple[Identity, ...]
    """The members' identities in group-rank order."""

    def name(self) -> str:
        """Role and place, as records and logs show a group (``sync[0, 3]``): unique among one rank's groups."""
        return f"{self.role}{list(self.place)}"

    def label(self) -> str:
        """A short stable name (for store keys and logs)."""
        text = f"{self.role}{self.place}{self.members}"
        return f"{self.role}-{'-'.join(map(str, self.place))}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"

    def has_member(self, identities: Iterable[Identity]) -> bool:
        return not set(self.members).isdisjoint(identities)


def identities(topology: JobTopology, ranks: Sequence[int]) -> tuple[Identity, ...]:
    return tuple(topology.slot_of(r) for r in ranks)


def sync_group_ranks(topology: Topology, block: int) -> tuple[int, ...]:
    """The ranks of sync group ``block`` of a stage (one per replica), ascending."""
    return tuple(sorted(topology.sync_member(rep.index, block) for rep in topology.replicas))


def intra_group_ranks(topology: Topology, block: int, dp: int, k: int, instance: int) -> tuple[int, ...]:
    """The ranks of sync group ``block`` in ``instance`` (of ``k`` over the ``dp`` launch replicas), ascending
    (that is, in replica order: ranks are numbered replica by replica), so a member's group rank is its
    replica's position in the instance."""
    present = {rep.index for rep in topology.replicas}
    return tuple(sorted(topology.sync_member(r, block) for r in optimizer_shards.instances(dp, k)[instance]
                        if r in present))


def key(topology: JobTopology, role: str, place: tuple[int, ...], ranks: Iterable[int]) -> GroupKey:
    """The key of the group of ``ranks`` in ``topology`` (the whole generation). Members in group-rank order:
    torch orders a group's ranks ascending, and a change of generation keeps the order of the ranks that stay."""
    return GroupKey(role, tuple(place), identities(topology, sorted(ranks)))


@dataclass(frozen=True)
class PlannedGroup:
    """One ``new_group`` call in a rank's sequence (:func:`rank_group_calls`)."""

    how: str
    """``first`` (the generation's first group: this rank's replica stage, made by its members alone), ``alone``
    (this rank by itself), ``part`` (this rank's part of a partition of the world, made by each part's members
    alone), ``every_rank`` (every rank of the world makes it, member or not, at the same point of its sequence)."""
    ranks: tuple[int, ...]
    """The group's ranks, ascending."""
    key: Optional[GroupKey]
    """Its key where this rank is a member; None where it is not (an ``every_rank`` call it only records)."""
    parts: tuple[tuple[int, ...], ...] = ()
    """``part`` only: every part of the partition (the maker checks that they cover the world)."""


def rank_group_calls(topology: JobTopology, rank: int, dp: Optional[int] = None,
                     instances: int = 1) -> list[PlannedGroup]:
    """Every ``new_group`` call ``rank`` makes in ``topology``, in order: the one enumeration of a generation's
    groups. :func:`ntp_megatron.core.groups.build_groups` makes exactly these, one by one, and
    :func:`rank_group_keys` (what a re-formation offers to keep) is the member calls among them.

    The order is torch's requirement: the first group (this rank's replica stage), this rank alone, with
    pipeline stages its replica's model-parallel group (its part of the partition of the world by replica), then
    the groups every rank makes whether it is a member or not — the sync groups, stage by stage and block by block,
    and with ``instances`` k > 1 (over the ``dp`` launch replicas) per block the k intra-instance parts of its sync
    group and then its dp/k twins' groups. Those are a function of the topology alone, the same list on every rank;
    every rank has made the same number of groups before each (one first group, one alone, one part)."""
    staged = topology.num_stages > 1
    if staged and instances > 1:
        raise ValueError("distributed-optimizer instances with pipeline stages are not supported under NTP yet")
    if instances > 1 and dp is None:
        raise ValueError("distributed-optimizer instances need the launch data-parallel size (dp)")
    stage = topology.stage_of(rank)
    replica = stage.replica_of(rank)
    tp_ranks = tuple(sorted(replica.ranks))
    calls = [PlannedGroup("first", tp_ranks, key(topology, "tp", (stage.stage,), tp_ranks)),
             PlannedGroup("alone", (rank,), key(topology, "alone", (), [rank]))]
    if staged:  # before the sync groups, which leave ranks members of different numbers of groups
        parts = tuple(tuple(sorted(topology.replica_ranks(r))) for r in topology.replica_indices)
        mine = tuple(sorted(topology.replica_ranks(replica.index)))
        calls.append(PlannedGroup("part", mine, key(topology, "mp", (replica.index,), mine), parts))
    for s in topology.stages:  # in stage order
        calls += [_every_rank(topology, rank, "sync", (s.stage, b), sync_group_ranks(s, b)) for b in range(s.tp_base)]
    if instances > 1:
        assert dp is not None
        for b in range(stage.tp_base):
            calls += [_every_rank(topology, rank, "intra", (b, i), intra_group_ranks(stage, b, dp, instances, i))
                      for i in range(instances)]
            calls += [_every_rank(topology, rank, "inter", (b, j),
                                  optimizer_shards.shard_holders(stage, dp, instances, (b, j)))
                      for j in range(dp // instances)]
    return calls


def _every_rank(topology: JobTopology, rank: int, role: str, place: tuple[int, ...],
                ranks: Iterable[int]) -> PlannedGroup:
    ranks = tuple(sorted(ranks))
    return PlannedGroup("every_rank", ranks, key(topology, role, place, ranks) if rank in ranks else None)


def rank_group_keys(topology: JobTopology, rank: int, dp: Optional[int] = None,
                    instances: int = 1) -> list[GroupKey]:
    """Every group ``rank`` is a member of in ``topology``, in the order it makes them: the member calls of
    :func:`rank_group_calls`."""
    return [call.key for call in rank_group_calls(topology, rank, dp, instances) if call.key is not None]


@dataclass(frozen=True)
class GroupPlan:
    """One rank's groups across a change of generation."""

    keep: tuple[GroupKey, ...]
    """In both generations: offered to go on (:func:`keep_verdict` decides)."""
    make: tuple[GroupKey, ...]
    """New in the generation joined."""
    release: tuple[GroupKey, ...]
    """Held, and not in the generation joined: shut down (gloo) or aborted (NCCL), then dropped."""


def plan(held: Iterable[GroupKey], wanted: Iterable[GroupKey]) -> GroupPlan:
    held, wanted = list(held), list(wanted)
    held_set, wanted_set = set(held), set(wanted)
    return GroupPlan(keep=tuple(k for k in wanted if k in held_set), make=tuple(k for k in wanted if k not in held_set),
                     release=tuple(k for k in held if k not in wanted_set))


def event_plan(old: JobTopology, new: JobTopology, identity: Identity,
               dp: Optional[int] = None, instances: int = 1) -> GroupPlan:
    """The plan of the process with ``identity`` from ``old`` to ``new`` (before the members' verdict)."""
    old_rank, new_rank = old.rank_of(*identity), new.rank_of(*identity)
    held = rank_group_keys(old, old_rank, dp, instances) if old_rank is not None else []
    wanted = rank_group_keys(new, new_rank, dp, instances) if new_rank is not None else []
    return plan(held, wanted)


def blocked_by(held: Iterable[GroupKey], dead: Iterable[Identity]) -> list[GroupKey]:
    """The groups a death can leave a member blocked in: those with a dead member. Shut down (gloo) or aborted
    (NCCL) the moment the generation ends; the others wait for the new generation's verdict."""
    dead = set(dead)
    return [k for k in held if k.has_member(dead)]


@dataclass(frozen=True)
class Offer:
    """What one member says of a group when a generation forms: which incarnation it holds (the generation
    that made it; None if it holds none) and how many collectives it issued on it."""

    made_in: Optional[int]
    issued: int

    def to_json(self) -> list:
        return [self.made_in, self.issued]

    @classmethod
    def from_json(cls, value: list) -> "Offer":
        made_in, issued = value
        return cls(made_in, int(issued))


def keep_verdict(offers: Mapping[Identity, Offer]) -> bool:
    """Whether a group goes on: every member holds it, the same incarnation, with as many collectives issued as
    every other (then every collective one issued, all issued: each completes, nothing is left half-matched)."""
    values = list(offers.values())
    return bool(values) and values[0].made_in is not None and all(v == values[0] for v in values)
