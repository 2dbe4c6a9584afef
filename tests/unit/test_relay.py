"""The two-level control plane (:mod:`ntp_megatron.elastic.relay`) in one process: a root TCPStore, one node relay
per simulated node, and ranks as threads voting through the real :class:`CommitProtocol` in their node's store.

Rules under test: every rank reads the root's one decision; the controller's ``abort`` reaches a node whose ranks
did not all vote; ``commit+reform`` comes with the generation it moves to already in the node store; a
generation's end reaches the node store after what it published; a re-formation completes across nodes; the keys
of finished iterations are deleted at both levels; the topology a rank computes from a publication is the
controller's.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ntp_megatron.elastic import keys
from ntp_megatron.elastic.commit import ABORT, COMMIT, COMMIT_REFORM, COMPLETE, CommitProtocol, NodeShare, settle
from ntp_megatron.elastic.controller import Controller, Death
from ntp_megatron.elastic.relay import NodeRelay
from ntp_megatron.layout import make_topology
from ntp_megatron.stages import load_topology, published_topology

TIMEOUT_S = 20.0
WAIT_S = 0.2
"""The relays' store calls time out and retry after this: stop() takes at most about as long."""


def _root() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)


def _client(port: int, timeout_s: float = TIMEOUT_S) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class Nodes:
    """``len(per_node)`` relays on one root; node ``i`` has ``per_node[i]`` ranks of generation 0."""

    def __init__(self, per_node: list[int]) -> None:
        self.root = _root()
        self.per_node = per_node
        self.relays = [NodeRelay(lambda t: _client(self.root.port, t), i, wait_s=WAIT_S) for i in range(len(per_node))]

    def protocol(self, node: int, generation: int = 0) -> CommitProtocol:
        share = NodeShare(members=self.per_node[node], nodes=len(self.per_node))
        return CommitProtocol(self.relays[node].open_local(TIMEOUT_S), generation, sum(self.per_node), node=share)

    def close(self) -> None:
        for relay in self.relays:
            assert relay.stop(), "a relay thread outlived stop(): at exit it would abort the process"
            assert not any(thread.is_alive() for thread in relay._threads)
            assert not relay.errors


@pytest.fixture
def nodes():
    made = []

    def make(per_node, **kw) -> Nodes:
        made.append(Nodes(per_node, **kw))
        return made[-1]

    yield make
    for n in made:
        n.close()


def _in_threads(calls) -> list:
    out = [None] * len(calls)

    def run(i, call):
        out[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S + 5)
    assert not any(t.is_alive() for t in threads)
    return out


def test_every_rank_reads_the_one_decision_and_finished_keys_are_deleted(nodes):
    n = nodes([2, 3, 1])
    protocols = [n.protocol(node) for node in range(3) for _ in range(n.per_node[node])]
    for iteration in range(1, 5):
        decided = _in_threads([lambda p=p: p.vote(iteration) for p in protocols])
        assert decided == [COMMIT] * 6
        assert n.root.get(keys.COMMITTED).decode() == str(iteration)
        assert int(n.root.add(keys.node_votes(0, iteration), 0)) == 3  # one count per node, not per rank
    local = n.relays[1].open_local(TIMEOUT_S)
    for iteration in (1, 2):  # deleted by the decider of iteration + 2
        assert not n.root.check([keys.decision(0, iteration), keys.node_votes(0, iteration)])
    assert n.root.check([keys.decision(0, 3)]) and local.check([keys.decision(0, 4)])
    assert not any(n.root.check([keys.votes(0, i)]) for i in range(1, 5))  # rank counts stay in the node stores


def test_the_controllers_abort_reaches_a_node_whose_ranks_did_not_all_vote(nodes):
    n = nodes([2, 2])
    voters = [n.protocol(0), n.protocol(0), n.protocol(1)]  # node 1's second rank died before voting
    results = []
    threads = [threading.Thread(target=lambda p=p: results.append(p.vote(1))) for p in voters]
    for t in threads:
        t.start()
    n.root.wait([keys.node_votes(0, 1)])  # node 0 counted; node 1 cannot complete
    assert settle(n.root, 0)[:2] == (1, ABORT)
    for t in threads:
        t.join(TIMEOUT_S + 5)
    assert results == [ABORT] * 3


