"""Cross-replica gradient sync under NTP: canonical blocks in Megatron's own flat buckets.

Every TP-split tensor is cut into ``tp_base`` canonical blocks of units (block ``s`` is what slot ``s`` of a
healthy replica holds). Gradients of block ``s`` are summed in sync group ``s``, which has one member per
replica (see :mod:`ntp_megatron.core.groups`):

* A rank of a **healthy** replica holds exactly block ``s``. Its DDP buckets are those of plain Megatron-Core
  at slot ``s``, its data-parallel group is sync group ``s``, and upstream's ``finalize_model_grads`` syncs
  it — same buckets, same collectives, same overlap. NTP adds nothing to its step.
* A rank of a **degraded** replica holds its own block plus units dealt from dead slots' blocks, so its own
  buckets line up with nobody's. For every block it is the sync-group member of (its slot's block, and each
  dead block it is the proxy of) it keeps a *shadow*: Megatron's own ``DistributedDataParallel`` built over
  meta-device parameters of the slot-``s`` shapes, whose flat buckets therefore match a healthy slot-``s``
  rank's byte for byte. After backward it copies its units into the shadows, gathers the pieces of dead
  blocks held by its replica peers (one packed message per peer and block, inside the replica), lets the
  shadow's upstream ``finish_grad_sync`` all-reduce bucket by bucket over the sync group in creation order,
  then copies the sums back and returns the peers' pieces. The cost lands where the failure is.

:class:`GradSync` is the one object a rank registers with Megatron, and the healthy path; a degraded rank's part
is :class:`ntp_megatron.core.degraded_sync.DegradedSync`, over the shadows of :mod:`ntp_megatron.core.shadows`; the
grad norm's tables are :mod:`ntp_megatron.core.grad_norm`.

Rules every member of a group follows, whatever its own layout:

* Buckets go out in creation order (:mod:`ntp_megatron.patches.distributed_param_and_grad_buffer`); a rank
  in several sync groups serves them in ascending block order, which cannot deadlock.
* Every data-parallel collective is repeated in each group a rank is a member of (the bucket syncs, the
  token count, the loss for the log). The loss is per token, so gradients are divided by the token count of
  the global batch; no ``1/dp`` factor is involved.
* Replicated parameters (norms, row-parallel biases, position embeddings) sit in every block's buckets.
  When blocks are uneven (``units % tp_base != 0`` for some family), slots' buckets put them at different
  offsets, and an all-reduce's summation order follows the offset: slots would end with different bits.
  Their synced value is then taken from one place — block 0's member broadcasts it inside each replica.
* The grad norm (:meth:`GradSync.grad_norm`) is assembled from a float64 table of squared sums per
  (parameter, block), each cell computed on a slot-shaped buffer that is bitwise the same in every replica,
  summed over the replica (one non-zero entry per cell, so the sum is exact) and finished with ``fsum``:
  bit-identical on every rank of every replica, hence so are clipping and the update.

Under Megatron's distributed optimizer (``use_distributed_optimizer``) the same buckets are reduce-scattered over
the sync group (the group each buffer shards over: upstream's ``intra_distributed_optimizer_instance_group``), so
after the sync only this rank's shard of each bucket holds reduced gradients, and after the optimizer step only
that shard of the parameters is updated:

* The grad norm's table has a cell per (block, position in the group) for TP-split pieces, and one per position
  for replicated pieces (block 0's only, so each is counted once), filled from the shards of ``grad_data``
  (:func:`ntp_megatron.core.grad_norm.shard_square_sums`), summed over the replica and then over the group (again
  one non-zero entry per cell) and finished with ``fsum``.
* The optimizer's step is local (:func:`ntp_megatron.patches.optimizer_distrib_optimizer.defer_param_sync`); the
  parameter all-gather that makes every rank's parameters whole again is :meth:`GradSync.param_gather`, a step
  of its own after the optimizer's.
* A degraded rank's shadows hold real slot-shaped parameters in Megatron's parameter buffer, sharded like a
  healthy slot-``s`` rank's over the same groups (:meth:`ntp_megatron.core.groups.NTPGroups.with_sync_groups`), and its
  optimizer steps its shard of every shadow (its own DDP only accumulates). The shadows are filled from the model
  before the optimizer is built over them (its bf16 main params are copies taken then: the dead blocks' units
  come from the replica peers holding them). After the sync only the shards are valid, so nothing is copied
  back; :meth:`GradSync.param_gather` all-gathers each shadow (ascending blocks) and copies the units back into
  the model, a dead block's from its member to the peers holding them (in the model's dtype).
* With uneven blocks a broadcast of replicated gradients would overwrite the receiver's reduced shard with the
  sender's unreduced elements; instead block 0's member broadcasts the replicated *parameters* after the
  gather. With fp32 parameters the optimizer's shard is a view of them, so every slot then steps from block 0's
  values; the Adam moments (and bf16's fp32 main params) of replicated elements on other slots are summed in
  their own order and may differ from block 0's in the last bits, but never reach the model: block 0's copy is
  the state (:meth:`GradSync.replicated_state_source`). A sum of two terms is the same in either order, so with
  two replicas every slot's copy is exactly block 0's.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

from ntp_megatron import phases
from ntp_megatron.core import grad_norm
from ntp_megatron.core.degraded_sync import DegradedSync, sum_over_replicas
from ntp_megatron.core.groups import NTPGroups
from ntp_megatron.core.pipeline import tied_embedding_sync
from ntp_megatron.core.shadows import Adoptable, Shadow
from ntp_megatron.plan.layout import Topology


class GradSync:
    """One rank's part of the cross-replica sync for one topology. Register :meth:`finalize_model_grads` as
    the model config's ``finalize_model_grads_func`` and :meth:`grad_norm` as the grad-norm override."""

    def __init__(self, topology: Topology, rank: int, groups: NTPGroups, model: DistributedDataParallel,
                 tf_config, ddp_config, adopt: Optional[dict[int, Adoptable]] = None, fill: bool = True) -> None:
        """``ddp_config``: the job's DDP config as given to every healthy rank (before DDP mutated it). ``adopt``:
        block -> a DDP to take over as that block's shadow (a degraded rank under the distributed optimizer).
        ``fill``: the shadows' parameters from the model (not when the caller fills them: a re-formation gathers
        them from the optimizer's shards, a checkpoint load refills them)."""
        self.topology, self.rank, self.groups = topology, rank, groups
        replica = topology.replica_of(rank)
        self.replica = replica.index
        self.members = list(groups.sync)                  # blocks this rank serves, ascending
        self.block0_member = topology.sync_member(replica.index, 0)
        self.tp_base = topology.tp_base
        self.uneven = any(n % topology.tp_base for n in topology.units.values())
        self.params: list[tuple[str, torch.nn.Parameter]] = [
            (n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.split = [(n, p.ntp_held_units) for n, p in self.params if hasattr(p, "ntp_held_units")]
        self.replicated = [(n, p) for n, p in self.params if not hasattr(p, "ntp_held_units")]
        for name, param in self.params:
            if getattr(param, "tensor_model_parallel", False) and not hasattr(param, "ntp_held_units"):
                raise ValueError(f"TP-split parameter {name} records no held units: it would be synced as replicated")
        self._by_name = dict(self.params)
        self.ddp = model
        self.distributed_optimizer = bool(ddp_config.use_distributed_optimizer)
        if self.distributed_optimizer and ddp_config.overlap_param_gather:
            raise ValueError("the distributed optimizer under NTP does not support overlap_param_gather (its "
                             "gather runs in the next forward's pre-hooks, not after the optimizer step)")
        degraded = [rep.index for rep in topology.replicas if not topology.is_healthy(rep.index)]  # or rebalanced
        if (self.distributed_optimizer and ddp_config.overlap_grad_reduce and groups.instances > 1 and degraded
                and dist.get_backend() == "gloo"):
            # With several instances Megatron syncs each bucket synchronously inside the backward hook of a healthy
            # rank (on gloo the host waits there; NCCL would only enqueue it), between its TP collectives; a proxy
            # serves its blocks' shadows one after another after its backward: a healthy rank waits in a hook for
            # the proxy, which waits for a bucket that needs the healthy rank's TP peers, blocked in their own
            # hooks (seen: gloo's recv timeout at iteration 2).
            raise ValueError(
                f"parallel.overlap_grad_reduce with parallel.num_distributed_optimizer_instances {groups.instances} "
                f"deadlocks on gloo while a replica is degraded (replica {degraded[0]} at TP "
                f"{topology.replica(degraded[0]).width} of {topology.tp_base}): the gradient sync of a healthy rank "
                "waits in its backward hooks for the degraded replica's proxy; set "
                "parallel.overlap_grad_reduce: false")
        self._cached_norm: Optional[float] = None
        self.tied = tied_embedding_sync(groups.job, rank, model.module)
        """Tied word embeddings across pipeline stages: the two copies' gradients summed before the sync."""
        self.degraded: Optional[DegradedSync] = None
        """A degraded rank's shadows and in-replica transfers (None on a healthy rank)."""
        if not groups.healthy:
            self.degraded = DegradedSync(topology, rank, groups, model, self.params, tf_config, ddp_config,
                                         adopt or {}, fill)

    @property
    def shadows(self) -> dict[int, Shadow]:
        """Block -> this rank's shadow of it (a degraded rank's, ascending blocks; empty on a healthy rank)."""
        return self.degraded.shadows if self.degraded is not None else {}

    @property
    def _device(self) -> torch.device:
        return self.params[0][1].main_grad.device

    def refill_shadows(self) -> None:
        """After the model's weights changed outside the optimizer (a checkpoint load), the shadows' parameters
        from the model again, as before the optimizer was built (under the distributed optimizer on a degraded
        rank; a collective over the replica). Nothing to do elsewhere."""
        if self.distributed_optimizer and self.shadows:
            self.degraded.fill_shadows()

    def close(self, hand_back: bool = False) -> None:
        """Release the shadows (and, with them, this generation's sync groups); ``hand_back``: the formation did
        not complete, and the DDPs the shadows adopted go back to the objects they came from."""
        if self.degraded is not None:
            self.degraded.close(hand_back)

    def adopted_blocks(self) -> dict[int, DistributedDataParallel]:
        """Block -> the DDP its shadow adopted (until :meth:`settle`)."""
        return self.degraded.adopted_blocks() if self.degraded is not None else {}

    def settle(self) -> None:
        """The formation these objects were built for completed: the adopted DDPs are theirs for good."""
        if self.degraded is not None:
            self.degraded.settle()

    def finalize_model_grads(self, model, num_tokens: Optional[torch.Tensor] = None, pg_collection=None,
                             force_all_reduce: bool = False) -> None:
        """Megatron's ``finalize_model_grads`` for NTP: upstream's on a healthy rank, the shadow sync on a
        degraded one; then, with uneven blocks, replicated gradients from block 0's member."""
        phases.point("grad_sync")
        if self.tied is not None:
            self.tied.exchange()
        if num_tokens is not None and self.groups.staged:
            # Counted by the last stage only; upstream broadcasts it along a pipeline group, which NTP stages of
            # different widths do not have: from the last stage's first rank over the replica instead.
            dist.broadcast(num_tokens, src=self.groups.last_stage_rank, group=self.groups.mp)
        if self.groups.healthy and not self.groups.staged:
            finalize_model_grads(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        elif self.groups.healthy:
            finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
            if num_tokens is not None:  # upstream's reduction and arithmetic (the sync group is the DP group)
                num_tokens.copy_(self.sum_over_replicas(num_tokens))
                if num_tokens > 0:
                    for chunk in model:
                        chunk.scale_gradients(1.0 / num_tokens)
        else:
            self.degraded.sync(num_tokens)
        if self._replicated_from_block0 and not self.distributed_optimizer:
            self._broadcast_from_block0([p.main_grad for _, p in self.replicated])

    @property
    def _replicated_from_block0(self) -> bool:
        return self.uneven and bool(self.replicated) and self.groups.tp.size() > 1

    def _broadcast_from_block0(self, tensors: list[torch.Tensor]) -> None:
        """Block 0's member's values of ``tensors`` (one per replicated parameter) on every rank of the replica."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=self.block0_member, group=self.groups.tp)
        offset = 0
        for tensor in tensors:
            tensor.view(-1).copy_(flat[offset:offset + tensor.numel()])
            offset += tensor.numel()

    @torch.no_grad()
    def param_gather(self) -> None:
        """Under the distributed optimizer, after the (local) optimizer step: every member's updated shard of each
        bucket to the other members of its group (upstream's synchronous all-gather, which the step left out),
        then, with uneven blocks, the replicated parameters from block 0's member. Idempotent given the shards;
        nothing to do without the distributed optimizer."""
        if not self.distributed_optimizer:
            return
        if self.groups.healthy:
            self.ddp.start_param_sync(force_sync=True)
        else:
            self.degraded.gather()
        if self._replicated_from_block0:
            self._broadcast_from_block0([p.data for _, p in self.replicated])
            for shadow in self.shadows.values():  # as a healthy slot's buffer holds them after the broadcast
                for name, param in self.replicated:
                    shadow.params[name].data.copy_(param.data)

    def replicated_state_source(self) -> Optional[int]:
        """The rank whose optimizer state of replicated parameters is the replica's, where slots' copies may
        differ in the last bits (uneven blocks under the distributed optimizer, more than two replicas: see the
        module docstring); None where every slot's copy is the same."""
        replicas = self.groups.sync[self.members[0]].size()
        if self._replicated_from_block0 and self.distributed_optimizer and replicas > 2:
            return self.block0_member
        return None

    def sum_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over replicas of a value every rank of a replica holds alike (each replica counted once):
        an all-reduce in each sync group this rank is a member of (the results are equal; the first is
        returned)."""
        return sum_over_replicas(self.groups, value)

    def grad_norm(self, *_args, **_kwargs) -> float:
        """Megatron's ``get_grad_norm_fp32`` under NTP: the norm :meth:`compute_grad_norm` computed before the
        commit point (the optimizer's step after it must not communicate), or, outside the training loop, a
        fresh one."""
        cached, self._cached_norm = self._cached_norm, None
        return cached if cached is not None else self._grad_norm()

    def compute_grad_norm(self) -> float:
        """Compute (a collective over the replica) and keep the grad norm the next optimizer step clips with."""
        self._cached_norm = self._grad_norm()
        return self._cached_norm

    @torch.no_grad()
    def _grad_norm(self) -> float:
        """The global L2 norm of the synced gradients, bit-identical on every rank of every replica
        (:mod:`ntp_megatron.core.grad_norm`)."""
        if self.distributed_optimizer:
            return grad_norm.shard_table_norm(self.shard_sources(), self.tp_base, self.groups.tp, self._device)
        # The last stage's copy of tied embeddings is counted once, in the first stage (upstream's
        # param_is_not_shared): its cells stay zero.
        counted = [(i, name) for i, (name, _) in enumerate(self.split)
                   if not getattr(self._by_name[name], "shared", False)]
        if self.groups.healthy:
            [block] = self.members
            grads = {block: {name: self._by_name[name].main_grad for _, name in counted}}
        else:
            grads = {block: shadow.grads for block, shadow in self.shadows.items()}
        replicated = [p.main_grad for _, p in self.replicated] if self.rank == self.block0_member else None
        stage_sum = grad_norm.block_table_sum(grads, counted, len(self.split), replicated, len(self.replicated),
                                              self.tp_base, self.groups.tp, self._device)
        return math.sqrt(grad_norm.over_stages(stage_sum, self.topology, self.rank, self.groups, self._device))

    def shard_sources(self) -> list[tuple[int, list]]:
        """(block, Megatron buffers holding that block's reduced shards) for every block this rank serves."""
        if self.groups.healthy:
            return [(self.members[0], self.ddp.buffers)]
        return [(block, shadow.ddp.buffers) for block, shadow in self.shadows.items()]

    def optimizer_chunks(self) -> list[DistributedDataParallel]:
        """The DDPs whose buffers the optimizer steps: the model's, or under the distributed optimizer on a
        degraded rank the shadows' (ascending blocks)."""
        if self.distributed_optimizer and not self.groups.healthy:
            return [shadow.ddp for shadow in self.shadows.values()]
        return [self.ddp]
