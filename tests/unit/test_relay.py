"""The two-level control plane (:mod:`ntp_megatron.elastic.relay`) in one process: a root TCPStore (node 0's store,
as in a job), one node store and relay per other simulated node, the real :class:`Controller` publishing, and ranks
as threads voting and forming through the real :class:`CommitProtocol`.

Rules under test: every rank reads the root's one decision, and the root counts one vote per node; the keys of
finished iterations are deleted at both levels; the controller's ``abort`` reaches a node whose ranks did not all
vote; after an aborted iteration the next generation's relays follow its redo; ``commit+reform`` comes with the
generation it moves to already in the node store, and a failure during that move still ends the generation left
there; a generation's end reaches the node store after what it published; a re-formation completes across nodes;
the topology a rank computes from a publication is the controller's; a relay's threads end at ``stop()``.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ntp_megatron.elastic import keys
from ntp_megatron.elastic.commit import ABORT, COMMIT, COMMIT_REFORM, COMPLETE, INCOMPLETE, CommitProtocol, \
    NodeShare, abandon_formation
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
    """``len(per_node)`` nodes on one root: node 0's store is the root, every other node has its store and relay;
    node ``i`` hosts ``per_node[i]`` ranks (launch ranks in node order), one replica of TP1 each. The controller
    publishes generation 0."""

    def __init__(self, per_node: list[int]) -> None:
        self.root = _root()
        self.per_node = per_node
        self.controller = Controller(self.root, make_topology(1, sum(per_node), {"layer": 2}), min_tp=1,
                                     policy="drop_replica", say=lambda _: None, emit=lambda _: None)
        self.controller._report_deaths = lambda *args: None  # its wait for the survivors' notes is not tested here
        self.relays = {i: NodeRelay(lambda t: _client(self.root.port, t), i, wait_s=WAIT_S)
                       for i in range(1, len(per_node))}

    def node_of(self, launch_rank: int) -> int:
        return next(i for i in range(len(self.per_node)) if launch_rank < sum(self.per_node[:i + 1]))

    def store_of(self, node: int) -> dist.Store:
        return _client(self.root.port) if node == 0 else self.relays[node].open_local(TIMEOUT_S)

    def protocols(self, generation: int = 0, live: list[int] = None) -> list[CommitProtocol]:
        """One protocol per live launch rank (default: all) in ``generation``, each on its own clients."""
        live = list(range(sum(self.per_node))) if live is None else live
        members = {node: sum(self.node_of(r) == node for r in live) for node in range(len(self.per_node))}
        share = {node: NodeShare(members=m, nodes=sum(1 for c in members.values() if c)) for node, m in members.items()}
        return [CommitProtocol(self.store_of(self.node_of(r)), generation, len(live), node=share[self.node_of(r)],
                               root=_client(self.root.port)) for r in live]

    def close(self) -> None:
        for relay in self.relays.values():
            assert relay.stop(), "a relay thread outlived stop(): at exit it would abort the process"
            assert not any(thread.is_alive() for thread in relay._threads)
            assert not relay.errors


@pytest.fixture
def nodes():
    made = []

    def make(per_node) -> Nodes:
        made.append(Nodes(per_node))
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


def _vote(protocols: list[CommitProtocol], iteration: int) -> list[str]:
    return _in_threads([lambda p=p: p.vote(iteration) for p in protocols])


def _form(protocols: list[CommitProtocol]) -> list[str]:
    return _in_threads([p.form for p in protocols])


def test_every_rank_reads_the_one_decision_and_finished_keys_are_deleted(nodes):
    n = nodes([2, 3, 1])
    protocols = n.protocols()
    assert _form(protocols) == [COMPLETE] * 6
    for iteration in range(1, 5):
        assert _vote(protocols, iteration) == [COMMIT] * 6
        assert n.root.get(keys.COMMITTED).decode() == str(iteration)
        assert int(n.root.add(keys.node_votes(0, iteration), 0)) == 3  # one count per node, not per rank
    node1 = n.store_of(1)
    for iteration in (1, 2):  # deleted by the decider of iteration + 2 in the root, by the last voter in a node
        assert not n.root.check([keys.decision(0, iteration)]) and not n.root.check([keys.node_votes(0, iteration)])
        assert not node1.check([keys.decision(0, iteration)])
    assert n.root.check([keys.decision(0, 3)]) and node1.check([keys.decision(0, 3)])
    assert int(node1.add(keys.node_tally(0), 0)) == 4 * 3  # a node counts every iteration in one key
    assert not any(node1.check([keys.votes(0, i)]) for i in range(1, 5))


def test_the_controllers_abort_reaches_a_node_whose_ranks_did_not_all_vote(nodes):
    n = nodes([2, 2])
    protocols = n.protocols()
    assert _form(protocols) == [COMPLETE] * 4
    voters = protocols[:3]  # node 1's second rank (launch rank 3) died before voting
    results = []
    threads = [threading.Thread(target=lambda p=p: results.append(p.vote(1))) for p in voters]
    for t in threads:
        t.start()
    n.root.wait([keys.node_votes(0, 1)])  # node 0 counted; node 1 cannot complete
    assert n.controller.handle([Death(3, time.time(), "killed")]) is None  # settles: abort, then ends generation 0
    for t in threads:
        t.join(TIMEOUT_S + 5)
    assert results == [ABORT] * 3
    assert keys.dead_named(n.store_of(1).get(keys.abort(0))) == {(3, 0)}  # replica 3 of TP1


def test_after_an_abort_the_next_generation_redoes_the_iteration_on_every_node(nodes):
    n = nodes([1, 1, 1])
    assert _form(n.protocols()) == [COMPLETE] * 3
    assert _vote(n.protocols(), 1) == [COMMIT] * 3
    survivors = n.protocols(live=[0, 1])
    waiting = threading.Thread(target=lambda: survivors[1].vote(2))  # launch rank 2 dies in iteration 2
    waiting.start()
    n.root.wait([keys.node_votes(0, 2)])
    assert n.controller.handle([Death(2, time.time(), "killed")]) is None  # aborts iteration 2, publishes generation 1
    waiting.join(TIMEOUT_S)
    assert n.store_of(1).get(keys.decision(0, 2)).decode() == ABORT
    again = n.protocols(generation=1, live=[0, 1])
    assert _form(again) == [COMPLETE] * 2
    assert _vote(again, 2) == [COMMIT] * 2  # the relay of node 1 follows generation 1 from iteration 2
    assert _vote(again, 3) == [COMMIT] * 2


def test_commit_reform_comes_with_the_next_generation_and_a_failure_in_the_move_ends_both(nodes):
    n = nodes([1, 2])
    protocols = n.protocols()
    assert _form(protocols) == [COMPLETE] * 3
    # As the controller admits: the next generation first, then the request for a boundary.
    n.root.set(keys.info(1), json.dumps({"base": 0, "dead": [], "joined": [[0, 1]]}))
    n.root.set(keys.LATEST, "1")
    n.root.set(keys.reform_requested(0), "1")
    seen = []

    def vote_and_read(p: CommitProtocol):
        decision = p.vote(1)
        seen.append((p.store.get(keys.LATEST).decode(), json.loads(p.store.get(keys.info(1)))["joined"]))
        return decision

    assert _in_threads([lambda p=p: vote_and_read(p) for p in protocols]) == [COMMIT_REFORM] * 3
    assert seen == [("1", [[0, 1]])] * 3
    # A rank dies while generation 1 forms: the controller abandons it and ends both generations.
    assert abandon_formation(n.root, 1)
    n.root.set(keys.info(2), json.dumps({"base": 0, "dead": [[2, 0]]}))
    n.root.set(keys.LATEST, "2")
    for g in (0, 1):
        n.root.set(keys.abort(g), keys.abort_value([(2, 0)]))
    node1 = n.store_of(1)
    node1.wait([keys.abort(0), keys.abort(1)])
    assert node1.get(keys.formed(1)).decode() == INCOMPLETE
    assert node1.get(keys.LATEST).decode() == "2"


def test_a_generations_end_reaches_the_node_store_after_what_it_published(nodes):
    n = nodes([1, 1, 1])
    assert n.controller.handle([Death(2, time.time(), "killed")]) is None  # before generation 0 formed
    for node in (1, 2):
        local = n.store_of(node)
        local.wait([keys.abort(0)])
        assert keys.dead_named(local.get(keys.abort(0))) == {(2, 0)}
        assert local.get(keys.LATEST).decode() == "1"
        assert json.loads(local.get(keys.info(1)))["dead"] == [[2, 0]]
        assert local.get(keys.formed(0)).decode() == INCOMPLETE
    n.root.set(keys.STOP, "no replica left")
    n.root.set(keys.abort(1), "stop")
    local = n.store_of(1)
    local.wait([keys.abort(1)])
    assert local.get(keys.STOP).decode() == "no replica left"


def test_a_reformation_completes_across_nodes(nodes):
    n = nodes([2, 1])
    assert _form(n.protocols()) == [COMPLETE] * 3
    assert n.root.get(keys.COMPLETED).decode() == "0"
    assert int(n.root.add(keys.node_ready(0), 0)) == 2


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
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.relay import NodeRelay


class SlowFinalization:
    \"\"\"Torn down with the module's globals, after the interpreter started finalizing (as pytest's long teardown
    is): a relay thread that wakes from its store call meanwhile aborts the process.\"\"\"

    def __del__(self, sleep=time.sleep, wait_s=float(sys.argv[1])):  # module globals are gone by then
        sleep(2 * wait_s)


def client(port, t):
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=t), wait_for_workers=False)


root = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=20), wait_for_workers=False)
root.set(keys.info(0), "{}")
root.set(keys.LATEST, "0")
relay = NodeRelay(lambda t: client(root.port, t), 1, wait_s=float(sys.argv[1]))
deadline = time.monotonic() + 20
while relay.published < 0 and time.monotonic() < deadline:  # then its mirror waits on the root for formed(0)
    time.sleep(0.01)
assert relay.published == 0
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
