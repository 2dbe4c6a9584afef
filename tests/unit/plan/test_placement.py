"""Placement: every slot has a fixed device of a fixed node, whatever is dead or dropped (pure layout math), and
the launcher starts exactly its node's ranks on those devices.

The properties are written from the definition (a slot's place depends on the grid alone; a replica never
straddles nodes; each node provides tp·dp/nnodes devices), not from the formula in ntp_megatron.plan.placement.
"""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.launch import describe, launcher
from ntp_megatron.config.schema import load_job_config
from ntp_megatron.config.files import EXIT_CONFIG_ERROR, ConfigError
from ntp_megatron.plan.layout import make_topology
from ntp_megatron.plan.placement import Device, Placement, PlacementError, launch_slots
from ntp_megatron.plan.stages import make_pipeline_topology
from ntp_megatron.training import runtime

UNITS = {"heads": 8, "ffn": 16, "vocab": 32}


@st.composite
def grids(draw):
    """(tp, dp, nnodes, dead slots, dropped replicas) that make_topology accepts, nnodes dividing dp."""
    tp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 6))
    nnodes = draw(st.sampled_from([n for n in range(1, dp + 1) if dp % n == 0]))
    dropped = draw(st.sets(st.integers(0, dp - 1), max_size=dp - 1))
    dead = []
    for r in sorted(set(range(dp)) - dropped):
        dead += [(r, s) for s in draw(st.sets(st.integers(0, tp - 1), max_size=tp - 1))]
    return tp, dp, nnodes, dead, sorted(dropped)


@settings(max_examples=200, deadline=None)
@given(grids())
def test_slots_keep_their_device_whatever_is_dead(grid):
    tp, dp, nnodes, dead, dropped = grid
    placement = Placement(tp, dp, nnodes)
    slots = launch_slots(tp, dp, make_topology(tp, dp, UNITS, dead_slots=dead, dropped=dropped))
    healthy = launch_slots(tp, dp, make_topology(tp, dp, UNITS))
    healthy_place = {}
    for node in range(nnodes):
        for rank, index in placement.node_ranks(node, healthy).items():
            healthy_place[healthy[rank]] = Device(node, index)
    # The healthy grid fills every device of every node exactly once.
    per_node = tp * dp // nnodes
    assert sorted(healthy_place.values()) == [Device(n, i) for n in range(nnodes) for i in range(per_node)]
    started = {}
    for node in range(nnodes):
        ranks = placement.node_ranks(node, slots)
        assert list(ranks) == sorted(ranks)
        assert len(set(ranks.values())) == len(ranks), "two ranks on one device"
        for rank, index in ranks.items():
            assert rank not in started, f"launch rank {rank} started by two nodes"
            started[rank] = Device(node, index)
            # A slot's device is the one it has in the healthy grid: dead slots and dropped replicas shift nothing.
            assert started[rank] == healthy_place[slots[rank]] == placement.device(*slots[rank])
    assert sorted(started) == list(range(len(slots))), "some live slot has no node"
    # A replica's TP group never straddles nodes.
    for replica in range(dp):
        nodes = {placement.device(replica, s).node for s in range(tp)}
        assert len(nodes) == 1
        assert replica in placement.replicas_on(nodes.pop())
    # Dead slots and dropped replicas leave exactly their own devices idle.
    idle = {placement.device(r, s) for r in range(dp) for s in range(tp)} - set(started.values())
    gone = {(r, s) for r, s in dead} | {(r, s) for r in dropped for s in range(tp)}
    assert idle == {placement.device(r, s) for r, s in gone}


@st.composite
def pipeline_grids(draw):
    """(tp, dp, pp, nnodes, dead (replica, slot, stage) triples), nnodes dividing dp·pp."""
    tp, dp, pp = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(2, 4))
    nnodes = draw(st.sampled_from([n for n in range(1, dp * pp + 1) if dp * pp % n == 0]))
    dead = [(r, s, p) for p in range(pp) for r in range(dp)
            for s in draw(st.sets(st.integers(0, tp - 1), max_size=tp - 1))]
    return tp, dp, pp, nnodes, dead


