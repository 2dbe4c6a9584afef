"""Layout math for Nonuniform Tensor Parallelism (NTP): pure Python, no torch.

NTP lets a data-parallel replica whose tensor-parallel group lost GPUs keep training at a lower TP degree. This
module decides which rank holds which piece of every TP-split weight, which ranks sum which gradients, and what
must move when ranks die or come back. Everything is a deterministic function of plain data, so every process
(and the controller) computes the same answer without talking to anyone.

Vocabulary
----------
*replica*
    One data-parallel (DP) replica, i.e. one TP group. Its index 0..dp-1 is stable for the whole job.
*slot*
    A position 0..tp_base-1 in a replica's nominal TP group. A live slot has a process, a dead slot has none.
    A process is identified across generations by ``(replica index, slot)``; its process-group *rank* is
    renumbered every generation (0, 1, ... over the live slots in (replica, slot) order), and its *TP rank* is
    its position among its replica's live slots.
*unit*
    The smallest movable piece of a TP-split *family* (see :data:`FAMILIES`); family ``f`` has
    ``units[f]`` units numbered 0..N-1.
*layout*
    For each replica and family, the units each live rank holds (ascending).
*topology*
    One generation of the job: the surviving replicas, their live slots and ranks, and what each holds.

Canonical blocks, healthy and degraded replicas
-----------------------------------------------
Block ``s`` of a family with N units is the ``s``-th contiguous run of unit ids with sizes
``balanced_counts(N, tp_base)`` (larger blocks first): ``canonical_blocks(6, 4) == [[0, 1], [2, 3], [4], [5]]``.
Every family needs ``N >= tp_base`` so that no block is empty.

A *healthy* replica (all slots live) holds exactly the canonical layout: slot ``s`` holds block ``s``. In a
*degraded* replica every live slot still holds its own block, and the units of each dead slot's block are
*dealt* to live slots so that, per family, the ranks' unit counts differ by at most one. Each dead block has
exactly one *proxy*: a live slot of the same replica (one per dead block, the same for every family).

Sync groups
-----------
Gradients of block ``s`` are summed across replicas in *sync group* ``s``: one member per replica, ordered by
replica index, namely the rank at slot ``s`` or, where slot ``s`` is dead, the rank of the proxy of block
``s``. There are always ``tp_base`` groups; a rank is in its own slot's group and in one more per proxy role.
Inside a replica the ranks holding units of block ``s`` (:meth:`Topology.block_holders`) gather them to the
member before the cross-replica sum and get them back after (a proxy may itself hold none of its block).

Shrinking is sticky
-------------------
When ranks die (:func:`next_topology`), every surviving process keeps exactly the units it held and proxies
keep their roles; only what the dead ranks held (their own block and any dealt units) is dealt to the survivors
of their replica. The layout therefore depends on the history, not only on the live slots, which is why a
topology stores, for each degraded replica, the dealt units and the proxies. Released units are handled block
by block in ascending order:

1. *Proxy rule.* If the block needs a proxy (its slot just died, or its proxy just died), it goes to the live
   slot with the fewest proxy roles so far, then the most units of that block currently held (summed over
   families, counting units kept and already dealt in this step), then the lowest slot.
2. *Dealing rule.* The block's released units, family by family in ascending unit order, each go to a live
   slot with the minimum current count of that family, preferring the block's proxy, then the lowest slot.

Counts were balanced (max - min <= 1) before the failure, removing ranks cannot break that, and giving a unit to
a current minimum keeps it, so counts stay balanced. :func:`make_topology` with dead slots is the healthy
topology shrunk by all of them at once.

A replica left with no rank, or with fewer than ``min_tp`` (config ``ntp.min_tp``), cannot go on: under policy
"drop_replica" it leaves the job (the other replicas keep their indices), under policy "stop" the failure is
unrecoverable (:class:`TopologyError`, restart from a checkpoint); losing every replica is always unrecoverable.

Widening
--------
When repaired processes rejoin (:func:`join_topology`), each joined slot takes its whole canonical block back
from whoever holds it in its replica, and the proxy role of that block ends. Proxies of blocks that are still
dead stay where they are (a joining slot never becomes a proxy of a surviving replica). Counts are then
rebalanced with the fewest moves: while some family's counts differ by two or more, the lowest slot with the
maximum count gives its largest dealt unit to a slot with the minimum count (the proxy of that unit's block if
it has the minimum, else the lowest such slot). This is the fewest moves: balanced counts of a fixed total are
all ``floor`` or ``ceil`` of the mean, and each move lowers the excess above ``ceil`` or the shortfall below
``floor`` by one (both while both are positive). The donor always has a dealt unit to give, as its count exceeds
the largest block. A replica whose slots are all live again is exactly canonical. A dropped replica may come
back: its missing blocks are dealt among its joined slots as in :func:`make_topology`.

Weighted dealing
----------------
A replica may weigh its live slots unevenly (:attr:`Replica.weights`, a slow rank's measured speed: 100 for a
normal one): each slot's *share* of a family is then proportional to its weight, never below one unit
(:func:`shares`), and each slot holds its share within one unit. A slot below its block's size *lends* units of its
block to the others (they are listed in ``dealt`` as a dead block's are, and the slot stays its block's sync member:
the lent units' gradients are gathered to it as a proxy's). The counts are chosen (:func:`_targets`) so that the
slowest slot's time (count / weight) is as small as counts within one unit of the shares allow, and among those
the ones reached with the fewest moves; remaining ties go to the slots the families dealt before (coarsest first)
gave least above their shares, then to the lowest slot. Units move straight there: a slot above its count gives the units it holds
away from home first (the largest), then its own block's largest, each to the unit's block's member if that one is
short, else to the lowest slot that is short. :func:`rebalanced_topology` changes a replica's weights (nothing dies,
proxies and sync groups stay); even weights on a full replica make it canonical again (lent units go home). With
even weights these rules are the ones above exactly. A death in a weighted replica makes its slots alike again
(survivors keep what they hold, the counts are balanced by the rules above): dealt by weight, a survivor could hold
more than any even layout down to ``ntp.min_tp``.

Transition plans
----------------
:func:`transition_plan` lists the units each new-generation rank lacks (a unit the surviving process at the
same slot already holds never moves), with a source for each: the surviving process of the same replica that
holds it, else a surviving process of another replica, from a replica that was healthy first (its slot ``s``
holds exactly block ``s``), then the lowest replica index.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from math import floor
from functools import cached_property, lru_cache
from typing import Any, Iterable, Literal, Mapping

__all__ = [
    "FAMILIES",
    "POLICIES",
    "Move",
    "Replica",
    "Topology",
    "TopologyError",
    "balanced_counts",
    "canonical_blocks",
    "join_topology",
    "make_topology",
    "next_topology",
    "parse_dead_slots",
    "parse_stage_slots",
    "restart_layout",
    "rebalanced_topology",
    "shares",
    "survivor_ranks",
    "transition_plan",
]

FAMILIES = ("heads", "ffn", "vocab")
"""Unit families of a GPT model. heads: one attention head, or one query group (GQA) with its heads; ffn: one
FFN hidden unit (a row of fc1 — gate and up rows for a gated MLP — and the matching column of fc2); vocab: one
vocabulary row (embedding and output layer)."""

Policy = Literal["drop_replica", "stop", "restart"]
POLICIES: tuple[str, ...] = ("drop_replica", "stop", "restart")
"""What :func:`next_topology` does with a replica left below ``min_tp`` (config ``ntp.on_unrecoverable``);
"restart" raises like "stop" (the launcher then restarts the job, see :func:`restart_layout`)."""


class TopologyError(ValueError):
    """A failure NTP cannot absorb (a replica below ``ntp.min_tp`` under policy "stop", every replica gone, a
    unit with no surviving holder): the caller must take the restart-from-checkpoint path."""


def _check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """Reject bools and non-ints early: a float or a string here is always a caller bug."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class _FrozenDict(dict):
    """A dict that refuses changes once built, so a frozen topology (and its caches) cannot be altered through
    its mappings. Hashable; compares, serialises to JSON, copies and pickles like a dict."""

    __slots__ = ()

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("topology mappings are read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only  # type: ignore

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple:
        return type(self), (dict(self),)


# ---------------------------------------------------------------------------------------------------------------
# Canonical blocks


def balanced_counts(num_units: int, width: int) -> list[int]:
    """Per-rank unit counts, larger first, differing by at most one: ``balanced_counts(8, 3) == [3, 3, 2]``."""
    _check_int("num_units", num_units, 0)
    _check_int("width", width, 1)
    base, rest = divmod(num_units, width)
    return [base + 1 if i < rest else base for i in range(width)]


def canonical_blocks(num_units: int, tp_base: int) -> list[list[int]]:
    """The canonical blocks of a family: contiguous runs of unit ids with sizes
    ``balanced_counts(num_units, tp_base)``. ``canonical_blocks(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]``,
    ``canonical_blocks(6, 4) == [[0, 1], [2, 3], [4], [5]]``. Block ``s`` is what slot ``s`` of a healthy replica
    holds."""
    # Validate before the cache: 8.0 == 8 would otherwise hit a cached entry and slip through.
    _check_int("num_units", num_units, 0)
    _check_int("tp_base", tp_base, 1)
    return [list(block) for block in _blocks(num_units, tp_base)]


@lru_cache(maxsize=1024)
def _blocks(num_units: int, tp_base: int) -> tuple[range, ...]:
    """Cached core of canonical_blocks (ranges: O(1) memory even for a large vocabulary); ints already checked."""
    blocks, start = [], 0
    for size in balanced_counts(num_units, tp_base):
        blocks.append(range(start, start + size))
        start += size
    return tuple(blocks)


def _block_of(num_units: int, tp_base: int, unit: int) -> int:
    """Index of the canonical block holding ``unit`` (needs ``num_units >= tp_base``)."""
    base, rest = divmod(num_units, tp_base)
    edge = rest * (base + 1)  # the first `rest` blocks have base + 1 units
    return unit // (base + 1) if unit < edge else rest + (unit - edge) // base


def _check_units(units: Any, tp_base: int) -> None:
    if not isinstance(units, Mapping) or not units:
        raise ValueError(f"units must be a non-empty mapping family -> number of units, got {units!r}")
    for family, count in units.items():
        if not isinstance(family, str) or not family:
            raise ValueError(f"unit family names must be non-empty strings, got {family!r}")
        _check_int(f"units[{family!r}]", count, 1)
        if count < tp_base:
            raise ValueError(f"family {family!r} has {count} units, fewer than tp_base ({tp_base}): every slot's "
                             f"canonical block needs at least one unit")


# ---------------------------------------------------------------------------------------------------------------
# Topology


@dataclass(frozen=True)
class Replica:
    """One DP replica in one generation: its stable index, live slots, ranks, and (if degraded) how the units of
    its dead blocks are spread."""

    index: int
    """Replica index 0..dp-1, stable for the whole job (the data order depends on it, never on the layout)."""
    slots: tuple[int, ...]
    """Live slots, ascending (slot = position 0..tp_base-1 in the nominal TP group)."""
    ranks: tuple[int, ...]
    """Process-group rank of each live slot in this generation, same order as ``slots``."""
    proxies: Mapping[int, int] = field(default_factory=dict)
    """Dead block -> the live slot that is its proxy (its member in the block's sync group). Empty when
    healthy."""
    dealt: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    """Family -> unit not held by its own slot -> live slot holding it: every unit of every dead block, and the
    units of live blocks that their slot lent (a weighted replica's slow slot). Empty when the replica is canonical;
    otherwise it has every family. Live slot ``s`` holds the units of block ``s`` not listed here."""
    weights: Mapping[int, int] = field(default_factory=dict)
    """Live slot -> positive weight (its speed, 100 for a normal one), when the replica's slots are not all alike:
    each slot's share of every family is proportional to its weight (:func:`shares`). Empty: all alike."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", tuple(self.slots))
        object.__setattr__(self, "ranks", tuple(self.ranks))
        _check_int("replica index", self.index, 0)
        for s in self.slots:
            _check_int(f"slot of replica {self.index}", s, 0)
        for r in self.ranks:
            _check_int(f"rank of replica {self.index}", r, 0)
        if not self.slots:
            raise ValueError(f"replica {self.index} has no live slot")
        if list(self.slots) != sorted(set(self.slots)):
            raise ValueError(f"replica {self.index}: slots must be distinct and ascending, got {list(self.slots)}")
        if len(self.ranks) != len(self.slots):
            raise ValueError(f"replica {self.index}: {len(self.slots)} slots but {len(self.ranks)} ranks")
        if not isinstance(self.proxies, Mapping) or not isinstance(self.dealt, Mapping):
            raise ValueError(f"replica {self.index}: proxies and dealt must be mappings")
        for block, slot in self.proxies.items():
            _check_int(f"replica {self.index}: proxied block", block, 0)
            self._check_live(f"proxy of block {block}", slot)
        dealt = {}
        for family, units in self.dealt.items():
            if not isinstance(family, str) or not isinstance(units, Mapping):
                raise ValueError(f"replica {self.index}: dealt must map family names to {{unit: slot}} mappings, "
                                 f"got {family!r}: {units!r}")
            for unit, slot in units.items():
                _check_int(f"replica {self.index}: dealt unit of family {family!r}", unit, 0)
                self._check_live(f"holder of dealt unit {unit} of family {family!r}", slot)
            dealt[family] = _FrozenDict(sorted(units.items()))
        if not isinstance(self.weights, Mapping):
            raise ValueError(f"replica {self.index}: weights must be a mapping")
        if self.weights:
            if sorted(self.weights) != list(self.slots):
                raise ValueError(f"replica {self.index}: weights must list exactly the live slots {list(self.slots)}, "
                                 f"got {sorted(self.weights)}")
            for slot, weight in self.weights.items():
                _check_int(f"replica {self.index}: weight of slot {slot}", weight, 1)
        object.__setattr__(self, "proxies", _FrozenDict(sorted(self.proxies.items())))
        object.__setattr__(self, "dealt", _FrozenDict(sorted(dealt.items())))
        object.__setattr__(self, "weights", _FrozenDict(sorted(self.weights.items())))

    def _check_live(self, what: str, slot: Any) -> None:
        _check_int(f"replica {self.index}: {what}", slot, 0)
        if slot not in self.slots:
            raise ValueError(f"replica {self.index}: {what} is slot {slot}, which is not live "
                             f"(live slots {list(self.slots)})")

    @property
    def width(self) -> int:
        """Live TP degree of this replica."""
        return len(self.slots)

    def to_json(self) -> dict:
        """Plain JSON: mappings with int keys become lists of ``[key, slot]`` pairs, ascending (weights only when
        a replica has them: a replica without reads as before)."""
        out = {"index": self.index, "slots": list(self.slots), "ranks": list(self.ranks),
               "proxies": [[b, s] for b, s in self.proxies.items()],
               "dealt": {f: [[u, s] for u, s in units.items()] for f, units in self.dealt.items()}}
        if self.weights:
            out["weights"] = [[s, w] for s, w in self.weights.items()]
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Replica":
        _expect_keys("replica", d, ("index", "slots", "ranks", "proxies", "dealt")
                     + (("weights",) if isinstance(d, dict) and "weights" in d else ()))
        if not isinstance(d["dealt"], dict):
            raise ValueError(f"replica JSON: 'dealt' must be an object, got {type(d['dealt']).__name__}")
        return cls(index=d["index"], slots=tuple(d["slots"]), ranks=tuple(d["ranks"]),
                   proxies=_pairs_to_dict("proxies", d["proxies"]),
                   dealt={f: _pairs_to_dict(f"dealt[{f!r}]", pairs) for f, pairs in d["dealt"].items()},
                   weights=_pairs_to_dict("weights", d.get("weights", [])))


def _expect_keys(what: str, d: Any, keys: tuple[str, ...]) -> None:
    if not isinstance(d, dict) or set(d) != set(keys):
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{what} JSON must have exactly the keys {list(keys)}, got {got}")


def _pairs_to_dict(what: str, pairs: Any) -> dict:
    if not isinstance(pairs, list):
        raise ValueError(f"replica JSON: {what} must be a list of [key, slot] pairs, got {pairs!r}")
    out: dict = {}
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"replica JSON: {what} must be a list of [key, slot] pairs, got item {pair!r}")
        if pair[0] in out:
            raise ValueError(f"replica JSON: {what} lists key {pair[0]!r} twice")
        out[pair[0]] = pair[1]
    return out


@dataclass(frozen=True)
class Topology:
    """Generation ``generation`` of the job: the surviving replicas (ascending index), their live ranks, and for
    each degraded replica its dealt units and proxies (healthy replicas store nothing: they are canonical).

    Validated on construction (every unit held exactly once per replica, dealt units from dead blocks only, one
    live proxy per dead block, balanced counts), immutable, hashable (usable as a cache key), and exactly
    round-tripped by :meth:`to_json` / :meth:`from_json`.
    """

    generation: int
    tp_base: int
    units: Mapping[str, int]
    """Family -> number of units, e.g. ``{"heads": 8, "ffn": 256, "vocab": 256}``; each at least ``tp_base``."""
    replicas: tuple[Replica, ...]
    stage: int = 0
    """The pipeline stage this is the layout of (:class:`ntp_megatron.plan.stages.JobTopology`); 0 without stages."""
    rank_base: int = 0
    """The first process-group rank of this stage: its ranks are ``rank_base .. rank_base + world_size - 1`` (the
    stages before it hold the lower ones); 0 without stages."""

    def __post_init__(self) -> None:
        _check_int("generation", self.generation, 0)
        _check_int("tp_base", self.tp_base, 1)
        _check_int("stage", self.stage, 0)
        _check_int("rank_base", self.rank_base, 0)
        _check_units(self.units, self.tp_base)
        # Defensive copies: a frozen topology must not change because a caller mutates its own dict.
        object.__setattr__(self, "units", _FrozenDict(sorted(self.units.items())))
        object.__setattr__(self, "replicas", tuple(self.replicas))
        if not self.replicas:
            raise TopologyError("a topology needs at least one replica")
        if not all(isinstance(rep, Replica) for rep in self.replicas):
            raise ValueError("replicas must be Replica objects")
        indices = [rep.index for rep in self.replicas]
        if indices != sorted(set(indices)):
            raise ValueError(f"replica indices must be distinct and ascending, got {indices}")
        ranks = [r for rep in self.replicas for r in rep.ranks]
        if sorted(ranks) != list(range(self.rank_base, self.rank_base + len(ranks))):
            raise ValueError(f"process-group ranks must be exactly {self.rank_base}..{self.rank_base + len(ranks) - 1}"
                             f", got {ranks}")
        for rep in self.replicas:
            self._check_replica(rep)

    def _check_replica(self, rep: Replica) -> None:
        if rep.slots[-1] >= self.tp_base:
            raise ValueError(f"replica {rep.index}: slot {rep.slots[-1]} out of range 0..{self.tp_base - 1}")
        dead = [s for s in range(self.tp_base) if s not in rep.slots]
        if sorted(rep.proxies) != dead:
            raise ValueError(f"replica {rep.index}: proxies are given for blocks {sorted(rep.proxies)} but the "
                             f"dead blocks are {dead}: every dead block needs exactly one proxy")
        if rep.dealt and set(rep.dealt) != set(self.units):
            raise ValueError(f"replica {rep.index}: dealt must list the families {sorted(self.units)}, "
                             f"got {sorted(rep.dealt)}")
        if dead and not rep.dealt:
            raise ValueError(f"replica {rep.index} is degraded (dead blocks {dead}) but lists no dealt units")
        if not dead and not rep.weights and rep.dealt:
            raise ValueError(f"replica {rep.index} has every slot live and its slots alike (no weights) but lists dealt "
                             "units: it must be canonical")
        if not dead and not rep.weights:
            # canonical: each slot holds its own block, and blocks differ by at most one unit, so every count is
            # within one unit of its even share (the check below, skipped for the thousands of healthy replicas
            # of a large job)
            return
        weights = _weights_of(rep.slots, rep.weights)
        for family, num_units in self.units.items():
            blocks = _blocks(num_units, self.tp_base)
            dealt = rep.dealt.get(family, {})
            missing = [u for s in dead for u in blocks[s] if u not in dealt]
            if missing:
                raise ValueError(f"replica {rep.index}, family {family!r}: units {missing} of the dead blocks "
                                 f"{dead} are not dealt")
            counts = Counter({s: len(blocks[s]) for s in rep.slots})
            for unit, holder in dealt.items():
                if unit >= num_units:
                    raise ValueError(f"replica {rep.index}, family {family!r}: dealt unit {unit} out of range "
                                     f"0..{num_units - 1}")
                block = _block_of(num_units, self.tp_base, unit)
                if block == holder:
                    raise ValueError(f"replica {rep.index}, family {family!r}: unit {unit} is listed as dealt to "
                                     f"slot {holder}, its own block's slot")
                counts[holder] += 1
                if block in counts:
                    counts[block] -= 1
            ideal = shares(num_units, weights)
            off = {s: c for s, c in counts.items() if not ideal[s] - 1 < c < ideal[s] + 1}
            if off:
                raise ValueError(f"replica {rep.index}, family {family!r}: unit counts per live slot "
                                 f"{dict(sorted(counts.items()))} are not within one unit of the shares "
                                 f"{ {s: float(q) for s, q in ideal.items()} } (slots {sorted(off)})")

    @cached_property
    def _hash(self) -> int:
        return hash((self.generation, self.tp_base, self.units, self.replicas, self.stage, self.rank_base))

    def __hash__(self) -> int:
        return self._hash

    # -- ranks, slots, replicas ---------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of live ranks (processes) in this generation (of this stage, with pipeline stages)."""
        return sum(rep.width for rep in self.replicas)

    @property
    def ranks(self) -> range:
        """This topology's process-group ranks."""
        return range(self.rank_base, self.rank_base + self.world_size)

    def placed(self, stage: int, rank_base: int) -> "Topology":
        """The same layout as pipeline stage ``stage`` whose ranks start at ``rank_base`` (renumbered in order)."""
        shift = rank_base - self.rank_base
        replicas = tuple(Replica(rep.index, rep.slots, tuple(r + shift for r in rep.ranks), rep.proxies, rep.dealt,
                                 rep.weights)
                         for rep in self.replicas)
        return Topology(self.generation, self.tp_base, self.units, replicas, stage=stage, rank_base=rank_base)

    @cached_property
    def _where(self) -> dict[int, tuple[Replica, int]]:
        return {rank: (rep, pos) for rep in self.replicas for pos, rank in enumerate(rep.ranks)}

    @cached_property
    def _by_index(self) -> dict[int, Replica]:
        return {rep.index: rep for rep in self.replicas}

    def replica(self, index: int) -> Replica:
        """The replica with index ``index`` (indices survive drops, so this is not ``replicas[index]``)."""
        try:
            return self._by_index[index]
        except (KeyError, TypeError):
            raise ValueError(f"no replica with index {index!r}; live replicas: {sorted(self._by_index)}") from None

    def replica_of(self, rank: int) -> Replica:
        """The replica that process-group rank ``rank`` belongs to."""
        return self._locate(rank)[0]

    def local_rank(self, rank: int) -> int:
        """Position of ``rank`` among its replica's live slots: its TP rank."""
        return self._locate(rank)[1]

    def slot_of(self, rank: int) -> tuple[int, int]:
        """``(replica index, slot)`` of a rank: the identity of a process across generations."""
        rep, pos = self._locate(rank)
        return rep.index, rep.slots[pos]

    def rank_of(self, replica: int, slot: int) -> int | None:
        """Process-group rank of ``(replica, slot)`` in this generation, None if that slot is not live."""
        rep = self._by_index.get(replica)
        if rep is None or slot not in rep.slots:
            return None
        return rep.ranks[rep.slots.index(slot)]

    def is_healthy(self, replica_index: int) -> bool:
        """Whether the replica holds exactly the canonical blocks: every slot live and none lending units (a
        weighted replica's slow slot lends some: its layout is a degraded one's, with every slot live)."""
        rep = self.replica(replica_index)
        return rep.width == self.tp_base and not rep.dealt

    def _locate(self, rank: int) -> tuple[Replica, int]:
        try:
            return self._where[rank]
        except (KeyError, TypeError):
            where = f" stage {self.stage}," if self.stage or self.rank_base else ""
            raise ValueError(f"rank {rank!r} is not live in generation {self.generation}{where} "
                             f"(ranks {self.rank_base}..{self.rank_base + self.world_size - 1})") from None

    def _units(self, family: str) -> int:
        try:
            return self.units[family]
        except (KeyError, TypeError):
            raise ValueError(f"unknown unit family {family!r}; this topology has {sorted(self.units)}") from None

    def _check_block(self, block: int) -> int:
        _check_int("block", block, 0)
        if block >= self.tp_base:
            raise ValueError(f"block {block} out of range 0..{self.tp_base - 1}")
        return block

    # -- layouts ------------------------------------------------------------------------------------------------

    def block(self, family: str, s: int) -> list[int]:
        """Canonical block ``s`` of ``family``: what slot ``s`` always holds while it is live."""
        return list(_blocks(self._units(family), self.tp_base)[self._check_block(s)])

    @cached_property
    def _layouts(self) -> dict[tuple[int, str], tuple[tuple[int, ...], ...]]:
        """(replica index, family) -> units held by each live slot, in slot order, each ascending."""
        out = {}
        for rep in self.replicas:
            for family, num_units in self.units.items():
                blocks = _blocks(num_units, self.tp_base)
                if not rep.dealt:
                    out[rep.index, family] = tuple(tuple(b) for b in blocks)
                    continue
                away = rep.dealt[family]
                extra: dict[int, list[int]] = {s: [] for s in rep.slots}
                for unit, slot in away.items():  # ascending units
                    extra[slot].append(unit)
                out[rep.index, family] = tuple(tuple(sorted([*(u for u in blocks[s] if u not in away), *extra[s]]))
                                               for s in rep.slots)
        return out

    def layout(self, family: str, replica: int) -> list[list[int]]:
        """Units of ``family`` held by each live slot of the replica with index ``replica``, in slot order (= TP
        rank order), each ascending."""
        self._units(family)
        self.replica(replica)
        return [list(units) for units in self._layouts[replica, family]]

    def units_of(self, rank: int, family: str) -> list[int]:
        """Units of ``family`` held by process-group rank ``rank``, ascending."""
        rep, pos = self._locate(rank)
        self._units(family)
        return list(self._layouts[rep.index, family][pos])

    # -- sync groups --------------------------------------------------------------------------------------------

    def proxy(self, replica_index: int, block: int) -> int:
        """The live slot of the replica that is its member of sync group ``block``: slot ``block`` itself if it
        is live, else the proxy of that dead block."""
        rep = self.replica(replica_index)
        self._check_block(block)
        return block if block in rep.slots else rep.proxies[block]

    def sync_member(self, replica_index: int, block: int) -> int:
        """Process-group rank of the replica's member of sync group ``block``."""
        rank = self.rank_of(replica_index, self.proxy(replica_index, block))
        assert rank is not None  # proxies are live slots (validated)
        return rank

    def sync_groups(self) -> list[tuple[int, ...]]:
        """For each block ``s`` (always ``tp_base`` of them), the ranks that sum gradients of block ``s`` across
        replicas: one per replica, ordered by replica index. A rank may be in several groups (proxy roles)."""
        return [tuple(self.sync_member(rep.index, s) for rep in self.replicas) for s in range(self.tp_base)]

    def member_blocks(self, rank: int) -> list[int]:
        """Ascending blocks whose sync group ``rank`` belongs to: its own slot's block plus the dead blocks of its
        replica it is proxy of."""
        rep, pos = self._locate(rank)
        slot = rep.slots[pos]
        return sorted([slot, *(b for b, p in rep.proxies.items() if p == slot)])

    def block_holders(self, family: str, replica_index: int, block: int) -> list[tuple[int, list[int]]]:
        """``(rank, units of block `block` it holds)`` within one replica: the block's sync member first (listed
        even when it holds none of the block, as it is where the block's gradients are gathered), then every
        other rank holding some of the block, by TP rank. Together they cover the block exactly once."""
        rep = self.replica(replica_index)
        self._check_block(block)
        wanted = set(_blocks(self._units(family), self.tp_base)[block])
        member = self.proxy(replica_index, block)
        first: list[tuple[int, list[int]]] = []
        rest: list[tuple[int, list[int]]] = []
        for slot, rank, units in zip(rep.slots, rep.ranks, self._layouts[replica_index, family]):
            held = [u for u in units if u in wanted]
            if slot == member:
                first.append((rank, held))
            elif held:
                rest.append((rank, held))
        return first + rest

    # -- serialisation ------------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """Plain JSON (a stage's place only when it has one: a topology without stages reads as before)."""
        out = {"generation": self.generation, "tp_base": self.tp_base, "units": dict(self.units),
               "replicas": [rep.to_json() for rep in self.replicas]}
        if self.stage or self.rank_base:
            out.update(stage=self.stage, rank_base=self.rank_base)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Topology":
        keys = ("generation", "tp_base", "units", "replicas")
        _expect_keys("topology", d, keys + (("stage", "rank_base") if "stage" in d else ()))
        if not isinstance(d["units"], dict) or not isinstance(d["replicas"], list):
            raise ValueError("topology JSON: 'units' must be an object and 'replicas' a list")
        return cls(generation=d["generation"], tp_base=d["tp_base"], units=dict(d["units"]),
                   replicas=tuple(Replica.from_json(r) for r in d["replicas"]), stage=d.get("stage", 0),
                   rank_base=d.get("rank_base", 0))


# ---------------------------------------------------------------------------------------------------------------
# Replica transitions. A draft is (index, live slots, proxies, dealt, weights), plain data without ranks.

_Draft = tuple[int, list[int], dict[int, int], dict[str, dict[int, int]], dict[int, int]]


def _draft_of(rep: Replica) -> _Draft:
    return (rep.index, list(rep.slots), dict(rep.proxies), {f: dict(d) for f, d in rep.dealt.items()},
            dict(rep.weights))


def _healthy(index: int, tp_base: int) -> _Draft:
    return index, list(range(tp_base)), {}, {}, {}


def shares(num_units: int, weights: Mapping[int, int]) -> dict[int, Fraction]:
    """Each slot's ideal number of units of a family of ``num_units`` (slot -> weight, every live slot listed):
    proportional to its weight, but never below one unit (a rank holds at least one unit of every family); the
    slots a plain proportional share would give less are set at one and the rest is shared among the others the
    same way. Exact fractions: ``shares(8, {0: 2, 1: 1, 2: 1}) == {0: 4, 1: 2, 2: 2}``."""
    if num_units < len(weights):
        raise ValueError(f"{num_units} units cannot give each of {len(weights)} slots one")
    out: dict[int, Fraction] = {}
    free, left = sorted(weights), num_units
    while True:
        total = sum(weights[s] for s in free)
        ideal = {s: Fraction(left * weights[s], total) for s in free}
        small = [s for s in free if ideal[s] < 1]
        if not small:
            out.update(ideal)
            return dict(sorted(out.items()))
        out.update((s, Fraction(1)) for s in small)
        free = [s for s in free if s not in small]
        left -= len(small)


def _weights_of(slots: Iterable[int], weights: Mapping[int, int]) -> dict[int, int]:
    """Slot -> weight for every live slot (all 1 when the replica's weights are even, ``weights`` empty)."""
    return {s: weights[s] if weights else 1 for s in slots}


def _member(block: int, slots: Iterable[int], proxies: Mapping[int, int]) -> int:
    """The replica's member of sync group ``block``: its own slot if live, else the block's proxy."""
    return block if block in slots else proxies[block]


def _shrink(draft: _Draft, dying: set[int], tp_base: int, units: Mapping[str, int]) -> _Draft:
    """The replica after slots ``dying`` died at once: survivors keep what they hold and their proxy roles; what
    the dying held is dealt by the proxy and dealing rules of the module docstring; a weighted replica's slots are
    alike again. Needs a survivor."""
    index, slots, proxies, dealt, weights = draft
    if not dying:
        return draft
    live = [s for s in slots if s not in dying]
    assert live, "a replica with no survivor is dropped, not shrunk"
    # A death makes a weighted replica's slots alike again: dealing its dead slots' units by weight could give a
    # survivor more than any even layout down to ntp.min_tp (what the memory plan vouches for); its slow slots are
    # measured and rebalanced again in the new layout.
    weights = {}
    kept = {b: p for b, p in proxies.items() if p not in dying}
    orphans = set(dying) | {b for b, p in proxies.items() if p in dying}  # blocks needing a new proxy
    new_dealt: dict[str, dict[int, int]] = {}
    counts: dict[str, dict[int, int]] = {}
    released: dict[int, dict[str, list[int]]] = {}  # block -> family -> released units
    of_block: Counter[tuple[int, int]] = Counter()  # (block, slot) -> units of that block the slot holds
    for family, num_units in units.items():
        blocks = _blocks(num_units, tp_base)
        counts[family] = {s: len(blocks[s]) for s in live}
        new_dealt[family] = {}
        away = dealt.get(family, {})
        for s in dying:  # what the dying slot held of its own block (units it lent stay where they are)
            released.setdefault(s, {}).setdefault(family, []).extend(u for u in blocks[s] if u not in away)
        for unit, holder in away.items():
            block = _block_of(num_units, tp_base, unit)
            if block in counts[family]:  # lent by a survivor
                counts[family][block] -= 1
            if holder in dying:
                released.setdefault(block, {}).setdefault(family, []).append(unit)
            else:
                new_dealt[family][unit] = holder
                counts[family][holder] += 1
                of_block[block, holder] += 1
    roles = Counter(kept.values())
    for block in sorted(orphans | set(released)):
        if block in orphans:
            proxy = min(live, key=lambda s: (roles[s], -of_block[block, s], s))
            kept[block] = proxy
            roles[proxy] += 1
        member = _member(block, live, kept)
        for family in sorted(released.get(block, {})):
            count = counts[family]
            for unit in sorted(released[block][family]):
                low = min(count.values())
                target = member if count[member] == low else min(s for s in live if count[s] == low)
                if target != block:  # a unit lent by a survivor that comes back to it is not dealt
                    new_dealt[family][unit] = target
                count[target] += 1
                of_block[block, target] += 1
    return _fit((index, live, kept, new_dealt, weights), tp_base, units)


def _targets(held: Mapping[int, int], ideal: Mapping[int, Fraction], weights: Mapping[int, int],
             load: Mapping[int, Fraction]) -> dict[int, int]:
    """A weighted replica's unit counts for one family: each within one unit of its share, the slowest slot's time
    (count / weight) as small as any such counts allow, and of those the counts that the slots' current ones
    (``held``) reach with the fewest moves; ties go to the slots with the least ``load`` (what the families dealt
    before gave them above their shares), then the lowest (module docstring, "Weighted dealing")."""
    low = {s: floor(q) for s, q in ideal.items()}
    extra = int(sum(ideal.values()) - sum(low.values()))  # slots at their share's ceiling
    if not extra:
        return low
    room = [s for s in low if ideal[s] != low[s]]
    after = {s: Fraction(low[s] + 1, weights[s]) for s in room}
    bound = max(max(Fraction(low[s], weights[s]) for s in low), sorted(after.values())[extra - 1])
    chosen = sorted((s for s in room if after[s] <= bound),
                    key=lambda s: (held[s] <= low[s], after[s], load[s], s))[:extra]
    return {s: low[s] + (s in chosen) for s in low}


def _fit(draft: _Draft, tp_base: int, units: Mapping[str, int]) -> _Draft:
    """The replica with every live slot's count of each family within one unit of its share (:func:`shares`),
    reached with the fewest moves (module docstring, "Weighted dealing"); a replica with even weights that already
    fits is returned as it is."""
    index, slots, proxies, dealt, weights = draft
    weighted = len(set(weights.values())) > 1
    new_dealt: dict[str, dict[int, int]] = {}
    load = {s: Fraction(0) for s in slots}  # above-share fractions the families dealt so far gave each slot
    for family, num_units in sorted(units.items(), key=lambda item: (item[1], item[0])):  # coarsest first
        blocks = _blocks(num_units, tp_base)
        ideal = shares(num_units, _weights_of(slots, weights))
        away = dict(dealt.get(family, {}))  # unit -> slot, for units not held by their own live slot
        extra: dict[int, list[int]] = {s: [] for s in slots}  # units away from their own slot, per holder
        count = {s: len(blocks[s]) for s in slots}
        for unit, holder in sorted(away.items()):
            extra[holder].append(unit)
            count[holder] += 1
            block = _block_of(num_units, tp_base, unit)
            if block in count:
                count[block] -= 1
        target = _targets(count, ideal, _weights_of(slots, weights), load) if weighted else None
        if target is not None:
            for s in slots:
                load[s] += (target[s] - ideal[s]) / num_units

        def give(unit: int, to: int) -> None:
            block = _block_of(num_units, tp_base, unit)
            if to == block:
                away.pop(unit, None)
            else:
                away[unit] = to
                bisect.insort(extra[to], unit)
            count[to] += 1

        def take(donor: int) -> int:
            """The unit ``donor`` gives: one it holds away from home first (the largest), else its block's largest."""
            count[donor] -= 1
            if extra[donor]:
                return extra[donor].pop()
            return max(u for u in blocks[donor] if u not in away)

        if target is not None:
            # Weighted: straight to the target counts; a unit goes to its block's member if that one is short.
            def short(unit: int) -> int:
                member = _member(_block_of(num_units, tp_base, unit), slots, proxies)
                return member if count[member] < target[member] else min(s for s in slots if count[s] < target[s])

            for donor in slots:
                while count[donor] > target[donor]:
                    unit = take(donor)
                    give(unit, short(unit))
        else:
            while True:
                excess = {s: count[s] - ideal[s] for s in slots}
                high, low = max(excess.values()), min(excess.values())
                if high < 1 and low > -1:
                    break
                # Some slot is over its share by a unit or more, or under it: the most loaded one gives (it holds at
                # least two units, see the docstring) to the least loaded, its block's member first.
                unit = take(min(s for s in slots if excess[s] == high))
                member = _member(_block_of(num_units, tp_base, unit), slots, proxies)
                give(unit, member if excess[member] == low else min(s for s in slots if excess[s] == low))
        new_dealt[family] = away
    return index, slots, proxies, dict(sorted(new_dealt.items())), weights


def _widen(draft: _Draft, joining: set[int], tp_base: int, units: Mapping[str, int]) -> _Draft:
    """The replica after slots ``joining`` rejoined: they take their blocks back, their blocks' proxy roles end,
    other proxies stay, and counts are rebalanced with the fewest moves (rule in the module docstring). A joined
    slot weighs as much as the replica's fastest slot."""
    index, slots, proxies, dealt, weights = draft
    live = sorted({*slots, *joining})
    if weights:
        weights = {**weights, **dict.fromkeys(joining, max(weights.values()))}
    if len(live) == tp_base and len(set(weights.values())) <= 1:
        return _healthy(index, tp_base)
    kept = {b: p for b, p in proxies.items() if b not in joining}
    back = {f: {u: s for u, s in d.items() if _block_of(units[f], tp_base, u) not in joining}
            for f, d in dealt.items()}
    return _fit((index, live, kept, back, weights), tp_base, units)


def _build(generation: int, tp_base: int, units: Mapping[str, int], drafts: Iterable[_Draft]) -> Topology:
    """A topology whose ranks are numbered 0, 1, ... over live slots in (replica, slot) order; a replica's dealt
    units are listed for every family when it has any, and even weights are not listed."""
    replicas, next_rank = [], 0
    for index, slots, proxies, dealt, weights in sorted(drafts, key=lambda d: d[0]):
        dealt = {f: dealt.get(f, {}) for f in units} if any(dealt.values()) or proxies else {}
        weights = weights if len(set(weights.values())) > 1 else {}
        replicas.append(Replica(index, tuple(slots), tuple(range(next_rank, next_rank + len(slots))),
                                proxies=proxies, dealt=dealt, weights=weights))
        next_rank += len(slots)
    return Topology(generation=generation, tp_base=tp_base, units=dict(units), replicas=tuple(replicas))


def _slot_text(item: Any) -> str:
    """A slot as the config writes it (``1:3``), anything else as itself."""
    if isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, int) for x in item):
        return f"{item[0]}:{item[1]}"
    return repr(item)


