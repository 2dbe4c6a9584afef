"""Another node's launcher and node 0's store (ntp_megatron/launch/root_watch.py): a call that fails while node 0's port
refuses starts a silence in which no call reaches torch's client (each would log a C++ warning and its stack), the port
is probed instead, a port that accepts again ends it with a fresh client, and a silence of ntp.node_timeout_s is node 0
lost. Over a fake store, port and clock: milliseconds."""

from __future__ import annotations

import pytest

from ntp_megatron.launch.root_watch import GuardedStore, Silence, StoreSilent, lost_line


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeStore:
    def __init__(self) -> None:
        self.calls = 0
        self.broken = False
        self.port = 29500

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        if self.broken:
            raise RuntimeError("sendBytes failed: Broken pipe")
        return True


def guarded(up: list[bool]) -> tuple[GuardedStore, FakeStore, Clock, list[FakeStore]]:
    clock, store, fresh = Clock(), FakeStore(), []

    def reconnect() -> FakeStore:
        fresh.append(FakeStore())
        return fresh[-1]

    return GuardedStore(store, Silence(timeout_s=30.0, probe_s=1.0), lambda: up[0], reconnect, clock), store, clock, fresh


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
    assert guard.check(["k"]) and len(fresh) == 1 and fresh[0].calls == 1
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
