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
import socket
import threading
import time
import types
from datetime import timedelta

import pytest
import torch.distributed as dist

from ntp_megatron.config import timing
from ntp_megatron.elastic import commit, keys, publication
from ntp_megatron.elastic.commit import ABORT, COMMIT, COMMIT_REFORM, COMPLETE, INCOMPLETE, \
    CommitProtocol, NodeShare, abandon_formation, settle
from ntp_megatron.elastic.controller import Controller, Death
from ntp_megatron.elastic.publication import copy_to_node, raise_latest
from ntp_megatron.elastic.generation import ElasticRank, NodePlane
from ntp_megatron.elastic.relay import NodeRelay
from ntp_megatron.elastic.watchdog import store_factory
from ntp_megatron.plan.layout import make_topology
from ntp_megatron.plan.stages import JobTopology, make_pipeline_topology, published_topology

TIMEOUT_S = 20.0


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
        self.controller = Controller(self.root, JobTopology.one_stage(make_topology(1, sum(per_node), {"layer": 2})),
                                     min_tp=1, policy="drop_replica", say=lambda _: None, emit=lambda _: None)
        self.controller.reports.start = lambda *args: None  # its wait for the survivors' notes is not tested here
        self.relays = {i: NodeRelay(lambda t: _client(self.root.port, t), i)
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
        assert n.root.get(commit.COMMITTED).decode() == str(iteration)
        assert int(n.root.add(commit.node_votes_key(0, iteration), 0)) == 3  # one count per node, not per rank
    node1 = n.store_of(1)
    for iteration in (1, 2):  # deleted by the decider of iteration + 2 in the root, by the last voter in a node
        assert not n.root.check([commit.decision_key(0, iteration)])
        assert not n.root.check([commit.node_votes_key(0, iteration)])
        assert not node1.check([commit.decision_key(0, iteration)])
    assert n.root.check([commit.decision_key(0, 3)]) and node1.check([commit.decision_key(0, 3)])
    assert int(node1.add(commit.node_tally_key(0), 0)) == 4 * 3  # a node counts every iteration in one key
    assert not any(node1.check([commit.votes_key(0, i)]) for i in range(1, 5))


def test_the_controllers_abort_reaches_a_node_whose_ranks_did_not_all_vote(nodes):
    n = nodes([2, 2])
    protocols = n.protocols()
    assert _form(protocols) == [COMPLETE] * 4
    voters = protocols[:3]  # node 1's second rank (launch rank 3) died before voting
    results = []
    threads = [threading.Thread(target=lambda p=p: results.append(p.vote(1))) for p in voters]
    for t in threads:
        t.start()
    n.root.wait([commit.node_votes_key(0, 1)])  # node 0 counted; node 1 cannot complete
    aborted = time.monotonic()
    assert n.controller.handle([Death(3, time.time(), "killed")]) is None  # settles: abort, then ends generation 0
    for t in threads:
        t.join(TIMEOUT_S + 5)
    assert results == [ABORT] * 3
    assert time.monotonic() - aborted < TIMEOUT_S / 4  # the relay brought it: not a wait that timed out
    assert keys.dead_named(n.store_of(1).get(keys.abort(0))) == {(3, 0)}  # replica 3 of TP1


def test_a_last_voter_waits_on_the_root_no_longer_than_its_timeout(nodes):
    """A rank that never votes but is not dead (stuck, its heartbeat alive): the other node's last voter gives up
    after its root client's timeout, as a vote with one level does after its store's (nothing hangs)."""
    n = nodes([1, 1])
    assert _form(n.protocols()) == [COMPLETE] * 2
    share = NodeShare(members=1, nodes=2)
    voter = CommitProtocol(n.store_of(1), 0, 2, node=share, root=_client(n.root.port, timeout_s=0.5))
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        voter.vote(1)
    assert time.monotonic() - started < 0.5 + 2 * timing.current().bring_wait_s


def test_after_an_abort_the_next_generation_redoes_the_iteration_on_every_node(nodes):
    n = nodes([1, 1, 1])
    assert _form(n.protocols()) == [COMPLETE] * 3
    assert _vote(n.protocols(), 1) == [COMMIT] * 3
    survivors = n.protocols(live=[0, 1])
    waiting = threading.Thread(target=lambda: survivors[1].vote(2))  # launch rank 2 dies in iteration 2
    waiting.start()
    n.root.wait([commit.node_votes_key(0, 2)])
    assert n.controller.handle([Death(2, time.time(), "killed")]) is None  # aborts iteration 2, publishes generation 1
    waiting.join(TIMEOUT_S)
    assert n.store_of(1).get(commit.decision_key(0, 2)).decode() == ABORT
    again = n.protocols(generation=1, live=[0, 1])
    assert _form(again) == [COMPLETE] * 2
    assert _vote(again, 2) == [COMMIT] * 2  # the relay of node 1 follows generation 1 from iteration 2
    assert _vote(again, 3) == [COMMIT] * 2


def test_commit_reform_comes_with_the_next_generation_and_a_failure_in_the_move_ends_both(nodes):
    n = nodes([1, 2])
    protocols = n.protocols()
    assert _form(protocols) == [COMPLETE] * 3
    # As the controller admits: the next generation first, then the request for a boundary.
    n.root.set(publication.info_key(1), json.dumps({"base": 0, "dead": [], "joined": [[0, 1]]}))
    n.root.set(publication.LATEST, "1")
    n.root.set(publication.reform_requested_key(0), "1")
    seen = []

    def vote_and_read(p: CommitProtocol):
        decision = p.vote(1)
        seen.append((p.store.get(publication.LATEST).decode(),
                     json.loads(p.store.get(publication.info_key(1)))["joined"]))
        return decision

    assert _in_threads([lambda p=p: vote_and_read(p) for p in protocols]) == [COMMIT_REFORM] * 3
    assert seen == [("1", [[0, 1]])] * 3
    # A rank dies while generation 1 forms: the controller abandons it and ends both generations.
    assert abandon_formation(n.root, 1)
    n.root.set(publication.info_key(2), json.dumps({"base": 0, "dead": [[2, 0]]}))
    n.root.set(publication.LATEST, "2")
    for g in (0, 1):
        n.root.set(keys.abort(g), keys.abort_value([(2, 0)]))
    node1 = n.store_of(1)
    node1.wait([keys.abort(0), keys.abort(1)])
    assert node1.get(commit.formed_key(1)).decode() == INCOMPLETE
    assert node1.get(publication.LATEST).decode() == "2"


def test_a_generation_left_at_an_admission_boundary_ends_on_every_node_and_the_next_one_follows(nodes):
    """A generation its ranks leave together at an admission boundary ends in the root when a rank marks it there
    (``moved``, no copy list): every node's relay reads what changed from the root, moves on, and ends the next
    generation at the next failure."""
    n = nodes([1, 1, 1])
    assert _form(n.protocols()) == [COMPLETE] * 3
    assert n.controller.handle([Death(2, time.time(), "killed")]) is None  # generation 1 without replica 2
    survivors = n.protocols(generation=1, live=[0, 1])
    assert _form(survivors) == [COMPLETE] * 2
    assert _vote(survivors, 1) == [COMMIT] * 2
    assert n.controller.admit([2])  # generation 2 with replica 2 back, at the next boundary
    assert _vote(survivors, 2) == [COMMIT_REFORM] * 2
    n.root.set(keys.abort(1), keys.MOVED)  # as the first rank of a node does once every rank is done with it
    for node in (1, 2):
        local = n.store_of(node)
        local.wait([keys.abort(1)])
        assert local.get(keys.abort(1)).decode() == keys.MOVED and local.get(publication.LATEST).decode() == "2"
    everyone = n.protocols(generation=2)
    assert _form(everyone) == [COMPLETE] * 3
    assert _vote(everyone, 3) == [COMMIT] * 3
    assert n.controller.handle([Death(1, time.time(), "killed")]) is None
    local = n.store_of(2)
    local.wait([keys.abort(2)])
    assert keys.dead_named(local.get(keys.abort(2))) == {(1, 0)} and local.get(publication.LATEST).decode() == "3"


def test_a_rank_on_another_node_votes_beats_and_follows_generations_in_its_nodes_store(nodes):
    """:class:`ElasticRank` with a :class:`NodePlane`: its heartbeat goes to its node's store, a new generation's
    topology is computed from its publication (the root's copy is gone), and it marks a generation it leaves at a
    boundary over in both stores when it is its node's first rank."""
    n = nodes([1, 2])
    server = n.relays[1]
    plane = NodePlane(server.open_local, 0, node=1, node_of=(0, 1, 1))
    elastic = ElasticRank(2, lambda t: _client(n.root.port, t), "gloo", TIMEOUT_S, 0.05, nodes=plane)
    try:
        assert elastic.local is not elastic.ctl
        n.store_of(1).wait([keys.heartbeat(2)])
        assert not n.root.check([keys.heartbeat(2)])
        assert n.controller.handle([Death(0, time.time(), "killed")]) is None
        published = json.loads(n.root.get(publication.topology_key(1)))
        n.root.delete_key(publication.topology_key(1))
        topology, info = elastic.await_newer(0)
        assert topology.to_json() == published and info["dead"] == [[0, 0]]
        assert plane.share(topology, elastic.identities) == NodeShare(members=2, nodes=1)
        left = types.SimpleNamespace(number=1, topology=topology)
        elastic.end_generation(left)  # launch rank 2 is not its node's first (1 is)
        assert n.store_of(1).get(keys.abort(1)).decode() == keys.MOVED and not n.root.check([keys.abort(1)])
        elastic.launch_rank = 1
        elastic.end_generation(left)
        assert n.root.get(keys.abort(1)).decode() == keys.MOVED
    finally:
        elastic.heartbeat.stop()


def test_a_generations_end_reaches_the_node_store_after_what_it_published(nodes):
    n = nodes([1, 1, 1])
    assert n.controller.handle([Death(2, time.time(), "killed")]) is None  # before generation 0 formed
    for node in (1, 2):
        local = n.store_of(node)
        local.wait([keys.abort(0)])
        assert keys.dead_named(local.get(keys.abort(0))) == {(2, 0)}
        assert local.get(publication.LATEST).decode() == "1"
        assert json.loads(local.get(publication.info_key(1)))["dead"] == [[2, 0]]
        assert local.get(commit.formed_key(0)).decode() == INCOMPLETE
    n.root.set(keys.STOP, "no replica left")
    n.root.set(keys.abort(1), "stop")
    local = n.store_of(1)
    local.wait([keys.abort(1)])
    assert local.get(keys.STOP).decode() == "no replica left"


def test_a_reformation_completes_across_nodes(nodes):
    n = nodes([2, 1])
    assert _form(n.protocols()) == [COMPLETE] * 3
    assert n.root.get(commit.COMPLETED).decode() == "0"
    assert int(n.root.add(commit.node_ready_key(0), 0)) == 2


class Recording:
    """A node store client that records the keys set through it, in order."""

    def __init__(self, store: dist.Store, written: list[str]) -> None:
        self._store, self.written = store, written

    def set(self, key: str, value) -> None:
        self.written.append(key)
        self._store.set(key, value)

    def multi_set(self, keys_: list[str], values: list) -> None:
        self.written.append(tuple(keys_))  # one request: applied whole
        self._store.multi_set(keys_, values)

    def compare_set(self, key: str, expected, desired) -> bytes:
        self.written.append(key)
        return self._store.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("by", ["controller", "root"])
def test_a_survivor_that_sees_the_new_generation_finds_its_decision_first(by):
    """A survivor settles the iteration it voted once it sees the new generation (``settle_voted``): in a node's store
    the decisions of the ended generation come before ``latest``, whether the controller wrote them into the end or
    the relay read them from the root (a generation's end without them)."""
    root = _root()
    controller = Controller(root, JobTopology.one_stage(make_topology(1, 2, {"layer": 2})), min_tp=1,
                            policy="drop_replica", say=lambda _: None, emit=lambda _: None)
    controller.reports.start = lambda *args: None
    server = _root()
    written: list[str] = []
    relay = NodeRelay(lambda t: _client(root.port, t), 1, lambda t: Recording(_client(server.port, t), written))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while relay.published < 0 and time.monotonic() < deadline:  # generation 0's publication copied first
            time.sleep(0.01)
        written.clear()
        root.set(commit.formed_key(0), COMPLETE)
        root.set(commit.decision_key(0, 1), COMMIT)
        root.set(commit.COMMITTED, "1")
        if by == "controller":
            assert controller.handle([Death(0, time.time(), "killed")]) is None  # aborts iteration 2
        else:
            settle(root, 0)
            root.set(publication.info_key(1), json.dumps({"base": 0, "dead": [[0, 0]]}))
            root.set(publication.LATEST, "1")
            root.set(keys.abort(0), keys.abort_value([(0, 0)]))
        assert relay.wait_ended(0, TIMEOUT_S)
        node = _client(server.port)
        assert node.get(commit.decision_key(0, 2)).decode() == ABORT
        assert node.get(commit.decision_key(0, 1)).decode() == COMMIT
        order = [key for entry in written for key in (entry if isinstance(entry, tuple) else (entry,))]
        assert order.index(publication.LATEST) > max(order.index(commit.decision_key(0, 1)),
                                                     order.index(commit.decision_key(0, 2))), order
        assert written[-1] == keys.abort(0)
    finally:
        assert relay.stop()


@pytest.mark.parametrize("stages, dead", [(1, [3]), (1, [1, 6]), (1, [4, 5]), (2, [2]), (2, [0, 13])])
def test_the_topology_a_rank_computes_from_a_publication_is_the_controllers(stages, dead):
    """After deaths, after a death while the next generation forms (it builds on the last completed one), and after
    the dead are admitted back: what a rank computes from each publication (:func:`published_topology`, from the
    generation it builds on) is what the controller published."""
    store = dist.HashStore()
    start = JobTopology.one_stage(make_topology(4, 2, {"vocab": 64, "layer": 8})) if stages == 1 else \
        make_pipeline_topology(4, 2, 2, {"vocab": 64, "layer": 8})
    controller = Controller(store, start, min_tp=1, policy="drop_replica", say=lambda _: None, emit=lambda _: None)
    controller.reports.start = lambda *args: None
    store.set(keys.abort(0), "")  # nothing of the ranks: the controller only publishes
    assert controller.handle([Death(rank, 0.0, "killed") for rank in dead[:1]]) is None
    if len(dead) > 1:  # before generation 1 formed
        assert controller.handle([Death(rank, 0.0, "killed") for rank in dead[1:]]) is None
    last = int(store.get(publication.LATEST))
    store.set(commit.formed_key(last), COMPLETE)
    store.set(commit.COMPLETED, str(last))
    assert controller.admit(dead)
    topologies = {0: start}
    for g in range(1, int(store.get(publication.LATEST)) + 1):
        info = json.loads(store.get(publication.info_key(g)))
        computed = published_topology(topologies[info["base"]], info, g)
        assert computed.to_json() == json.loads(store.get(publication.topology_key(g))), g
        assert computed == JobTopology.from_json(json.loads(store.get(publication.topology_key(g))))
        topologies[g] = computed
    assert topologies[max(topologies)].world_size == start.world_size  # the dead came back


def test_stop_wakes_a_relay_thread_out_of_its_store_call():
    """What CI met: relay threads still blocked in a store call when the interpreter finalizes abort the process
    (``terminate called without an active exception``, exit code 134 after the suite had passed). ``stop()`` shuts
    the relay's connections down: a thread in a 30 s wait on the root ends at once."""
    root = _root()
    root.set(publication.info_key(0), "{}")
    root.set(publication.LATEST, "0")
    relay = NodeRelay(lambda t: _client(root.port, t), 1, wait_s=30.0)
    assert relay.wait_ready(TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while relay.published < 0 and time.monotonic() < deadline:  # then its mirror waits on the root for the end
        time.sleep(0.01)
    started = time.monotonic()
    assert relay.stop(timeout_s=2.0)
    assert time.monotonic() - started < 2.0
    assert not any(thread.is_alive() for thread in relay._threads)


def test_latest_never_goes_back_in_a_node_store():
    """Two writers copy ``latest`` into a node's store (the relay; a last voter bringing ``commit+reform``), each
    from its own read of the root: the one that read earlier may write later. A node store's ``latest`` only grows,
    else its ranks would go back to a generation already ended, whose end the relay does not write again."""
    root, node = _root(), _root()
    for g in range(3):
        root.set(publication.info_key(g), json.dumps({"g": g}))
    root.set(publication.LATEST, "1")  # what the slow writer read
    node.set(publication.LATEST, "2")  # what the other wrote meanwhile
    assert copy_to_node(root, node, since=0) == 1
    assert node.get(publication.LATEST).decode() == "2"
    assert json.loads(node.get(publication.info_key(1))) == {"g": 1}
    assert raise_latest(node, 3) == 3 and node.get(publication.LATEST).decode() == "3"
    fresh = _root()
    assert raise_latest(fresh, 0) == 0 and fresh.get(publication.LATEST).decode() == "0"


def test_a_relay_started_before_generation_0_is_published_copies_it_at_once():
    """Node k's launcher may start its relay before node 0's controller published generation 0 (the nodes start
    together): the relay copies it as soon as it is published, not a relay wait (30 s in a job) later."""
    root = _root()
    relay = NodeRelay(lambda t: _client(root.port, t), 1, wait_s=30.0)
    try:
        assert relay.wait_ready(TIMEOUT_S)
        root.set(publication.info_key(0), "{}")
        root.set(publication.LATEST, "0")
        deadline = time.monotonic() + 5.0
        while relay.published < 0:
            assert time.monotonic() < deadline, "generation 0 was not copied into the node store within 5 s"
            time.sleep(0.01)
        assert relay.open_local(TIMEOUT_S).get(publication.LATEST).decode() == "0"
    finally:
        assert relay.stop(timeout_s=2.0)


def test_stop_ends_a_relay_still_connecting_to_a_root_that_is_not_there():
    """At the end of a job node 0's launcher may end first: a relay thread whose call failed connects again, to a
    root that has gone, and waits up to a minute for its port. ``stop()`` ends that wait at once (the launcher's
    factories share the relay's stop event) instead of blocking the launcher's exit."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stop = threading.Event()
    relay = NodeRelay(store_factory("127.0.0.1", port, stop), 1, wait_s=30.0, stop=stop)
    assert not relay.wait_ready(0.5)  # its threads are waiting for the root's port
    started = time.monotonic()
    assert relay.stop(timeout_s=5.0)
    assert time.monotonic() - started < 2.0
    assert not any(thread.is_alive() for thread in relay._threads)


def test_a_last_voter_that_dies_between_counting_its_node_and_bringing_the_decision(nodes):
    """Node 1's last voter counts its node in the root, which decides ``commit``, and dies before it brings the
    decision into its node's store: the node's other rank must read that ``commit`` (the ranks of node 0 stepped
    the iteration), not take the generation's end for an abort. The controller writes the decision into the end it
    writes, and the relay copies it before the end."""
    n = nodes([2, 2])
    protocols = n.protocols()
    assert _form(protocols) == [COMPLETE] * 4
    results: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, protocols[i].vote(1))) for i in (0, 1, 2)]
    for t in threads:
        t.start()
    last = protocols[3]
    deadline = time.monotonic() + TIMEOUT_S
    # node 1's other rank counted: it waits for the decision
    while int(last.store.add(commit.node_tally_key(0), 0)) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert last.store.add(commit.node_tally_key(0), 1) % last.node.members == 0  # its vote completes node 1's count
    last.carry_vote(1)  # ... and it dies here, before bring()
    for t in threads[:2]:
        t.join(TIMEOUT_S + 5)
    assert [results.get(i) for i in (0, 1)] == [COMMIT, COMMIT]  # node 0's ranks stepped iteration 1
    ended = time.monotonic()
    assert n.controller.handle([Death(3, time.time(), "killed")]) is None
    threads[2].join(TIMEOUT_S + 5)
    assert results.get(2) == COMMIT, results
    assert time.monotonic() - ended < TIMEOUT_S / 4  # the relay brought it: not a wait that timed out
