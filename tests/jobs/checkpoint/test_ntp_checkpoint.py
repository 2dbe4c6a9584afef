"""Checkpoints of NTP runs (``ntp_megatron.core.checkpoint_map``, ``ntp_megatron.training.checkpoint``).

- Layout independence, on metadata alone: for random topologies every rank's fragments, with their replica
  ids, cover every global tensor exactly once as main replicas, and every replica covers it once.
- In one process, every rank of a topology at a time: the NTP model's sharded state dict has plain
  Megatron-Core's keys and global shapes, and its main fragments reassemble plain TP1's tensors element for
  element (gated MLP, GQA, untied output layer included; a healthy and a degraded writer).
- Real multi-process gloo jobs: save under TP4 + TP3, continue under TP2 + TP2 + TP2 (through a live failure
  after the resume) and under uniform TP1 with NTP off; a plain Megatron-Core script's checkpoint continues
  under NTP TP2 + TP1; NTP checkpoints load into plain Megatron-Core at TP1 and TP2 with the NTP model's
  logits; a rank killed during a save is absorbed live and the checkpoint written again; a job that ends in
  the middle of a save leaves the last good checkpoint, from which a new job resumes (its first generation
  degraded by a failure before it formed).
- Errors and crash safety: a checkpoint of another model shape; ``latest`` moves only after a complete save.

``python -m tests.jobs.checkpoint.test_ntp_checkpoint ntp-logits ...`` is the NTP side of the logits comparison (the tests fork it
from the zygote of ``tests.harness``, like ``tests.plain_megatron``; it forks its ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.plan.layout import make_topology, next_topology
from tests.harness import TINY, assert_ok, assert_replicas_agree, relative_difference, run_job, run_module
from tests.jobs.live.test_live_failure import leftover_processes

ITERS, SAVE_AT = 6, 3
TOLERANCE = 1e-5

# ---------------------------------------------------------------------------------------------------------------
# Layout independence on metadata (no processes, no torch tensors)


def _param_table(m: SimpleNamespace, n: dict[str, int]) -> list[tuple[str, str, int, tuple[int, ...], int, int]]:
    """(name, family, split axis, local shape, outer, inner) of a GPT layer's TP-split parameters for a rank
    holding ``n[family]`` units: Megatron's layouts, written out independently of the NTP layers."""
    hpg = m.heads // m.groups
    rows = (hpg + 2) * m.hd
    return [
        ("qkv.weight", "heads", 0, (n["heads"] * rows, m.hidden), 1, rows * m.hidden),
        ("qkv.bias", "heads", 0, (n["heads"] * rows,), 1, rows),
        ("proj.weight", "heads", 1, (m.hidden, n["heads"] * hpg * m.hd), m.hidden, hpg * m.hd),
        ("fc1.weight", "ffn", 0, (m.gate * n["ffn"], m.hidden), m.gate, m.hidden),
        ("fc1.bias", "ffn", 0, (m.gate * n["ffn"],), m.gate, 1),
        ("fc2.weight", "ffn", 1, (m.hidden, n["ffn"]), m.hidden, 1),
        ("embedding", "vocab", 0, (n["vocab"], m.hidden), 1, m.hidden),
    ]


def _global_shape(m: SimpleNamespace, name: str) -> tuple[int, ...]:
    full = {family: getattr(m, family) for family in ("heads", "ffn", "vocab")}
    full["heads"] = m.groups
    return next(shape for n, _, _, shape, _, _ in _param_table(m, full) if n == name)


def topology_boxes(topology, m: SimpleNamespace):
    """Every rank's boxes per tensor as the checkpoint code describes them: ``{name: [(rank, replica,
    replica_id, offset, size)]}``, TP-split tensors through ``checkpoint_map.fragments`` and a replicated one
    (``norm``) whole on every rank."""
    from ntp_megatron.core.checkpoint_map import UnitAxis, checkpoint_roles, fragments

    members = [(topology.replica_of(r).index, topology.replica_of(r).width, topology.local_rank(r))
               for r in range(topology.world_size)]
    roles = checkpoint_roles(members, topology.tp_base)
    out: dict[str, list] = {}
    for rank in range(topology.world_size):
        replica = members[rank][0]
        units = {f: topology.units_of(rank, f) for f in ("heads", "ffn", "vocab")}
        for name, family, axis, shape, outer, inner in _param_table(m, {f: len(u) for f, u in units.items()}):
            num_units = topology.units[family]
            split = UnitAxis.of(shape, axis, num_units, len(units[family]), outer, inner)
            for box in fragments(shape, split, units[family]):
                out.setdefault(name, []).append((rank, replica, roles[rank].split_replica_id, box.global_offset,
                                                 box.shape))
        out.setdefault("norm", []).append((rank, replica, roles[rank].replicated_replica_id, (0,), (m.hidden,)))
    return out


def _counts(shape: tuple[int, ...], boxes) -> np.ndarray:
    """How many of ``boxes`` (offset, size) cover each element: an independent element-level count."""
    count = np.zeros(shape, dtype=np.int32)
    for offset, size in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(offset, size))] += 1
    return count