def _slot_pair(what: str, item: Any, tp_base: int) -> tuple[int, int]:
    try:
        replica, slot = item
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a (replica, slot) pair, got {item!r}") from None
    _check_int(f"replica of {what} {_slot_text(item)}", replica, 0)
    _check_int(f"slot of {what} {_slot_text(item)}", slot, 0)
    if slot >= tp_base:
        raise ValueError(f"{what} {_slot_text(item)}: slot {slot} out of range 0..{tp_base - 1}")
    return replica, slot


def make_topology(tp_base: int, dp: int, units: Mapping[str, int], dead_slots: Iterable[tuple[int, int]] = (),
                  generation: int = 0, min_tp: int = 1, dropped: Iterable[int] = ()) -> Topology:
    """The starting topology: ``dp`` healthy replicas shrunk by ``dead_slots`` ((replica, slot) pairs), all
    dead at once, with the usual proxy and dealing rules; ranks 0, 1, ... go to live slots in (replica, slot)
    order. Replicas in ``dropped`` are not started (as if dropped by ``drop_replica``: the others keep their
    indices). A started replica with no slot or below ``min_tp`` is a configuration error (ValueError)."""
    _check_int("tp_base", tp_base, 1)
    _check_int("dp", dp, 1)
    _check_int("generation", generation, 0)
    _check_int("min_tp", min_tp, 1)
    if min_tp > tp_base:
        raise ValueError(f"ntp.min_tp ({min_tp}) must be <= tp_base ({tp_base})")
    _check_units(units, tp_base)
    gone = set()
    for replica in dropped:
        _check_int("dropped replica", replica, 0)
        if replica >= dp:
            raise ValueError(f"dropped replica {replica} out of range 0..{dp - 1}")
        gone.add(replica)
    if len(gone) == dp:
        raise ValueError(f"every replica (0..{dp - 1}) is dropped")
    dead: dict[int, set[int]] = {r: set() for r in range(dp)}
    for item in dead_slots:
        replica, slot = _slot_pair("dead slot", item, tp_base)
        if replica >= dp:
            raise ValueError(f"dead slot {_slot_text(item)}: replica {replica} out of range 0..{dp - 1}")
        if replica in gone:
            raise ValueError(f"dead slot {_slot_text(item)}: replica {replica} is dropped")
        dead[replica].add(slot)
    drafts = []
    for r in sorted(set(range(dp)) - gone):
        left = tp_base - len(dead[r])
        if not left:
            raise ValueError(f"replica {r} has no live slot: all {tp_base} slots are in dead_slots")
        if left < min_tp:
            raise ValueError(f"replica {r} starts with {left} live slots, below ntp.min_tp ({min_tp})")
        drafts.append(_shrink(_healthy(r, tp_base), dead[r], tp_base, units))
    return _build(generation, tp_base, units, drafts)