def test_commit_reform_comes_with_the_next_generation_in_the_node_store(nodes):
    n = nodes([1, 2])
    n.root.set(keys.info(0), json.dumps({"base": 0, "dead": []}))
    n.root.set(keys.LATEST, "0")
    n.root.set(keys.info(1), json.dumps({"base": 0, "dead": [], "joined": [[0, 1]]}))
    n.root.set(keys.LATEST, "1")
    n.root.set(keys.reform_requested(0), "1")
    protocols = [n.protocol(0), n.protocol(1), n.protocol(1)]
    seen = []

    def vote_and_read(p: CommitProtocol):
        decision = p.vote(1)
        seen.append((p.store.get(keys.LATEST).decode(), json.loads(p.store.get(keys.info(1)))["joined"]))
        return decision

    assert _in_threads([lambda p=p: vote_and_read(p) for p in protocols]) == [COMMIT_REFORM] * 3
    assert seen == [("1", [[0, 1]])] * 3


def test_a_generations_end_reaches_the_node_store_after_what_it_published(nodes):
    n = nodes([1, 1])
    n.root.set(keys.info(0), json.dumps({"base": 0, "dead": []}))  # as the controller publishes generation 0
    n.root.set(keys.info(1), json.dumps({"base": 0, "dead": [[0, 1]]}))
    n.root.set(keys.LATEST, "1")
    n.root.set(keys.abort(0), keys.abort_value([(0, 1)]))
    for relay in n.relays:
        local = relay.open_local(TIMEOUT_S)
        local.wait([keys.abort(0)])
        assert keys.dead_named(local.get(keys.abort(0))) == {(0, 1)}
        assert local.get(keys.LATEST).decode() == "1"
        assert json.loads(local.get(keys.info(1)))["dead"] == [[0, 1]]
    n.root.set(keys.STOP, "no replica left")
    n.root.set(keys.abort(1), "stop")
    local = n.relays[0].open_local(TIMEOUT_S)
    local.wait([keys.abort(1)])
    assert local.get(keys.STOP).decode() == "no replica left"


def test_a_reformation_completes_across_nodes(nodes):
    n = nodes([2, 1])
    protocols = [n.protocol(0, generation=1), n.protocol(0, generation=1), n.protocol(1, generation=1)]
    assert _in_threads([p.form for p in protocols]) == [COMPLETE] * 3
    assert n.root.get(keys.COMPLETED).decode() == "1"


@pytest.mark.parametrize("dead", [[3], [1, 6], [4, 5]])
def test_the_topology_a_rank_computes_from_a_publication_is_the_controllers(dead):
    store = dist.HashStore()
    start = make_topology(4, 2, {"vocab": 64, "layer": 8})
    controller = Controller(store, start, min_tp=1, policy="drop_replica", say=lambda _: None, emit=lambda _: None)
    store.set(keys.abort(0), "")  # nothing of the ranks: the controller only publishes
    assert controller.handle([Death(rank, 0.0, "killed") for rank in dead]) is None
    info = json.loads(store.get(keys.info(1)))
    computed = published_topology(start, info, 1)
    assert computed.to_json() == json.loads(store.get(keys.topology(1)))
    assert computed == load_topology(json.loads(store.get(keys.topology(1))))


EXITS_AFTER_STOP = """
import sys
import time
from datetime import timedelta
import torch.distributed as dist
from ntp_megatron.elastic.commit import COMMIT, CommitProtocol, NodeShare
from ntp_megatron.elastic.relay import NodeRelay


class SlowFinalization:
    \"\"\"Torn down with the module's globals, after the interpreter started finalizing (as pytest's long teardown
    is): a relay thread that wakes from its store call meanwhile aborts the process.\"\"\"

    def __del__(self, sleep=time.sleep, wait_s=float(sys.argv[1])):  # module globals are gone by then
        sleep(2 * wait_s)


def client(port, t):
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=t), wait_for_workers=False)


root = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=20), wait_for_workers=False)
relay = NodeRelay(lambda t: client(root.port, t), 0, wait_s=float(sys.argv[1]))
assert CommitProtocol(relay.open_local(20), 0, 1, node=NodeShare(members=1, nodes=1)).vote(1) == COMMIT
relay.stop()
slow = SlowFinalization()
"""


def test_a_process_exits_cleanly_once_its_relay_stopped(tmp_path):
    """What CI met: relay threads still blocked in a store call while the interpreter finalizes abort the process
    (``terminate called without an active exception``, exit code 134). ``stop()`` joins them."""
    import subprocess
    import sys

    script = tmp_path / "relay_exit.py"
    script.write_text(EXITS_AFTER_STOP)
    done = subprocess.run([sys.executable, str(script), "1.5"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
