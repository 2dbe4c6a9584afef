"""The policy of "a peer died: get out, then make new groups" (ntp_megatron.elastic.group_backend) over fake process
groups: which groups each rank cuts the moment a generation ends (those with a dead member, and nothing else), how
each backend cuts them (gloo: their sockets; NCCL: an abort of exactly those communicators and the default group's),
and which new groups NCCL makes by shrinking a group that only lost members, per NCCL version, topology and event
(kill, rejoin, dropped replica, with pipeline stages). The NCCL half never ran on a GPU here: this is its test."""

from __future__ import annotations

import socket
import threading

import pytest
import torch.distributed as dist

from ntp_megatron import stages
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.group_backend import GlooBackend, NcclBackend, Shrink, shrink_into, shrink_plan
from ntp_megatron.elastic.watchdog import GenerationWatchdog
from ntp_megatron.group_plan import blocked_by, event_plan, rank_group_keys
from ntp_megatron.groups import PooledGroup
from ntp_megatron.layout import join_topology, make_topology, next_topology
from ntp_megatron.sockets import socket_fds

UNITS = {"heads": 8, "ffn": 24, "vocab": 29}


class FakeGroup:
    def __init__(self, name: str) -> None:
        self.name, self.aborted = name, 0

    def abort(self) -> None:
        self.aborted += 1


def pooled(topology, rank: int) -> dict:
    return {k: PooledGroup(key=k, group=FakeGroup(k.label()), made_in=topology.generation, sockets={})
            for k in rank_group_keys(topology, rank)}


def kill(topology, identity, policy="stop", min_tp=1):
    return stages.with_generation(next_topology(topology, [topology.rank_of(*identity)], min_tp=min_tp, policy=policy),
                                  topology.generation + 1)


def names(keys) -> list[str]:
    return sorted(f"{k.role}{list(k.place)}" for k in keys)


EVENTS = {
    "kill": (make_topology(4, 2, UNITS), lambda t: kill(t, (1, 3)), [(1, 3)]),
    "rejoin": (kill(make_topology(4, 2, UNITS), (1, 3)), lambda t: join_topology(t, [(1, 3)]), []),
    "drop": (make_topology(2, 3, UNITS), lambda t: kill(t, (2, 1), "drop_replica", min_tp=2), [(2, 1)]),
}


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_nccl_aborts_exactly_the_groups_with_a_dead_member_and_the_default_group(event):
    old, step, dead = EVENTS[event]
    default = FakeGroup("default")
    backend = NcclBackend(lambda: default)
    for rank in old.ranks:
        held = pooled(old, rank)
        default.aborted = 0
        blocked = [held[k] for k in blocked_by(held, dead)]
        backend.get_out(blocked, {})
        assert default.aborted == 1
        assert {k for k, p in held.items() if p.group.aborted} == {k for k in held if k.has_member(dead)}
        assert all(p.group.aborted <= 1 for p in held.values())


def test_a_kill_shrinks_the_degraded_replicas_tp_group_where_nccl_can():
    """TP4 × 2, replica 1 loses slot 3: its survivors' TP group only lost a member, so NCCL 2.27–2.30 shrinks it
    (with the abort flag: a collective may be blocked in it); the sync group of block 3 gets another member (the
    proxy) and is made fresh. NCCL 2.26 has no shrink; from 2.31 a shrink with abort can hang and is not used.
    Healthy ranks make nothing they could shrink."""
    old, step, dead = EVENTS["kill"]
    new = step(old)
    for slot in range(3):
        identity = (1, slot)
        plan = event_plan(old, new, identity)
        held = rank_group_keys(old, old.rank_of(*identity))
        shrinks = shrink_plan(held, rank_group_keys(new, new.rank_of(*identity)), dead, (2, 28, 3))
        assert names(shrinks) == ["tp[0]"]
        [tp] = shrinks.values()
        assert tp.abort and tp.excluded == ((1, 3),) and tp.key in plan.make and tp.parent.role == "tp"
        assert shrink_plan(held, plan.make, dead, (2, 26, 5)) == {}
        assert shrink_plan(held, plan.make, dead, (2, 31, 0)) == {}
        assert shrink_plan(held, plan.make, dead, None) == {}
    for slot in range(4):
        identity = (0, slot)
        held = rank_group_keys(old, old.rank_of(*identity))
        assert shrink_plan(held, rank_group_keys(new, new.rank_of(*identity)), dead, (2, 28, 3)) == {}


def test_a_dropped_replica_shrinks_every_sync_group():
    old, step, dead = EVENTS["drop"]
    new = step(old)
    for rank in new.ranks:
        identity = new.slot_of(rank)
        held = rank_group_keys(old, old.rank_of(*identity))
        shrinks = shrink_plan(held, rank_group_keys(new, rank), dead, (2, 28, 3))
        assert names(shrinks) == [f"sync[0, {identity[1]}]"]
        [s] = shrinks.values()
        # The replica's other rank is alive (it retires): a group without a dead member shrinks without abort.
        assert s.excluded == ((2, identity[1]),) and s.abort == (identity[1] == 1)


