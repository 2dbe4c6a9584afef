"""The policy of "a peer died: get out, then make new groups" (ntp_megatron.elastic.group_backend) over fake process
groups, per topology and event (kill, rejoin, dropped replica, with pipeline stages): which groups each rank cuts the
moment a generation ends and how — gloo: the sockets of exactly the groups with a dead member, and the generation's
own; NCCL: an abort of the default group's and every group's communicator after a death (a host blocked on an NCCL
kernel cannot be reached otherwise), none across a planned move — and that a group cut never goes on. The NCCL half
never ran on a GPU here: this is its test."""

from __future__ import annotations

import socket
import threading

import pytest
import torch.distributed as dist

from ntp_megatron.plan import stages
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.group_backend import GlooBackend, NcclBackend
from ntp_megatron.elastic.watchdog import GenerationWatchdog
from ntp_megatron.plan.group_plan import blocked_by, event_plan, rank_group_keys
from ntp_megatron.core.groups import PooledGroup
from ntp_megatron.plan.layout import make_topology
from ntp_megatron.plan.stages import JobTopology, join_topology, next_topology
from ntp_megatron.sockets import socket_fds

UNITS = {"heads": 8, "ffn": 24, "vocab": 29}


class FakeGroup:
    def __init__(self, name: str) -> None:
        self.name, self.aborted = name, 0

    def abort(self) -> None:
        self.aborted += 1


def make_job(*args, **kwargs) -> JobTopology:
    """A job without pipeline stages."""
    return JobTopology.one_stage(make_topology(*args, **kwargs))


def pooled(topology, rank: int) -> dict:
    return {k: PooledGroup(key=k, group=FakeGroup(k.label()), made_in=topology.generation, sockets={})
            for k in rank_group_keys(topology, rank)}


def kill(topology, identity, policy="stop", min_tp=1):
    return stages.with_generation(next_topology(topology, [topology.rank_of(*identity)], min_tp=min_tp, policy=policy),
                                  topology.generation + 1)


def names(keys) -> list[str]:
    return sorted(k.name() for k in keys)


EVENTS = {
    "kill": (make_job(4, 2, UNITS), lambda t: kill(t, (1, 3)), [(1, 3)]),
    "rejoin": (kill(make_job(4, 2, UNITS), (1, 3)), lambda t: join_topology(t, [(1, 3)]), []),
    "drop": (make_job(2, 3, UNITS), lambda t: kill(t, (2, 1), "drop_replica", min_tp=2), [(2, 1)]),
}


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_gloo_cuts_exactly_the_groups_with_a_dead_member_and_nccl_every_group(event):
    old, step, dead = EVENTS[event]
    for rank in old.ranks:
        held = rank_group_keys(old, rank)
        with_dead = {k for k in held if k.has_member(dead)}
        assert set(GlooBackend().cut_at_end(held, set(dead))) == with_dead
        assert set(NcclBackend().cut_at_end(held, set(dead))) == (set(held) if dead else set())
        assert set(GlooBackend().cut_at_end(held, None)) == set(NcclBackend().cut_at_end(held, None)) == set(held)


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_what_gloo_leaves_uncut_is_what_the_next_generation_may_keep(event):
    """No group gloo cuts is one the next generation wants: a group with a dead member never goes on (its key in the
    next generation has other members), so cutting it loses nothing; everything left uncut is offered or let go."""
    old, step, dead = EVENTS[event]
    new = step(old)
    for rank in old.ranks:
        identity = old.slot_of(rank)
        cut = set(GlooBackend().cut_at_end(rank_group_keys(old, rank), set(dead)))
        plan = event_plan(old, new, identity)
        assert cut.isdisjoint(plan.keep) and cut <= set(plan.release)


def test_nccl_aborts_the_default_group_and_the_groups_it_is_given_and_shuts_the_store_client():
    old, step, dead = EVENTS["kill"]
    held = pooled(old, old.rank_of(0, 3))
    default = FakeGroup("default")
    a, b = socket.socketpair()
    try:
        own = {a.fileno(): socket_fds()[a.fileno()]}
        cut = [held[k] for k in NcclBackend().cut_at_end(held, set(dead))]
        assert NcclBackend().get_out(cut, own, default) == 1 + 1 + len(held)
        b.settimeout(5.0)
        assert b.recv(1) == b""  # the store client's socket is shut down too: a store wait of the generation ends
    finally:
        a.close()
        b.close()
    assert default.aborted == 1 and all(p.group.aborted == 1 for p in held.values())
    NcclBackend().let_go(list(held.values()))
    assert all(p.group.aborted == 2 for p in held.values())  # an abort of an aborted group is harmless


def test_across_a_planned_move_nccl_keeps_every_group():
    old, step, dead = EVENTS["rejoin"]
    held = rank_group_keys(old, old.rank_of(0, 0))
    assert NcclBackend().cut_at_end(held, set()) == [] == GlooBackend().cut_at_end(held, set())
    assert NcclBackend().environment()["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_with_pipeline_stages_gloo_cuts_only_the_failed_stages_groups_and_the_replicas():
    old = stages.make_pipeline_topology(2, 2, 2, UNITS)
    dead = {(1, 1, 1)}
    other_stage = rank_group_keys(old, old.rank_of(1, 0, 0))
    assert names(GlooBackend().cut_at_end(other_stage, dead)) == ["mp[1]"]
    same_stage = rank_group_keys(old, old.rank_of(1, 0, 1))
    assert names(GlooBackend().cut_at_end(same_stage, dead)) == ["mp[1]", "tp[1]"]  # its sync group is block 0's


def test_gloo_gets_out_by_shutting_down_exactly_the_blocked_groups_sockets():
    pairs = {name: socket.socketpair() for name in ("own", "blocked", "other")}
    try:
        fds = socket_fds()
        sockets = {name: {a.fileno(): fds[a.fileno()]} for name, (a, b) in pairs.items()}
        blocked = PooledGroup(key=None, group=None, made_in=0, sockets=sockets["blocked"])
        assert GlooBackend().get_out([blocked], sockets["own"], None) == 2
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


class RecordingBackend(GlooBackend):
    name = "fake"

    def __init__(self) -> None:
        self.cut = []
        self.done = threading.Event()

    def get_out(self, groups, own_sockets, default_group):
        self.cut.append(sorted(p.key.label() for p in groups))
        self.done.set()
        return len(groups)


@pytest.mark.parametrize("value, dead", [(keys.abort_value([(1, 3)]), [(1, 3)]), (keys.MOVED, []), ("stop", None)])
def test_the_watchdog_cuts_the_groups_the_abort_key_names(value, dead):
    """A kill names the dead: the groups with one are cut; a planned move cuts none; a stop cuts every group."""
    topology = make_job(4, 2, UNITS)
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
    assert watchdog.cut == set(expected)  # leave() keeps none of them
