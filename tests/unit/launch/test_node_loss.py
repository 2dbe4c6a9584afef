"""A lost node: node 0's decision (pure, on its own monotonic clock), the link it reads, the keys it writes.

- :class:`NodeLiveness`: a closed link is a loss at once; a silence of ``ntp.node_timeout_s`` is one; each incarnation
  is reported once; what a lost incarnation says later changes nothing; a new launcher for the node is watched anew;
  a launcher that left as it should is not lost.
- The link over real sockets: hello, beats, end of file when the client's process ends, goodbye when it ends well.
- The keys: node 0 appends each lost launcher; the lost launcher finds itself fenced, a later one finds the node lost.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from ntp_megatron.config import timing
from ntp_megatron.elastic.controller import Death
from ntp_megatron.launch import nodes
from ntp_megatron.launch.node_link import LinkClient, LinkServer
from ntp_megatron.launch.node_liveness import Loss, NodeLiveness
from tests.harness import store_server

pytestmark = pytest.mark.unit

TIMEOUT = 3.0


def test_a_closed_link_is_a_loss_at_once_and_reported_once():
    live = NodeLiveness(TIMEOUT)
    live.connected(1, 100, 0.0)
    live.connected(2, 200, 0.0)
    live.heard(1, 100, 1.0)
    assert live.lost(1.5) == []
    live.closed(1, 100, 1.6)
    assert live.lost(1.7) == [Loss(1, 100, "its launcher's connection to node 0 closed", 1.6)]
    assert live.lost(10.0) == [Loss(2, 200, "node 0 has not heard from its launcher for 10.0 s "
                                             "(ntp.node_timeout_s 3)", 0.0)]
    assert live.lost(20.0) == [] and live.watched() == {}


def test_a_silence_counts_from_the_last_beat_heard():
    live = NodeLiveness(TIMEOUT)
    live.connected(1, 100, 0.0)
    for t in (0.75, 1.5, 2.25):
        live.heard(1, 100, t)
    assert live.lost(2.25 + TIMEOUT - 0.01) == []
    [loss] = live.lost(2.25 + TIMEOUT)
    assert (loss.node, loss.pid, loss.at) == (1, 100, 2.25) and "for 3.0 s" in loss.reason


def test_a_lost_launcher_that_resumes_stays_lost_and_a_new_one_is_watched():
    live = NodeLiveness(TIMEOUT)
    live.connected(1, 100, 0.0)
    assert [loss.pid for loss in live.lost(TIMEOUT)] == [100]
    # The stopped launcher resumes: its beats, even a new link of its own, do not bring the node back.
    live.heard(1, 100, 4.0)
    live.connected(1, 100, 4.0)
    assert live.watched() == {} and live.is_lost(1, 100)
    # A replacement launcher for node 1 (a new pid) is watched from its link on, and can be lost in turn.
    live.connected(1, 300, 5.0)
    live.heard(1, 100, 5.1)  # the old one's beat counts for nothing
    assert live.watched() == {1: 300} and live.lost(5.0 + TIMEOUT - 0.1) == []
    live.closed(1, 100, 6.0)  # nor does its link closing
    assert live.lost(6.1) == []
    live.closed(1, 300, 7.0)
    assert [(loss.node, loss.pid) for loss in live.lost(7.0)] == [(1, 300)]


def test_a_launcher_that_left_as_it_should_is_not_lost():
    live = NodeLiveness(TIMEOUT)
    live.connected(1, 100, 0.0)
    live.left(1, 100, 1.0)
    assert live.lost(100.0) == [] and live.watched() == {}


def _events(server: LinkServer, kinds: set[str], timeout_s: float = 5.0) -> list:
    """The server's events until one of ``kinds`` came (bounded)."""
    out: list = []
    deadline = time.monotonic() + timeout_s
    while not any(e.kind in kinds for e in out):
        assert time.monotonic() < deadline, out
        out += server.events()
        time.sleep(0.01)  # the poll of another thread's queue
    return out


def test_the_link_says_hello_beats_and_goodbye():
    server = LinkServer("127.0.0.1")
    try:
        client = LinkClient("127.0.0.1", server.port, 1, 4242, beat_s=0.02, connect_timeout_s=5.0)
        got = _events(server, {"heard"})
        assert (got[0].kind, got[0].node, got[0].pid) == ("connected", 1, 4242)
        client.close(clean=True)
        assert _events(server, {"left", "closed"})[-1].kind == "left"
    finally:
        server.close()


def test_a_link_whose_process_is_killed_reads_end_of_file_at_once():
    """The client in a child process, SIGKILLed: node 0 reads the link's end within a second."""
    server = LinkServer("127.0.0.1")
    try:
        pid = os.fork()
        if pid == 0:  # the child: hold a link until killed
            try:
                LinkClient("127.0.0.1", server.port, 2, os.getpid(), beat_s=0.05, connect_timeout_s=5.0)
                time.sleep(60)
            finally:
                os._exit(0)
        _events(server, {"heard"})
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        os.waitpid(pid, 0)
        closed = [e for e in _events(server, {"closed"}) if e.kind == "closed"][0]
        assert closed.node == 2 and closed.pid == pid and closed.at - killed < 1.0
    finally:
        server.close()