@settings(max_examples=200, deadline=None)
@given(pipeline_grids())
def test_with_stages_a_stage_tp_group_stays_on_one_node_and_every_device_is_used_once(grid):
    """With stages: the healthy grid fills every device of every node once, launch rank r is Megatron's rank r
    (stage-major: stage · tp · dp + replica · tp + slot, dead slots skipped), each replica's TP group of each stage
    sits on one node, and dead slots leave exactly their own devices idle."""
    tp, dp, pp, nnodes, dead = grid
    placement = Placement(tp, dp, nnodes, pp)
    every = [(r, s, p) for p in range(pp) for r in range(dp) for s in range(tp)]
    per_node = tp * dp * pp // nnodes
    assert sorted(placement.device(*slot) for slot in every) == \
        [Device(n, i) for n in range(nnodes) for i in range(per_node)]
    for index, slot in enumerate(every):  # Megatron's order, from its definition
        assert placement.device(*slot) == Device(*divmod(index, per_node))
    for p in range(pp):
        for r in range(dp):
            assert len({placement.device(r, s, p).node for s in range(tp)}) == 1, (r, p)
    topology = make_pipeline_topology(tp, dp, pp, UNITS, dead_slots=dead)
    slots = launch_slots(tp, dp, topology, pp)
    assert slots == [slot for slot in every if slot not in set(dead)]
    started = {}
    for node in range(nnodes):
        for rank, index in placement.node_ranks(node, slots).items():
            assert rank not in started
            started[rank] = Device(node, index)
            assert started[rank] == placement.device(*slots[rank])
    assert sorted(started) == list(range(len(slots)))
    idle = {placement.device(*slot) for slot in every} - set(started.values())
    assert idle == {placement.device(*slot) for slot in dead}


def test_the_launcher_says_who_each_launch_rank_is_in_every_stage(tmp_path):
    """PP2 × TP2 × 2 under NTP with slot 1 of replica 0 dead in stage 0: stage 0 has 3 launch ranks (0, 1, 2 are
    0:0, 1:0, 1:1), stage 1 has 4 (3..6); the default config's 2 layers, one per stage; on 2 nodes, node 0 runs stage 0 and node 1 stage 1."""
    node0 = _launcher(tmp_path, 2, 0, "ntp.enabled=true", "parallel.tensor_model_parallel_size=2",
                      "parallel.data_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                      "model.init=layout_free", "ntp.dead_slots=[0:1@0]")
    assert describe.stage_lines(node0.cfg, node0.placement, node0.launch_slots) == [
        "stage 0 (layers 0..0) on node 0: replica 0 = launch rank 0 in slot 0 (dead slot 1); "
        "replica 1 = launch ranks 1..2 in slots 0..1",
        "stage 1 (layers 1..1) on node 1: replica 0 = launch ranks 3..4 in slots 0..1; "
        "replica 1 = launch ranks 5..6 in slots 0..1"]
    assert node0.local_ranks == [0, 1, 2]


def test_a_dead_slot_leaves_its_gpu_idle_and_shifts_nothing():
    """TP2 × DP2 on 2 nodes with slot 1 of replica 0 dead: 3 ranks, which the old rule (each node takes the next
    world/N launch ranks) refused, 3 not being divisible by 2."""
    placement = Placement(2, 2, 2)
    slots = launch_slots(2, 2, make_topology(2, 2, UNITS, dead_slots=[(0, 1)]))
    assert slots == [(0, 0), (1, 0), (1, 1)]
    assert placement.node_ranks(0, slots) == {0: 0}
    assert placement.node_ranks(1, slots) == {1: 0, 2: 1}
    # TP4 × DP4 on 2 nodes (8 GPUs each), replica 1 lost slot 2, replica 2 dropped.
    placement = Placement(4, 4, 2)
    slots = launch_slots(4, 4, make_topology(4, 4, UNITS, dead_slots=[(1, 2)], dropped=[2]))
    assert placement.node_ranks(0, slots) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 7}
    assert placement.node_ranks(1, slots) == {7: 4, 8: 5, 9: 6, 10: 7}


