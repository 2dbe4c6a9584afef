"""Moving units between layouts: parameters and optimizer state, from the ranks that hold them, by value.

When a replica's layout changes (a rank died and its units were dealt to the survivors, or a repaired rank
takes its block back), the new owner of a unit fetches it from a process that holds it — a survivor of the
same replica when there is one, else the rank holding the same canonical block in another replica
(:func:`ntp_megatron.plan.layout.transition_plan`). Nothing is read from disk. Per (source, destination) pair one
message carries, for each TP-split parameter of each moved unit's family, the unit's slice of the parameter and
of every per-element optimizer state tensor (Adam's two moments, SGD's momentum), in an order both ends derive
from the topology and the parameter names alone; it is sent one parameter at a time (:func:`exchange`). Under
bf16 / fp16 the parameter travels as the fp32 main param the optimizer steps; the model's 16-bit copy is its
rounding (as after every step) and is rebuilt from it on arrival.

Everything a rank keeps (its own units, replicated parameters, step counters) is copied locally; the bytes on
the wire are exactly the units that moved.

Under Megatron's distributed optimizer the state is sharded instead, and whole shards move rather than units
(:class:`ShardTensors`, :func:`plan_shard_transfers`): every parameter is gathered from the shards afterwards.
Both kinds of message go through one :func:`exchange`, one piece in flight at a time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

import torch
import torch.distributed as dist

from ntp_megatron.core.adam_step import read_step, write_step
from ntp_megatron.core.layers import HeldUnits
from ntp_megatron.plan.layout import Topology, survivor_ranks, transition_plan
from ntp_megatron.plan.stages import JobTopology
from ntp_megatron.plan.optimizer_shards import ShardId, shard_plan

Unit = tuple[str, int]  # (family, unit id)


def optimizer_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor the optimizer steps for ``param`` and keys its state by: under bf16 / fp16 Megatron's fp32
    copy (``main_param``), else the parameter itself."""
    main = getattr(param, "main_param", None)
    return param if main is None else main


def state_keys(optimizer_name: str) -> tuple[str, ...]:
    """Per-element optimizer state tensors, in message order."""
    return {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}[optimizer_name]


@dataclass(frozen=True)
class Transfer:
    """Units that new-generation rank ``src`` sends to new-generation rank ``dst``; with ``replicated``, also
    every replicated parameter and its state (for a process that holds nothing yet)."""

    src: int
    dst: int
    units: tuple[Unit, ...]
    replicated: bool = False


def plan_transfers(old: JobTopology, new: JobTopology, dead_old_ranks: Iterable[int]) -> list[Transfer]:
    """The moves of :func:`transition_plan`, grouped into one message per (source, destination) pair, with
    both ends numbered in the new generation: each stage's own, in stage order (nothing crosses stages)."""
    dead = list(dead_old_ranks)
    for rank in dead:
        old.stage_of(rank)  # a ValueError for a rank that is not live
    return [transfer for before, after in zip(old.stages, new.stages)
            for transfer in _stage_transfers(before, after, [r for r in dead if r in before.ranks])]


def _stage_transfers(old: Topology, new: Topology, dead: list[int]) -> list[Transfer]:
    """:func:`plan_transfers` of one stage."""
    survivors = survivor_ranks(old, new, dead)
    grouped: dict[tuple[int, int], list[Unit]] = defaultdict(list)
    for move in transition_plan(old, new, dead):
        source = move.src if move.src is not None else move.peer
        grouped[(survivors[source], move.dst)].append((move.family, move.unit))
    # A process new to the job (a replacement) also needs the replicated parameters, once: from the first survivor
    # that sends it units, else the first survivor.
    fresh = sorted(set(new.ranks) - set(survivors.values()))
    replicated_from: set[tuple[int, int]] = set()
    for dst in fresh:
        src = next((s for (s, d) in sorted(grouped) if d == dst), min(survivors.values()))
        grouped.setdefault((src, dst), [])
        replicated_from.add((src, dst))
    return [Transfer(src, dst, tuple(sorted(units)), replicated=(src, dst) in replicated_from)
            for (src, dst), units in sorted(grouped.items())]