_SLOT_RE = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*(?:@\s*(\d+)\s*)?", re.ASCII)


def parse_stage_slots(items: Iterable[str | tuple[int, ...] | list[int]] | str | None
                      ) -> list[tuple[int, int, int]]:
    """Config form ``["1:3@1", "0:2"]`` -> ``[(1, 3, 1), (0, 2, 0)]``: (replica, slot, stage), the stage 0 when
    omitted, order kept.

    Also accepts one comma-separated string (``"1:3@1,0:2"``, handy on a command line), ``(replica, slot)`` pairs
    and ``(replica, slot, stage)`` triples already parsed, and None/empty for no dead slots. Range checks are
    :func:`make_topology`'s (and :func:`ntp_megatron.plan.stages.make_pipeline_topology`'s) job.
    """
    if items is None:
        return []
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    out: list[tuple[int, int, int]] = []
    written: dict[tuple[int, int, int], str] = {}

    def add(triple: tuple[int, int, int], item: Any) -> None:
        text = item.strip() if isinstance(item, str) else ":".join(map(str, item))
        if triple in written:
            same = f" ('{written[triple]}' and '{text}')" if written[triple] != text else ""
            raise ValueError(f"ntp.dead_slots: slot '{text}' is listed twice{same}")
        written[triple] = text
        out.append(triple)

    for item in items:
        if isinstance(item, str):
            match = _SLOT_RE.fullmatch(item)
            if match:
                add((int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)), item)
                continue
        elif (isinstance(item, (tuple, list)) and len(item) in (2, 3)
              and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in item)):
            add((item[0], item[1], item[2] if len(item) == 3 else 0), item)
            continue
        raise ValueError(f"ntp.dead_slots: expected 'replica:slot' like '1:3', or 'replica:slot@stage' like '1:3@1', "
                         f"got {item!r}")
    return out


