"""What every re-formation must move: the lower bound of its bytes, from the job's model and the two topologies
the controller published, checked against what the ranks moved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from tests.harness.checks import _stage_topology, segments
from tests.harness.processes import JobResult

# -- what a re-formation must move -----------------------------------------------------------------------------------

_STATE_TENSORS = {"adam": 2, "sgd": 1}
"""Per-element optimizer state tensors that move with a parameter: Adam's two moments, SGD's momentum."""
BYTES_PER_ELEMENT = 4
"""Every moved tensor travels in fp32: the parameter (under bf16 its fp32 main param) and its state."""


def unit_elements(model: dict, stage: int = 0, stages: int = 1) -> tuple[dict[str, int], int]:
    """Parameter elements of one unit of each TP-split family, and of the replicated parameters, for the GPT of
    this project's local layer spec (Megatron-Core's ``add_bias_linear`` default: every linear layer has a
    bias), written out from the model's dimensions:

    - ``heads`` (one query group, with its ``heads / groups`` query heads), per layer: its rows of the fused QKV
      weight (q heads, one k, one v, ``kv_channels`` each, by ``hidden``) and of the QKV bias, and its columns of
      the attention projection;
    - ``ffn`` (one hidden unit), per layer: its row of FC1 (two, gate and up, under a gated MLP) and their biases,
      and its column of FC2;
    - ``vocab`` (one row): the word embedding's, and the output layer's when untied.

    Replicated: per layer the two norms (weight, and bias under LayerNorm), the projection's and FC2's biases;
    the final norm; learned position embeddings (``max_position_embeddings`` or ``seq_length`` rows).

    With pipeline stages, of ``stage`` of ``stages``: its share of the layers; the word embeddings and the position
    embeddings in the first stage, the final norm and the output layer in the last (untied, or tied its copy of the
    word embeddings, which a re-formation moves as it moves the first stage's)."""
    h, layers = model["hidden_size"], model["num_layers"] // stages
    first, last = stage == 0, stage == stages - 1
    heads = model["num_attention_heads"]
    groups = model["num_query_groups"] or heads
    head_dim = model["kv_channels"] or h // heads
    per_group = heads // groups
    qkv_rows = (per_group + 2) * head_dim
    gate = 2 if model["gated_linear_unit"] else 1
    norm = h * (2 if model["normalization"] == "LayerNorm" else 1)
    positions = model["max_position_embeddings"] or model["seq_length"]
    per_unit = {
        "heads": layers * (qkv_rows * h + qkv_rows + h * per_group * head_dim),
        "ffn": layers * (gate * h + gate + h),
        "vocab": h * (first + last) if stages > 1 else h * (2 if model["untie_embeddings_and_output_weights"] else 1),
    }
    replicated = layers * (2 * norm + 2 * h) + norm * last + (
        positions * h if model["position_embedding_type"] == "learned_absolute" and first else 0)
    return per_unit, replicated


def unit_counts(model: dict) -> dict[str, int]:
    return {"heads": model["num_query_groups"] or model["num_attention_heads"],
            "ffn": model["ffn_hidden_size"] or 4 * model["hidden_size"], "vocab": model["vocab_size"]}


def _canonical_block(num_units: int, tp_base: int, slot: int) -> set[int]:
    """Block ``slot``: the ``slot``-th of ``tp_base`` contiguous runs of unit ids, larger runs first."""
    base, rest = divmod(num_units, tp_base)
    start = slot * base + min(slot, rest)
    return set(range(start, start + base + (1 if slot < rest else 0)))


def holdings(topology: dict) -> dict[tuple[int, int], dict[str, set[int]]]:
    """(replica, slot) -> family -> the units that slot's process holds: its canonical block but the units listed
    away from it, plus the units listed as dealt to it (the topology's ``dealt`` lists every unit not held by its own
    slot: a dead block's, or one a weighted replica's slot lent)."""
    tp_base, units = topology["tp_base"], topology["units"]
    out = {}
    for rep in topology["replicas"]:
        for slot in rep["slots"]:
            out[rep["index"], slot] = {
                family: (_canonical_block(n, tp_base, slot) - {u for u, _ in rep["dealt"].get(family, [])})
                | {u for u, s in rep["dealt"].get(family, []) if s == slot}
                for family, n in units.items()}
    return out


def _slot_of_rank(topology: dict) -> dict[int, tuple[int, int]]:
    return {rank: (rep["index"], slot)
            for rep in topology["replicas"] for slot, rank in zip(rep["slots"], rep["ranks"])}


def reformation_lower_bound(model: dict, optimizer: str, base: dict, new: dict, dead_ranks: Sequence[int],
                            fresh: bool) -> int:
    """Bytes a re-formation from ``base`` to ``new`` must move, from peers: every unit a process holds in ``new``
    and did not hold in ``base`` (a survivor keeps what it held; all a dead rank held is gone), and for a process
    new to the job (a joiner) also the replicated parameters; each with its optimizer state. Zero when ``fresh``:
    before the run's first committed iteration every rank builds its state itself (from the seed, or from the
    checkpoint the run starts from)."""
    if fresh:
        return 0
    if "stages" in base:  # units move inside a stage only
        return sum(_stage_lower_bound(model, optimizer, b, n, dead_ranks, p, len(base["stages"]))
                   for p, (b, n) in enumerate(zip(base["stages"], new["stages"])))
    return _stage_lower_bound(model, optimizer, base, new, dead_ranks)


def _stage_lower_bound(model: dict, optimizer: str, base: dict, new: dict, dead_ranks: Sequence[int], stage: int = 0,
                       stages: int = 1) -> int:
    """:func:`reformation_lower_bound` of one stage's topologies (the whole job's without stages)."""
    per_unit, replicated = unit_elements(model, stage, stages)
    ranks = _slot_of_rank(base)
    dead = {ranks[r] for r in dead_ranks if r in ranks}
    before, after = holdings(base), holdings(new)
    elements = 0
    for slot, held in after.items():
        kept = before.get(slot) if slot not in dead else None
        for family, units in held.items():
            elements += len(units - (kept[family] if kept else set())) * per_unit[family]
        if kept is None:
            elements += replicated
    return elements * BYTES_PER_ELEMENT * (1 + _STATE_TENSORS[optimizer])


def _member_slot(rep: dict, block: int) -> int:
    """The slot of replica ``rep`` (topology JSON) that is its member of sync group ``block``: slot ``block``, or
    the proxy of that dead block."""
    return block if block in rep["slots"] else dict(map(tuple, rep["proxies"]))[block]


def needed_shards(base: dict, new: dict, dead_ranks: Sequence[int], dp: int, instances: int) -> dict:
    """Under the distributed optimizer: (block, position, destination (replica, slot)) -> the (replica, slot)
    processes of ``base`` that could send it, for every shard a member of a sync group in ``new`` did not hold in
    ``base``. Megatron's instances: instance i is replicas ``[i·dp/k, (i+1)·dp/k)``, a replica's position is its
    place in its instance, and the holders of shard (block, position) are the block's sync members of the replicas
    at that position (one per instance). A possible source is a surviving holder: the destination's own replica's
    old member (a slot rejoining takes its shard back), else its twin in another instance."""
    per = dp // instances
    dead = {_slot_of_rank(base)[r] for r in dead_ranks}
    old = {rep["index"]: rep for rep in base["replicas"]}
    out = {}
    for rep in new["replicas"]:
        position = rep["index"] % per
        for block in range(new["tp_base"]):
            dst = (rep["index"], _member_slot(rep, block))
            before = old.get(rep["index"])
            if before is not None and (rep["index"], _member_slot(before, block)) == dst and dst not in dead:
                continue  # it held this shard and lives on
            sources = [(r, _member_slot(o, block)) for r, o in sorted(old.items()) if r % per == position]
            out[block, position, dst] = [src for src in sources if src not in dead]
    return out


def shard_bytes(model: dict, optimizer: str, tp_base: int, block: int, positions: int) -> Optional[int]:
    """Bytes of one shard of ``block`` (its parameter elements, as fp32, with the optimizer's state) where the
    whole of a block's buffers is one shard (one position per instance): the block's units and every replicated
    parameter; None where shards cut buffers (more positions: where the cut falls depends on Megatron's padding)."""
    if positions != 1:
        return None
    per_unit, replicated = unit_elements(model)
    counts = unit_counts(model)
    elements = sum(len(_canonical_block(counts[f], tp_base, block)) * per_unit[f] for f in per_unit) + replicated
    return elements * BYTES_PER_ELEMENT * (1 + _STATE_TENSORS[optimizer])


def check_shard_moves(event: dict, cfg: dict, launch: dict, base: dict, new: dict,
                      dead_ranks: Sequence[int]) -> list[str]:
    """What is wrong with a ``reformed`` event of a job with the distributed optimizer: its ``shard_moves`` (block,
    position, source and destination launch ranks, bytes) must be exactly the shards :func:`needed_shards` finds,
    each from one of its possible sources, each of the bytes :func:`shard_bytes` says (where it can say), and
    ``moved_bytes`` their sum. ``launch``: the segment's generation 0 topology (its ranks are launch ranks)."""
    p = cfg["parallel"]
    dp, instances = p["data_parallel_size"], p["num_distributed_optimizer_instances"]
    slot_of = _slot_of_rank(launch)
    g = event["generation"]
    moves = event.get("shard_moves")
    if moves is None:
        return [f"generation {g}: no shard_moves in the reformed event"]
    needed = needed_shards(base, new, dead_ranks, dp, instances)
    got = {(m["block"], m["position"], slot_of[m["dst"]]): m for m in moves}
    wrong = []
    if len(got) != len(moves) or sorted(got) != sorted(needed):
        wrong.append(f"generation {g}: shards moved (block, position, to) {sorted(got)}, needed {sorted(needed)}")
    for key, m in got.items():
        if key in needed and slot_of[m["src"]] not in needed[key]:
            wrong.append(f"generation {g}: shard {key[:2]} came from {slot_of[m['src']]}, not from a surviving "
                         f"holder {needed[key]}")
        expected = shard_bytes(cfg["model"], cfg["training"]["optimizer"], new["tp_base"], m["block"],
                               dp // instances)
        if expected is not None and m["bytes"] != expected:
            wrong.append(f"generation {g}: shard {key[:2]} moved {m['bytes']} bytes; its state is {expected} bytes")
    if sum(m["bytes"] for m in moves) != event["moved_bytes"]:
        wrong.append(f"generation {g}: moved {event['moved_bytes']} bytes, the shards listed are "
                     f"{sum(m['bytes'] for m in moves)} bytes")
    return wrong


class ReformationBoundError(AssertionError):
    """A re-formation moved other bytes than the units that had to move, or a rank reported another lower bound;
    ``result``: the job (every re-formation of it was checked)."""

    result: Optional[JobResult] = None


CHECKED_METRICS: set[Path] = set()
"""Metrics files already checked by :func:`run_job` (the conftest check skips them)."""


def job_config(run_dir: Path) -> dict:
    """The job's resolved configuration, as the launcher wrote it."""
    path = run_dir / "config.node0.json"
    assert path.is_file(), f"{path} not found: the model dimensions for the moved-bytes check come from it"
    return json.loads(path.read_text())


def check_reformations(records: list[dict], run_dir: Path) -> list[dict]:
    """Every ``reformed`` event recovered in less than half of ``parallel.timeout_s`` (no wait ran into the collective
    timeout), and moved exactly :func:`reformation_lower_bound` bytes, computed from the model's dimensions and the
    topologies in the ``generation_published`` events, and reported that bound (else
    :class:`ReformationBoundError`, once every re-formation is checked); the unit counts the controller published
    are the model's. Under the distributed optimizer whole shards move instead of units: the event's shard moves
    must be the needed ones, from surviving holders, and the bound is their state's bytes
    (:func:`check_shard_moves`)."""
    found, wrong = [], []
    for segment in segments(records):
        reformed = [r for r in segment.records if r.get("event") == "reformed"]
        if not reformed:
            continue
        cfg = job_config(run_dir)
        model, optimizer = cfg["model"], cfg["training"]["optimizer"]
        published, iterations = segment.published(), segment.iterations()
        for event in reformed:
            g = event["generation"]
            assert g in published, f"re-formed into generation {g}, which the controller never published"
            new = published[g]
            base = published[new["base"]]
            units = [_stage_topology(t["topology"], 0)["units"] for t in (new, base)]
            assert units[0] == units[1] == unit_counts(model), (
                f"generation {g}: unit counts {units[0]}, but the model has {unit_counts(model)}")
            fresh = not any(i < event["resume_iteration"] for i in iterations)
            sharded = cfg.get("parallel", {}).get("use_distributed_optimizer", False)
            if sharded and not fresh:  # whole shards move, and no units
                wrong += check_shard_moves(event, cfg, published[0]["topology"], base["topology"], new["topology"],
                                           new["dead_ranks"])
                p = cfg["parallel"]
                positions = p["data_parallel_size"] // p["num_distributed_optimizer_instances"]
                sizes = [shard_bytes(model, optimizer, new["topology"]["tp_base"], m["block"], positions)
                         for m in event.get("shard_moves", [])]
                # Where shards cut the buffers the harness has no geometry of its own: the figure the ranks computed
                # from Megatron's layout, which the moved bytes (received into the real objects) must equal.
                bound = event["lower_bound_bytes"] if None in sizes else sum(sizes)
            else:
                bound = reformation_lower_bound(model, optimizer, base["topology"], new["topology"],
                                                new["dead_ranks"], fresh)
            found.append({"generation": g, "moved_bytes": event["moved_bytes"], "bound": bound, "fresh": fresh})
            if event["moved_bytes"] != bound:
                wrong.append(f"generation {g} (from {new['base']}, dead ranks {new['dead_ranks']}, joined "
                             f"{new['joined']}): moved {event['moved_bytes']} bytes, but the units that had to move "
                             f"are {bound} bytes")
            timeout_s = cfg.get("parallel", {}).get("timeout_s")
            if timeout_s is not None and event["recovery_s"] >= timeout_s / 2:
                wrong.append(f"generation {g}: recovered in {event['recovery_s']:.1f} s, half the collective timeout "
                             f"parallel.timeout_s ({timeout_s} s) or more: a wait ran into it rather than out")
            if event["lower_bound_bytes"] != bound:
                wrong.append(f"generation {g}: the rank reported a lower bound of {event['lower_bound_bytes']} bytes; "
                             f"the units that had to move are {bound} bytes")
    if wrong:
        raise ReformationBoundError("; ".join(wrong))
    return found