class UnitTensors:
    """One rank's TP-split parameters and their optimizer state, addressable by unit."""

    def __init__(self, model: torch.nn.Module, optimizer, keys: tuple[str, ...], with_state: bool) -> None:
        self.params: list[tuple[str, torch.nn.Parameter, HeldUnits]] = [
            (name, p, p.ntp_held_units) for name, p in model.named_parameters() if hasattr(p, "ntp_held_units")]
        self.replicated: list[torch.nn.Parameter] = [p for p in model.parameters() if not hasattr(p, "ntp_held_units")]
        self.keys = keys if with_state else ()
        self.optimizer: Optional[torch.optim.Optimizer] = optimizer.optimizer if optimizer is not None else None
        """The torch optimizer inside Megatron's."""
        self.state = self.optimizer.state if self.optimizer is not None else {}

    def tensors(self, param: torch.nn.Parameter) -> list[torch.Tensor]:
        """Every per-element tensor of ``param`` this rank holds: the parameter, its fp32 main param (bf16 /
        fp16), then its state tensors in ``keys`` order."""
        main = optimizer_param(param)
        return [param.data, *([main.data] if main is not param else []), *self._state(main)]

    def moved(self, param: torch.nn.Parameter) -> list[torch.Tensor]:
        """What a message carries for ``param``: the tensor the optimizer steps, then its state tensors."""
        main = optimizer_param(param)
        return [main.data, *self._state(main)]

    def _state(self, main: torch.Tensor) -> list[torch.Tensor]:
        return [self.state[main][key] for key in self.keys]

    @property
    def device(self) -> torch.device:
        return self.params[0][1].device

    def unit_numel(self, family: str) -> int:
        """Elements one unit of ``family`` occupies in a message."""
        per_param = sum(s.outer * s.inner for _, _, s in self.params if s.family == family)
        return per_param * (1 + len(self.keys))

    def replicated_numel(self) -> int:
        return sum(p.numel() for p in self.replicated) * (1 + len(self.keys))

    def pieces(self, t: Transfer) -> list[Optional[int]]:
        """The pieces the message of ``t`` is sent in, in order: None for every replicated parameter (with
        ``t.replicated``), then the index in :attr:`params` of each TP-split parameter of a family ``t.units`` has
        units of. Every rank's model has the same parameters, so both ends of a message cut it alike."""
        families = {family for family, _ in t.units}
        split = [i for i, (_, _, held) in enumerate(self.params) if held.family in families]
        return ([None] if t.replicated and self.replicated else []) + split

    def _local(self, units: tuple[Unit, ...], piece: int) -> list[int]:
        _, _, held = self.params[piece]
        return [held.units.index(u) for f, u in units if f == held.family]

    def pack(self, t: Transfer, piece: Optional[int]) -> torch.Tensor:
        """One piece of a message (:meth:`pieces`): ``t.units`` of one parameter (or every replicated parameter),
        the tensor the optimizer steps then its state tensors, as fp32."""
        units = t.units
        if piece is None:
            return torch.cat([x.reshape(-1) for p in self.replicated for x in self.moved(p)]).float()
        _, param, held = self.params[piece]
        index = torch.tensor(self._local(units, piece), device=param.device)
        return torch.cat([tensor.view(held.outer, len(held.units), held.inner).index_select(1, index).reshape(-1)
                          for tensor in self.moved(param)]).float()

    def piece_numel(self, t: Transfer, piece: Optional[int]) -> int:
        if piece is None:
            return self.replicated_numel()
        _, _, held = self.params[piece]
        return held.outer * len(self._local(t.units, piece)) * held.inner * (1 + len(self.keys))

    def numel(self, units: tuple[Unit, ...], replicated: bool = False) -> int:
        return sum(self.unit_numel(family) for family, _ in units) + (self.replicated_numel() if replicated else 0)

    def unpack(self, t: Transfer, piece: Optional[int], buffer: torch.Tensor) -> None:
        units, offset = t.units, 0
        if piece is None:
            for param in self.replicated:
                for tensor in self.moved(param):
                    tensor.view(-1).copy_(buffer[offset:offset + tensor.numel()])
                    offset += tensor.numel()
                if optimizer_param(param) is not param:
                    param.data.copy_(optimizer_param(param).data)
        else:
            _, param, held = self.params[piece]
            local = self._local(units, piece)
            index = torch.tensor(local, device=param.device)
            for tensor in self.moved(param):
                size = held.outer * len(local) * held.inner
                chunk = buffer[offset:offset + size].view(held.outer, len(local), held.inner).to(tensor.dtype)
                held.view(tensor).index_copy_(1, index, chunk)
                offset += size
            main = optimizer_param(param)
            if main is not param:  # the 16-bit parameter: its main param's new units, rounded
                held.view(param.data).index_copy_(1, index, held.view(main.data).index_select(1, index).to(param.dtype))
        assert offset == buffer.numel(), f"piece of {buffer.numel()} elements, {offset} used"


