"""A launcher of a node other than 0, and node 0's store: noticing that node 0 is gone, and saying so once.

Node 0's launcher hosts the job's store and its controller; without them another node's ranks cannot go on (no new
generation comes, no decision, no admission). When node 0's launcher dies, its store's port closes, and every call
of torch's store client fails with a C++ warning and its stack (a launcher polling that store every 20 ms wrote
megabytes of them). Every call such a launcher makes to node 0's store goes through :class:`GuardedStore`: a call
that fails while node 0's port refuses connections starts a *silence*, during which no call reaches torch's client
(each raises :class:`StoreSilent` at once) and the port is probed every ``timing.node_probe_s`` instead; a port that
accepts again ends it (with a fresh client). A silence of ``ntp.node_timeout_s`` means node 0 is lost
(:meth:`GuardedStore.lost`): the launcher stops its ranks and exits 1 with one line.

A node 0 that stops answering without closing its port (its host frozen, its launcher stopped: the kernel still
accepts connections into the listen backlog) fails no call: torch's client waits for the answer with no bound (a
``get`` blocked over 40 s with a 4 s client timeout). So every call runs in a caller thread and is waited for
``timing.node_call_s`` at most: a call not answered by then starts a silence too, and its client (a request half-way
on its socket) is dropped with its thread; a probe then must get an answer from a fresh client within the same bound.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from ntp_megatron.config import timing
from ntp_megatron.launch import nodes
from ntp_megatron.elastic.watchdog import store_factory, wait_for_port


class StoreSilent(ConnectionError):
    """Node 0's store does not answer: the call was not made, or not answered in time."""


@dataclass
class Silence:
    """Since when node 0 has not answered (monotonic seconds; pure: the caller gives the time)."""

    timeout_s: float
    """``ntp.node_timeout_s``: a silence this long means node 0 is lost."""
    probe_s: float
    """How often a silent node's port is probed."""
    since: Optional[float] = None
    """Silent since then (the last time node 0 answered), or None: not silent."""
    last_heard: Optional[float] = None
    last_probe: float = -math.inf

    def unheard(self, now: float) -> None:
        """A call failed and the port refused: silent since node 0 last answered (now, if it never did), unless
        already."""
        if self.since is None:
            self.since = self.last_heard if self.last_heard is not None else now
        self.last_probe = now

    def heard(self, now: float) -> None:
        self.since, self.last_heard = None, now

    @property
    def silent(self) -> bool:
        return self.since is not None

    def probe_due(self, now: float) -> bool:
        return self.silent and now - self.last_probe >= self.probe_s

    def probed(self, now: float) -> None:
        self.last_probe = now

    def lost(self, now: float) -> Optional[float]:
        """How long node 0 has been silent, once that is ``timeout_s`` or more (else None)."""
        if self.since is None or now - self.since < self.timeout_s:
            return None
        return now - self.since


class Unanswered(TimeoutError):
    """A call did not return within its bound: its thread is left blocked in it."""