@st.composite
def cases(draw):
    tp_base = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 3))
    groups = draw(st.integers(tp_base, 7))
    m = SimpleNamespace(groups=groups, heads=groups * draw(st.integers(1, 2)), hd=2, hidden=3,
                        ffn=draw(st.integers(tp_base, 11)), vocab=draw(st.integers(tp_base, 13)),
                        gate=draw(st.sampled_from([1, 2])))
    dead = [(r, s) for r in range(dp) for s in draw(st.sets(st.integers(0, tp_base - 1), max_size=tp_base - 1))]
    topology = make_topology(tp_base, dp, {"heads": groups, "ffn": m.ffn, "vocab": m.vocab}, dead)
    if draw(st.booleans()) and topology.world_size > 1:  # a later failure: units dealt in two rounds
        victim = draw(st.integers(0, topology.world_size - 1))
        topology = next_topology(topology, [victim])
    return topology, m


@settings(max_examples=25, deadline=None)
@given(cases())
def test_fragments_cover_every_tensor_exactly_once(case):
    """main replicas tile each tensor once (whichever replicas are degraded or dropped), and
    each replica on its own tiles it once (so any replica can load it)."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from ntp_megatron.patches.dist_checkpointing_validation import coverage_error

    topology, m = case
    for name, boxes in topology_boxes(topology, m).items():
        shape = (m.hidden,) if name == "norm" else _global_shape(m, name)
        main = [(offset, size) for _, _, rid, offset, size in boxes if is_main_replica(rid)]
        assert (_counts(shape, main) == 1).all(), f"{name}: main replicas do not tile {shape} exactly once"
        assert len({replica for _, replica, rid, _, _ in boxes if is_main_replica(rid)}) == 1, name
        holders = {b[1] for b in boxes} if name != "norm" else {b[0] for b in boxes}  # replicas; ranks for norm
        for holder in holders:
            mine = [(offset, size) for rank, r, _, offset, size in boxes if (r if name != "norm" else rank) == holder]
            assert (_counts(shape, mine) == 1).all(), f"{name}: replica/rank {holder} does not hold it exactly once"
        # The validator the save runs (patch) agrees with the element count.
        assert coverage_error(shape, [(rank, offset, size) for rank, _, rid, offset, size in boxes
                                      if is_main_replica(rid)]) is None


def test_coverage_validator_finds_holes_overlaps_and_strays():
    from ntp_megatron.patches.dist_checkpointing_validation import coverage_error

    assert coverage_error((4, 2), [(0, (0, 0), (2, 2)), (1, (2, 0), (2, 2))]) is None
    assert "overlap" in coverage_error((4, 2), [(0, (0, 0), (3, 2)), (1, (2, 0), (2, 2))])
    assert "cover 6 of its 8" in coverage_error((4, 2), [(0, (0, 0), (3, 2))])
    assert "outside" in coverage_error((4, 2), [(0, (0, 0), (2, 2)), (1, (3, 0), (2, 2))])


def test_writer_is_the_first_healthy_replica_else_the_first():
    from ntp_megatron.core.checkpoint_map import checkpoint_roles, unit_runs, writer_replica

    assert writer_replica({0: 3, 1: 4, 2: 4}, 4) == 1
    assert writer_replica({1: 3, 2: 2}, 4) == 1
    roles = checkpoint_roles([(0, 3, 0), (0, 3, 1), (0, 3, 2), (2, 4, 0), (2, 4, 1), (2, 4, 2), (2, 4, 3)], 4)
    assert [r.replica_rank for r in roles] == [1, 1, 1, 0, 0, 0, 0]
    assert [r.replicated_replica_id for r in roles][3:5] == [(0, 0, 0), (0, 1, 0)]
    assert unit_runs([0, 1, 6]) == [(0, 0, 2), (6, 2, 1)]
    with pytest.raises(ValueError, match="TP ranks"):
        checkpoint_roles([(0, 2, 0), (0, 2, 0)], 2)


# ---------------------------------------------------------------------------------------------------------------
# In one process: real NTP models of every rank against plain Megatron-Core's GPTModel


@pytest.fixture(scope="module")
def megatron():
    """A one-rank gloo world with Megatron-Core's groups and this package's patches (in this process)."""
    import torch.distributed as dist

    from ntp_megatron.patches import apply_patches
    from ntp_megatron.patches import parallel_state as ps_patch

    apply_patches(cpu=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from ntp_megatron.core.groups import dense_groups

    yield ps_patch.install(dense_groups(1, 0, 1, timedelta(seconds=60)))
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


MODELS = {
    "tiny": [],
    "gated-gqa-untied": ["model.num_attention_heads=12", "model.num_query_groups=6", "model.kv_channels=8",
                         "model.hidden_size=32", "model.ffn_hidden_size=41", "model.vocab_size=263",
                         "model.gated_linear_unit=true", "model.activation=swiglu",
                         "model.untie_embeddings_and_output_weights=true"],
}
TOPOLOGIES = {  # (tp_base, dp, dead slots): a healthy writer; no healthy replica (a degraded writer)
    "tp4+tp3": (4, 2, [(1, 3)]),
    "tp3+tp2": (4, 2, [(0, 1), (1, 0), (1, 2)]),
}


def _entries(sharded_state_dict) -> list:
    """ShardedTensors and ShardedObjects after Megatron applies the factories."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    apply_factories(sharded_state_dict)
    return list(nested_values(sharded_state_dict))


def _place(full, entry) -> None:
    import torch

    size = (1,) * entry.prepend_axis_num + tuple(entry.local_shape)
    index = tuple(slice(o, o + s) for o, s in zip(entry.global_offset, size))
    full[index] = entry.data.reshape(size).to(torch.float64)


