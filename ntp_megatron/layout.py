"""Layout math for Nonuniform Tensor Parallelism: pure Python, no torch.

Vocabulary (DESIGN.md §2): a *replica* is one DP replica (one TP group); a *slot* is a position
0..tp_base-1 in its nominal TP group; a *unit* is the smallest movable piece of a TP-split family (one head or
query group, one FFN hidden unit, one vocabulary row); a *layout* says which units each live rank of a replica
holds; a *topology* is a generation, the replicas with their live ranks, and (implicitly) the layouts.

Gradients of TP-split parameters are all-reduced across replicas in ``m`` *sync partitions*, ``m`` being the
smallest replica width (the *sync width*). In each replica, rank ``i < m`` is the *core* of sync partition
``i`` and holds only units of that partition; ranks ``>= m`` are *extras* holding the leftovers, which they
hand to the cores around the DP all-reduce. Everything here is a deterministic function of plain data, so
every process (and the controller) computes the same answer without talking to anyone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Iterable, Literal

__all__ = [
    "FAMILIES",
    "Move",
    "Replica",
    "Topology",
    "TopologyError",
    "balanced_counts",
    "join_topology",
    "make_topology",
    "next_topology",
    "parse_dead_slots",
    "replica_layout",
    "survivor_ranks",
    "sync_partitions",
    "transition_plan",
]

FAMILIES = ("heads", "ffn", "vocab")
"""Unit families of a GPT model. heads: one attention head, or one query group (GQA) with its heads; ffn: one
FFN hidden unit (a row of fc1 — gate and up rows for a gated MLP — and the matching column of fc2); vocab: one
vocabulary row (embedding and output layer)."""

Policy = Literal["drop_replica", "fail"]
POLICIES: tuple[str, ...] = ("drop_replica", "fail")


class TopologyError(ValueError):
    """A failure NTP cannot absorb (a replica below ``ntp.min_tp`` under policy "fail", every replica gone, a
    unit with no surviving holder): the caller must take the restart-from-checkpoint path."""


def _check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """Reject bools and non-ints early: a float or a string here is always a caller bug."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# ---------------------------------------------------------------------------------------------------------------
# Unit-level layout math


def balanced_counts(num_units: int, width: int) -> list[int]:
    """Per-rank unit counts, larger first, differing by at most one: ``balanced_counts(8, 3) == [3, 3, 2]``.

    Rank ``i`` gets ``ceil((num_units - i) / width)`` units; the closed form is what makes a core's count never
    exceed its sync partition's size (see :func:`replica_layout`).
    """
    _check_int("num_units", num_units, 0)
    _check_int("width", width, 1)
    base, rest = divmod(num_units, width)
    return [base + 1 if i < rest else base for i in range(width)]


def sync_partitions(num_units: int, sync_width: int) -> list[list[int]]:
    """Contiguous blocks of unit ids with sizes ``balanced_counts(num_units, sync_width)``:
    ``sync_partitions(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]``."""
    _check_int("num_units", num_units, 0)
    _check_int("sync_width", sync_width, 1)
    return [list(block) for block in _partitions(num_units, sync_width)]


@lru_cache(maxsize=4096)
def _partitions(num_units: int, sync_width: int) -> tuple[tuple[int, ...], ...]:
    blocks, start = [], 0
    for size in balanced_counts(num_units, sync_width):
        blocks.append(tuple(range(start, start + size)))
        start += size
    return tuple(blocks)


def replica_layout(num_units: int, width: int, sync_width: int) -> list[list[int]]:
    """Unit ids held by each rank 0..width-1 of one replica of ``width`` live ranks, each list ascending.

    Counts are ``balanced_counts(num_units, width)``. Core rank ``i < sync_width`` holds the first
    ``counts[i]`` units of sync partition ``i``; extra ranks take the leftovers of the partitions (partition by
    partition, ascending) in rank order. ``width == sync_width`` gives exactly the sync partitions.

    A core always fits in its partition: ``counts[i] = ceil((N - i) / width) <= ceil((N - i) / sync_width)``
    = size of partition ``i``, because ``width >= sync_width`` and ``N - i > 0``.
    """
    # Validate before the cache: 8.0 == 8 would otherwise hit a cached entry and slip through.
    _check_int("num_units", num_units, 0)
    _check_int("width", width, 1)
    _check_int("sync_width", sync_width, 1)
    return [list(units) for units in _layout(num_units, width, sync_width)]


