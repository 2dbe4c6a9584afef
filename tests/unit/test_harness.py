"""The suite's own checks (``tests/harness/``), on records written out by hand: the moved-bytes bound of a
re-formation, and that every live (replica, TP rank) reports agreeing state checksums."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness import (JobResult, ReformationBoundError, assert_replicas_agree, check_reformations,
                           reformation_lower_bound, unit_counts, unit_elements)

TINY_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": None,
              "kv_channels": None, "ffn_hidden_size": None, "vocab_size": 256, "gated_linear_unit": False,
              "normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "seq_length": 64,
              "max_position_embeddings": None, "untie_embeddings_and_output_weights": False}
UNITS = {"heads": 8, "ffn": 256, "vocab": 256}


def replica(index: int, slots: list[int], ranks: list[int], dealt_to: dict[int, int] = {}) -> dict:
    """A replica's topology JSON; ``dealt_to``: dead block -> the live slot holding (and proxying) all of it."""
    dealt = {}
    for block, slot in dealt_to.items():
        for family, n in UNITS.items():
            per = n // 2
            dealt.setdefault(family, []).extend([u, slot] for u in range(block * per, (block + 1) * per))
    return {"index": index, "slots": slots, "ranks": ranks, "proxies": [[b, s] for b, s in dealt_to.items()],
            "dealt": dealt}


def topology(generation: int, *replicas: dict) -> dict:
    return {"generation": generation, "tp_base": 2, "units": UNITS, "replicas": list(replicas)}


HEALTHY = topology(0, replica(0, [0, 1], [0, 1]), replica(1, [0, 1], [2, 3]))
DEGRADED = topology(1, replica(0, [0, 1], [0, 1]), replica(1, [0], [2], {1: 0}))


def test_bound_of_the_main_jobs_failure_and_rejoin():
    """The main job (README): a kill of replica 1's slot 1 moves its canonical block, 677.2 KiB; the rejoin moves
    it back with the replicated parameters, 735.8 KiB; before the first commit nothing moves."""
    assert reformation_lower_bound(TINY_MODEL, "adam", HEALTHY, DEGRADED, [3], fresh=False) == 693504
    assert reformation_lower_bound(TINY_MODEL, "adam", DEGRADED, HEALTHY, [], fresh=False) == 753408
    assert reformation_lower_bound(TINY_MODEL, "adam", HEALTHY, DEGRADED, [3], fresh=True) == 0
    assert reformation_lower_bound(TINY_MODEL, "sgd", HEALTHY, DEGRADED, [3], fresh=False) == 693504 * 2 // 3


def test_bound_of_a_dropped_replica_rebuilt_by_one_joiner():
    """Replica 1 was dropped; one replacement brings it back alone at TP1: it must receive both blocks and the
    replicated parameters (1.4 MiB), not only its own canonical block."""
    dropped = topology(2, replica(0, [0, 1], [0, 1]))
    rebuilt = topology(3, replica(0, [0, 1], [0, 1]), replica(1, [0], [2], {1: 0}))
    assert reformation_lower_bound(TINY_MODEL, "adam", dropped, rebuilt, [], fresh=False) == 2 * 693504 + 59904


def _main_job_records(moved: int, reported: int) -> list[dict]:
    """The records of the main job's failure, as the launcher and rank 0 write them, with the figures given."""
    published = [{"kind": "event", "event": "generation_published", "generation": g, "base": base, "dead_ranks": dead,
                  "joined": [], "topology": topo} for g, base, dead, topo in ((0, None, [], HEALTHY),
                                                                            (1, 0, [3], DEGRADED))]
    iterations = [{"kind": "iteration", "iteration": k} for k in range(1, 15)]
    reformed = {"kind": "event", "event": "reformed", "generation": 1, "moved_bytes": moved,
                "lower_bound_bytes": reported, "resume_iteration": 15}
    return [*published, *iterations, reformed]


def test_every_reformation_is_held_to_the_tests_own_bound_not_the_ranks(tmp_path):
    """``check_reformations`` computes the bound from the published topologies: a rank that moved too much and
    reported that figure as its bound fails it; the exact figure passes."""
    (tmp_path / "config.node0.json").write_text(json.dumps({"model": TINY_MODEL, "training": {"optimizer": "adam"}}))
    [found] = check_reformations(_main_job_records(693504, 693504), tmp_path)
    assert found["bound"] == 693504 and not found["fresh"]
    with pytest.raises(ReformationBoundError, match="moved 693508 bytes, but the units that had to move are 693504"):
        check_reformations(_main_job_records(693508, 693508), tmp_path)
    with pytest.raises(ReformationBoundError, match="reported a lower bound of 600000 bytes"):
        check_reformations(_main_job_records(693504, 600000), tmp_path)


