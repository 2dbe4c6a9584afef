"""What the launcher says about where a job's ranks run: this node's devices, and each pipeline stage's replicas."""

from __future__ import annotations

from typing import Sequence

from ntp_megatron.config.schema import JobConfig
from ntp_megatron.plan.placement import Placement


def spans(numbers: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs)


def where(devices: dict[int, int], devices_per_node: int, nnodes: int, node_rank: int) -> str:
    """Where this node's ranks run (``devices``: launch rank -> local device), for the start message: which local
    devices, and which stay idle."""
    idle = [i for i in range(devices_per_node) if i not in devices.values()]
    if nnodes == 1 and not idle:
        return ""
    used = spans(sorted(devices.values())) or "none"
    idle_text = f" (device{'s' if len(idle) > 1 else ''} {spans(idle)} idle)" if idle else ""
    return f" on node {node_rank}, devices {used}{idle_text}"


def stage_lines(cfg: JobConfig, placement: Placement, launch_slots: list[tuple[int, ...]]) -> list[str]:
    """With pipeline stages, where each runs and who each launch rank is: per stage and replica, its launch ranks
    and their slots (ascending together), its dead slots, and the nodes."""
    p = cfg.parallel
    if p.pipeline_model_parallel_size == 1:
        return []
    layers = cfg.model.num_layers // p.pipeline_model_parallel_size
    lines = []
    for stage in range(p.pipeline_model_parallel_size):
        ranks = [r for r, (_, _, st) in enumerate(launch_slots) if st == stage]
        nodes = sorted({placement.device(*launch_slots[r]).node for r in ranks})
        replicas = [_replica_text(replica, [r for r in ranks if launch_slots[r][0] == replica], launch_slots,
                                  p.tensor_model_parallel_size) for replica in range(p.data_parallel_size)]
        lines.append(f"stage {stage} (layers {stage * layers}..{(stage + 1) * layers - 1}) on "
                     f"node{'s' if len(nodes) > 1 else ''} {spans(nodes)}: {'; '.join(replicas)}")
    return lines


def _replica_text(replica: int, mine: list[int], launch_slots: list[tuple[int, ...]], tp: int) -> str:
    if not mine:
        return f"replica {replica} dropped"
    slots = [launch_slots[r][1] for r in mine]
    dead = [s for s in range(tp) if s not in slots]
    dead_text = f" (dead slot{'s' if len(dead) > 1 else ''} {spans(dead)})" if dead else ""
    return (f"replica {replica} = launch rank{'s' if len(mine) > 1 else ''} {spans(mine)} "
            f"in slot{'s' if len(mine) > 1 else ''} {spans(slots)}{dead_text}")
