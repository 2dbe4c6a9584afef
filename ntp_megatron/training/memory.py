"""What a rank's training state occupies, measured from its objects, and the peak of a phase of its work.

*State* is counted as :mod:`ntp_megatron.plan.memory_plan` plans it (:class:`~ntp_megatron.plan.memory_plan.StateBytes`), from
the real objects: the unique storages of the model's parameters (under the distributed optimizer, the DDP's flat
parameter buffer they are views of), of the DDP's gradient buffers, of a degraded rank's shadows (their
parameters where they have storage, their gradient buffers), and of the optimizer (the tensors its torch
optimizer steps, i.e. fp32 main params where they are copies, and every per-element state tensor; Adam's
zero-dimensional step counters are left out, as in the plan). A storage is counted once, in the first kind that
holds it, in that order: the distributed optimizer's fp32 shards are views of the parameter buffer and count
as parameters. Meta tensors and storages resized to nothing count zero.

The *peak* of a phase (an iteration, a re-formation):

- on CUDA, ``torch.cuda.max_memory_allocated`` since the phase began (its counter is reset then): every tensor
  the caching allocator handed out, activations and messages included;
- on CPU, where torch keeps no allocation statistics (its profiler reports frees only of blocks allocated while
  it ran, so the frees that matter in a re-formation would be missed), the highest of the samples the phase
  took: at each sample point, the unique storages of every set of objects the rank holds then (during a
  re-formation the old and the new ones) plus the messages it has posted, counted at the sizes
  :func:`ntp_megatron.core.unit_moves.exchange` allocates. It covers the training state and the re-formation's messages
  at those points; not activations or autograd's saved tensors (no sample falls inside a forward/backward),
  not allocations between two samples, not the allocator's caches.

Alongside, every record carries the process's resident-set high-water mark since the phase began (Linux
``VmHWM``, reset by writing ``5`` to ``/proc/self/clear_refs``): everything the process touched, the Python
interpreter and its libraries included, so it is an upper bound of the rest, meaningful as a difference.

:class:`RankMemory` is the training side of :class:`ntp_megatron.elastic.interfaces.Memory`: it measures, emits the
``memory`` records (docs/metrics.md), and frees (and restores) gradient buffers that are dead during a
re-formation.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from ntp_megatron import metrics
from ntp_megatron.plan.memory_plan import StateBytes, dims_of, stage_rank_state, training_of

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (which they join); meta and empty storages count 0."""
    total = 0
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def ddp_buffers(ddp) -> list:
    """Every ``_ParamAndGradBuffer`` of a Megatron DDP (dense and expert)."""
    return [*getattr(ddp, "buffers", ()), *getattr(ddp, "expert_parallel_buffers", ())]


def shadows(parts) -> list:
    """The shadows (:class:`ntp_megatron.core.shadows.Shadow`) of a degraded rank's objects; none on a healthy rank or NTP off."""
    setup = getattr(parts, "setup", None)
    grad_sync = getattr(setup, "grad_sync", None)
    return [s for s in getattr(grad_sync, "shadows", {}).values() if s.ddp is not None]


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """What the optimizer keeps: the tensors its torch optimizer steps (the model's parameters themselves, fp32
    main copies, or distributed-optimizer shards) and their per-element state."""
    out = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        out += [p for group in inner.param_groups for p in group["params"]]
        out += [t for state in inner.state.values() for t in state.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0]
    return out


def state_bytes(parts, seen: Optional[set] = None) -> StateBytes:
    """The state ``parts`` (a :class:`ntp_megatron.training.components.Components`) holds, by kind; storages in
    ``seen`` (shared with objects measured before) are not counted again."""
    seen = set() if seen is None else seen
    params = _storage_bytes(parts.model.module.parameters(), seen)
    held = shadows(parts)
    shadow_params = _storage_bytes((p for s in held for p in s.module.parameters()), seen)
    grads = _storage_bytes((b.grad_data for b in ddp_buffers(parts.model)), seen)
    shadow_grads = _storage_bytes((b.grad_data for s in held for b in ddp_buffers(s.ddp)), seen)
    optimizer = _storage_bytes(optimizer_tensors(parts.optimizer), seen)
    return StateBytes(params=params, grads=grads, optimizer=optimizer, shadow_params=shadow_params,
                      shadow_grads=shadow_grads)


def gradient_buffers(parts) -> list[torch.Tensor]:
    """The flat gradient buffers of the objects: the DDP's and every shadow's."""
    return [b.grad_data for ddp in [parts.model, *(s.ddp for s in shadows(parts))] for b in ddp_buffers(ddp)]