def test_a_dead_proxy_moves_its_own_block_and_the_dead_block_it_held():
    """A degraded TP4 replica (TP3) loses the proxy of its dead block: its own block and the dealt unit it held
    move to the survivors; what a survivor already held does not."""
    four = {"heads": 8, "ffn": 8, "vocab": 8}
    base = {"generation": 1, "tp_base": 4, "units": four, "replicas": [
        {"index": 0, "slots": [0, 1, 2, 3], "ranks": [0, 1, 2, 3], "proxies": [], "dealt": {}},
        {"index": 1, "slots": [0, 1, 2], "ranks": [4, 5, 6], "proxies": [[3, 0]],
         "dealt": {f: [[6, 0], [7, 1]] for f in four}}]}
    new = {"generation": 2, "tp_base": 4, "units": four, "replicas": [
        base["replicas"][0],
        {"index": 1, "slots": [1, 2], "ranks": [5, 6], "proxies": [[0, 1], [3, 2]],
         "dealt": {f: [[0, 1], [1, 2], [6, 2], [7, 1]] for f in four}}]}
    model = {**TINY_MODEL, "ffn_hidden_size": 8, "vocab_size": 8}
    per_unit, _ = unit_elements(model)
    # Slot 0 held units 0, 1 and 6 of each family: slot 1 receives 0, slot 2 receives 1 and 6 (7 stays on slot 1).
    assert reformation_lower_bound(model, "adam", base, new, [4], fresh=False) == 3 * sum(per_unit.values()) * 12


@pytest.mark.parametrize("overrides", [
    {},
    {"num_attention_heads": 12, "num_query_groups": 6, "kv_channels": 8, "hidden_size": 32, "ffn_hidden_size": 41,
     "vocab_size": 263, "gated_linear_unit": True, "untie_embeddings_and_output_weights": True,
     "normalization": "RMSNorm", "position_embedding_type": "rope"},
], ids=["tiny", "gqa-gated-untied-rmsnorm-rope"])
def test_unit_elements_count_every_parameter_of_megatrons_gpt(megatron, overrides):  # noqa: F811
    """The formula's units times their counts, plus the replicated parameters, are exactly the parameters of
    Megatron-Core's TP1 GPTModel; and each family's share is the parameters this project splits by it."""
    from ntp_megatron.config.schema import load_job_config
    from ntp_megatron.core.gpt import family_geometry
    from ntp_megatron.training.model import build_model, transformer_config

    model = {**TINY_MODEL, **overrides}
    keys = ["ntp.enabled=false", "parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=1",
            *(f"model.{k}={'null' if v is None else v}" for k, v in model.items())]
    if model["gated_linear_unit"]:
        keys.append("model.activation=swiglu")
    cfg = load_job_config(None, keys)
    tf_config = transformer_config(cfg)
    gpt = build_model(cfg, tf_config, megatron, torch.device("cpu")).module
    per_unit, replicated = unit_elements(model)
    counts = unit_counts(model)
    by_family = {family: 0 for family in per_unit}
    other = 0
    for name, param in gpt.named_parameters():
        geometry = family_geometry(name, tf_config)
        if geometry is None:
            other += param.numel()
        else:
            by_family[geometry[0]] += param.numel()
    assert by_family == {family: per_unit[family] * counts[family] for family in per_unit}
    assert other == replicated


def _records(rows: list[tuple], iters: int = 3, kill_after: int = 0, stopped: bool = False) -> list[dict]:
    """Generation 0 TP2 x 2 (and, with ``kill_after`` k, generation 1 at TP2 + TP1 from iteration k + 1; with
    ``stopped``, the job stopped after its last iteration instead) with checksum rows (iteration, replica, tp_rank
    [, generation]) all alike but for their iteration; a row's generation is its iteration's unless it says."""
    out = [{"kind": "event", "event": "generation_published", "generation": 0, "base": None, "dead_ranks": [],
            "joined": [], "topology": HEALTHY}]
    if kill_after:
        out.append({"kind": "event", "event": "generation_published", "generation": 1, "base": 0, "dead_ranks": [3],
                    "joined": [], "topology": DEGRADED})
        out.append({"kind": "event", "event": "rank_failed", "launch_rank": 3, "generation": 0})
    for i in range(1, iters + 1):
        g = 1 if kill_after and i > kill_after else 0
        out.append({"kind": "iteration", "iteration": i, "generation": g, "tp_per_replica": [2, 1] if g else [2, 2]})
    for row in rows:
        i, rep, tp = row[:3]
        g = row[3] if len(row) > 3 else (1 if kill_after and i > kill_after else 0)
        out.append({"kind": "state_checksums", "iteration": i, "replica": rep, "tp_rank": tp, "generation": g,
                    "checksums": {"w": f"state-{i}"}, "grad_norm": 0.5})
    if stopped:
        out.append({"kind": "event", "event": "rank_failed", "launch_rank": 3, "generation": 0})
        out.append({"kind": "event", "event": "job_stopped", "reason": "test"})
    return out