def parse_dead_slots(items: Iterable[str | tuple[int, int] | list[int]] | str | None) -> list[tuple[int, int]]:
    """Config form ``["1:3", "0:2"]`` -> ``[(1, 3), (0, 2)]``, order kept (:func:`parse_stage_slots` without
    stages: ``@0`` may be written, any other stage is refused)."""
    out = []
    for replica, slot, stage in parse_stage_slots(items):
        if stage:
            raise ValueError(f"ntp.dead_slots: '{replica}:{slot}@{stage}' names stage {stage}, but the job has one "
                             "pipeline stage (parallel.pipeline_model_parallel_size 1): stages 0..0")
        out.append((replica, slot))
    return out


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy (ntp.on_unrecoverable) must be one of {list(POLICIES)}, got {policy!r}")


def next_topology(current: Topology, dead_ranks: Iterable[int], min_tp: int = 1,
                  policy: Policy = "drop_replica") -> Topology:
    """The topology of generation g+1 after process-group ranks ``dead_ranks`` of ``current`` died.

    Each replica that lost ranks shrinks stickily (survivors keep their units and proxy roles; the dead ranks'
    units are dealt to the survivors of their replica); healthy and untouched replicas keep their layout.
    Survivors are renumbered 0.. in (replica, slot) order. A replica left with no slot or below ``min_tp`` is
    dropped (policy "drop_replica"; the other replicas keep their indices) or raises :class:`TopologyError`
    (policy "stop"). Losing every replica raises :class:`TopologyError`.
    """
    _check_int("min_tp", min_tp, 1)
    _check_policy(policy)
    dead = _check_ranks(current, dead_ranks)
    drafts = []
    for rep in current.replicas:
        dying = {s for s, r in zip(rep.slots, rep.ranks) if r in dead}
        left = rep.width - len(dying)
        if left < min_tp:  # includes "no slot left", since min_tp >= 1
            if policy != "drop_replica":
                raise TopologyError(f"replica {rep.index} fell below ntp.min_tp ({min_tp}): {left} live slots "
                                    f"left after losing slots {sorted(dying)} (policy {policy!r})")
            continue
        drafts.append(_shrink(_draft_of(rep), dying, current.tp_base, current.units))
    if not drafts:
        raise TopologyError(f"no replica survives generation {current.generation}: every replica lost all its "
                            f"ranks or fell below ntp.min_tp ({min_tp})")
    return _build(current.generation + 1, current.tp_base, current.units, drafts)