class Caller:
    """One thread that runs calls for a waiting caller, each waited for a bounded time. A call not answered in time
    leaves the thread blocked in it (a thread in a C++ call cannot be interrupted): the caller is then spent, and its
    owner makes a new one."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="ntp-root-call", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, box, done = self._jobs.get()
            try:
                box.append((True, call()))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                box.append((False, exc))
            done.set()

    def __call__(self, call: Callable[[], Any], within_s: float) -> Any:
        box: list = []
        done = threading.Event()
        self._jobs.put((call, box, done))
        if not done.wait(None if math.isinf(within_s) else within_s):
            raise Unanswered(f"no answer within {within_s:g} s")
        ok, value = box[0]
        if ok:
            return value
        raise value


class GuardedStore:
    """A client of node 0's store (duck-typed: every method of ``dist.Store`` the launcher calls) that stops calling
    it while node 0 is silent (module docstring). ``reachable()``: whether node 0's port accepts a connection now;
    ``reconnect()``: a fresh client, once it does again; ``call_s``: how long a call may take before node 0 counts as
    silent."""

    def __init__(self, store: dist.Store, silence: Silence, reachable: Callable[[], bool],
                 reconnect: Callable[[], dist.Store], clock: Callable[[], float] = time.monotonic,
                 call_s: float = math.inf) -> None:
        self._store: Optional[dist.Store] = store
        self.silence = silence
        self._reachable, self._reconnect, self._clock = reachable, reconnect, clock
        self._call_s = call_s
        self._caller = Caller()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name) if self._store is not None else None  # None: dropped, silent
        if attribute is not None and not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self._before_call()
            store = self._store
            if store is None:
                raise StoreSilent("node 0's store has no client (dropped with a call it did not answer)")
            try:
                result = self._bounded(lambda: getattr(store, name)(*args, **kwargs))
            except Unanswered as exc:
                self.silence.unheard(self._clock())
                raise StoreSilent(f"node 0's store did not answer a {name} ({exc})") from None
            except Exception:
                if not self._reachable():  # gone, not just a slow or refused request
                    self.silence.unheard(self._clock())
                raise
            self.silence.heard(self._clock())
            return result

        return call

    def _bounded(self, call: Callable[[], Any]) -> Any:
        """``call()`` waited for ``call_s`` at most; unanswered, the client and the caller thread are dropped (the
        thread stays blocked in the client's request)."""
        try:
            return self._caller(call, self._call_s)
        except Unanswered:
            self._store, self._caller = None, Caller()
            raise

    def _before_call(self) -> None:
        """Raise :class:`StoreSilent` while node 0 is silent; probe it when due: a fresh client that answers a
        request in time ends the silence."""
        if not self.silence.silent:
            return
        now = self._clock()
        if self.silence.probe_due(now):
            self.silence.probed(now)
            if self._reachable():
                try:
                    fresh = self._bounded(self._reconnect)
                    self._bounded(lambda: nodes.probe(fresh))
                except Exception:  # noqa: BLE001 - gone again, or no answer: still silent
                    pass
                else:
                    self._store = fresh
                    self.silence.heard(now)
                    return
        raise StoreSilent(f"node 0's store has not answered for {now - self.silence.since:.1f} s")

    def lost(self) -> Optional[float]:
        """Seconds node 0 has been silent once that counts as lost (``ntp.node_timeout_s``), else None; probes the
        port when due (a silence with no call in it ends too)."""
        if self.silence.silent and self.silence.probe_due(self._clock()):
            try:
                self._before_call()
            except StoreSilent:
                pass
        return self.silence.lost(self._clock())


def guard(store: dist.Store, host: str, port: int, node_timeout_s: float, client_timeout_s: float) -> GuardedStore:
    """``store`` (a client of node 0's store at ``host:port``) behind a :class:`GuardedStore`: lost after
    ``node_timeout_s`` of silence, probed every ``timing.node_probe_s``, reconnected with ``client_timeout_s``."""
    def reachable() -> bool:
        try:
            wait_for_port(host, port, 0.0)
        except (TimeoutError, InterruptedError):
            return False
        return True

    open_store = store_factory(host, port)
    t = timing.current()
    return GuardedStore(store, Silence(node_timeout_s, t.node_probe_s), reachable,
                        lambda: open_store(client_timeout_s), call_s=min(t.node_call_s, node_timeout_s))


def lost_line(store: object, host: str, port: int, node_timeout_s: float) -> Optional[str]:
    """The line a launcher says once node 0 is lost (``store``, its client of node 0's store, a :class:`GuardedStore`
    on a node other than 0), else None."""
    silent = store.lost() if isinstance(store, GuardedStore) else None
    if silent is None:
        return None
    return (f"node 0 is lost: its store at {host}:{port} has not answered for {silent:.0f} s (ntp.node_timeout_s "
            f"{node_timeout_s:g}); stopping this node's ranks")
