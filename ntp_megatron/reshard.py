"""Moving units between layouts: parameters and optimizer state, from the ranks that hold them, by value.

When a replica's layout changes (a rank died and its units were dealt to the survivors, or a repaired rank
takes its block back), the new owner of a unit fetches it from a process that holds it — a survivor of the
same replica when there is one, else the rank holding the same canonical block in another replica
(:func:`ntp_megatron.layout.transition_plan`). Nothing is read from disk. Per (source, destination) pair one
message carries, for each TP-split parameter of each moved unit's family, the unit's slice of the parameter and
of every per-element optimizer state tensor (Adam's two moments, SGD's momentum), in an order both ends derive
from the topology and the parameter names alone; it is sent one parameter at a time (:func:`exchange`). Under
bf16 / fp16 the parameter travels as the fp32 main param the optimizer steps; the model's 16-bit copy is its
rounding (as after every step) and is rebuilt from it on arrival.

Everything a rank keeps (its own units, replicated parameters, step counters) is copied locally; the bytes on
the wire are exactly the units that moved.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ntp_megatron.layers import UnitShard
from ntp_megatron.layout import Topology, survivor_ranks, transition_plan

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


def plan_transfers(old: Topology, new: Topology, dead_old_ranks: Iterable[int]) -> list[Transfer]:
    """The moves of :func:`transition_plan`, grouped into one message per (source, destination) pair, with
    both ends numbered in the new generation."""
    dead = list(dead_old_ranks)
    survivors = survivor_ranks(old, new, dead)
    grouped: dict[tuple[int, int], list[Unit]] = defaultdict(list)
    for move in transition_plan(old, new, dead):
        source = move.src if move.src is not None else move.peer
        grouped[(survivors[source], move.dst)].append((move.family, move.unit))
    # A process new to the job (a replacement) also needs the replicated parameters, once: from the first survivor
    # that sends it units, else the first survivor.
    fresh = sorted(set(range(new.world_size)) - set(survivors.values()))
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
        self.params: list[tuple[str, torch.nn.Parameter, UnitShard]] = [
            (name, p, p.ntp_shard) for name, p in model.named_parameters() if hasattr(p, "ntp_shard")]
        self.replicated: list[torch.nn.Parameter] = [p for p in model.parameters() if not hasattr(p, "ntp_shard")]
        self.keys = keys if with_state else ()
        self.state = optimizer.optimizer.state if optimizer is not None else {}

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

    def unit_numel(self, family: str) -> int:
        """Elements one unit of ``family`` occupies in a message."""
        per_param = sum(s.outer * s.inner for _, _, s in self.params if s.family == family)
        return per_param * (1 + len(self.keys))

    def replicated_numel(self) -> int:
        return sum(p.numel() for p in self.replicated) * (1 + len(self.keys))

    def pieces(self, units: tuple[Unit, ...], replicated: bool = False) -> list[Optional[int]]:
        """The pieces one message is sent in, in order: None for every replicated parameter (with ``replicated``),
        then the index in :attr:`params` of each TP-split parameter of a family ``units`` has units of. Every
        rank's model has the same parameters, so both ends of a message cut it alike."""
        families = {family for family, _ in units}
        split = [i for i, (_, _, shard) in enumerate(self.params) if shard.family in families]
        return ([None] if replicated and self.replicated else []) + split

    def _local(self, units: tuple[Unit, ...], piece: int) -> list[int]:
        _, _, shard = self.params[piece]
        return [shard.units.index(u) for f, u in units if f == shard.family]

    def pack(self, units: tuple[Unit, ...], piece: Optional[int]) -> torch.Tensor:
        """One piece of a message (:meth:`pieces`): ``units`` of one parameter (or every replicated parameter),
        the tensor the optimizer steps then its state tensors, as fp32."""
        if piece is None:
            return torch.cat([t.reshape(-1) for p in self.replicated for t in self.moved(p)]).float()
        _, param, shard = self.params[piece]
        index = torch.tensor(self._local(units, piece), device=param.device)
        return torch.cat([tensor.view(shard.outer, len(shard.units), shard.inner).index_select(1, index).reshape(-1)
                          for tensor in self.moved(param)]).float()

    def piece_numel(self, units: tuple[Unit, ...], piece: Optional[int]) -> int:
        if piece is None:
            return self.replicated_numel()
        _, _, shard = self.params[piece]
        return shard.outer * len(self._local(units, piece)) * shard.inner * (1 + len(self.keys))

    def numel(self, units: tuple[Unit, ...], replicated: bool = False) -> int:
        return sum(self.unit_numel(family) for family, _ in units) + (self.replicated_numel() if replicated else 0)

    def unpack(self, units: tuple[Unit, ...], piece: Optional[int], buffer: torch.Tensor) -> None:
        offset = 0
        if piece is None:
            for param in self.replicated:
                for tensor in self.moved(param):
                    tensor.view(-1).copy_(buffer[offset:offset + tensor.numel()])
                    offset += tensor.numel()
                if optimizer_param(param) is not param:
                    param.data.copy_(optimizer_param(param).data)
        else:
            _, param, shard = self.params[piece]
            local = self._local(units, piece)
            index = torch.tensor(local, device=param.device)
            for tensor in self.moved(param):
                size = shard.outer * len(local) * shard.inner
                chunk = buffer[offset:offset + size].view(shard.outer, len(local), shard.inner).to(tensor.dtype)
                shard.view(tensor).index_copy_(1, index, chunk)
                offset += size
            main = optimizer_param(param)
            if main is not param:  # the 16-bit parameter: its main param's new units, rounded
                shard.view(param.data).index_copy_(1, index, shard.view(main.data).index_select(1, index).to(param.dtype))
        assert offset == buffer.numel(), f"piece of {buffer.numel()} elements, {offset} used"


