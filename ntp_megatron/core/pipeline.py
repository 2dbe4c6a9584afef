"""Stage boundaries under NTP: Megatron-Core's pipeline schedule with a communicator that knows each stage's width.

Megatron's ``P2PCommunicator`` sends to one rank and receives from one rank per direction, the neighbours in the
rank's pipeline group (TP rank ``i`` of one stage with TP rank ``i`` of the next). Under NTP two neighbouring
stages of a replica may have different TP degrees, so :class:`NTPP2PCommunicator` keeps upstream's schedule and
replaces only its transfer step (``_communicate``) by the pairing of :class:`ntp_megatron.plan.stages.JobTopology`:
one receive per direction, from a live rank of the same replica, and as many sends as there are ranks of the
neighbouring stage that take their tensor from this rank (none, one, or more). All transfers of one step are posted
together (``batch_isend_irecv``) on the generation's default group, then waited for.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from ntp_megatron.patches.parallel_state import PipelinePosition
from ntp_megatron.plan.stages import JobTopology


def _check_upstream() -> None:
    """The private method replaced below, as megatron-core 0.16's ``P2PCommunicator`` has it: a keyword-only
    ``_communicate`` taking these arguments (and returning the received tensors and the pending requests)."""
    want = ["self", "tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next", "tensor_shape", "wait_on_reqs"]
    got = list(inspect.signature(P2PCommunicator._communicate).parameters)
    if got != want:
        raise RuntimeError(f"NTPP2PCommunicator replaces P2PCommunicator._communicate({', '.join(want[1:])}), but "
                           f"this megatron-core has _communicate({', '.join(got[1:])}): written for 0.16.x")


class NTPP2PCommunicator(P2PCommunicator):
    """Upstream's communicator for ``rank`` of ``topology``: its position for the schedule, explicit peers for the
    transfers."""

    def __init__(self, topology: JobTopology, rank: int, config, device: torch.device) -> None:
        _check_upstream()
        # Not upstream's __init__: it looks for one next and one previous rank in a pipeline group.
        stage = topology.stage_of(rank).stage
        self.pp_group = PipelinePosition(stage, topology.num_stages)
        self.config = config
        self.virtual_pipeline_model_parallel_size = None
        self.next_rank = self.prev_rank = None
        self.device = device
        self.forward_from: Optional[int] = topology.receives_from(rank, "forward")
        self.forward_to: list[int] = topology.sends_to(rank, "forward")
        self.backward_from: Optional[int] = topology.receives_from(rank, "backward")
        self.backward_to: list[int] = topology.sends_to(rank, "backward")

    def _communicate(self, *, tensor_send_next: Optional[torch.Tensor], tensor_send_prev: Optional[torch.Tensor],
                     recv_prev: bool, recv_next: bool, tensor_shape, wait_on_reqs: bool = True):
        """Upstream's contract, with every transfer waited for before returning (``wait_on_reqs=False`` asks for
        pending requests back; the 1F1B schedule never does, and waiting is always correct: no requests are
        returned)."""
        config = self.config
        if (recv_prev or recv_next) and (config.pipeline_dtype is None or tensor_shape is None):
            raise RuntimeError("receiving at a stage boundary needs config.pipeline_dtype and a tensor shape")
        if config.variable_seq_lengths or getattr(config, "mtp_standalone", False):
            raise RuntimeError("NTP stage boundaries carry fixed shapes only (no variable sequence lengths)")

        def receive_buffer() -> torch.Tensor:
            return torch.empty(tensor_shape, requires_grad=True, device=self.device, dtype=config.pipeline_dtype)

        received_prev = received_next = None
        ops = []
        if tensor_send_prev is not None:  # an input gradient, to the ranks of the previous stage that take it
            ops += [dist.P2POp(dist.isend, tensor_send_prev, peer) for peer in self.backward_to]
        if recv_prev:  # an activation from the previous stage
            received_prev = receive_buffer()
            ops.append(dist.P2POp(dist.irecv, received_prev, _peer(self.forward_from, "forward")))
        if tensor_send_next is not None:  # an activation, to the ranks of the next stage that take it
            ops += [dist.P2POp(dist.isend, tensor_send_next, peer) for peer in self.forward_to]
        if recv_next:  # an output gradient from the next stage
            received_next = receive_buffer()
            ops.append(dist.P2POp(dist.irecv, received_next, _peer(self.backward_from, "backward")))
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
        if ops and self.device.type == "cuda" and config.batch_p2p_sync:
            torch.cuda.synchronize()  # upstream's guard against batch_isend_irecv's race
        return received_prev, received_next, None


def _peer(rank: Optional[int], direction: str) -> int:
    if rank is None:
        raise RuntimeError(f"the schedule asked for a {direction} receive at the end of the pipeline")
    return rank


class TiedEmbeddingSync:
    """Tied word embeddings across pipeline stages under NTP: the first stage's embedding and the last stage's output
    layer are two copies of one weight, and each copy's gradient must be the sum of both uses.

    Upstream all-reduces the two copies' whole local tensors over the embedding group, which needs equal vocabulary
    slices at both ends; here the two ends of a replica may hold different units (different widths, dealt units). Every
    vocabulary unit has exactly one holder in each end stage of a replica: the holders swap that unit's rows of the
    unsynced gradient and each adds the other's (a + b on one side, b + a on the other: the same bits, addition
    commutes), before the cross-replica sync, which then runs on equal copies. Messages go between the ranks that share units, one per
    pair and direction, on the generation's default group."""

    def __init__(self, topology: JobTopology, rank: int, weight: torch.nn.Parameter) -> None:
        stage = topology.stage_of(rank)
        other = topology.stages[-1] if stage.stage == 0 else topology.stages[0]
        replica = stage.replica_of(rank).index
        mine = list(weight.ntp_held_units.units)  # local rows in this order
        row = {unit: i for i, unit in enumerate(mine)}
        self.weight = weight
        self.peers: list[tuple[int, torch.Tensor]] = []
        """(peer rank, local rows of the units both hold, ascending units): the same units in the same order at
        both ends."""
        for peer in other.replica(replica).ranks:
            shared = sorted(set(mine) & set(other.units_of(peer, "vocab")))
            if shared:
                self.peers.append((peer, torch.tensor([row[u] for u in shared], dtype=torch.long)))

    @torch.no_grad()
    def exchange(self) -> None:
        grad = self.weight.main_grad
        outgoing = [grad.index_select(0, rows.to(grad.device)) for _, rows in self.peers]
        incoming = [torch.empty_like(part) for part in outgoing]
        ops = [dist.P2POp(dist.isend, part, peer) for (peer, _), part in zip(self.peers, outgoing)]
        ops += [dist.P2POp(dist.irecv, part, peer) for (peer, _), part in zip(self.peers, incoming)]
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
        for (_, rows), mine, theirs in zip(self.peers, outgoing, incoming):
            grad.index_copy_(0, rows.to(grad.device), mine + theirs)


def tied_embedding_sync(topology: Optional[JobTopology], rank: int, model: torch.nn.Module
                        ) -> Optional[TiedEmbeddingSync]:
    """The exchange for ``rank``'s copy of tied word embeddings (an NTP GPT model, unwrapped) in ``topology`` (the
    whole generation), or None: no stages, untied embeddings, or a middle stage."""
    if topology is None or topology.num_stages == 1:
        return None
    if not getattr(model, "share_embeddings_and_output_weights", False):
        return None
    weight = model.shared_embedding_or_output_weight()
    return TiedEmbeddingSync(topology, rank, weight) if weight is not None else None