def restart_layout(tp_base: int, dp: int, live_slots: Iterable[tuple[int, int]], min_tp: int = 1
                   ) -> tuple[list[int], list[tuple[int, int]]]:
    """What a job restarted from a checkpoint on the surviving processes starts as, in the starting
    configuration's terms ``(dropped replicas, dead slots)`` for :func:`make_topology`: each of the ``dp``
    replicas keeps the slots in ``live_slots`` ((replica, slot) pairs whose process is alive), and a replica left
    below ``min_tp`` is dropped (its share of the global batch goes to the others). Replicas keep their indices;
    TP groups never mix replicas (each is one fast domain). :class:`TopologyError` if no replica is left."""
    _check_int("tp_base", tp_base, 1)
    _check_int("dp", dp, 1)
    live: dict[int, set[int]] = {r: set() for r in range(dp)}
    for item in live_slots:
        replica, slot = _slot_pair("live slot", item, tp_base)
        if replica >= dp:
            raise ValueError(f"live slot {item!r}: replica {replica} out of range 0..{dp - 1}")
        live[replica].add(slot)
    dropped = [r for r in range(dp) if len(live[r]) < min_tp]
    if len(dropped) == dp:
        raise TopologyError(f"no replica keeps ntp.min_tp ({min_tp}) live slots: "
                            f"{ {r: len(live[r]) for r in range(dp)} } live slots per replica")
    dead = [(r, slot) for r in range(dp) if r not in dropped for slot in range(tp_base) if slot not in live[r]]
    return dropped, dead