@pytest.mark.parametrize("topology_name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_ntp_state_dict_is_plain_megatrons(megatron, model_name, topology_name):
    """Keys, global shapes and element order of plain TP1 Megatron-Core, from every rank's fragments."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
    from megatron.core.models.gpt import GPTModel

    from ntp_megatron.config.schema import load_job_config
    from ntp_megatron.core.gpt import RankUnits, build_ntp_gpt
    from ntp_megatron.core.checkpoint_map import ROLE_KEY, checkpoint_roles
    from ntp_megatron.training.model import layer_spec, transformer_config

    cfg = load_job_config(None, ["parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=1",
                                 *MODELS[model_name]])
    m = cfg.model
    common = dict(max_sequence_length=m.seq_length, pre_process=True, post_process=True,
                  share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                  position_embedding_type=m.position_embedding_type, pg_collection=megatron)
    torch.manual_seed(5)
    plain = GPTModel(config=transformer_config(cfg), transformer_layer_spec=layer_spec(cfg),
                     vocab_size=m.vocab_size, **common)
    with torch.no_grad():
        for param in plain.parameters():
            param.normal_()  # distinct values everywhere, norms and biases included
    full = dict(plain.named_parameters())
    expected: dict[str, torch.Tensor] = {}
    objects: set[tuple[str, tuple[int, ...]]] = set()
    for entry in _entries(plain.sharded_state_dict()):
        if isinstance(entry, ShardedObject):
            objects.add((entry.key, entry.global_offset))
            continue
        expected.setdefault(entry.key, torch.zeros(entry.global_shape, dtype=torch.float64))
        _place(expected[entry.key], entry)

    tp_base, dp, dead = TOPOLOGIES[topology_name]
    topology = make_topology(tp_base, dp, cfg.unit_counts(), dead)
    members = [(topology.replica_of(r).index, topology.replica_of(r).width, topology.local_rank(r))
               for r in range(topology.world_size)]
    roles = checkpoint_roles(members, tp_base)
    main = {key: torch.zeros_like(t) for key, t in expected.items()}
    count = {key: torch.zeros_like(t) for key, t in expected.items()}
    per_replica: dict[tuple[int, str], torch.Tensor] = {}
    main_objects: list[tuple[str, tuple[int, ...]]] = []
    for rank in range(topology.world_size):
        units = RankUnits(*(tuple(topology.units_of(rank, f)) for f in ("heads", "ffn", "vocab")))
        model = build_ntp_gpt(transformer_config(cfg), units, m.normalization, m.vocab_size, initialize=False,
                              **common)
        with torch.no_grad():
            for name, param in model.named_parameters():
                held = getattr(param, "ntp_held_units", None)
                value = held.select(full[name]) if held is not None else full[name]
                param.copy_(value.reshape(param.shape))
        for entry in _entries(model.sharded_state_dict(metadata={ROLE_KEY: roles[rank]})):
            if isinstance(entry, ShardedObject):
                if is_main_replica(entry.replica_id):
                    main_objects.append((entry.key, entry.global_offset))
                continue
            assert isinstance(entry, ShardedTensor)
            assert entry.key in expected, f"{entry.key} is not a key of plain Megatron's GPTModel"
            assert entry.global_shape == tuple(expected[entry.key].shape), entry.key
            replica = members[rank][0]
            mine = per_replica.setdefault((replica, entry.key), torch.zeros_like(expected[entry.key]))
            _place(mine, entry)
            if is_main_replica(entry.replica_id):
                _place(main[entry.key], entry)
                ones = entry.data.new_ones(entry.local_shape)
                size = (1,) * entry.prepend_axis_num + tuple(entry.local_shape)
                index = tuple(slice(o, o + s) for o, s in zip(entry.global_offset, size))
                count[entry.key][index] += ones.reshape(size).to(torch.float64)
    assert set(main) == set(expected)
    for key in expected:
        assert (count[key] == 1).all(), f"{key}: main fragments do not cover it exactly once"
        assert torch.equal(main[key], expected[key]), f"{key}: element order differs from plain Megatron's"
        for replica in range(dp):
            assert torch.equal(per_replica[replica, key], expected[key]), f"{key}: replica {replica} differs"
    assert sorted(main_objects) == sorted(objects), "each extra-state object must be written exactly once"


def test_sharded_state_dict_needs_a_role(megatron):
    from ntp_megatron.config.schema import load_job_config
    from ntp_megatron.core.gpt import RankUnits, build_ntp_gpt
    from ntp_megatron.training.model import transformer_config

    cfg = load_job_config(None, ["parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=1"])
    m = cfg.model
    model = build_ntp_gpt(transformer_config(cfg), RankUnits(tuple(range(8)), tuple(range(256)), tuple(range(256))),
                          m.normalization, m.vocab_size, max_sequence_length=m.seq_length, pre_process=True,
                          post_process=True, share_embeddings_and_output_weights=True,
                          position_embedding_type=m.position_embedding_type, pg_collection=megatron)
    with pytest.raises(ValueError, match="ntp_role"):
        model.sharded_state_dict()


# ---------------------------------------------------------------------------------------------------------------
# Errors and crash safety


def test_a_checkpoint_of_another_model_shape_is_one_clear_line(megatron, tmp_path):
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from ntp_megatron.training.checkpoint import check_shapes

    key = "decoder.layers.mlp.linear_fc1.weight"
    saved = {"w": ShardedTensor.from_rank_offsets(key, torch.ones(4, 3))}
    dist_checkpointing.save(saved, str(tmp_path))
    check_shapes({"w": ShardedTensor.from_rank_offsets(key, torch.ones(4, 3))}, tmp_path)
    with pytest.raises(SystemExit) as info:
        check_shapes({"w": ShardedTensor.from_rank_offsets(key, torch.ones(6, 3))}, tmp_path)
    message = str(info.value)
    assert "\n" not in message and key in message and "(4, 3)" in message and "(6, 3)" in message
    with pytest.raises(SystemExit, match="has no tensor 'other'"):
        check_shapes({"w": ShardedTensor.from_rank_offsets("other", torch.ones(4, 3))}, tmp_path)


def test_latest_file_moves_only_after_a_complete_save(tmp_path, monkeypatch):
    """A save that dies midway leaves ``latest`` on the last good checkpoint; re-saving the iteration
    ``latest`` names first points ``latest`` at the newest other complete checkpoint."""
    from ntp_megatron.training import checkpoint as ck
    from ntp_megatron.training.checkpoint import files

    root = tmp_path / "ckpt"
    for iteration in (3, 6):
        files._prepare_dir(root, iteration)
        (ck.iteration_dir(root, iteration) / "metadata.json").write_text("{}")
        files._write_latest(root, iteration)
    assert ck.resolve_load_dir(root) == ck.iteration_dir(root, 6)
    # Writing iteration 9 dies after some files: latest is untouched.
    files._prepare_dir(root, 9)
    (ck.iteration_dir(root, 9) / "__0_0.distcp").write_bytes(b"partial")
    assert files._latest_iteration(root) == 6
    # Re-saving 6 (a resumed run going over the same iteration): latest falls back to 3 while 6 is rewritten.
    files._prepare_dir(root, 6)
    assert files._latest_iteration(root) == 3 and not any(ck.iteration_dir(root, 6).iterdir())
    assert not list(root.glob(".*.tmp"))
    # A partial directory is not loadable, with a clear message.
    with pytest.raises(SystemExit, match="not a complete checkpoint"):
        ck.load_checkpoint(ck.iteration_dir(root, 9), None, None, None, None)


# ---------------------------------------------------------------------------------------------------------------
# Real jobs


def ntp_args(tp_base: int, dp: int, dead: str = "", extra=()) -> list[str]:
    args = [*TINY, "--set", "ntp.enabled=true", "--set", f"parallel.tensor_model_parallel_size={tp_base}",
            "--set", f"parallel.data_parallel_size={dp}", "--set", f"training.train_iters={ITERS}",
            "--set", "parallel.timeout_s=60", *extra]
    if dead:
        args += ["--set", f"ntp.dead_slots=[{dead}]"]
    return args


def assert_continues(resumed: dict[int, float], reference: dict[int, float], what: str,
                     first: int = SAVE_AT + 1) -> float:
    """Iterations ``first``..ITERS ran, and each one's lm loss is the uninterrupted run's."""
    assert sorted(resumed) == list(range(first, ITERS + 1)), f"{what}: ran iterations {sorted(resumed)}"
    worst = max(relative_difference(resumed[i], reference[i]) for i in resumed)
    assert worst <= TOLERANCE, f"{what}: worst relative loss difference {worst:.2e}"
    assert len({round(v, 5) for v in resumed.values()}) == len(resumed), "the loss must keep moving"
    return worst


def saves(result) -> list[tuple[int, int, list[int]]]:
    """(iteration, generation, TP per replica) of every checkpoint the run saved."""
    return [(e["iteration"], e["generation"], e["tp_per_replica"]) for e in result.events("checkpoint_saved")]


@pytest.fixture(scope="module")
def degraded_run(tmp_path_factory):
    """The uninterrupted run, and the checkpoints the other jobs load: TP4 + TP3 (a rank holding query groups
    {0, 1, 6}), saving at iteration 3 and at the end. Every topology computes the same losses, so it is the
    reference of every job below."""
    base = tmp_path_factory.mktemp("ntp-ckpt")
    ckpt = base / "ckpt"
    result = run_job(base / "full", ntp_args(4, 2, "1:3", ("--set", f"checkpoint.save={ckpt}",
                                                          "--set", f"checkpoint.save_interval={SAVE_AT}")))
    assert_ok(result)
    assert saves(result) == [(SAVE_AT, 0, [4, 3]), (ITERS, 0, [4, 3])]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    return SimpleNamespace(base=base, ckpt=ckpt, losses=result.losses())


def test_degraded_checkpoint_continues_under_tp2_tp2_tp2_and_absorbs_a_failure(degraded_run, tmp_path):
    """saved under TP4 + TP3 at iteration 3, loaded under TP2 + TP2 + TP2 (another tp_base and DP),
    which runs iteration 4. Launch rank 5 is killed in iteration 5 after its vote: the controller (whose
    committed iteration started at the checkpoint's) settles 5 as committed, the survivors roll it forward,
    re-form at TP2 + TP2 + TP1 from peers and save iteration 5's checkpoint in the new layout. Iterations 4..6
    are the uninterrupted run's."""
    load = degraded_run.ckpt / f"iter_{SAVE_AT:07d}"
    ckpt = tmp_path / "ckpt"
    result = run_job(tmp_path / "run", ntp_args(2, 3, extra=(
        "--set", f"checkpoint.load={load}", "--set", f"checkpoint.save={ckpt}", "--set", "checkpoint.save_interval=5",
        "--set", "logging.state_checksums=true", "--inject-failure", "kill:rank=5,iter=5,phase=optimizer")))
    assert_ok(result)
    assert_replicas_agree(result)  # iterations 4..6: the run starts from the checkpoint of 3
    worst = assert_continues(result.losses(), degraded_run.losses, "TP2 + TP2 + TP2")
    widths = {r["iteration"]: r["tp_per_replica"] for r in result.records if r.get("kind") == "iteration"}
    assert widths == {4: [2, 2, 2], 5: [2, 2, 2], 6: [2, 2, 1]}
    [failed] = result.events("rank_failed")
    assert (failed["iteration"], failed["phase"]) == (5, "optimizer")
    [reformed] = result.events("reformed")
    assert (reformed["resume_iteration"], reformed["iterations_redone"]) == (6, 0)
    assert reformed["moved_bytes"] > 0  # from peers, not from disk; exactly the bound: run_job checks it
    assert saves(result) == [(5, 1, [2, 2, 1]), (6, 1, [2, 2, 1])]  # 5: rolled forward, then saved
    assert leftover_processes(result) == []
    print(f"TP4+TP3 -> TP2+TP2+TP2 -> TP2+TP2+TP1: worst relative difference {worst:.2e}")


def test_degraded_checkpoint_continues_under_uniform_tp1(degraded_run, tmp_path):
    """the TP4 + TP3 checkpoint continues under plain uniform TP1 (NTP off)."""
    load = degraded_run.ckpt / f"iter_{SAVE_AT:07d}"
    result = run_job(tmp_path / "run", [*TINY, "--set", "parallel.tensor_model_parallel_size=1",
                                        "--set", "parallel.data_parallel_size=1",
                                        "--set", f"training.train_iters={ITERS}",
                                        "--set", f"checkpoint.load={load}"])
    assert_ok(result)
    worst = assert_continues(result.losses(), degraded_run.losses, "TP1, NTP off")
    print(f"TP4+TP3 -> TP1 (NTP off): worst relative difference {worst:.2e}")


def _python(out_dir: Path, module: str, *args: str) -> None:
    returncode, stderr = run_module(module, args, out_dir)
    assert returncode == 0, f"{module} failed ({returncode}):\n{stderr[-4000:]}"


def test_plain_megatron_checkpoint_continues_under_ntp(tmp_path):
    """plain Megatron-Core (TP2, its own initialisation) saves at iteration 3; NTP TP2 + TP1
    loads it and iterations 4..6 match the plain script's own."""
    ckpt, out = tmp_path / "plain-ckpt", tmp_path / "plain-losses.json"
    _python(tmp_path, "tests.plain_megatron", "train", "--tp", "2", "--iters", str(ITERS),
            "--save-at", str(SAVE_AT), "--ckpt", str(ckpt), "--out", str(out))
    plain = {int(k): v for k, v in json.loads(out.read_text()).items()}
    load = ckpt / f"iter_{SAVE_AT:07d}"
    result = run_job(tmp_path / "ntp", ntp_args(2, 2, "1:1", ("--set", f"checkpoint.load={load}")))
    assert_ok(result)
    worst = assert_continues(result.losses(), plain, "NTP TP2 + TP1 from a plain checkpoint")
    print(f"plain TP2 -> NTP TP2+TP1: worst relative difference {worst:.2e}")


def _fresh_optimizer_reference(out_dir: Path, *args: str) -> dict[int, dict]:
    """What plain Megatron-Core computes from a checkpoint's model weights with a fresh optimizer and scheduler
    (:mod:`tests.megatron_model_only`): every iteration's lm loss, grad norm and learning rate."""
    out = out_dir / "reference.json"
    _python(out_dir, "tests.megatron_model_only", *args, "--out", str(out))
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def assert_matches(result, reference: dict[int, dict], what: str) -> float:
    """The run did the reference's iterations, each with its lm loss and grad norm (TOLERANCE) and learning rate;
    the first one on the reference's first batch (consumed samples)."""
    records = {r["iteration"]: r for r in result.records if r.get("kind") == "iteration"}
    assert sorted(records) == sorted(reference), f"{what}: ran iterations {sorted(records)}"
    first = min(records)
    assert records[first]["consumed_samples"] == first * 12, f"{what}: {records[first]['consumed_samples']} samples"
    differences = []
    for i, ref in reference.items():
        for key in ("lm_loss", "grad_norm"):
            difference = relative_difference(records[i][key], ref[key])
            assert difference <= TOLERANCE, f"{what}: iteration {i}'s {key} {records[i][key]} vs {ref[key]}"  # NaN too
            differences.append(difference)
        assert records[i]["lr"] == pytest.approx(ref["lr"], rel=1e-9, abs=1e-12), f"{what}: lr of iteration {i}"
    return max(differences)


def _said_once(result, line: str) -> None:
    said = [x for x in result.stderr.splitlines() if x.startswith("ntp-launch: checkpoint.load:")]
    assert said == [line], said


MODEL_ONLY = {  # writer TP, Megatron-LM layout, what --load names, the run (NTP TP2 + TP1; NTP off, TP2)
    "tp2-release-root": (2, "release", "", ntp_args(2, 2, "1:1")),
    "tp1-iter-dir": (1, "iter", "iter_0000002", [*TINY, "--set", "parallel.tensor_model_parallel_size=2",
                                                 "--set", "parallel.data_parallel_size=1"]),
}


@pytest.mark.parametrize("case", sorted(MODEL_ONLY))
def test_a_model_only_megatron_checkpoint_starts_an_ntp_run_at_iteration_0(tmp_path, case):
    """plain Megatron-Core trains 2 iterations from its own initialisation (weights a run does not start from
    by itself) and saves the model part alone (``{"model": model.sharded_state_dict()}``: no iteration, optimizer,
    scheduler or RNG) at TP2 in a ``release`` directory the tracker file names, or at TP1 in ``iter_0000002``.
    A run at another TP (NTP TP2 + TP1; NTP off at TP2) says once that it starts at iteration 0 with fresh optimizer
    and scheduler state, and its iterations 1..3 are plain Megatron-Core's from those weights with a fresh
    optimizer and scheduler: iteration 1 on the weights themselves, 3 after two fresh Adam steps."""
    tp, layout, under, run_args = MODEL_ONLY[case]
    root = tmp_path / "model-only"
    reference = _fresh_optimizer_reference(tmp_path, "--tp", str(tp), "--pretrain", "2", "--save", str(root),
                                           "--layout", layout, "--iters", "3")
    path = root / (under or "release")
    assert sorted(p.name for p in root.iterdir()) == sorted(["latest_checkpointed_iteration.txt", path.name])
    result = run_job(tmp_path / "run", [*run_args, "--set", f"checkpoint.load={root / under}",
                                        "--set", "training.train_iters=3"])
    assert_ok(result)
    why = "is a release checkpoint" if layout == "release" else "holds no iteration (a model-only checkpoint)"
    _said_once(result, f"ntp-launch: checkpoint.load: {path} {why}: starting at iteration 0 from its model weights, "
                       "with fresh optimizer, scheduler and RNG state")
    worst = assert_matches(result, reference, case)
    print(f"model-only TP{tp} ({layout}) -> {case}: worst relative difference {worst:.2e}")


def test_finetune_loads_the_model_alone_at_iteration_0(degraded_run, tmp_path):
    """Megatron's ``--finetune`` on a full NTP checkpoint (TP4 + TP3, iteration 3): NTP TP2 + TP1 starts at
    iteration 0 with no samples consumed, and runs plain Megatron-Core's fresh-optimizer iterations from its
    weights (an optimizer or scheduler state carried over would change iteration 2's learning rate and 3's loss)."""
    load = degraded_run.ckpt / f"iter_{SAVE_AT:07d}"
    reference = _fresh_optimizer_reference(tmp_path, "--tp", "1", "--load", str(load), "--iters", "3")
    result = run_job(tmp_path / "ntp", [*ntp_args(2, 2, "1:1", ("--set", f"checkpoint.load={load}",
                                                                 "--set", "training.train_iters=3")), "--finetune"])
    assert_ok(result)
    _said_once(result, f"ntp-launch: checkpoint.load: --finetune (checkpoint.finetune) from {load}: starting at "
                       "iteration 0 from its model weights, with fresh optimizer, scheduler and RNG state")
    assert_matches(result, reference, "--finetune")


def test_no_load_optim_keeps_the_iteration_with_a_fresh_optimizer(degraded_run, tmp_path):
    """``--no-load-optim --no-load-rng`` on the same checkpoint, NTP off at TP1: iterations 4..6 on the
    batches after the checkpoint's, as plain Megatron-Core computes them from its weights with a fresh optimizer
    and a fresh schedule (Megatron-LM restarts the schedule with the optimizer: iteration 4 warms up again), not
    the continuing run's."""
    load = degraded_run.ckpt / f"iter_{SAVE_AT:07d}"
    reference = _fresh_optimizer_reference(tmp_path, "--tp", "1", "--load", str(load), "--start", str(SAVE_AT),
                                           "--iters", str(ITERS))
    result = run_job(tmp_path / "run", [*TINY, "--set", "parallel.tensor_model_parallel_size=1",
                                        "--set", "parallel.data_parallel_size=1", "--set", f"training.train_iters={ITERS}",
                                        "--set", f"checkpoint.load={load}", "--no-load-optim", "--no-load-rng"])
    assert_ok(result)
    assert_matches(result, reference, "--no-load-optim")
    assert relative_difference(result.losses()[ITERS], degraded_run.losses[ITERS]) > 1e-4, "the optimizer was fresh"
    _said_once(result, f"ntp-launch: checkpoint.load: {load}: --no-load-optim (checkpoint.no_load_optim) and "
                       "--no-load-rng (checkpoint.no_load_rng): starting at iteration 3 from its model weights, with "
                       "fresh optimizer, scheduler and RNG state")


REJOIN_ITERS = 30
"""Long enough for a warm spare to be admitted after the failure at iteration 5."""


def test_a_replacement_after_no_load_optim_starts_at_its_peers_optimizer_step(degraded_run, tmp_path):
    """``--no-load-optim`` on the TP4 + TP3 checkpoint of iteration 3 under NTP 2 x TP2: Adam and the schedule
    start fresh at iteration 4. Launch rank 3 dies at iteration 5 and a warm spare takes its slot back at a later
    boundary, with no state of its own: its Adam step and its schedule are its peers' (iterations since 3, not
    since 0), so every iteration is still plain Megatron-Core's from those weights with a fresh optimizer."""
    load = degraded_run.ckpt / f"iter_{SAVE_AT:07d}"
    reference = _fresh_optimizer_reference(tmp_path, "--tp", "1", "--load", str(load), "--start", str(SAVE_AT),
                                           "--iters", str(REJOIN_ITERS))
    args = ntp_args(2, 2, extra=("--set", f"checkpoint.load={load}", "--set", f"training.train_iters={REJOIN_ITERS}",
                                 "--set", "ntp.rejoin_after_s=0", "--set", "ntp.warm_spares=1"))
    result = run_job(tmp_path / "run", [*args, "--no-load-optim", "--inject-failure", "kill:rank=3,iter=5,phase=backward"])
    assert_ok(result)
    [joined] = [e for e in result.events("reformed") if e["joined"]]
    assert joined["resume_iteration"] < REJOIN_ITERS - 2, "the replacement came too late to train"
    assert_matches(result, reference, "--no-load-optim, then a rejoin")


def test_ntp_checkpoints_load_into_plain_megatron(degraded_run, tmp_path):
    """the TP4 + TP3 run's final checkpoint, and one re-saved by a degraded TP3 replica as the only
    replica (non-contiguous units written), load into plain Megatron-Core at TP1 and TP2 and give the logits
    the NTP models (both replicas of TP4 + TP3, and the TP3) compute on the same batch."""
    import torch

    final = degraded_run.ckpt / f"iter_{ITERS:07d}"
    resaved = tmp_path / "resaved"
    ntp_out, plain_out = tmp_path / "ntp-logits.pt", tmp_path / "plain-logits.pt"
    _python(tmp_path, "tests.jobs.checkpoint.test_ntp_checkpoint", "ntp-logits", "--ckpt", str(final), "--resave", str(resaved),
            "--out", str(ntp_out))
    resaved_dir = resaved / f"iter_{ITERS:07d}"
    _python(tmp_path, "tests.plain_megatron", "logits", "--tp", "1", "--tp", "2", "--ckpt", str(final),
            "--ckpt", str(resaved_dir), "--out", str(plain_out))
    ntp, plain = torch.load(ntp_out), torch.load(plain_out)
    assert set(ntp) == {("tp4+tp3", 0), ("tp4+tp3", 1), ("tp3", 0)}
    reference = ntp["tp4+tp3", 0]
    assert reference.shape == (2, 64, 256) and reference.abs().max() > 0.1
    for (ckpt, tp), logits in sorted(plain.items()):
        for key, mine in ntp.items():
            diff = float((logits - mine).abs().max() / mine.abs().max())
            assert diff <= TOLERANCE, f"plain TP{tp} on {Path(ckpt).parent.name} vs NTP {key}: {diff:.2e}"
    print("logits agree: plain TP1/TP2 x {final, re-saved by TP3} vs NTP", sorted(ntp))


SAVE_EVERY = 2
SAVE_KILL = ["--inject-failure", "kill:rank=3,iter=4,phase=checkpoint"]


def test_kill_during_a_save_is_absorbed_live(degraded_run, tmp_path):
    """TP2 + TP2 saving every 2 iterations; launch rank 3 is killed in the middle of iteration 4's
    save. The job re-forms at TP2 + TP1 and saves iteration 4 again in its new layout; every iteration is the
    uninterrupted run's, replicas agree, nothing is left behind."""
    ckpt = tmp_path / "ckpt"
    result = run_job(tmp_path / "run", ntp_args(2, 2, extra=(
        "--set", f"checkpoint.save={ckpt}", "--set", f"checkpoint.save_interval={SAVE_EVERY}",
        "--set", "logging.state_checksums=true", *SAVE_KILL)))
    assert_ok(result)
    assert_continues(result.losses(), degraded_run.losses, "killed during a save", first=1)
    assert_replicas_agree(result, ITERS)
    [failed] = result.events("rank_failed")
    assert (failed["launch_rank"], failed["phase"], failed["iteration"]) == (3, "checkpoint", 4)
    [reformed] = result.events("reformed")
    assert (reformed["tp_per_replica"], reformed["resume_iteration"], reformed["iterations_redone"]) == (
        [2, 1], 5, 0)
    assert saves(result) == [(2, 0, [2, 2]), (4, 1, [2, 1]), (6, 1, [2, 1])]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert leftover_processes(result) == []


def test_a_save_cut_short_leaves_the_last_good_checkpoint_to_resume_from(degraded_run, tmp_path):
    """the same kill, where NTP may not absorb it (``ntp.min_tp`` 2, policy
    ``stop``): the job ends in the middle of iteration 4's save. ``latest`` still names iteration 2, the
    partial iteration-4 directory is not loadable; a new job resuming from the directory starts at iteration 2
    — in a degraded layout, as a rank dies before its first generation has formed — and iterations 3..6 are the
    uninterrupted run's."""
    ckpt = tmp_path / "ckpt"
    stopped = run_job(tmp_path / "stopped", ntp_args(2, 2, extra=(
        "--set", f"checkpoint.save={ckpt}", "--set", f"checkpoint.save_interval={SAVE_EVERY}",
        "--set", "ntp.min_tp=2", "--set", "ntp.on_unrecoverable=stop", *SAVE_KILL)))
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "NTP cannot absorb the failure" in stopped.stderr
    assert sorted(stopped.losses()) == [1, 2, 3, 4] and saves(stopped) == [(2, 0, [2, 2])]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (ckpt / "iter_0000004" / "metadata.json").exists()
    assert leftover_processes(stopped) == []

    resumed = run_job(tmp_path / "resumed", ntp_args(2, 2, extra=(
        "--set", f"checkpoint.load={ckpt}", "--inject-failure", "kill:rank=1,iter=3,phase=reform")))
    assert_ok(resumed)
    assert "resuming from checkpoint" in resumed.stderr and "iter_0000002 (iteration 2)" in resumed.stderr
    worst = assert_continues(resumed.losses(), degraded_run.losses, "resumed after a cut-short save", first=3)
    [reformed] = resumed.events("reformed")
    assert (reformed["tp_per_replica"], reformed["generation"], reformed["moved_bytes"]) == ([1, 2], 1, 0)
    assert all(r["tp_per_replica"] == [1, 2] for r in resumed.records if r.get("kind") == "iteration")
    assert leftover_processes(resumed) == []
    print(f"resumed at iteration 3 in TP1 + TP2: worst relative difference {worst:.2e}")


# ---------------------------------------------------------------------------------------------------------------
# NTP side of the logits comparison (python -m tests.jobs.checkpoint.test_ntp_checkpoint ntp-logits)

LOGITS_TOPOLOGIES = {"tp4+tp3": (4, 2, "1:3"), "tp3": (4, 1, "0:3")}


def _ntp_logits_store(rank: int, port_pipe):
    """Rank 0 hosts the ranks' store on a port the OS picks and hands the port to the parent; the others get it
    from the parent. (The parent starts no thread before it forks the ranks: a store's server thread holding a lock
    at a fork left a rank deadlocked before its first line, once in a few runs on a loaded machine.)"""
    import torch.distributed as dist

    from tests.harness import store_client

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=120),
                              wait_for_workers=False)
        port_pipe.send(store.port)
        return store
    if not port_pipe.poll(120):
        raise TimeoutError("no store port from the parent within 120 s")
    return store_client(port_pipe.recv(), 120)


