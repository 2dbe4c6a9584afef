"""Another node's launcher and node 0's store (ntp_megatron/launch/root_watch.py): a call that fails while node 0's port
refuses starts a silence in which no call reaches torch's client (each would log a C++ warning and its stack), the port
is probed instead, a port that accepts again ends it with a fresh client, and a silence of ntp.node_timeout_s is node 0
lost. A node 0 that answers nothing while its port accepts (frozen): a call unanswered within its bound starts the
silence too. Over a fake store, port and clock, and once over a real store whose host is stopped (SIGSTOP)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ntp_megatron.launch.root_watch import GuardedStore, Silence, StoreSilent, guard, lost_line


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeStore:
    def __init__(self) -> None:
        self.calls = 0
        self.broken = False
        self.frozen = threading.Event()
        """Set: a call blocks until :attr:`thawed` (node 0 frozen with its port open)."""
        self.thawed = threading.Event()
        self.port = 29500

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        if self.frozen.is_set():
            self.thawed.wait(10.0)
        if self.broken:
            raise RuntimeError("sendBytes failed: Broken pipe")
        return True


def guarded(up: list[bool], call_s: float = 30.0) -> tuple[GuardedStore, FakeStore, Clock, list[FakeStore]]:
    clock, store, fresh = Clock(), FakeStore(), []

    def reconnect() -> FakeStore:
        fresh.append(FakeStore())
        return fresh[-1]

    return GuardedStore(store, Silence(timeout_s=30.0, probe_s=1.0), lambda: up[0], reconnect, clock,
                        call_s=call_s), store, clock, fresh


def test_a_failure_while_the_port_refuses_stops_every_call_until_node_0_is_lost():
    up = [True]
    guard, store, clock, fresh = guarded(up)
    assert guard.check(["k"]) and guard.port == 29500  # attributes and calls pass through
    store.broken, up[0] = True, False  # node 0's launcher died: its port closed
    clock.now += 0.5  # silent since it last answered
    with pytest.raises(RuntimeError, match="Broken pipe"):
        guard.check(["k"])
    assert store.calls == 2
    for _ in range(100):  # the launcher's passes: none reaches torch's client (no C++ warning, no stack)
        with pytest.raises(StoreSilent):
            guard.check(["k"])
        clock.now += 0.02
    assert store.calls == 2
    assert guard.lost() is None  # 2.5 s of silence
    clock.now += 28.0
    assert guard.lost() == pytest.approx(30.5)
    assert "node 0 is lost: its store at h:1 has not answered for 30 s (ntp.node_timeout_s 30)" in lost_line(
        guard, "h", 1, 30.0)
    assert not fresh


def test_a_failure_while_the_port_accepts_is_no_silence():
    """A refused or slow request of a node 0 that is there (a store timeout): the caller's error, nothing more."""
    up = [True]
    guard, store, clock, _ = guarded(up)
    store.broken = True
    with pytest.raises(RuntimeError):
        guard.check(["k"])
    clock.now += 60.0
    assert guard.lost() is None and lost_line(guard, "h", 1, 30.0) is None
    with pytest.raises(RuntimeError):
        guard.check(["k"])  # still calls the client
    assert store.calls == 2


def test_a_port_that_accepts_again_ends_the_silence_with_a_fresh_client():
    up = [False]
    guard, store, clock, fresh = guarded(up)
    store.broken = True
    with pytest.raises(RuntimeError):
        guard.check(["k"])
    clock.now += 0.5
    up[0] = True
    with pytest.raises(StoreSilent):  # not probed yet: at most once a probe interval
        guard.check(["k"])
    clock.now += 0.6
    assert guard.check(["k"]) and len(fresh) == 1 and fresh[0].calls == 2  # the probe's request, then this one
    clock.now += 60.0
    assert guard.lost() is None


def test_the_silence_is_probed_without_calls_too():
    up = [False]
    guard, store, clock, fresh = guarded(up)
    store.broken = True
    with pytest.raises(RuntimeError):
        guard.check(["k"])
    clock.now += 20.0
    up[0] = True
    assert guard.lost() is None and len(fresh) == 1  # lost() probes: node 0 came back before the timeout


def test_a_store_that_is_not_guarded_is_never_lost():
    assert lost_line(FakeStore(), "h", 1, 30.0) is None


def test_a_call_node_0_does_not_answer_starts_the_silence_and_drops_its_client():
    """Node 0 frozen, its port open: the call is given up after its bound (its thread left in it), no later call
    reaches that client, and a probe whose fresh client answers in time ends the silence."""
    up = [True]
    guard_, store, clock, fresh = guarded(up, call_s=0.05)
    assert guard_.check(["k"])
    clock.now += 0.5
    store.frozen.set()
    started = time.monotonic()
    with pytest.raises(StoreSilent):
        guard_.check(["k"])
    assert time.monotonic() - started < 5.0  # the bound, not the frozen call (10 s)
    clock.now += 0.5
    with pytest.raises(StoreSilent):
        guard_.check(["k"])  # not probed yet
    assert store.calls == 2
    clock.now += 29.0
    assert guard_.lost() is None and len(fresh) == 1  # probed: the fresh client answered
    assert guard_.check(["k"]) and fresh[0].calls == 2  # the probe's request, then this one
    store.thawed.set()


def _state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _host_store(port_pipe) -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    port_pipe.send(store.port)
    signal.pause()


def test_a_stopped_node_0_is_lost_within_the_timeout():
    """A real store whose host process is stopped (SIGSTOP): its port accepts, nothing answers. Before the bound on
    every call, a ``get`` blocked past the client's timeout and node 0 was never found lost."""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    host = ctx.Process(target=_host_store, args=(theirs,), daemon=True)
    host.start()
    try:
        assert ours.poll(30.0)
        port = ours.recv()
        client = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30), wait_for_workers=False)
        client.set("k", "v")
        watched = guard(client, "127.0.0.1", port, node_timeout_s=1.0, client_timeout_s=30.0)
        assert watched.get("k") == b"v"
        os.kill(host.pid, signal.SIGSTOP)
        started = time.monotonic()
        while _state(host.pid) != "T":  # the stop is delivered when the process next runs
            assert time.monotonic() - started < 10.0, "the store's host did not stop"
            time.sleep(0.01)
        with pytest.raises(StoreSilent):
            watched.get("k")
        while watched.lost() is None:
            assert time.monotonic() - started < 10.0, "node 0 stopped, never found lost"
            time.sleep(0.05)  # polls a state bounded by the loop's deadline
        assert time.monotonic() - started < 5.0
    finally:
        os.kill(host.pid, signal.SIGKILL)
        host.join(10.0)