def copy_kept(old: UnitTensors, new: UnitTensors, old_model: torch.nn.Module, new_model: torch.nn.Module) -> None:
    """Into a rebuilt model and optimizer: every unit this rank already held, every replicated parameter and its
    state, and the step counters (which every parameter shares)."""
    old_by_name = dict(old_model.named_parameters())
    step = read_step(old.optimizer) if old.optimizer is not None else None
    if step is not None:
        write_step(new.optimizer, step)
    for name, param in new_model.named_parameters():
        before = old_by_name[name]
        held: Optional[HeldUnits] = getattr(param, "ntp_held_units", None)
        if held is None:
            for target, source in zip(new.tensors(param), old.tensors(before)):
                target.copy_(source)
            continue
        previous: HeldUnits = before.ntp_held_units
        kept = [(i, previous.units.index(u)) for i, u in enumerate(held.units) if u in previous.units]
        if not kept:
            continue
        dst, src = (torch.tensor(x, device=param.device) for x in zip(*kept))
        for target, source in zip(new.tensors(param), old.tensors(before)):
            view = source.view(previous.outer, len(previous.units), previous.inner)
            target.view(held.outer, len(held.units), held.inner).index_copy_(1, dst, view.index_select(1, src))


def init_state(model: torch.nn.Module, tensors: UnitTensors) -> None:
    """Create zeroed per-element state for every parameter of a freshly built optimizer (filled afterwards)."""
    for param in model.parameters():
        main = optimizer_param(param)
        tensors.state[main] = {key: torch.zeros_like(main.data) for key in tensors.keys}


class Side(Protocol):
    """One end of the messages :func:`exchange` moves: how a transfer's message is cut into pieces (alike on both
    ends), and each piece packed (sender) or unpacked (receiver). :class:`UnitTensors` for units,
    :class:`ShardTensors` for distributed-optimizer shards."""

    def pieces(self, t) -> list: ...

    def piece_numel(self, t, piece) -> int: ...

    def pack(self, t, piece) -> torch.Tensor: ...

    def unpack(self, t, piece, buffer: torch.Tensor) -> None: ...

    @property
    def device(self) -> torch.device: ...


def exchange(transfers: list, rank: int, old: Optional[Side], new: Optional[Side],
             group: Optional[dist.ProcessGroup] = None) -> int:
    """Run this rank's side of every transfer (sends from ``old``, receives into ``new``; each has ``src`` and
    ``dst``), one piece (:meth:`Side.pieces`) at a time, in the order of ``transfers``; returns the bytes
    received.

    Every rank walks the same list in the same order, so the earliest piece not yet moved always has both its
    ends at it: nothing waits in a cycle. One piece in flight bounds the messages a rank holds at once to its
    largest piece (:func:`largest_piece_bytes`: one parameter's units and their state), where posting every
    message at once would hold all it sends and receives — on a healthy rank that sends a dead rank's whole
    block, about three quarters of its own state again."""
    received = 0
    for t in transfers:
        if t.dst == rank:
            for piece in new.pieces(t):
                buffer = torch.empty(new.piece_numel(t, piece), dtype=torch.float32, device=new.device)
                dist.recv(buffer, src=t.src, group=group)
                new.unpack(t, piece, buffer)
                received += buffer.numel() * buffer.element_size()
        elif t.src == rank:
            for piece in old.pieces(t):
                dist.send(old.pack(t, piece), dst=t.dst, group=group)
    return received


