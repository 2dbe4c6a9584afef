"""What a re-formation reports: every rank's ``reform_rank`` record (rebuilt or kept, and that kept objects are the
same objects; the groups it made and kept), and generation rank 0's ``reformed`` event and line (recovery time,
bytes moved against the lower bound, shard moves under the distributed optimizer)."""

from __future__ import annotations

import sys
import time
from datetime import datetime
from typing import Optional

from ntp_megatron import metrics
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.core.groups import references_to
from ntp_megatron.core.unit_moves import plan_shard_transfers, state_keys
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.formation import Staged
from ntp_megatron.elastic.generation import ElasticRank
from ntp_megatron.elastic.interfaces import RankObjects, Training
from ntp_megatron.plan import stages
from ntp_megatron.plan.succession import ShardedOptimizer


def report_rank(elastic: ElasticRank, rank: int, old: Optional[RankObjects], new: RankObjects, staged: Staged,
                pool) -> None:
    """Every rank, every generation adopted: whether it rebuilt its objects, and whether the model, its DDP
    wrapper and the optimizer it trains with now are the very objects it held before."""
    topology = staged.topology
    metrics.emit({"kind": "reform_rank", "launch_rank": elastic.launch_rank,
                  "generation": topology.generation, "replica": topology.replica_of(rank).index,
                  "tp_rank": topology.local_rank(rank), "stage": new.setup.stage,
                  "rebuilt": staged.new_parts is not None,
                  "same_model": old is not None and new.model.module is old.model.module,
                  "same_ddp": old is not None and new.model is old.model,
                  "same_optimizer": old is not None and new.optimizer is old.optimizer,
                  "adopted_blocks": sorted(new.adopted) if staged.new_parts is not None else [],
                  **_group_record(pool),
                  "tp_references": references_to([new.model, new.optimizer], new.setup.groups.tp),
                  "time": time.time()}, sys.stdout)


def report_reformed(cfg: JobConfig, elastic: ElasticRank, training: Training, staged: Staged) -> None:
    """Generation rank 0, after a re-formation that a death, a join or a rebalance caused: the ``reformed`` event and
    line (recovery time, bytes moved against the bound, the iteration redone or resumed)."""
    topology, info = staged.topology, staged.info
    moved = keys.moved_bytes(elastic.ctl, topology.generation)
    joined = [tuple(slot) for slot in info.get("joined", [])]
    shard_moves = moved_shards(cfg, elastic, staged) if cfg.parallel.use_distributed_optimizer else None
    if staged.fresh:
        bound = 0  # before the first step every rank draws its initial weights: nothing has to move
    elif shard_moves is not None:  # every shard a new holder lacked, from the geometry of the layout
        sharded = ShardedOptimizer.of(cfg)
        per_element = 4 * (1 + len(state_keys(cfg.training.optimizer)))
        bound = sum(per_element * sharded.shard_numel(m["block"], m["position"]) for m in shard_moves)
    else:  # every rank's own lack, from the layouts alone (own_lower_bound_bytes)
        bound = keys.lower_bound_bytes(elastic.ctl, topology.generation)
    settled = info.get("settled") or {}
    redone = 1 if settled.get("decision") == "abort" and settled.get("started") else 0
    recovery_s = time.time() - info["failure_time"]
    widths = stages.tp_per_replica(topology, cfg.parallel.data_parallel_size)
    resume = training.iteration + 1
    event = {"kind": "event", "event": "reformed", "generation": topology.generation, "tp_per_replica": widths,
             "recovery_s": recovery_s, "moved_bytes": moved, "lower_bound_bytes": bound,
             "iterations_redone": redone, "resume_iteration": resume, "time": time.time(),
             "reform_s": time.time() - staged.started, "joined": [list(j) for j in joined],
             "weights": info.get("weights", [])}
    if shard_moves is not None:
        event["shard_moves"] = shard_moves
    metrics.emit(event, sys.stdout)
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    if joined:
        what = "rejoined: " + ", ".join(f"replica {j[0]} slot {j[1]}" + "".join(f" stage {p}" for p in j[2:])
                                        for j in joined)
    elif info.get("weights"):
        what = "rebalanced: " + "; ".join(
            f"replica {r}" + (f" stage {p}" if topology.num_stages > 1 else "") + " "
            + (", ".join(f"slot {slot} weight {w}" for slot, w in pairs) or "even") for r, p, pairs in info["weights"])
    else:
        what = f"recovered in {recovery_s:.2f} s"
    redo = f"iteration {resume} redone" if redone else f"resuming at iteration {resume}"
    print(f" [{stamp}] re-formed | generation {topology.generation} | tp per replica: {widths} | {what} | "
          f"moved {_size(moved)} (lower bound {_size(bound)}) | {redo} |", flush=True)


def moved_shards(cfg: JobConfig, elastic: ElasticRank, staged: Staged) -> list[dict]:
    """The distributed-optimizer shards the re-formation moved: block, position, the launch ranks of source and
    destination, and the bytes the destination received."""
    if staged.fresh:
        return []
    topology, p = staged.topology, cfg.parallel
    launch = elastic.topology(0)

    def launch_rank(rank: int) -> int:
        return launch.rank_of(*topology.slot_of(rank))

    out = []
    transfers = plan_shard_transfers(staged.base.only_stage, topology.only_stage, staged.dead, p.data_parallel_size,
                                     p.num_distributed_optimizer_instances)
    for dst in sorted({t.dst for t in transfers}):
        received = {(b, j): n for b, j, n in keys.received_shards(elastic.ctl, topology.generation, dst)}
        for t in transfers:
            if t.dst == dst:
                out += [{"block": b, "position": j, "src": launch_rank(t.src), "dst": launch_rank(dst),
                         "bytes": received[b, j]} for b, j in t.shards]
    return out




def _group_record(pool) -> dict:
    """Which of the generation's groups this rank made and which it kept (role and place), and the generation
    that made each group it is in (a kept group's incarnation is older than the generation)."""
    return {"groups_made": sorted(k.name() for k in pool.made), "groups_kept": sorted(k.name() for k in pool.kept),
            "groups_made_in": {k.name(): pooled.made_in for k, pooled in sorted(pool.groups.items())}}



def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