@lru_cache(maxsize=4096)
def _layout(num_units: int, width: int, sync_width: int) -> tuple[tuple[int, ...], ...]:
    """Cached core of replica_layout; callers pass ints already checked."""
    if width < sync_width:
        raise ValueError(f"replica width {width} is below the sync width {sync_width}: the sync width is the "
                         f"smallest replica width")
    if num_units < width:
        raise ValueError(f"{num_units} units cannot be spread over {width} ranks: every rank must hold at least "
                         f"one unit of each family")
    counts = balanced_counts(num_units, width)
    cores: list[tuple[int, ...]] = []
    leftovers: list[int] = []
    for i, block in enumerate(_partitions(num_units, sync_width)):
        if counts[i] > len(block):  # impossible by the docstring's argument; kept as a guard, not a path
            raise AssertionError(f"core {i} needs {counts[i]} units but partition {i} has {len(block)}")
        cores.append(block[:counts[i]])
        leftovers.extend(block[counts[i]:])
    extras, start = [], 0
    for count in counts[sync_width:]:
        extras.append(tuple(leftovers[start:start + count]))
        start += count
    assert start == len(leftovers)
    return tuple(cores) + tuple(extras)


# ---------------------------------------------------------------------------------------------------------------
# Topology


@dataclass(frozen=True)
class Replica:
    """One DP replica: its stable index, its live slots and the process-group rank of each in this generation."""

    index: int
    """Replica index 0..dp-1, stable for the whole job (the data order depends on it, never on the layout)."""
    slots: tuple[int, ...]
    """Live slots, ascending (slot = position 0..tp_base-1 in the nominal TP group)."""
    ranks: tuple[int, ...]
    """Process-group rank of each live slot in this generation, same order as ``slots``."""

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

    @property
    def width(self) -> int:
        """Live TP degree of this replica."""
        return len(self.slots)

    def to_json(self) -> dict:
        return {"index": self.index, "slots": list(self.slots), "ranks": list(self.ranks)}

    @classmethod
    def from_json(cls, d: dict) -> "Replica":
        _expect_keys("replica", d, ("index", "slots", "ranks"))
        return cls(index=d["index"], slots=tuple(d["slots"]), ranks=tuple(d["ranks"]))


def _expect_keys(what: str, d: Any, keys: tuple[str, ...]) -> None:
    if not isinstance(d, dict) or set(d) != set(keys):
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{what} JSON must have exactly the keys {list(keys)}, got {got}")