def copy_kept(old: UnitTensors, new: UnitTensors, old_model: torch.nn.Module, new_model: torch.nn.Module) -> None:
    """Into a rebuilt model and optimizer: every unit this rank already held, every replicated parameter and its
    state, and the step counters (which every parameter shares)."""
    old_by_name = dict(old_model.named_parameters())
    step = _any_step(old.state)
    for name, param in new_model.named_parameters():
        before = old_by_name[name]
        if step is not None:
            new.state[optimizer_param(param)]["step"] = step.clone()
        shard: Optional[UnitShard] = getattr(param, "ntp_shard", None)
        if shard is None:
            for target, source in zip(new.tensors(param), old.tensors(before)):
                target.copy_(source)
            continue
        previous: UnitShard = before.ntp_shard
        kept = [(i, previous.units.index(u)) for i, u in enumerate(shard.units) if u in previous.units]
        if not kept:
            continue
        dst, src = (torch.tensor(x, device=param.device) for x in zip(*kept))
        for target, source in zip(new.tensors(param), old.tensors(before)):
            view = source.view(previous.outer, len(previous.units), previous.inner)
            target.view(shard.outer, len(shard.units), shard.inner).index_copy_(1, dst, view.index_select(1, src))


def _any_step(state) -> Optional[torch.Tensor]:
    for entry in state.values():
        if "step" in entry:
            step = entry["step"]
            return step if isinstance(step, torch.Tensor) else torch.tensor(float(step))
    return None


def set_step(tensors: UnitTensors, steps: int) -> None:
    """Adam's step counter on every parameter of a freshly built optimizer (a process that holds no old one)."""
    for entry in tensors.state.values():
        entry["step"] = torch.tensor(float(steps))


def init_state(model: torch.nn.Module, tensors: UnitTensors) -> None:
    """Create zeroed per-element state for every parameter of a freshly built optimizer (filled afterwards)."""
    for param in model.parameters():
        main = optimizer_param(param)
        tensors.state[main] = {key: torch.zeros_like(main.data) for key in tensors.keys}


def exchange(transfers: list[Transfer], rank: int, old: Optional[UnitTensors], new: Optional[UnitTensors],
             group: Optional[dist.ProcessGroup] = None) -> int:
    """Run this rank's side of every transfer (sends from ``old``, receives into ``new``), one piece
    (:meth:`UnitTensors.pieces`) at a time, in the order of ``transfers``; returns the bytes received.

    Every rank walks the same list in the same order, so the earliest piece not yet moved always has both its
    ends at it: nothing waits in a cycle. One piece in flight bounds the messages a rank holds at once to its
    largest piece (:func:`largest_piece_bytes`: one parameter's units and their state), where posting every
    message at once would hold all it sends and receives — on a healthy rank that sends a dead rank's whole
    block, about three quarters of its own state again."""
    received = 0
    for t in transfers:
        if t.dst == rank:
            for piece in new.pieces(t.units, t.replicated):
                buffer = torch.empty(new.piece_numel(t.units, piece), dtype=torch.float32, device=_device(new))
                dist.recv(buffer, src=t.src, group=group)
                new.unpack(t.units, piece, buffer)
                received += buffer.numel() * buffer.element_size()
        elif t.src == rank:
            for piece in old.pieces(t.units, t.replicated):
                dist.send(old.pack(t.units, piece), dst=t.dst, group=group)
    return received


def largest_piece_bytes(transfers: list[Transfer], rank: int, old: Optional[UnitTensors],
                        new: Optional[UnitTensors]) -> int:
    """The largest message piece :func:`exchange` holds on ``rank`` (fp32), 0 if it sends and receives none."""
    sizes = [0]
    for t in transfers:
        side = new if t.dst == rank else old if t.src == rank else None
        if side is not None:
            sizes += [side.piece_numel(t.units, piece) for piece in side.pieces(t.units, t.replicated)]
    return 4 * max(sizes)


def _device(tensors: UnitTensors) -> torch.device:
    return tensors.params[0][1].device


def lower_bound_bytes(old: Topology, new: Topology, dead_old_ranks: Iterable[int], unit_numel: dict[str, int],
                      element_size: int = 4) -> int:
    """Bytes that any re-formation must move: every unit the dead ranks held, in replicas that live on."""
    live = {rep.index for rep in new.replicas}
    total = 0
    for rank in dead_old_ranks:
        if old.replica_of(rank).index not in live:
            continue
        for family, per_unit in unit_numel.items():
            total += len(old.units_of(rank, family)) * per_unit * element_size
    return total


def join_lower_bound_bytes(new: Topology, joined: list[tuple[int, int]], unit_numel: dict[str, int],
                           element_size: int = 4) -> int:
    """Bytes that admitting ``joined`` (replica, slot) pairs must move at least: every unit the new processes
    hold in ``new``, since they start with none — their canonical blocks, and more where their replica still lacks
    slots (a process that brings a dropped replica back alone holds all of its units)."""
    return sum(len(new.units_of(new.rank_of(replica, slot), family)) * per_unit * element_size
               for replica, slot in joined for family, per_unit in unit_numel.items())
