"""Scale-up domains: with ``--nproc-per-node`` smaller than the TP size, a TP group spans nodes of one domain
(``--nnodes-per-domain`` consecutive nodes) and ranks keep Megatron's order.

The properties are written from the definitions (every slot on exactly one device; a TP group inside one domain;
node n hosts ranks n·nproc .. (n+1)·nproc - 1), not from the formula in ntp_megatron.plan.placement.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.config.files import EXIT_CONFIG_ERROR
from ntp_megatron.config.schema import load_job_config
from ntp_megatron.launch import launcher
from ntp_megatron.plan.placement import Device, Placement, PlacementError

pytestmark = pytest.mark.unit


@st.composite
def domain_grids(draw):
    """(tp, dp, pp, nnodes, nproc_per_node, nnodes_per_domain) that fit: drawn as domains of whole TP groups cut into
    nodes."""
    tp, dp, pp = draw(st.integers(1, 8)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    world = tp * dp * pp
    nnodes = draw(st.sampled_from([n for n in range(1, world + 1) if world % n == 0]))
    nproc = world // nnodes
    fits = [k for k in range(1, nnodes + 1) if nnodes % k == 0 and k * nproc % tp == 0]
    return tp, dp, pp, nnodes, nproc, draw(st.sampled_from(fits))


@settings(max_examples=300, deadline=None)
@given(domain_grids())
def test_every_slot_placed_once_and_every_tp_group_inside_one_domain(grid):
    tp, dp, pp, nnodes, nproc, k = grid
    placement = Placement(tp, dp, nnodes, pp, nproc, k)
    every = [(r, s, p) for p in range(pp) for r in range(dp) for s in range(tp)]  # Megatron's order
    devices = [placement.device(*slot) for slot in every]
    assert sorted(devices) == [Device(n, i) for n in range(nnodes) for i in range(nproc)]
    assert devices == [Device(*divmod(rank, nproc)) for rank in range(len(every))]
    for p in range(pp):
        for r in range(dp):
            nodes = {placement.device(r, s, p).node for s in range(tp)}
            assert len({placement.domain(n) for n in nodes}) == 1, (r, p, nodes)
    for n in range(nnodes):
        want = [slot if pp > 1 else slot[:2] for slot in every if placement.device(*slot).node == n]
        assert placement.slots_on(n) == want


def test_tp4_over_nodes_of_two():
    """TP4 × DP2 on four nodes of 2 (the job test's placement): replica 0 on nodes 0 and 1, replica 1 on 2 and 3."""
    placement = Placement(4, 2, 4, 1, 2, 2)
    assert [placement.device(0, s).node for s in range(4)] == [0, 0, 1, 1]
    assert [placement.device(1, s).node for s in range(4)] == [2, 2, 3, 3]
    assert placement.slots_on(1) == [(0, 2), (0, 3)]
    assert [placement.domain(n) for n in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("args, flags, allowed", [
    ((4, 2, 4, 1, 3, 2), "--nnodes 4 × --nproc-per-node 3 must be the world size 8",
     "allowed --nproc-per-node with --nnodes 4: 2"),
    ((4, 2, 4, 1, 2, 3), "--nnodes 4 is not a multiple of --nnodes-per-domain 3",
     "allowed --nnodes-per-domain: 1, 2, 4"),
    ((4, 2, 4, 1, 2, 1), "--nnodes-per-domain 1 × --nproc-per-node 2 devices does not hold whole TP groups of "
                         "tensor_model_parallel_size 4", "allowed --nnodes-per-domain: 2, 4"),
    ((4, 2, 4, 1, None, 1), "--nnodes 4 does not divide parallel.data_parallel_size 2",
     "allowed --nnodes: 1, 2 (or TP groups across nodes: --nnodes-per-domain 2, 4)"),
])
def test_a_placement_that_does_not_fit_is_refused_in_one_line_naming_the_flags(args, flags, allowed):
    with pytest.raises(PlacementError) as info:
        Placement(*args)
    message = str(info.value)
    assert "\n" not in message and flags in message and message.endswith(allowed), message


def test_the_launcher_refuses_it_with_exit_2(tmp_path, capsys):
    code = launcher.main(["--nnodes", "4", "--node-rank", "0", "--nproc-per-node", "2", "--store-port", "29999",
                          "--run-dir", str(tmp_path), "--set", "parallel.tensor_model_parallel_size=4",
                          "--set", "parallel.data_parallel_size=2"])
    assert code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nnodes-per-domain 1 × --nproc-per-node 2" in err[0], err


def test_the_launcher_places_a_tp_group_across_two_nodes(tmp_path):
    """Node 1 of TP4 × DP2 on four nodes of 2 in domains of 2 runs launch ranks 2 and 3 (replica 0's slots 2, 3) on
    its devices 0 and 1, and tells them the domain size."""
    args = launcher.build_parser().parse_args(["--nnodes", "4", "--node-rank", "1", "--nproc-per-node", "2",
                                               "--nnodes-per-domain", "2", "--store-port", "29999"])
    cfg = load_job_config(None, [f"logging.run_dir={tmp_path}", "ntp.enabled=true",
                                 "parallel.tensor_model_parallel_size=4", "parallel.data_parallel_size=2"])
    node1 = launcher.Launcher(cfg, tmp_path / "config.json", args, [])
    assert node1.local_ranks == [2, 3]
    env = node1.rank_env(2)
    assert (env["LOCAL_RANK"], env["NTP_NNODES_PER_DOMAIN"]) == ("0", "2")
