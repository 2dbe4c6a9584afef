"""Which node and which local device each slot runs on: a fixed place, computed from the configuration alone.

The job's full grid of ``data_parallel_size × tensor_model_parallel_size`` slots is laid out over the nodes in
(replica, slot) order, ``devices_per_node`` slots per node, whether a slot is live, dead from the start, or in a
dropped replica. So a slot's place never depends on which other slots are live: a dead slot leaves its device
idle instead of shifting every later rank to another device or node, a replacement process for a slot starts on
the slot's own device, and every node's launcher computes the same map without talking to the others.

Rule: ``--nnodes`` must divide ``data_parallel_size``, i.e. each node hosts whole replicas (``devices_per_node`` is
a multiple of the TP size), so a replica's TP group — NTP's fast scale-up domain — never straddles two nodes.

Pure math: no torch, no process groups (the launcher and the tests call it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ntp_megatron.config_io import ConfigError


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
    """The slot → device map of a ``tp_base × dp`` grid on ``nnodes`` nodes."""

    tp_base: int
    dp: int
    nnodes: int

    def __post_init__(self) -> None:
        for name, value in (("tensor_model_parallel_size", self.tp_base), ("data_parallel_size", self.dp),
                            ("--nnodes", self.nnodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlacementError(f"{name} must be a positive integer, got {value!r}")
        if self.dp % self.nnodes:
            allowed = ", ".join(map(str, _divisors(self.dp)))
            raise PlacementError(
                f"--nnodes {self.nnodes} does not divide parallel.data_parallel_size {self.dp}: each node hosts whole "
                f"replicas of tensor_model_parallel_size {self.tp_base} slots (a TP group never straddles nodes); "
                f"allowed --nnodes: {allowed}")

    @property
    def devices_per_node(self) -> int:
        """Devices each node provides: its replicas' slots, live or not."""
        return self.tp_base * self.dp // self.nnodes

    @property
    def replicas_per_node(self) -> int:
        return self.dp // self.nnodes

    def device(self, replica: int, slot: int) -> Device:
        """The fixed place of slot ``slot`` of replica ``replica``."""
        if not (0 <= replica < self.dp and 0 <= slot < self.tp_base):
            raise ValueError(f"slot ({replica}, {slot}) is outside the {self.dp} × {self.tp_base} grid")
        node, index = divmod(replica * self.tp_base + slot, self.devices_per_node)
        return Device(node, index)

    def replicas_on(self, node: int) -> range:
        """Replica indices node ``node`` hosts."""
        if not 0 <= node < self.nnodes:
            raise ValueError(f"node {node} out of range 0..{self.nnodes - 1}")
        return range(node * self.replicas_per_node, (node + 1) * self.replicas_per_node)

    def node_ranks(self, node: int, launch_slots: Sequence[tuple[int, int]]) -> dict[int, int]:
        """Launch rank → local device index, for the launch ranks node ``node`` starts, ascending.

        ``launch_slots[r]`` is the (replica, slot) that launch rank ``r`` runs (live slots only: dead slots and
        dropped replicas have no launch rank, and their devices stay idle)."""
        hosted = self.replicas_on(node)
        out = {}
        for rank, (replica, slot) in enumerate(launch_slots):
            if replica in hosted:
                out[rank] = self.device(replica, slot).index
        return out


def launch_slots(tp_base: int, dp: int, topology=None) -> list[tuple[int, int]]:
    """(replica, slot) of each launch rank, in launch-rank order: the starting NTP ``topology``'s live slots (its
    generation-0 ranks), or, without NTP (None), Megatron's dense grid, where rank ``r`` is slot ``r % tp`` of
    replica ``r // tp`` (TP groups are consecutive ranks)."""
    if topology is None:
        return [divmod(rank, tp_base) for rank in range(tp_base * dp)]
    return [topology.slot_of(rank) for rank in range(topology.world_size)]