def free_gradients(parts) -> int:
    """Give back the storage of every gradient buffer of ``parts`` (their contents are dead: the iteration that
    filled them was settled, or nothing filled them yet); returns the bytes freed. Every view of a buffer
    (``param.main_grad``, the buckets) keeps pointing at its storage, which :func:`restore_gradients`
    re-allocates."""
    freed = 0
    for grad in gradient_buffers(parts):
        storage = grad.untyped_storage()
        if storage.nbytes():
            grad._ntp_freed_nbytes = storage.nbytes()
            freed += storage.nbytes()
            storage.resize_(0)
    return freed


def free_parameters(parts) -> int:
    """Give back the storage of the model's own parameters (not a shadow's: a degraded rank's model holds its units
    apart from them); returns the bytes freed. For objects whose parameter values are dead: under the distributed
    optimizer a degraded rank's are gathered from its shadows' shards into whatever objects train next, so the
    objects freed here are never trained with again."""
    freed, seen = 0, set()
    for param in parts.model.module.parameters():
        storage = param.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            freed += storage.nbytes()
            storage.resize_(0)
    parts.parameters_freed = True
    return freed


def restore_gradients(parts) -> None:
    """Re-allocate, zeroed, every gradient buffer :func:`free_gradients` freed (nothing to do otherwise)."""
    for grad in gradient_buffers(parts):
        nbytes = getattr(grad, "_ntp_freed_nbytes", None)
        if nbytes is not None:
            grad.untyped_storage().resize_(nbytes)
            grad.zero_()
            del grad._ntp_freed_nbytes


def _rss_hwm_bytes() -> Optional[int]:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_rss_hwm() -> None:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass


def role(topology, rank: int) -> str:
    """``healthy`` (a rank of a canonical replica, or NTP off), ``proxy`` (a degraded rank that is the sync-group
    member of a dead slot's block as well as its own), or ``survivor`` (another rank of a degraded or weighted
    replica)."""
    if topology is None or topology.is_healthy(topology.replica_of(rank).index):
        return "healthy"
    return "proxy" if len(topology.member_blocks(rank)) > 1 else "survivor"


class RankMemory:
    """One rank's measurements (:class:`ntp_megatron.elastic.interfaces.Memory`)."""

    def __init__(self, cfg, device: torch.device, launch_rank: int) -> None:
        self.cfg, self.device, self.launch_rank = cfg, device, launch_rank
        self.cuda = device.type == "cuda"
        self._sampled = 0

    def begin(self) -> None:
        """A phase begins: its peak is measured from here."""
        self._sampled = 0
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        _reset_rss_hwm()

    def sample(self, *held: Any, transient: int = 0) -> int:
        """A sample point: the state of every set of objects in ``held`` (None ignored; a storage shared by two
        counted once) plus ``transient`` bytes of messages; returns that sum."""
        seen: set = set()
        total = sum(state_bytes(parts, seen).total for parts in held if parts is not None) + transient
        self._sampled = max(self._sampled, total)
        return total

    def peak(self) -> tuple[int, str]:
        """(the phase's peak, what measured it)."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device)), "cuda_max_memory_allocated"
        return self._sampled, "sampled_state"

    def report(self, phase: str, parts, **fields: Any) -> dict:
        """Emit a ``memory`` record of ``parts`` at the end of ``phase`` (its state, planned and measured, and
        the phase's peak); ``fields`` are added to it. Returns the record."""
        self.sample(parts)
        state = state_bytes(parts)
        setup = parts.setup
        topology, rank = setup.topology, setup.rank
        planned = None
        if topology is not None:
            planned = asdict(stage_rank_state(dims_of(self.cfg), topology, rank, training_of(self.cfg)))  # its stage's
        peak, source = self.peak()
        record = {"kind": "memory", "phase": phase, "launch_rank": self.launch_rank,
                  "generation": setup.generation, "replica": setup.replica, "tp_rank": setup.tp_rank,
                  "role": role(topology, rank), "state": {**asdict(state), "total": state.total},
                  "planned": planned, "peak_bytes": peak, "peak_source": source, "rss_hwm_bytes": _rss_hwm_bytes(),
                  **fields}
        metrics.emit(record, sys.stdout)
        return record

    def free_gradients(self, parts) -> int:
        return free_gradients(parts)

    def restore_gradients(self, parts) -> None:
        restore_gradients(parts)

    def free_parameters(self, parts) -> int:
        return free_parameters(parts)