@dataclass(frozen=True)
class Topology:
    """Generation ``generation`` of the job: the surviving replicas (ascending index) and their live ranks.

    Layouts are not stored: they are a function of ``units`` and the replica widths, recomputed on demand, so a
    topology published in the store is small and cannot disagree with itself. Hashable (usable as a cache key).
    """

    generation: int
    tp_base: int
    units: dict[str, int]
    """Family -> number of units, e.g. ``{"heads": 8, "ffn": 256, "vocab": 256}``."""
    replicas: tuple[Replica, ...]

    def __post_init__(self) -> None:
        # Defensive copies: a frozen topology must not change because a caller mutates its own dict.
        object.__setattr__(self, "units", dict(self.units))
        object.__setattr__(self, "replicas", tuple(self.replicas))
        _check_int("generation", self.generation, 0)
        _check_int("tp_base", self.tp_base, 1)
        for family, count in self.units.items():
            if not isinstance(family, str) or not family:
                raise ValueError(f"unit family names must be non-empty strings, got {family!r}")
            _check_int(f"units[{family!r}]", count, 1)
        if not self.replicas:
            raise TopologyError("a topology needs at least one replica")
        indices = [rep.index for rep in self.replicas]
        if indices != sorted(set(indices)):
            raise ValueError(f"replica indices must be distinct and ascending, got {indices}")
        ranks = [r for rep in self.replicas for r in rep.ranks]
        if sorted(ranks) != list(range(len(ranks))):
            raise ValueError(f"process-group ranks must be exactly 0..{len(ranks) - 1}, got {ranks}")
        for rep in self.replicas:
            if rep.slots[-1] >= self.tp_base:
                raise ValueError(f"replica {rep.index}: slot {rep.slots[-1]} out of range 0..{self.tp_base - 1}")
            for family, count in self.units.items():
                if count < rep.width:
                    raise ValueError(f"family {family!r} has {count} units, fewer than the {rep.width} live ranks "
                                     f"of replica {rep.index}: every rank must hold at least one unit")

    def __hash__(self) -> int:
        return hash((self.generation, self.tp_base, tuple(sorted(self.units.items())), self.replicas))

    # -- basic queries ------------------------------------------------------------------------------------------

    @property
    def sync_width(self) -> int:
        """m: the smallest replica width, i.e. the number of sync partitions."""
        return min(rep.width for rep in self.replicas)

    @property
    def world_size(self) -> int:
        """Number of live ranks (processes) in this generation."""
        return sum(rep.width for rep in self.replicas)

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
        except KeyError:
            raise ValueError(f"no replica with index {index!r}; live replicas: {sorted(self._by_index)}") from None

    def replica_of(self, rank: int) -> Replica:
        """The replica that process-group rank ``rank`` belongs to."""
        return self._locate(rank)[0]

    def local_rank(self, rank: int) -> int:
        """Position of ``rank`` inside its replica: its TP rank (core if < sync_width, extra otherwise)."""
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

    def _locate(self, rank: int) -> tuple[Replica, int]:
        try:
            return self._where[rank]
        except (KeyError, TypeError):
            raise ValueError(f"rank {rank!r} is not live in generation {self.generation} "
                             f"(ranks 0..{self.world_size - 1})") from None

    def _units(self, family: str) -> int:
        try:
            return self.units[family]
        except KeyError:
            raise ValueError(f"unknown unit family {family!r}; this topology has {sorted(self.units)}") from None

    # -- layouts ------------------------------------------------------------------------------------------------

    def partitions(self, family: str) -> list[list[int]]:
        """The sync partitions of ``family``: ``sync_partitions(units[family], sync_width)``."""
        return sync_partitions(self._units(family), self.sync_width)

    def layout(self, family: str, replica: int) -> list[list[int]]:
        """Units of ``family`` held by each local rank of the replica with index ``replica``."""
        return replica_layout(self._units(family), self.replica(replica).width, self.sync_width)

    def units_of(self, rank: int, family: str) -> list[int]:
        """Units of ``family`` held by process-group rank ``rank``, ascending."""
        rep, pos = self._locate(rank)
        return list(_layout(self._units(family), rep.width, self.sync_width)[pos])

    def sync_groups(self) -> list[tuple[int, ...]]:
        """For each sync partition i: the ranks that are core i of every replica, ordered by replica index.

        These are the DP all-reduce groups for TP-split parameters; extra ranks are in none of them.
        """
        return [tuple(rep.ranks[i] for rep in self.replicas) for i in range(self.sync_width)]

    def partition_holders(self, family: str, replica: int, partition: int) -> list[tuple[int, list[int]]]:
        """Within one replica, ``(rank, units of sync partition `partition` it holds)`` for every rank holding
        some: the core first, then the extras in rank order. This is the in-replica gather/scatter around the DP
        all-reduce of partition ``partition``."""
        m = self.sync_width
        _check_int("partition", partition, 0)
        if partition >= m:
            raise ValueError(f"partition {partition} out of range 0..{m - 1} (sync width {m})")
        rep = self.replica(replica)
        block = set(_partitions(self._units(family), m)[partition])
        layout = _layout(self._units(family), rep.width, m)
        out = []
        for pos in (partition, *range(m, rep.width)):
            held = [u for u in layout[pos] if u in block]
            if held:
                out.append((rep.ranks[pos], held))
        return out

    # -- serialisation ------------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"generation": self.generation, "tp_base": self.tp_base, "units": dict(self.units),
                "replicas": [rep.to_json() for rep in self.replicas]}

    @classmethod
    def from_json(cls, d: dict) -> "Topology":
        _expect_keys("topology", d, ("generation", "tp_base", "units", "replicas"))
        if not isinstance(d["units"], dict) or not isinstance(d["replicas"], list):
            raise ValueError("topology JSON: 'units' must be an object and 'replicas' a list")
        return cls(generation=d["generation"], tp_base=d["tp_base"], units=dict(d["units"]),
                   replicas=tuple(Replica.from_json(r) for r in d["replicas"]))


