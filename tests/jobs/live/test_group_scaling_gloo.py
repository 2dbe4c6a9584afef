"""The NTP process-group builder in real gloo processes, across generations (the counting tests with fake worlds
are in ``tests/unit/core/test_group_scaling.py``)."""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state as ps

from ntp_megatron.elastic import keys
from ntp_megatron.plan.layout import make_topology
from tests.harness import store_client, store_server


# -- the same builder in real gloo processes, across generations -------------------------------------------------

UNITS = {"heads": 4, "ffn": 8, "vocab": 16}
GENERATIONS = [[], [(1, 1)], [(1, 1), (0, 1)], []]
"""Dead slots of each generation of TP2 × 2: healthy; replica 1 at TP1 (its rank is the proxy of block 1);
both at TP1 (the two sync groups have the same ranks); healthy again (the two processes come back)."""


def _slot_process(replica: int, slot: int, port: int, timeout_s: float) -> None:
    """One process (a fixed slot) through every generation it has a rank in: groups, one all-reduce in each,
    and no group of this process besides the default one and the ones it uses."""
    try:
        import torch
        from torch.distributed import distributed_c10d

        from ntp_megatron.core.groups import build_groups
        from ntp_megatron.plan.stages import JobTopology  # in the spawned process, as build_groups

        store = store_client(port, timeout_s)
        for generation, dead in enumerate(GENERATIONS):
            topology = make_topology(2, 2, UNITS, dead_slots=dead, generation=generation)
            rank = topology.rank_of(replica, slot)
            if rank is None:
                continue
            dist.init_process_group("gloo", store=dist.PrefixStore(keys.process_group_prefix(generation), store),
                                    rank=rank, world_size=topology.world_size, timeout=timedelta(seconds=timeout_s))
            groups = build_groups(JobTopology.one_stage(topology), rank, timeout_s)
            used = [groups.tp, groups.pg_collection.pp, *groups.sync.values()]
            held = [g for g in distributed_c10d._world.pg_names if g is not distributed_c10d._get_default_group()]
            assert {id(g) for g in held} == {id(g) for g in used}, (generation, [g.size() for g in held])
            for group in used:  # replica, this rank alone, then sync groups in ascending block: one order
                value = torch.ones(1)
                dist.all_reduce(value, group=group)
                assert value.item() == group.size() == dist.get_world_size(group)
            dist.barrier()
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def test_groups_work_in_gloo_across_generations():
    """Four forked gloo processes build their groups in four generations of one store (healthy, one replica at
    TP1, both at TP1 with identical sync groups, healthy again): every group works, and a process holds no
    group besides the default one and its replica, itself and its sync groups."""
    timeout_s = 30.0
    master = store_server(timeout_s)  # on a port the OS picks; the processes connect to master.port
    # Spawned, not forked: the suite's process has threads by now (store servers, output relays), and a fork copies
    # whatever lock one of them held; a forked child then hung in the suite once in a while (it passed alone).
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_slot_process, args=(r, s, master.port, timeout_s)) for r in range(2) for s in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=90)
        if proc.exitcode is None:
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0, 0, 0]
    del master