def join_topology(current: Topology, joined_slots: Iterable[tuple[int, int]], min_tp: int = 1) -> Topology:
    """The topology of generation g+1 after new processes for ``joined_slots`` ((replica, slot) pairs) are
    admitted; all ranks are renumbered in (replica, slot) order.

    In a surviving replica each joined slot takes its canonical block back, its block's proxy role ends, the
    other proxies stay, and counts are rebalanced with the fewest moves (module docstring); a replica whose slots
    are all live again is canonical. A replica index absent from ``current`` (a dropped replica) comes back if
    its joined slots number at least ``min_tp`` (else :class:`TopologyError`), laid out like :func:`make_topology`
    with its other slots dead. Joining a slot that is live, or listing one twice, is a ValueError.
    """
    _check_int("min_tp", min_tp, 1)
    joining: dict[int, set[int]] = {}
    for item in joined_slots:
        replica, slot = _slot_pair("joined slot", item, current.tp_base)
        if current.rank_of(replica, slot) is not None:
            raise ValueError(f"joined slot {item!r} is already live in generation {current.generation}")
        if slot in joining.get(replica, ()):
            raise ValueError(f"joined slot {item!r} is listed twice")
        joining.setdefault(replica, set()).add(slot)
    drafts = []
    for rep in current.replicas:
        slots = joining.pop(rep.index, set())
        drafts.append(_widen(_draft_of(rep), slots, current.tp_base, current.units) if slots else _draft_of(rep))
    for index, slots in sorted(joining.items()):  # what is left: dropped replicas coming back
        if len(slots) < min_tp:
            raise TopologyError(f"dropped replica {index} would come back with {len(slots)} slots, below "
                                f"ntp.min_tp ({min_tp})")
        dying = set(range(current.tp_base)) - slots
        drafts.append(_shrink(_healthy(index, current.tp_base), dying, current.tp_base, current.units))
    return _build(current.generation + 1, current.tp_base, current.units, drafts)