def _build(generation: int, tp_base: int, units: dict[str, int],
           live: dict[int, list[int]]) -> Topology:
    """A topology whose ranks are numbered 0, 1, ... over live slots in (replica, slot) order."""
    replicas, next_rank = [], 0
    for index in sorted(live):
        slots = sorted(live[index])
        replicas.append(Replica(index, tuple(slots), tuple(range(next_rank, next_rank + len(slots)))))
        next_rank += len(slots)
    return Topology(generation=generation, tp_base=tp_base, units=dict(units), replicas=tuple(replicas))


def _check_units_fit(units: dict[str, int], live: dict[int, list[int]]) -> None:
    for family, count in units.items():
        _check_int(f"units[{family!r}]", count, 1)
        for index, slots in sorted(live.items()):
            if count < len(slots):
                raise ValueError(f"family {family!r} has {count} units, fewer than the {len(slots)} live ranks of "
                                 f"replica {index}: need at least one unit per rank")


def make_topology(tp_base: int, dp: int, units: dict[str, int], dead_slots: Iterable[tuple[int, int]] = (),
                  generation: int = 0, min_tp: int = 1) -> Topology:
    """The starting topology: replica r has slots 0..tp_base-1 minus its dead slots; ranks are assigned
    0, 1, 2, ... to live slots in (replica, slot) order. A replica that starts below ``min_tp`` is a
    configuration error here (there is no drop policy at launch)."""
    _check_int("tp_base", tp_base, 1)
    _check_int("dp", dp, 1)
    _check_int("generation", generation, 0)
    _check_int("min_tp", min_tp, 1)
    if min_tp > tp_base:
        raise ValueError(f"ntp.min_tp ({min_tp}) must be <= tp_base ({tp_base})")
    dead: set[tuple[int, int]] = set()
    for item in dead_slots:
        try:
            replica, slot = item
        except (TypeError, ValueError):
            raise ValueError(f"dead slot must be a (replica, slot) pair, got {item!r}") from None
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < dp:
            raise ValueError(f"dead slot {item!r}: replica {replica!r} out of range 0..{dp - 1}")
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < tp_base:
            raise ValueError(f"dead slot {item!r}: slot {slot!r} out of range 0..{tp_base - 1}")
        dead.add((replica, slot))
    live = {r: [s for s in range(tp_base) if (r, s) not in dead] for r in range(dp)}
    for r, slots in live.items():
        if not slots:
            raise ValueError(f"replica {r} has no live slot: all {tp_base} slots are in dead_slots")
        if len(slots) < min_tp:
            raise ValueError(f"replica {r} starts with {len(slots)} live slots, below ntp.min_tp ({min_tp})")
    _check_units_fit(units, live)
    return _build(generation, tp_base, units, live)


_SLOT_RE = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*", re.ASCII)


def parse_dead_slots(items: Iterable[str | tuple[int, int] | list[int]] | str | None) -> list[tuple[int, int]]:
    """Config form ``["1:3", "0:2"]`` -> ``[(1, 3), (0, 2)]``, order kept.

    Also accepts one comma-separated string (``"1:3,0:2"``, handy on a command line), ``(replica, slot)`` pairs
    already parsed, and None/empty for no dead slots. Range checks are :func:`make_topology`'s job.
    """
    if items is None:
        return []
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    out = []
    for item in items:
        if isinstance(item, str):
            match = _SLOT_RE.fullmatch(item)
            if match:
                out.append((int(match.group(1)), int(match.group(2))))
                continue
        elif (isinstance(item, (tuple, list)) and len(item) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in item)):
            out.append((item[0], item[1]))
            continue
        raise ValueError(f"ntp.dead_slots: expected 'replica:slot' like '1:3', got {item!r}")
    return out


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")


