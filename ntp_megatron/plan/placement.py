"""Which node and which local device each slot runs on: a fixed place, computed from the configuration alone.

The job's full grid of ``pipeline_model_parallel_size × data_parallel_size × tensor_model_parallel_size`` slots
is laid out over the nodes in Megatron's rank order ((stage, replica, slot): :class:`ntp_megatron.plan.grid.Grid`),
``nproc_per_node`` slots per node (torchrun's name: the ranks one launcher starts), whether a slot is live, dead from
the start, or in a dropped replica. So a slot's place never depends on which other slots are live: a dead slot leaves
its device idle instead of shifting every later rank to another device or node, a replacement process for a slot
starts on the slot's own device, and every node's launcher computes the same map without talking to the others.

Rule: a *scale-up domain* is ``nnodes_per_domain`` consecutive nodes (an NVL72 rack: its trays of 4 GPUs are the
nodes). The TP group of a replica's stage — NTP's fast group — lies inside one domain and may span several of its
nodes; ranks keep Megatron's order (no reordering to fit). So ``nnodes × nproc_per_node`` is the world,
``nnodes`` is a multiple of ``nnodes_per_domain``, and a domain's ``nnodes_per_domain × nproc_per_node`` devices
are a multiple of the TP size (TP groups are aligned blocks of consecutive ranks, so a domain then holds whole
ones). With the defaults (``nproc_per_node`` = world / ``nnodes``, one node per domain) each node hosts whole TP
groups. At PP 1 a domain hosts whole replicas; with stages, the stages of one replica may run on different domains
(stage-major order: a node hosts consecutive stages of every replica first). A lost node takes every slot it hosts,
in every TP group it serves (TP4 over two nodes of 2 → TP2 after one).

Pure math: no torch, no process groups (the launcher, the ranks and the tests call it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ntp_megatron.config.files import ConfigError
from ntp_megatron.plan.grid import Grid


class PlacementError(ConfigError):
    """The node count does not fit the parallel sizes (a one-line config error)."""


@dataclass(frozen=True, order=True)
class Device:
    """Where one slot runs: ``node`` (the launcher's ``--node-rank``) and ``index``, the local device index on
    that node (the rank's ``LOCAL_RANK`` and CUDA device)."""

    node: int
    index: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Placement:
    """The slot → device map of a ``tp_base × dp × pp`` grid on ``nnodes`` nodes of ``nproc_per_node`` devices each
    (None: world / ``nnodes``), in scale-up domains of ``nnodes_per_domain`` nodes."""

    tp_base: int
    dp: int
    nnodes: int
    pp: int = 1
    nproc_per_node: Optional[int] = None
    nnodes_per_domain: int = 1

    def __post_init__(self) -> None:
        for name, value in (("tensor_model_parallel_size", self.tp_base), ("data_parallel_size", self.dp),
                            ("pipeline_model_parallel_size", self.pp), ("--nnodes", self.nnodes),
                            ("--nproc-per-node", 1 if self.nproc_per_node is None else self.nproc_per_node),
                            ("--nnodes-per-domain", self.nnodes_per_domain)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlacementError(f"{name} must be a positive integer, got {value!r}")
        world = self.tp_base * self.dp * self.pp
        if self.nproc_per_node is not None and self.nnodes * self.nproc_per_node != world:
            raise PlacementError(
                f"--nnodes {self.nnodes} × --nproc-per-node {self.nproc_per_node} must be the world size {world} "
                f"(tensor × data × pipeline parallel sizes); allowed --nproc-per-node with --nnodes {self.nnodes}: "
                + (str(world // self.nnodes) if world % self.nnodes == 0 else "none (--nnodes must divide "
                   f"{world}: {', '.join(map(str, _divisors(world)))})"))
        groups = self.dp * self.pp
        k = self.nnodes_per_domain
        spans = [d for d in _divisors(self.nnodes) if world % self.nnodes == 0
                 and d * (world // self.nnodes) % self.tp_base == 0]
        if self.nproc_per_node is None and k == 1 and groups % self.nnodes:
            what = "parallel.data_parallel_size" if self.pp == 1 else \
                "parallel.data_parallel_size × pipeline_model_parallel_size"
            raise PlacementError(
                f"--nnodes {self.nnodes} does not divide {what} {groups}: each node hosts whole TP groups of "
                f"tensor_model_parallel_size {self.tp_base} slots (one node per scale-up domain); allowed --nnodes: "
                f"{', '.join(map(str, _divisors(groups)))}"
                + (f" (or TP groups across nodes: --nnodes-per-domain {', '.join(map(str, spans))})" if spans else ""))
        if world % self.nnodes:
            raise PlacementError(f"--nnodes {self.nnodes} does not divide the world size {world}; allowed --nnodes: "
                                 + ", ".join(map(str, _divisors(world))))
        if self.nnodes % k:
            raise PlacementError(f"--nnodes {self.nnodes} is not a multiple of --nnodes-per-domain {k}; allowed "
                                 f"--nnodes-per-domain: {', '.join(map(str, _divisors(self.nnodes)))}")
        if k * self.devices_per_node % self.tp_base:
            raise PlacementError(
                f"a scale-up domain of --nnodes-per-domain {k} × --nproc-per-node {self.devices_per_node} devices "
                f"does not hold whole TP groups of tensor_model_parallel_size {self.tp_base} (a TP group lies inside "
                f"one domain); allowed --nnodes-per-domain: {', '.join(map(str, spans)) or 'none'}")

    @property
    def devices_per_node(self) -> int:
        """Devices each node provides: its slots, live or not (``--nproc-per-node``)."""
        return self.tp_base * self.dp * self.pp // self.nnodes

    def domain(self, node: int) -> int:
        """The scale-up domain node ``node`` belongs to."""
        return node // self.nnodes_per_domain

    def slots_on(self, node: int) -> list[tuple[int, ...]]:
        """Every slot node ``node`` hosts, live or not: (replica, slot), or with stages (replica, slot, stage)."""
        grid = Grid(self.tp_base, self.dp, self.pp)
        first = node * self.devices_per_node
        out = []
        for rank in range(first, first + self.devices_per_node):
            stage, replica, slot = grid.coords(rank)
            out.append((replica, slot) if self.pp == 1 else (replica, slot, stage))
        return out

    def device(self, replica: int, slot: int, stage: int = 0) -> Device:
        """The fixed place of slot ``slot`` of replica ``replica``'s stage ``stage``."""
        if not (0 <= replica < self.dp and 0 <= slot < self.tp_base and 0 <= stage < self.pp):
            raise ValueError(f"slot ({replica}, {slot}) of stage {stage} is outside the {self.pp} × {self.dp} × "
                             f"{self.tp_base} grid")
        node, index = divmod(Grid(self.tp_base, self.dp, self.pp).rank(stage, replica, slot), self.devices_per_node)
        return Device(node, index)

    def replicas_on(self, node: int) -> list[int]:
        """Replica indices node ``node`` hosts a slot of."""
        if not 0 <= node < self.nnodes:
            raise ValueError(f"node {node} out of range 0..{self.nnodes - 1}")
        return sorted({r for r in range(self.dp) for p in range(self.pp) if self.device(r, 0, p).node == node})

    def node_ranks(self, node: int, launch_slots: Sequence[tuple[int, ...]]) -> dict[int, int]:
        """Launch rank → local device index, for the launch ranks node ``node`` starts, ascending.

        ``launch_slots[r]`` is the (replica, slot) or, with stages, (replica, slot, stage) that launch rank ``r``
        runs (live slots only: dead slots and dropped replicas have no launch rank, and their devices stay idle)."""
        out = {}
        for rank, where in enumerate(launch_slots):
            device = self.device(*where)
            if device.node == node:
                out[rank] = device.index
        return out


def launch_nodes(placement: Placement, launch_slots: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The node of each launch rank (``launch_slots`` as :meth:`Placement.node_ranks` takes them)."""
    return tuple(placement.device(*where).node for where in launch_slots)


def launch_slots(tp_base: int, dp: int, topology=None, pp: int = 1) -> list[tuple[int, ...]]:
    """(replica, slot) of each launch rank, in launch-rank order: the starting NTP ``topology``'s live slots (its
    generation-0 ranks), or, without NTP (None), Megatron's dense grid, where rank ``r`` is slot ``r % tp`` of
    replica ``r // tp`` (TP groups are consecutive ranks); with ``pp`` stages (NTP off) (replica, slot, stage), in
    Megatron's order (:class:`ntp_megatron.plan.grid.Grid`)."""
    if topology is None:
        grid = Grid(tp_base, dp, pp)
        if pp == 1:
            return [divmod(rank, tp_base) for rank in range(grid.world_size)]
        return [(replica, slot, stage) for stage, replica, slot in map(grid.coords, range(grid.world_size))]
    return [topology.slot_of(rank) for rank in range(topology.world_size)]