def _result(records: list[dict]) -> JobResult:
    return JobResult(0, "", "", records, Path("."))


ALL = [(i, rep, tp) for i in (1, 2, 3) for rep in (0, 1) for tp in (0, 1)]


def test_every_live_rank_must_report_every_iteration():
    assert_replicas_agree(_result(_records(ALL)), 3)
    with pytest.raises(AssertionError, match=r"iteration 2: no state checksums from .*\[\(1, 1\)\] in generation 0"):
        assert_replicas_agree(_result(_records([r for r in ALL if r != (2, 1, 1)])), 3)
    with pytest.raises(AssertionError, match="iterations without checksums"):
        assert_replicas_agree(_result(_records(ALL)), 4)


def test_a_check_a_failure_cut_short_is_made_up_in_the_next_generation():
    """Launch rank 3 (replica 1, TP rank 1) dies after iteration 2: generation 1 (TP2 + TP1) trains iteration 3
    from the state after 2, so its three ranks must have checked that state too."""
    live_after = [(0, 0), (0, 1), (1, 0)]
    first = [(1, rep, tp) for rep in (0, 1) for tp in (0, 1)]
    cut_short = [(2, 0, 0), (2, 0, 1)]  # replica 1's check of iteration 2 never ran in generation 0
    made_up = [(2, rep, tp, 1) for rep, tp in live_after]
    third = [(3, rep, tp) for rep, tp in live_after]
    assert_replicas_agree(_result(_records(first + cut_short + made_up + third, kill_after=2)), 3)
    with pytest.raises(AssertionError, match=r"iteration 2: no state checksums .* in generation 1"):
        assert_replicas_agree(_result(_records(first + cut_short + third, kill_after=2)), 3)
    with pytest.raises(AssertionError, match=r"iteration 3: a report from \(1, 1\), which is not live in generation 1"):
        assert_replicas_agree(_result(_records(first + cut_short + made_up + third + [(3, 1, 1)], kill_after=2)), 3)
    records = _records(first + cut_short + made_up + third, kill_after=2)
    next(r for r in records if r.get("kind") == "state_checksums" and r["iteration"] == 2
         and r["generation"] == 1)["checksums"]["w"] = "x"
    with pytest.raises(AssertionError, match="iteration 2: .* differs"):
        assert_replicas_agree(_result(records), 3)


def test_only_the_last_iteration_before_a_stop_may_lack_rows():
    lacking_3 = [r for r in ALL if r[0] != 3 or r[1] == 0]
    assert_replicas_agree(_result(_records(lacking_3, stopped=True)), 3)
    with pytest.raises(AssertionError, match=r"iteration 3: no state checksums"):
        assert_replicas_agree(_result(_records(lacking_3)), 3)  # no stop: nothing excuses them
    died = _records(lacking_3) + [{"kind": "event", "event": "rank_failed", "launch_rank": 3, "generation": 0}]
    with pytest.raises(AssertionError, match=r"iteration 3: no state checksums"):
        assert_replicas_agree(_result(died), 3)  # a death the job went on from: the next generation checks
    lacking_2 = [r for r in ALL if r[0] != 2 or r[1] == 0]
    with pytest.raises(AssertionError, match=r"iteration 2: no state checksums"):
        assert_replicas_agree(_result(_records(lacking_2, stopped=True)), 3)


def test_reports_must_agree():
    records = _records(ALL)
    next(r for r in records if r.get("kind") == "state_checksums" and r["iteration"] == 2)["checksums"]["w"] = "x"
    with pytest.raises(AssertionError, match="iteration 2: .* differs"):
        assert_replicas_agree(_result(records), 3)