def _ntp_logits_rank(rank: int, world: int, port_pipe, cfg_json: str, ckpt: str, resave: str, results) -> None:
    try:
        import torch
        import torch.distributed as dist
        from megatron.core import tensor_parallel

        from ntp_megatron.config.schema import JobConfig
        from ntp_megatron.patches import apply_patches
        from ntp_megatron.training import checkpoint, parallel
        from ntp_megatron.training.components import build_components
        from tests.plain_megatron import fixed_batch

        apply_patches(cpu=True)
        dist.init_process_group("gloo", store=_ntp_logits_store(rank, port_pipe), rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        cfg = JobConfig.model_validate_json(cfg_json)
        topology = cfg.topology()
        setup = parallel.ntp_parallel(cfg, topology, rank)
        torch.manual_seed(cfg.training.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed)
        parts = build_components(cfg, setup, torch.device("cpu"))
        coords = checkpoint.ParallelCoords.of(setup, cfg.parallel)
        iteration = checkpoint.load_checkpoint(Path(ckpt), parts.model, parts.optimizer, parts.scheduler,
                                               coords).iteration
        with torch.no_grad():
            logits = parts.model.module(*fixed_batch())  # [b, s, this rank's vocabulary rows]
        pieces: list = [None] * setup.pg.tp.size()
        vocab = parts.model.module.ntp_units.vocab
        dist.all_gather_object(pieces, (vocab, logits), group=setup.pg.tp)
        if setup.tp_rank == 0:
            full = torch.empty(*logits.shape[:-1], cfg.model.vocab_size)
            for units, part in pieces:
                full[..., list(units)] = part
            results.put((setup.replica, full.numpy()))
        if resave:
            checkpoint.save_checkpoint(Path(resave), iteration, parts.model, parts.optimizer, parts.scheduler,
                                       coords)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _ntp_logits_main(argv: list[str]) -> int:
    import multiprocessing

    import torch

    from ntp_megatron.config.schema import load_job_config
    from ntp_megatron.training import runtime
    runtime.quiet_optional_dependency_warnings()
    # What the ranks import, imported once here: each forked rank would otherwise pay seconds of imports.
    import megatron.core.tensor_parallel  # noqa: F401

    import ntp_megatron.training.checkpoint  # noqa: F401
    import ntp_megatron.training.components  # noqa: F401
    import ntp_megatron.training.parallel  # noqa: F401
    import tests.plain_megatron  # noqa: F401

    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--resave", default="", help="the single-replica TP3 topology saves here")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    ctx = multiprocessing.get_context("fork")
    out = {}
    for name, (tp_base, dp, dead) in LOGITS_TOPOLOGIES.items():
        overrides = [a for a in ntp_args(tp_base, dp, dead) if a != "--set"]
        cfg = load_job_config(None, overrides)
        world, results = cfg.world_size, ctx.Queue()  # the parent only reads it: no feeder thread here
        pipes = [ctx.Pipe() for _ in range(world)]  # the store's port, from rank 0 through the parent
        resave = args.resave if dp == 1 else ""
        procs = [ctx.Process(target=_ntp_logits_rank, args=(r, world, pipes[r][1], cfg.model_dump_json(), args.ckpt,
                                                             resave, results)) for r in range(world)]
        for p in procs:
            p.start()
        if not pipes[0][0].poll(120):
            raise SystemExit(f"ntp-logits {name}: rank 0 hosted no store within 120 s")
        port = pipes[0][0].recv()
        for parent_end, _ in pipes[1:]:
            parent_end.send(port)
        got = {}
        while len(got) < dp:
            try:
                replica, logits = results.get(timeout=1)
                got[replica] = logits
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or not any(p.is_alive() for p in procs):
                    break
        for p in procs:
            p.join(timeout=300)
        if any(p.exitcode != 0 for p in procs) or len(got) < dp:
            raise SystemExit(f"ntp-logits {name}: ranks failed ({[p.exitcode for p in procs]})")
        out.update({(name, replica): torch.from_numpy(logits) for replica, logits in got.items()})
    torch.save(out, args.out)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] != ["ntp-logits"]:
        raise SystemExit("usage: python -m tests.jobs.checkpoint.test_ntp_checkpoint ntp-logits --ckpt DIR --out FILE [--resave DIR]")
    return _ntp_logits_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