def rebalanced_topology(current: Topology, weights: Mapping[int, Mapping[int, int]]) -> Topology:
    """The topology of generation g+1 in which each replica listed in ``weights`` (replica index -> live slot ->
    positive weight; an empty mapping: its slots alike again) shares every family in proportion to its slots'
    weights, with the fewest moves (module docstring, "Weighted dealing"): a slow slot lends units of its block to
    the others of its replica, as a dead slot's units are dealt. Nothing else changes: no slot dies or joins, proxies
    and sync groups stay, other replicas keep their layout. A replica with every slot live and its slots alike again
    is canonical (lent units go home)."""
    drafts = {rep.index: _draft_of(rep) for rep in current.replicas}
    for index, given in weights.items():
        rep = current.replica(index)
        if given and sorted(given) != list(rep.slots):
            raise ValueError(f"replica {index}: weights must name exactly its live slots {list(rep.slots)}, got "
                             f"{sorted(given)}")
        for slot, weight in given.items():
            _check_int(f"replica {index}: weight of slot {slot}", weight, 1)
        even = len(set(given.values())) <= 1
        if even and rep.width == current.tp_base:
            drafts[index] = _healthy(index, current.tp_base)
            continue
        index, slots, proxies, dealt, _ = drafts[index]
        drafts[index] = _fit((index, slots, proxies, dealt, {} if even else dict(given)), current.tp_base,
                             current.units)
    return _build(current.generation + 1, current.tp_base, current.units, drafts.values())


