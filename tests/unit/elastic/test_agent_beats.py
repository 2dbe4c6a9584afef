"""How a launcher's Agent reads its ranks' heartbeats (:meth:`ntp_megatron.elastic.agent.Agent._read_beats`): one
request per poll for all of them (every 20 ms, on every node), a rank's key set for it until its first beat, never
over a beat; a replacement's predecessor's beat does not count for it."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

from ntp_megatron.elastic import agent as agent_module
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.agent import Agent
from ntp_megatron.elastic.watchdog import beat

TIMEOUT_S = 4.0
GRACE_S = 30.0


class _Proc:
    def __init__(self, rank: int) -> None:
        self.rank, self.pid = rank, os.getpid()

    def poll(self):
        return None


class Counting:
    """A store that counts the requests made through it."""

    def __init__(self, store: dist.Store) -> None:
        self._store, self.requests = store, 0

    def __getattr__(self, name):
        attr = getattr(self._store, name)

        def call(*args, **kwargs):
            self.requests += 1
            return attr(*args, **kwargs)

        return call


@pytest.fixture
def node(monkeypatch):
    killed: list[int] = []
    monkeypatch.setattr(agent_module, "_signal", lambda pid, sig: killed.append(pid))
    store = Counting(dist.HashStore())
    procs = {rank: _Proc(rank) for rank in range(8)}
    agent = Agent(store, lambda: procs, TIMEOUT_S, startup_grace_s=GRACE_S, specs=[], say=lambda _: None,
                  live=lambda: list(procs))
    return agent, store, killed


def test_one_request_per_poll_for_every_rank(node):
    agent, store, killed = node
    agent._fence(agent.started)  # the first poll sets the keys of ranks that never beat
    store.requests = 0
    for k in range(3):
        agent._fence(agent.started + k)
    assert store.requests == 3
    assert killed == []


def test_a_rank_that_never_beat_is_silent_since_its_start_and_a_beat_is_never_overwritten(node):
    agent, store, killed = node
    store.set(keys.heartbeat(3), json.dumps({**beat(), "t": agent.started + 1.0}))
    agent._fence(agent.started + 1.0)
    assert json.loads(store.get(keys.heartbeat(3)))["t"] == agent.started + 1.0  # not set over
    assert agent._read_beats([3, 4])[1] is None  # rank 4 never beat
    later = agent.started + GRACE_S + 0.5  # past the start-up grace: every rank that never beat is fenced
    store.set(keys.heartbeat(3), json.dumps({**beat(), "t": later - 1.0}))
    agent._fence(later)
    assert len(killed) == 7 and 3 not in agent.notes and 4 in agent.notes


def test_a_replacements_predecessor_does_not_count_for_it(node):
    agent, store, killed = node
    agent._fence(agent.started)
    store.set(keys.heartbeat(5), json.dumps({**beat(), "t": agent.started + 2.0}))
    assert agent._read_beats([5])[0]["t"] == agent.started + 2.0
    agent.forget(5)
    assert agent._read_beats([5]) == [None]


def test_a_step_of_the_wall_clock_fences_no_one(node, monkeypatch):
    """A rank and its launcher share a host: heartbeats and stops are timed on its monotonic clock, so a step of the
    wall clock (NTP, an operator) makes no beat look old. Death times stay wall time: they are only reported."""
    import time

    agent, store, killed = node
    wall, step = time.time, [0.0]
    monkeypatch.setattr(time, "time", lambda: wall() + step[0])
    for rank in range(8):
        keys.beat(store, rank, beat())
    step[0] = 3600.0  # the wall clock jumps an hour ahead between the beats and the launcher's poll
    agent.poll(inject=False)
    assert killed == [] and agent.notes == {}
    step[0] = 0.0
    agent.heartbeat_timeout_s = 0.0  # every beat is too old now: the notes say when, in wall time
    agent.poll(inject=False)
    assert len(killed) == 8 and all(abs(when - time.time()) < 5.0 for when, _ in agent.notes.values())
