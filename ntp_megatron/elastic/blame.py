"""Who a wait is on: the causal rule of hang detection (pure: no torch, no store, no clock).

A rank stuck in a kernel (or a busy loop) keeps its heartbeat alive while its peers block on it; the launcher must
fence that rank and no other. Liveness cannot tell them apart, progress alone is not causal (a rank frozen
somewhere else is not why this wait does not end), so the rule asks what each rank *waits for*:

- every rank reports, per process group it is in, how many collectives it has *entered* on it (its sequence
  number: :mod:`ntp_megatron.elastic.sequences`), whether it waits on its peers and for how long, and, where the
  source knows it, the one collective it waits for (``on``: the group and that collective's sequence number);
- a rank that has waited at least ``patience_s`` is a *waiter*;
- the *culprit* of a waiter is a member of a group the waiter waits in that is *behind* it there (it has entered
  fewer collectives on the group than the waiter, so the waiter's collective cannot complete until it moves) and
  that makes no progress: it does not wait itself, its progress count has stood still for ``patience_s``, and it is
  in a phase of an iteration's work, its start mark to the parameter all-gather
  (:data:`ntp_megatron.phases.ITERATION`; elsewhere — a checkpoint write, an evaluation, a re-formation, a rank's
  setup — long work without marks is normal).

So a rank frozen elsewhere (level with or ahead of every waiter on every group it shares with one, or in no group
with any) is never named for a wait; a rank that waits is a victim, never a culprit (what it waits on is found from
its own wait, which makes chains end at the rank that is really stuck); and a slow rank that progresses is never
named, however long its peers wait on it.

Which group a wait is on. On NCCL the flight recorder says it (the collective the device started and has not
completed). On gloo a host wait cannot name it (``Work.wait`` does not know its group), so the waiter's wait
is taken to be on each group where it is ahead of a member: a collective it entered there cannot complete before
that member enters it too, so the member blocks the waiter now or at its next wait on that group — it is causal,
only less precise about *which* of the waiter's collectives it holds up. Counts are compared only between reports
of the same group incarnation (a group's id names its members and the generation that made it).

Clocks: every duration here was measured on one host's monotonic clock (a rank's wait by the rank; how long a
rank's progress stood still by its own launcher); no two hosts' clocks are ever compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

from ntp_megatron.phases import ITERATION


@dataclass(frozen=True)
class Wait:
    """A rank waiting on its peers: for how long, and on which collective when its source knows."""

    waited_s: float
    on: Optional[tuple[str, int]] = None
    """(group id, sequence number of the collective it waits for), or None: one of its groups (gloo)."""

    def to_json(self) -> dict:
        return {"s": round(self.waited_s, 3), "on": list(self.on) if self.on is not None else None}

    @classmethod
    def from_json(cls, value: Optional[dict]) -> Optional["Wait"]:
        if not value:
            return None
        on = value.get("on")
        return cls(float(value["s"]), (str(on[0]), int(on[1])) if on else None)


@dataclass(frozen=True)
class Waiter:
    """What a launcher publishes of one of its ranks that has waited at least ``patience_s``."""

    launch_rank: int
    groups: Mapping[str, int]
    """Group id -> collectives entered on it."""
    wait: Wait

    def to_json(self) -> dict:
        return {"launch_rank": self.launch_rank, "groups": dict(self.groups), "wait": self.wait.to_json()}

    @classmethod
    def from_json(cls, value: dict) -> "Waiter":
        return cls(int(value["launch_rank"]), {str(k): int(v) for k, v in value["groups"].items()},
                   Wait.from_json(value["wait"]))


@dataclass(frozen=True)
class RankState:
    """One rank as its launcher sees it: its last heartbeat and how long its progress count has stood still."""

    launch_rank: int
    phase: str
    iteration: int
    groups: Mapping[str, int] = field(default_factory=dict)
    """Group id -> collectives entered on it."""
    wait: Optional[Wait] = None
    """Its current wait on its peers, None if it is not waiting."""
    still_s: float = 0.0
    """How long its progress count has not moved (its launcher's monotonic clock)."""


@dataclass(frozen=True)
class Blame:
    """``culprit`` holds up ``waiter``'s collective ``seq`` on ``group``, having entered only ``entered`` there."""

    culprit: int
    waiter: int
    group: str
    seq: int
    entered: int
    still_s: float
    waited_s: float
    phase: str
    iteration: int

    def cause(self) -> str:
        """The fence's cause, as the launcher's line and the ``rank_failed`` event say it."""
        return (f"stuck: no progress for {self.still_s:.1f} s in phase {self.phase} of iteration {self.iteration} "
                f"while launch rank {self.waiter} has waited {self.waited_s:.1f} s on it in group {self.group} "
                f"(for collective {self.seq}; this rank entered {self.entered} there; its heartbeat goes on)")


def waiters(states: Iterable[RankState], patience_s: float) -> list[Waiter]:
    """The ranks among ``states`` that have waited on their peers at least ``patience_s``."""
    return [Waiter(s.launch_rank, dict(s.groups), s.wait) for s in states
            if s.wait is not None and s.wait.waited_s >= patience_s]


def suspect(state: RankState, patience_s: float) -> bool:
    """Whether ``state`` could be a culprit at all: it works in an iteration's phase and its progress stood still for
    ``patience_s`` while it does not wait."""
    return state.wait is None and state.phase in ITERATION and state.still_s >= patience_s


def held_up_by(waiter: Waiter, state: RankState) -> Optional[tuple[str, int, int]]:
    """(group, the waiter's collective, what ``state`` entered) where ``state`` is behind ``waiter`` in a group the
    waiter waits in; None if it is behind it nowhere (the first such group by id, for a stable message)."""
    if waiter.launch_rank == state.launch_rank:
        return None
    if waiter.wait.on is not None:
        group, seq = waiter.wait.on
        entered = state.groups.get(group)
        return (group, seq, entered) if entered is not None and entered < seq else None
    for group in sorted(set(waiter.groups) & set(state.groups)):
        if state.groups[group] < waiter.groups[group]:
            return group, waiter.groups[group], state.groups[group]
    return None


def culprits(published: Sequence[Waiter], states: Iterable[RankState], patience_s: float) -> list[Blame]:
    """Of ``states`` (one launcher's own ranks), those that hold up some waiter of ``published`` (every launcher's)
    and make no progress: at most one blame per culprit, naming the waiter that has waited longest."""
    ordered = sorted(published, key=lambda w: (-w.wait.waited_s, w.launch_rank))
    blames = []
    for state in states:
        if not suspect(state, patience_s):
            continue
        for waiter in ordered:
            if waiter.wait.waited_s < patience_s:
                continue
            found = held_up_by(waiter, state)
            if found is not None:
                group, seq, entered = found
                blames.append(Blame(state.launch_rank, waiter.launch_rank, group, seq, entered, state.still_s,
                                    waiter.wait.waited_s, state.phase, state.iteration))
                break
    return blames