def test_node_0_marks_a_node_lost_and_its_launchers_tell_fenced_from_replacement():
    store = store_server()
    assert nodes.node_losses(store, 1) == []
    nodes.mark_node_lost(store, 1, 100, "its launcher's connection to node 0 closed", [2, 3])
    nodes.mark_node_lost(store, 1, 300, "node 0 has not heard from its launcher for 3.0 s", [2, 3])
    assert [r["pid"] for r in nodes.node_losses(store, 1)] == [100, 300]
    assert nodes.node_losses(store, 2) == []
    timing.use(timing.TimingSection(node_fence_poll_s=1e-6))
    try:
        watcher = nodes.Nodes(4, 1, "127.0.0.1", store.port, 5.0, lambda line: None, TIMEOUT)
        assert watcher.fenced(store) is None  # this process's pid was never declared lost
        nodes.mark_node_lost(store, 1, os.getpid(), "lost", [2, 3])
        assert watcher.fenced(store)["launch_ranks"] == [2, 3]
    finally:
        timing.use(timing.TimingSection())


def _joining_node_1(store, node_timeout_s: float = TIMEOUT) -> nodes.Nodes:
    return nodes.Nodes(4, 1, "127.0.0.1", store.port, 5.0, lambda line: None, node_timeout_s)


def test_a_launcher_for_a_lost_node_replaces_it_and_one_for_a_live_node_is_refused():
    """A later launcher for node 1 replaces it once node 0 declared the launcher before it lost (at once if it already
    had), and gives up in one line if node 0 never does: two launchers must never run one node's slots."""
    store = store_server()
    links = LinkServer("127.0.0.1")
    store.set(nodes.LINK, str(links.port))
    first = _joining_node_1(store)
    first._open_link(store)  # the node's first launcher: nothing before it
    assert not first.replacing
    store.set(nodes.node_key(1), "100")  # as its join does, with its pid
    first.close(clean=True)
    nodes.mark_node_lost(store, 1, 100, "its launcher's connection to node 0 closed", [2, 3])
    second = _joining_node_1(store)
    second._open_link(store)
    assert second.replacing
    second.close(clean=True)
    store.set(nodes.node_key(1), "300")  # the second one joined, and is not lost
    timing.use(timing.TimingSection(node_takeover_s=0.1, node_poll_s=0.02))
    try:
        started = time.monotonic()
        with pytest.raises(nodes.NodeTaken, match="node 1 still has a launcher \\(pid 300\\) that node 0 has not "
                                                  "declared lost within 0 s"):
            _joining_node_1(store, node_timeout_s=0.2)._open_link(store)
        assert time.monotonic() - started < 2.0
    finally:
        timing.use(timing.TimingSection())
        links.close()


def test_node_0_ignores_deaths_a_lost_launcher_publishes_after_it_resumed():
    """A fenced launcher that ran on for a moment (resumed in the middle of its monitor's pass) publishes deaths of
    its ranks: node 0 ignores them (a replacement node may run those launch ranks by then); another node's count."""
    store = store_server()
    said: list[str] = []
    node0 = nodes.Nodes(4, 0, "127.0.0.1", store.port, 5.0, said.append, TIMEOUT)
    node0.liveness.connected(1, os.getpid(), 0.0)
    assert node0.liveness.lost(TIMEOUT) and node0.liveness.is_lost(1, os.getpid())
    nodes.publish_death(store, Death(2, 1.0, "stopped responding"), 1)
    nodes.publish_death(store, Death(5, 2.0, "was killed by signal SIGKILL"), 2)
    assert [d.launch_rank for d in node0.remote_deaths(store)] == [5]
    assert said[0].startswith(f"ignored: node 1's launcher (pid {os.getpid()}), declared lost, reported launch rank 2")
    assert [d.launch_rank for d in nodes.published_deaths(store)] == [2, 5]  # NTP off reads them all


def test_a_death_counted_but_never_written_is_skipped_not_waited_for():
    """A launcher killed between counting a death and writing it (``publish_death`` adds, then sets): node 0 reads
    the deaths after it at once, never blocks on the missing one, and skips it after ``timing.node_call_s``."""
    store = store_server(timeout_s=30.0)
    said: list[str] = []
    node0 = nodes.Nodes(4, 0, "127.0.0.1", store.port, 5.0, said.append, TIMEOUT)
    store.add(nodes.DEATHS, 1)  # counted; its launcher died before writing it
    nodes.publish_death(store, Death(5, 2.0, "was killed by signal SIGKILL"), 2)
    started = time.monotonic()
    assert node0.remote_deaths(store) == []  # not yet given up: nothing read past it, and no blocking get
    assert time.monotonic() - started < 1.0
    before = timing.current()
    timing.use(before.model_copy(update={"node_call_s": 0.0}))
    try:
        assert [d.launch_rank for d in node0.remote_deaths(store)] == [5]
    finally:
        timing.use(before)
    assert any("counted but never written" in line for line in said), said


def test_node_0_waits_for_the_current_launcher_of_a_node_to_leave():
    """``launcher/left/node<n>`` names the launcher that left: a fenced launcher's leaving does not stand for the
    replacement that runs the node now."""
    store = store_server()
    store.set(nodes.node_key(1), "111")
    nodes.set_left(store, 1, 1)  # this process's pid: not the node's current launcher
    assert not nodes.has_left(store, 1)
    store.set(nodes.node_key(1), str(os.getpid()))
    assert nodes.has_left(store, 1)