def test_plain_runs_place_megatron_ranks_as_before():
    """NTP off: rank r is slot r % tp of replica r // tp (Megatron's TP-first order); node i runs ranks
    i·world/N .. (i+1)·world/N - 1 on devices 0.., as the launcher always did."""
    placement = Placement(2, 4, 2)
    slots = launch_slots(2, 4)
    assert placement.node_ranks(0, slots) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert placement.node_ranks(1, slots) == {4: 0, 5: 1, 6: 2, 7: 3}


@pytest.mark.parametrize("tp, dp, nnodes", [(2, 3, 2), (4, 2, 4), (1, 1, 2), (2, 4, 3)])
def test_nodes_must_host_whole_replicas(tp, dp, nnodes):
    with pytest.raises(PlacementError) as info:
        Placement(tp, dp, nnodes)
    message = str(info.value)
    assert "\n" not in message
    assert f"--nnodes {nnodes}" in message and f"data_parallel_size {dp}" in message
    assert f"tensor_model_parallel_size {tp}" in message
    allowed = [n for n in range(1, dp + 1) if dp % n == 0]
    assert ("allowed --nnodes: " + ", ".join(map(str, allowed))) in message


def _launcher(tmp_path, nnodes: int, node: int, *overrides: str) -> launcher.Launcher:
    args = launcher.build_parser().parse_args(["--nnodes", str(nnodes), "--node-rank", str(node),
                                               "--store-port", "29999"])
    sets = [f"logging.run_dir={tmp_path}", *overrides]
    cfg = load_job_config(None, sets)
    return launcher.Launcher(cfg, tmp_path / "config.json", args, [])


def test_launcher_gives_each_rank_its_slots_device(tmp_path):
    """Node 1 of a TP2 × DP4 NTP job with slot 1 of replica 2 dead: ranks 4 (2:0), 5 (3:0), 6 (3:1) on devices
    0, 2, 3; device 1 idle. A replacement for a rank gets the same environment, so the same device."""
    node1 = _launcher(tmp_path, 2, 1, "ntp.enabled=true", "parallel.tensor_model_parallel_size=2",
                      "parallel.data_parallel_size=4", "ntp.dead_slots=[2:1]")
    assert node1.local_ranks == [4, 5, 6]
    assert [node1.rank_env(r)[runtime.ENV_LOCAL_RANK] for r in node1.local_ranks] == ["0", "2", "3"]
    assert [node1.rank_env(r, joining=True)[runtime.ENV_LOCAL_RANK] for r in node1.local_ranks] == ["0", "2", "3"]
    assert node1._where() == " on node 1, devices 0, 2..3 (device 1 idle)"
    node0 = _launcher(tmp_path, 2, 0, "ntp.enabled=true", "parallel.tensor_model_parallel_size=2",
                      "parallel.data_parallel_size=4", "ntp.dead_slots=[2:1]")
    assert node0.local_ranks == [0, 1, 2, 3]


def test_node_zero_must_run_a_rank(tmp_path):
    with pytest.raises(ConfigError, match="node 0 .* would run no rank"):
        _launcher(tmp_path, 2, 1, "ntp.enabled=true", "parallel.data_parallel_size=2", "ntp.dropped_replicas=[0]")


def test_launcher_refuses_a_node_count_that_splits_replicas(tmp_path, capsys):
    code = launcher.main(["--nnodes", "2", "--node-rank", "0", "--store-port", "29999", "--run-dir", str(tmp_path),
                          "--set", "parallel.tensor_model_parallel_size=2", "--set", "parallel.data_parallel_size=3",
                          "--set", "training.global_batch_size=12"])
    assert code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ntp-launch: --nnodes 2 does not divide"), err