def largest_piece_bytes(transfers: list, rank: int, old: Optional[Side], new: Optional[Side]) -> int:
    """The largest message piece :func:`exchange` holds on ``rank`` (fp32), 0 if it sends and receives none."""
    sizes = [0]
    for t in transfers:
        side = new if t.dst == rank else old if t.src == rank else None
        if side is not None:
            sizes += [side.piece_numel(t, piece) for piece in side.pieces(t)]
    return 4 * max(sizes)


def own_lower_bound_bytes(old: Topology, new: Topology, old_rank: Optional[int], rank: int,
                          unit_numel: dict[str, int], replicated_numel: int, element_size: int = 4) -> int:
    """Bytes rank ``rank`` of ``new`` must receive at least (``old_rank``: the same process in ``old``, None for a
    process new to the job, or one whose old rank died): every unit it holds in ``new`` and did not hold in ``old``
    (a survivor keeps what it held; a dead rank's units all go to ranks that lack them), ``unit_numel`` elements
    each, and for a new process the replicated parameters too (``replicated_numel``). Each rank counts its own, with
    its own stage's tensor sizes; the sum over ranks is a re-formation's lower bound. Works within one stage's
    topologies or across whole ones (with or without stages: only ``units_of`` is asked)."""
    total = 0
    for family, per_unit in unit_numel.items():
        had = set(old.units_of(old_rank, family)) if old_rank is not None else set()
        total += len(set(new.units_of(rank, family)) - had) * per_unit
    if old_rank is None:
        total += replicated_numel
    return total * element_size


# -- distributed-optimizer shards -----------------------------------------------------------------------------
# Under Megatron's distributed optimizer a rank's state is its shard of each block it serves: one position's part
# of the block's canonical buckets, the same elements on every holder of that shard (one per instance: twins).
# A re-formation moves whole shards — the fp32 main parameter and the optimizer's per-element state of every piece
# in it — and no units: every rank's parameters are then gathered from the shards (``GradSync.param_gather``).


@dataclass(frozen=True)
class ShardTransfer:
    """Shards (block, position) that new-generation rank ``src`` sends to new-generation rank ``dst``."""

    src: int
    dst: int
    shards: tuple[ShardId, ...]


def plan_shard_transfers(old: Topology, new: Topology, dead_old_ranks: Iterable[int], dp: int,
                         instances: int) -> list[ShardTransfer]:
    """The moves of :func:`ntp_megatron.plan.optimizer_shards.shard_plan` (each new sync member's shard it did not hold:
    from its twin in another instance, or from its own replica's old holder), one message per (source,
    destination) pair, both numbered in the new generation. Raises ``ShardLostError`` if a shard has no
    holder left (the controller does not publish such a generation)."""
    dead = list(dead_old_ranks)
    survivors = survivor_ranks(old, new, dead)
    grouped: dict[tuple[int, int], list[ShardId]] = defaultdict(list)
    for move in shard_plan(old, new, dead, dp, instances):
        grouped[(survivors[move.src], move.dst)].append(move.shard)
    return [ShardTransfer(src, dst, tuple(sorted(shards))) for (src, dst), shards in sorted(grouped.items())]