def _check_ranks(topology: Topology, ranks: Iterable[int]) -> frozenset[int]:
    out = set()
    for rank in ranks:
        topology._locate(rank)  # raises ValueError for a rank that is not live
        out.add(rank)
    return frozenset(out)


# ---------------------------------------------------------------------------------------------------------------
# Transition plans


@dataclass(frozen=True)
class Move:
    """One unit that a new-generation rank must receive because the surviving process at its slot lacks it."""

    family: str
    unit: int
    replica: int
    """Replica index whose new layout needs the unit."""
    dst: int
    """New-generation rank that must hold it."""
    src: int | None
    """Old-generation rank of the same replica that holds it and survives; None if no survivor there does."""
    peer: int | None
    """When ``src`` is None: old-generation rank of another surviving replica holding the unit (a replica that
    was healthy in the old generation first, then the lowest replica index); None otherwise."""

    def __post_init__(self) -> None:
        if (self.src is None) == (self.peer is None):
            raise ValueError(f"a move needs exactly one of src and peer, got src={self.src!r} peer={self.peer!r}")

    def to_json(self) -> dict:
        return {"family": self.family, "unit": self.unit, "replica": self.replica, "dst": self.dst,
                "src": self.src, "peer": self.peer}

    @classmethod
    def from_json(cls, d: dict) -> "Move":
        _expect_keys("move", d, ("family", "unit", "replica", "dst", "src", "peer"))
        return cls(**d)


def survivor_ranks(old: Topology, new: Topology, dead_ranks: Iterable[int] = ()) -> dict[int, int]:
    """Old rank -> new rank for every process that lives on into ``new``.

    A process is identified by (replica index, slot): it survives if its slot is live in both generations and
    its old rank is not in ``dead_ranks`` (a slot that died and was refilled at once is a new process).
    """
    dead = _check_ranks(old, dead_ranks)
    out = {}
    for rep in old.replicas:
        for slot, rank in zip(rep.slots, rep.ranks):
            new_rank = new.rank_of(rep.index, slot)
            if rank not in dead and new_rank is not None:
                out[rank] = new_rank
    return out


def transition_plan(old: Topology, new: Topology, dead_ranks: Iterable[int] = ()) -> list[Move]:
    """Every (family, unit, replica, dst) whose holder changes from ``old`` to ``new``, sorted by
    (family, replica, unit).

    A unit the surviving process at dst's (replica, slot) already holds produces no move, so the plan is minimal.
    The source is the surviving process of the same replica holding the unit (``src``) if there is one, else a
    surviving process of another replica (``peer``): a replica healthy in ``old`` first, then the lowest replica
    index. Works for shrinking (after :func:`next_topology`) and widening (after :func:`join_topology`). Raises
    :class:`TopologyError` if some needed unit has no surviving holder at all.
    """
    if dict(old.units) != dict(new.units) or old.tp_base != new.tp_base:
        raise ValueError(f"old and new topologies describe different models: units {dict(old.units)} / "
                         f"{dict(new.units)}, tp_base {old.tp_base} / {new.tp_base}")
    survivors = survivor_ranks(old, new, dead_ranks)
    peer_order = sorted((rep.index for rep in old.replicas), key=lambda i: (not old.is_healthy(i), i))
    moves: list[Move] = []
    for family in sorted(new.units):
        # For each old replica: unit -> old rank holding it, restricted to processes that survive (so a dropped
        # replica offers nothing).
        held: dict[int, dict[int, int]] = {}
        for rep in old.replicas:
            held[rep.index] = {u: rank for rank, units in zip(rep.ranks, old._layouts[rep.index, family])
                               if rank in survivors for u in units}
        for rep in new.replicas:
            same = held.get(rep.index, {})
            peers = [held[i] for i in peer_order if i != rep.index]
            for dst, units in zip(rep.ranks, new._layouts[rep.index, family]):
                for unit in units:
                    src = same.get(unit)
                    if src is not None and survivors[src] == dst:
                        continue  # stays put
                    peer = None
                    if src is None:
                        peer = next((p[unit] for p in peers if unit in p), None)
                        if peer is None:
                            raise TopologyError(f"unit {unit} of family {family!r} has no surviving holder for "
                                                f"replica {rep.index}: restart from a checkpoint")
                    moves.append(Move(family, unit, rep.index, dst, src, peer))
    moves.sort(key=lambda mv: (mv.family, mv.replica, mv.unit))
    return moves