def test_a_rejoin_grows_groups_and_shrinks_none():
    old, step, dead = EVENTS["rejoin"]
    new = step(old)
    for rank in new.ranks:
        identity = new.slot_of(rank)
        old_rank = old.rank_of(*identity)
        held = rank_group_keys(old, old_rank) if old_rank is not None else []
        assert shrink_plan(held, rank_group_keys(new, rank), dead, (2, 28, 3)) == {}


def test_with_pipeline_stages_only_the_failed_stage_shrinks():
    old = stages.make_pipeline_topology(2, 2, 2, UNITS)
    new = stages.with_generation(stages.next_topology(old, [old.rank_of(1, 1, 1)]), 1)
    dead = [(1, 1, 1)]
    survivor = (1, 0, 1)
    shrinks = shrink_plan(rank_group_keys(old, old.rank_of(*survivor)), rank_group_keys(new, new.rank_of(*survivor)),
                          dead, (2, 28, 3))
    assert names(shrinks) == ["mp[1]", "tp[1]"]  # its stage's TP group and its replica's model-parallel group
    other_stage = (1, 0, 0)
    shrinks = shrink_plan(rank_group_keys(old, old.rank_of(*other_stage)),
                          rank_group_keys(new, new.rank_of(*other_stage)), dead, (2, 28, 3))
    assert names(shrinks) == ["mp[1]"]


def test_shrinking_calls_torch_with_the_parents_group_ranks_in_key_order_and_skips_a_failure():
    old, step, dead = EVENTS["kill"]
    new = step(old)
    identity = (1, 0)
    held = pooled(old, old.rank_of(*identity))
    shrinks = shrink_plan(held, rank_group_keys(new, new.rank_of(*identity)), dead, (2, 28, 3))
    calls = []

    def fake_shrink(excluded, group, shrink_flags):
        calls.append((excluded, group.name, shrink_flags))
        return FakeGroup("shrunk")

    out = shrink_into(held, shrinks, 1, fake_shrink)
    [tp] = shrinks
    assert calls == [([3], held[shrinks[tp].parent].group.name, 1)] and out[tp].made_in == 1
    bad = Shrink(tp, shrinks[tp].parent, ((1, 3),), True)

    def failing(excluded, group, shrink_flags):
        raise RuntimeError("ncclInternalError")

    assert shrink_into(held, {tp: bad}, 1, failing) == {}  # made fresh instead


def test_gloo_gets_out_by_shutting_down_exactly_the_blocked_groups_sockets():
    pairs = {name: socket.socketpair() for name in ("own", "blocked", "other")}
    try:
        fds = socket_fds()
        sockets = {name: {a.fileno(): fds[a.fileno()]} for name, (a, b) in pairs.items()}
        blocked = PooledGroup(key=None, group=None, made_in=0, sockets=sockets["blocked"])
        assert GlooBackend().get_out([blocked], sockets["own"]) == 2
        for name, (a, b) in pairs.items():
            if name == "other":
                b.setblocking(False)
                with pytest.raises(BlockingIOError):  # untouched: nothing to read, still open
                    b.recv(1)
            else:
                b.settimeout(5.0)
                assert b.recv(1) == b"", name  # a shut-down peer reads as closed at once
    finally:
        for a, b in pairs.values():
            a.close()
            b.close()


class RecordingBackend:
    name = "fake"

    def __init__(self) -> None:
        self.cut = []
        self.done = threading.Event()

    def get_out(self, groups, own_sockets):
        self.cut.append(sorted(p.key.label() for p in groups))
        self.done.set()
        return len(groups)


@pytest.mark.parametrize("value, dead", [(keys.abort_value([(1, 3)]), [(1, 3)]), (keys.MOVED, []), ("stop", None)])
def test_the_watchdog_cuts_the_groups_the_abort_key_names(value, dead):
    """A kill names the dead: the groups with one are cut; a planned move cuts none; a stop cuts every group."""
    topology = make_topology(4, 2, UNITS)
    store = dist.HashStore()
    backend = RecordingBackend()
    watchdog = GenerationWatchdog(lambda timeout_s: store, 0, {}, 30.0, backend)
    held = pooled(topology, topology.rank_of(0, 3))
    watchdog.add_groups(held.values())
    store.set(keys.abort(0), value)
    assert backend.done.wait(10.0)
    watchdog.join(10.0)
    expected = held if dead is None else blocked_by(held, dead)
    assert backend.cut == [sorted(k.label() for k in expected)]