def distributed_optimizer(optimizer):
    """The one ``DistributedOptimizer`` of a rank's optimizer (Megatron wraps it in a ``ChainedOptimizer``)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(parts) != 1:
        raise ValueError(f"expected one distributed optimizer, got a chain of {len(parts)}")
    return parts[0]


class ShardTensors:
    """One rank's shards, by block: for each block it serves (``sources``: block and the Megatron buffers that
    hold it, :meth:`ntp_megatron.core.grad_sync.GradSync.shard_sources`), the pieces of its shard bucket by bucket, each
    piece the dict of references Megatron's ``get_parameter_state_dp_reshardable`` gives (main param and state
    tensors, no copies), in the optimizer's ``gbuf_ranges`` order. Both holders of a shard have identical buffers
    (the block's canonical slot-shaped buckets, sharded over equal groups), so their pieces correspond one to one.

    A message (:class:`ShardTransfer`) is sent one parameter's piece at a time: the fp32 main parameter, then each
    state tensor of ``keys`` (Adam: ``exp_avg``, ``exp_avg_sq``). Adam's step is the same for every
    piece and every rank; it does not travel here."""

    def __init__(self, optimizer, sources: list[tuple[int, list]], keys: tuple[str, ...]) -> None:
        self.optimizer = distributed_optimizer(optimizer)
        self.keys = ("param", *keys)
        state = self.optimizer.get_parameter_state_dp_reshardable()
        block_of = {id(buffer): block for block, buffers in sources for buffer in buffers}
        self.buckets: dict[int, list[list[dict]]] = defaultdict(list)
        self.position: dict[int, int] = {}
        for index, buffer in enumerate(self.optimizer.buffers):
            block = block_of[id(buffer)]
            self.position[block] = buffer.data_parallel_group.rank()
            for buckets in state[index].values():
                self.buckets[block] += buckets

    @property
    def device(self) -> torch.device:
        return next(iter(self.buckets.values()))[0][0]["param"].device

    def _blocks(self, t: ShardTransfer) -> list[int]:
        for block, position in t.shards:
            if self.position.get(block) != position:
                raise RuntimeError(f"shard (block {block}, position {position}) moves, but this rank holds "
                                   f"position {self.position.get(block)} of block {block}")
        return [block for block, _ in t.shards]

    def pieces(self, t: ShardTransfer) -> list[tuple[int, int, int]]:
        """(block, bucket index, piece index) of every parameter's piece of the message, in order: one piece in
        flight holds one parameter's shard state, never a whole bucket's (Megatron's default bucket is 40 M
        elements: 480 MB of fp32 main params and moments)."""
        return [(block, i, j) for block in self._blocks(t) for i, bucket in enumerate(self.buckets[block])
                for j in range(len(bucket))]

    def piece_numel(self, t: ShardTransfer, piece: tuple[int, int, int]) -> int:
        block, i, j = piece
        return self.buckets[block][i][j]["param"].numel() * len(self.keys)

    def numel(self, block: int) -> int:
        """Parameter elements of this rank's shard of ``block`` (what one holder's state covers)."""
        return sum(p["param"].numel() for bucket in self.buckets[block] for p in bucket)

    def pack(self, t: ShardTransfer, piece: tuple[int, int, int]) -> torch.Tensor:
        block, i, j = piece
        p = self.buckets[block][i][j]
        return torch.cat([p[key].detach().reshape(-1).float() for key in self.keys])

    @torch.no_grad()
    def unpack(self, t: ShardTransfer, piece: tuple[int, int, int], buffer: torch.Tensor) -> None:
        block, i, j = piece
        p, offset = self.buckets[block][i][j], 0
        for key in self.keys:
            target = p[key]
            target.view(-1).copy_(buffer[offset:offset + target.numel()])
            offset += target.numel()
        assert offset == buffer.numel(), f"shard piece of {buffer.numel()} elements, {offset} used"

    @torch.no_grad()
    def copy_from(self, other: "ShardTensors", block: int) -> None:
        """This rank's shard of ``block`` from ``other`` (the same rank's old objects, which held the same shard:
        its old healthy optimizer, or an old shadow of the block at the same position), locally."""
        if other.position.get(block) != self.position[block]:
            raise RuntimeError(f"block {block}: the old objects hold position {other.position.get(block)}, the new "
                               f"ones position {self.position[block]}")
        ours, theirs = self.buckets[block], other.buckets[block]
        if [[p["param"].numel() for p in b] for b in ours] != [[p["param"].numel() for p in b] for b in theirs]:
            raise RuntimeError(f"block {block}: the old and the new shard are cut differently")
        for bucket, old_bucket in zip(ours, theirs):
            for p, q in zip(bucket, old_bucket):
                for key in self.keys:
                    p[key].copy_(q[key])


def main_param_of(optimizer, model_param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor a Megatron ``DistributedOptimizer`` steps for ``model_param`` (this rank's shard of it)."""
    group, order = optimizer.model_param_group_index_map[model_param]
    return optimizer.optimizer.param_groups[group]["params"][order]


