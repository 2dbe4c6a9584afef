"""A degraded rank's part of the cross-replica gradient sync (:mod:`ntp_megatron.core.grad_sync` says why it is
shaped so): for every block it is the sync-group member of, a :class:`ntp_megatron.core.shadows.Shadow` with a healthy
slot-``s`` rank's buckets; its own units copied in, the pieces of dead blocks held by its replica peers gathered onto
the block's proxy (one packed message per peer and block, inside the replica), the shadows' upstream sync over the
sync groups in ascending block order, and the sums scattered back. Under the distributed optimizer the same transfers
fill the shadows' parameters and bring the gathered parameters back to the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel

from ntp_megatron import phases
from ntp_megatron.core.groups import NTPGroups
from ntp_megatron.core.shadows import Adoptable, Piece, Shadow, block_pieces, unit_view
from ntp_megatron.plan.layout import Topology


@dataclass(frozen=True)
class _Transfer:
    """One packed message inside a degraded replica: the pieces of ``block`` held by ``holder`` (a rank that
    is not the block's sync-group member), in parameter order."""

    block: int
    holder: int
    member: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def sum_over_replicas(groups: NTPGroups, value: torch.Tensor) -> torch.Tensor:
    """The sum over replicas of a value every rank of a replica holds alike (each replica counted once): an
    all-reduce in each sync group this rank is a member of (the results are equal; the first is returned)."""
    result = None
    for group in groups.sync.values():
        reduced = value.clone()
        dist.all_reduce(reduced, group=group)
        result = reduced if result is None else result
    return result


class DegradedSync:
    """The shadows of a degraded rank (block -> :class:`Shadow`, ascending: the blocks it serves) and the
    in-replica transfers between them and its replica peers."""

    def __init__(self, topology: Topology, rank: int, groups: NTPGroups, model: DistributedDataParallel,
                 params: list[tuple[str, torch.nn.Parameter]], tf_config, ddp_config,
                 adopt: dict[int, Adoptable], fill: bool) -> None:
        """``params``: the model's trained parameters by name, in order. ``adopt`` and ``fill``: as
        :class:`ntp_megatron.core.grad_sync.GradSync` takes them. On an error what was adopted goes back first."""
        self.topology, self.rank, self.groups = topology, rank, groups
        self.replica = topology.replica_of(rank).index
        self.tp_base = topology.tp_base
        self.distributed_optimizer = bool(ddp_config.use_distributed_optimizer)
        self.split = [(n, p.ntp_held_units) for n, p in params if hasattr(p, "ntp_held_units")]
        self.replicated = [(n, p) for n, p in params if not hasattr(p, "ntp_held_units")]
        self._by_name = dict(params)
        self._first = params[0][1]
        self.shadows: dict[int, Shadow] = {}
        self.own: dict[int, list[Piece]] = {}
        self.incoming: list[_Transfer] = []
        self.outgoing: list[_Transfer] = []
        try:
            self._plan(model, tf_config, ddp_config, adopt)
            if self.distributed_optimizer and fill:
                self.fill_shadows()
        except BaseException:
            self.close(hand_back=True)  # what was adopted goes back before the error goes on
            raise

    def _plan(self, model, tf_config, ddp_config, adopt: dict[int, Adoptable]) -> None:
        topo, rank = self.topology, self.rank
        for block in self.groups.sync:  # ascending
            self.shadows[block] = Shadow(model.module, topo, block, self.groups, tf_config, ddp_config,
                                         distributed_optimizer=self.distributed_optimizer, adopted=adopt.get(block))
            self.own[block] = block_pieces(topo, rank, block, self.split, self._device)
        replica = topo.replica(self.replica)
        for block in range(self.tp_base):
            member = topo.sync_member(self.replica, block)
            for holder in replica.ranks:
                if holder == member or (rank not in (holder, member)):
                    continue
                pieces = tuple(block_pieces(topo, holder, block, self.split, self._device))
                if not pieces:
                    continue
                transfer = _Transfer(block, holder, member, pieces)
                (self.incoming if rank == member else self.outgoing).append(transfer)

    @property
    def _device(self) -> torch.device:
        return self._first.main_grad.device

    def _model_units(self, piece: Piece, what: str) -> torch.Tensor:
        """This rank's units of ``piece``'s parameter as ``[outer, units, inner]``: gradient or value."""
        param = self._by_name[piece.name]
        return unit_view(param.main_grad if what == "grad" else param.data, piece.held, len(piece.held.units))

    def _pack(self, transfer: _Transfer, from_shadow: bool, what: str) -> torch.Tensor:
        parts = []
        for piece in transfer.pieces:
            if from_shadow:
                source, index = self.shadows[transfer.block].region(piece, what), piece.in_block
            else:
                source, index = self._model_units(piece, what), piece.local
            parts.append(source.index_select(1, index).reshape(-1))
        return torch.cat(parts)

    def _unpack(self, transfer: _Transfer, buffer: torch.Tensor, into_shadow: bool, what: str) -> None:
        offset = 0
        for piece in transfer.pieces:
            chunk = buffer[offset:offset + piece.numel].view(piece.held.outer, -1, piece.held.inner)
            offset += piece.numel
            if into_shadow:
                self.shadows[transfer.block].region(piece, what).index_copy_(1, piece.in_block, chunk)
            else:
                self._model_units(piece, what).index_copy_(1, piece.local, chunk)

    def _exchange(self, receive: list[_Transfer], send: list[_Transfer], to_member: bool,
                  what: str = "grad") -> None:
        """Post every receive and send of one direction, then complete them: receives land in the shadows
        (towards members) or in the model (back to holders). ``what``: gradients (fp32, as the buffers hold
        them) or parameter values (in the model's dtype)."""
        tag_base = 0 if to_member else self.tp_base
        tp = self.groups.tp
        dtype = torch.float32 if what == "grad" else self._first.dtype
        works = []
        for t in receive:
            buffer = torch.empty(t.numel, dtype=dtype, device=self._device)
            peer = t.holder if to_member else t.member
            works.append((t, buffer, dist.irecv(buffer, src=peer, group=tp, tag=tag_base + t.block)))
        sends = []
        for t in send:
            buffer = self._pack(t, from_shadow=not to_member, what=what)
            peer = t.member if to_member else t.holder
            sends.append((buffer, dist.isend(buffer, dst=peer, group=tp, tag=tag_base + t.block)))
        phases.posted_point_to_point(tp, len(works) + len(sends))  # torch counts each: not a collective
        for t, buffer, work in works:
            work.wait()
            self._unpack(t, buffer, into_shadow=to_member, what=what)
        for _, work in sends:
            work.wait()

    @torch.no_grad()
    def fill_shadows(self) -> None:
        """Under the distributed optimizer, before it is built (under bf16 it clones its fp32 main params from
        the shadows at construction): every shadow's parameters from the model — this rank's units of the block,
        the replica peers' units of it (received in the model's dtype), the replicated parameters."""
        for block, shadow in self.shadows.items():
            for piece in self.own[block]:
                shadow.region(piece, "param").index_copy_(
                    1, piece.in_block, self._model_units(piece, "param").index_select(1, piece.local))
            for name, param in self.replicated:
                shadow.params[name].data.copy_(param.data)
        self._exchange(self.incoming, self.outgoing, to_member=True, what="param")

    def sync(self, num_tokens: Optional[torch.Tensor]) -> None:
        """The gradient sync of a degraded rank (Megatron's ``finalize_model_grads`` for it): units into the
        shadows, the dead blocks' pieces to their proxies, each shadow's upstream sync, then (without the
        distributed optimizer) the sums back into the model and to the peers."""
        for block, shadow in self.shadows.items():
            shadow.ddp.zero_grad_buffer()
            for piece in self.own[block]:
                shadow.region(piece).index_copy_(
                    1, piece.in_block, self._model_units(piece, "grad").index_select(1, piece.local))
            for name, param in self.replicated:
                shadow.grads[name].copy_(param.main_grad)
        self._exchange(self.incoming, self.outgoing, to_member=True)
        for shadow in self.shadows.values():      # ascending block order on every rank
            shadow.ddp.finish_grad_sync()         # upstream: bucket by bucket over sync group `block`
        if num_tokens is not None:
            num_tokens.copy_(sum_over_replicas(self.groups, num_tokens))
            if num_tokens > 0:
                scaling = 1.0 / num_tokens        # upstream's arithmetic, so the bits match healthy ranks
                for shadow in self.shadows.values():
                    shadow.ddp.scale_gradients(scaling)
        if self.distributed_optimizer:
            return  # only the shards are reduced: the optimizer steps them in the shadows; nothing goes back
        for block, shadow in self.shadows.items():
            for piece in self.own[block]:
                self._model_units(piece, "grad").index_copy_(
                    1, piece.local, shadow.region(piece).index_select(1, piece.in_block))
        if self.shadows:
            first = next(iter(self.shadows.values()))
            for name, param in self.replicated:
                param.main_grad.copy_(first.grads[name])
        self._exchange(self.outgoing, self.incoming, to_member=False)

    def gather(self) -> None:
        """The parameter all-gather of a degraded rank (distributed optimizer): each shadow's, then the model's
        units from them, the peers' units sent back to them, the replicated parameters from the first shadow."""
        for shadow in self.shadows.values():      # ascending block order on every rank
            shadow.ddp.start_param_sync(force_sync=True)
        for block, shadow in self.shadows.items():
            for piece in self.own[block]:
                self._model_units(piece, "param").index_copy_(
                    1, piece.local, shadow.region(piece, "param").index_select(1, piece.in_block))
        first = self.shadows[next(iter(self.groups.sync))]
        for name, param in self.replicated:
            param.data.copy_(first.params[name].data)
        self._exchange(self.outgoing, self.incoming, to_member=False, what="param")

    def close(self, hand_back: bool = False) -> None:
        """Release the shadows (and, with them, this generation's sync groups); ``hand_back``: the formation did
        not complete, and the DDPs the shadows adopted go back to the objects they came from."""
        for shadow in self.shadows.values():
            shadow.close(hand_back)
        self.shadows = {}

    def adopted_blocks(self) -> dict[int, DistributedDataParallel]:
        """Block -> the DDP its shadow adopted (until :meth:`settle`)."""
        return {block: shadow.ddp for block, shadow in self.shadows.items() if shadow.adopted is not None}

    def settle(self) -> None:
        """The formation these objects were built for completed: the adopted DDPs are theirs for good."""
        for shadow in self.shadows.values():
            shadow.settle()