def next_topology(current: Topology, dead_ranks: Iterable[int], min_tp: int = 1,
                  policy: Policy = "drop_replica") -> Topology:
    """The topology of generation g+1 after process-group ranks ``dead_ranks`` of ``current`` died.

    Their slots are removed and survivors renumbered 0.. in (replica, slot) order. A replica left with no slot or
    below ``min_tp`` is dropped (policy "drop_replica"; the other replicas keep their indices) or raises
    :class:`TopologyError` (policy "fail"). Losing every replica raises :class:`TopologyError`.
    """
    _check_int("min_tp", min_tp, 1)
    _check_policy(policy)
    dead = _check_ranks(current, dead_ranks)
    live: dict[int, list[int]] = {}
    for rep in current.replicas:
        slots = [s for s, r in zip(rep.slots, rep.ranks) if r not in dead]
        if len(slots) < min_tp:  # includes "no slot left", since min_tp >= 1
            if policy == "fail":
                lost = [s for s, r in zip(rep.slots, rep.ranks) if r in dead]
                raise TopologyError(f"replica {rep.index} fell below ntp.min_tp ({min_tp}): {len(slots)} live "
                                    f"slots left after losing slots {lost}")
            continue
        live[rep.index] = slots
    if not live:
        raise TopologyError(f"no replica survives generation {current.generation}: every replica lost all its "
                            f"ranks or fell below ntp.min_tp ({min_tp})")
    return _build(current.generation + 1, current.tp_base, current.units, live)


def join_topology(current: Topology, joined_slots: Iterable[tuple[int, int]], min_tp: int = 1) -> Topology:
    """The topology of generation g+1 after processes for ``joined_slots`` ((replica, slot) pairs) are admitted.

    The rejoin counterpart of :func:`next_topology`: replicas widen again (a dropped replica index may come back
    if it reaches ``min_tp``), and all ranks are renumbered in (replica, slot) order.
    """
    _check_int("min_tp", min_tp, 1)
    live = {rep.index: list(rep.slots) for rep in current.replicas}
    for item in joined_slots:
        try:
            replica, slot = item
        except (TypeError, ValueError):
            raise ValueError(f"joined slot must be a (replica, slot) pair, got {item!r}") from None
        _check_int(f"replica of joined slot {item!r}", replica, 0)
        _check_int(f"slot of joined slot {item!r}", slot, 0)
        if slot >= current.tp_base:
            raise ValueError(f"joined slot {item!r}: slot {slot} out of range 0..{current.tp_base - 1}")
        if slot in live.get(replica, ()):
            raise ValueError(f"joined slot {item!r} is already live in generation {current.generation}")
        live.setdefault(replica, []).append(slot)
    for index, slots in live.items():
        if len(slots) < min_tp:
            raise TopologyError(f"replica {index} would rejoin with {len(slots)} slots, below ntp.min_tp ({min_tp})")
    _check_units_fit(current.units, live)
    return _build(current.generation + 1, current.tp_base, current.units, live)


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
    """When ``src`` is None: old-generation rank of another surviving replica holding the unit (lowest replica
    index first); None otherwise."""

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

    A unit the surviving process at dst's slot already holds produces no move, so the plan is minimal. Sources
    are survivors in the same replica when possible (fast in-replica links), else the holder in the surviving
    peer replica with the lowest index. Works for shrinking (after :func:`next_topology`) and widening (after
    :func:`join_topology`). Raises :class:`TopologyError` if some unit has no surviving holder at all.
    """
    if old.units != new.units or old.tp_base != new.tp_base:
        raise ValueError(f"old and new topologies describe different models: units {old.units} / {new.units}, "
                         f"tp_base {old.tp_base} / {new.tp_base}")
    survivors = survivor_ranks(old, new, dead_ranks)
    moves: list[Move] = []
    for family in sorted(new.units):
        # For each old replica: unit -> old rank holding it, restricted to processes that survive.
        held: dict[int, dict[int, int]] = {}
        for rep in old.replicas:
            held[rep.index] = {u: rank for rank in rep.ranks if rank in survivors
                               for u in old.units_of(rank, family)}
        for rep in new.replicas:
            same = held.get(rep.index, {})
            # Only survivors are in `held`, so a dropped replica offers nothing: peers are surviving replicas.
            peers = [held[index] for index in sorted(held) if index != rep.index]
            for dst, units in zip(rep.ranks, new.layout(family, rep.index)):
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