@torch.no_grad()
def adopt_shard_state(new_optimizer, old_optimizer, params) -> frozenset[int]:
    """The shards' state of ``params`` (model parameters both distributed optimizers step: those of a DDP the new
    objects adopted) from the old optimizer into the new one, by reference: the new optimizer's state of each is
    the old tensors; its main parameter is the old one's view of the same buffer (fp32), or under bf16 / fp16 the
    old fp32 copy's values (the new optimizer cloned its own from the 16-bit model when it was built; Megatron
    keeps it in several places, so it is filled rather than swapped). Returns the ids of the new main parameters
    (which :func:`init_shard_state` must leave alone)."""
    new, old = distributed_optimizer(new_optimizer), distributed_optimizer(old_optimizer)
    adopted = set()
    for param in params:
        held = param in new.model_param_group_index_map
        if held != (param in old.model_param_group_index_map):
            raise RuntimeError("an adopted parameter has a piece in the shard of one optimizer and not the other's")
        if not held:  # no element of it in this rank's shard
            continue
        ours, theirs = main_param_of(new, param), main_param_of(old, param)
        if ours.shape != theirs.shape:
            raise RuntimeError(f"an adopted parameter's shard is {tuple(theirs.shape)} in the old optimizer and "
                               f"{tuple(ours.shape)} in the new one")
        if ours.data_ptr() != theirs.data_ptr():
            ours.copy_(theirs)
        new.optimizer.state[ours] = dict(old.optimizer.state[theirs])
        adopted.add(id(ours))
    return frozenset(adopted)


def point_main_params(optimizer, params) -> None:
    """Under bf16 / fp16 every model parameter names its fp32 main copy (``main_param``, which Megatron's QK
    clipping reads), and building a distributed optimizer over a parameter re-points it: after a formation that
    did not complete, the adopted parameters point at ``optimizer``'s copies (the old optimizer's) again."""
    opt = distributed_optimizer(optimizer)
    for param in params:
        if getattr(param, "main_param", None) is not None and param in opt.model_param_group_index_map:
            param.main_param = main_param_of(opt, param)


@torch.no_grad()
def init_shard_state(optimizer, keys: tuple[str, ...], step: Optional[int],
                     adopted: frozenset[int] = frozenset()) -> None:
    """A freshly built distributed optimizer's state before it is filled: every per-element state tensor of
    ``keys`` created (a fresh torch optimizer has none until its first step), Adam's ``step`` set (``step``:
    the steps its peers took), and every main parameter and state element NaN, so that an element no copy or
    message fills cannot pass unnoticed (the next loss is NaN). Main parameters in ``adopted`` (ids) keep the
    state :func:`adopt_shard_state` gave them."""
    inner = distributed_optimizer(optimizer).optimizer
    for group in inner.param_groups:
        for main in group["params"]:
            if id(main) in adopted:
                continue
            state = inner.state[main]
            for key in keys:
                state[key] = torch.full_like(main.data, float("nan"))
            main.data.fill_(float("nan"))
    if step is not None:
        write_step(inner, step)


def copy_main_params_to_model(optimizer) -> None:
    """Under bf16 / fp16: the model's 16-bit shard of the parameter buffer from the fp32 main params (Megatron's
    own copy, as after every step); with fp32 parameters the main params are views of the buffer already."""
    distributed_optimizer(optimizer)._copy_main_params_to_model_params()
