"""A node's relay: the middle of the two-level control plane.

One store for every rank of a large job does not scale: each rank's votes, heartbeats and polls for the next
generation are requests to node 0, and a saturated store delays heartbeats until healthy ranks are fenced
(``scripts/bench.sh --only control-plane`` measures both designs). With two levels each node's launcher hosts a
store of its own (the *node store*), where the node's ranks vote, beat and wait, and a relay between it and the
root store:

- per iteration the root serves each node one count and one wait: the node's ranks count their votes (and their
  re-formation) in the node store, and the node's last voter counts the node in the root, decides there if its
  count completes the root's (first writer wins against the controller, as with one level), and brings the root's
  decision into the node store, where the node's other ranks wait for it
  (:class:`~ntp_megatron.elastic.commit.CommitProtocol` with a :class:`~ntp_megatron.elastic.commit.NodeShare`).
  The relay has no part in an iteration: a hop through it would cost every vote two more thread wake-ups;
- the relay waits for each generation's end at the root. When the controller ends one (a failure, a stop; the
  ranks themselves at an admission boundary), the relay writes into the node store the stop if there is one, the
  decisions of the generation a rank of the node may still wait for (its last voter died, or the node's count never
  completed: the controller writes a decision for whatever the ranks wait on before it ends a generation), then
  what changed (each new generation's ``info``: the dead or admitted slots, from which every rank computes the
  topology with the same pure function, :func:`~ntp_megatron.plan.stages.published_topology`; then ``latest``), then the
  end itself, where the ranks' watchdogs wait. In that order: a survivor reads the decision on the iteration it voted
  once it sees the new generation. The controller writes all of it into the generation's end, so that a relay reads
  the root once per end (:func:`~ntp_megatron.elastic.keys.abort_value`); an end the ranks or a stop wrote says
  nothing of it, and the relay reads each from the root;
- it writes one heartbeat per node to the root (:func:`~ntp_megatron.elastic.keys.node_beat`); the ranks'
  heartbeats stay in the node store, read by the node's launcher.

The root store stays the single point of truth: a node store only holds copies of what the root decided. A relay
thread whose store call fails starts again on fresh connections, where it was. :meth:`NodeRelay.stop` shuts the
relay's connections down, so a thread in a store call (a wait for a generation's end lasts as long as the
generation) fails out of it at once, and joins the threads: one still in a store call when the interpreter exits
aborts the process (``terminate called without an active exception``).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from ntp_megatron.config import timing
from ntp_megatron.elastic import commit, keys, publication
from ntp_megatron.elastic.publication import copy_to_node, published_since, raise_latest
from ntp_megatron.sockets import SocketScope, connected_to, shutdown_sockets

logger = logging.getLogger(__name__)

StoreFactory = Callable[[float], dist.Store]
"""Opens a new client of a store with the given timeout (seconds)."""

_CONNECTING = threading.Lock()
"""One client made at a time in this process, so that the sockets that appear while it is made are its own."""


class NodeRelay:
    """Node ``node_rank``'s relay between the root store and the node store. ``open_root`` opens clients of the
    root store (one per thread: each blocks on its own); ``open_local`` clients of the node store (default: a store
    the relay hosts itself on ``host``); ``ranks`` says how many of the node's ranks are alive (for the node's
    heartbeat). ``wrap_root`` wraps each client of the root store (a load test counts requests with it). ``stop`` is set
    by :meth:`stop`: the factories may share it, so that a client still being made (the root has gone: its launcher
    ended first) gives up at once."""

    def __init__(self, open_root: StoreFactory, node_rank: int, open_local: Optional[StoreFactory] = None,
                 host: str = "127.0.0.1", beat_s: float = 1.0, wait_s: Optional[float] = None,
                 ranks: Callable[[], int] = lambda: 0,
                 wrap_root: Callable[[dist.Store], dist.Store] = lambda store: store,
                 stop: Optional[threading.Event] = None) -> None:
        self.node_rank = node_rank
        self.beat_s = beat_s
        self.wait_s = timing.current().relay_wait_s if wait_s is None else wait_s
        self.ranks = ranks
        self._open_root_raw = open_root
        self._polling_root = lambda store: wrap_root(self._polling(store))
        self._server: Optional[dist.TCPStore] = None
        if open_local is None:
            self._server = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=timing.current().relay_connect_timeout_s),
                                         wait_for_workers=False)
            port = self._server.port
            open_local = lambda timeout_s: dist.TCPStore(host, port, None, False,  # noqa: E731
                                                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.open_local: StoreFactory = open_local
        """Opens a client of the node store (what the node's ranks hold)."""
        self._stop = stop if stop is not None else threading.Event()
        self.generation = 0
        """The generation the relay follows."""
        self.published = -1
        """The newest generation whose ``info`` is in the node store."""
        self.ended_at: dict[int, float] = {}
        """Generation -> when its end was written into the node store (wall clock)."""
        self._ended = threading.Condition()
        self._connected = threading.Semaphore(0)
        self._sockets: dict[int, str] = {}
        """The relay's own connections (fd -> identity), shut down at :meth:`stop` to wake a thread in a store call."""
        self._sockets_lock = threading.Lock()
        self.errors: list[str] = []
        """What went wrong in a relay thread (it then stops; the node's ranks time out on their waits)."""
        self._threads = [threading.Thread(target=self._guarded, args=(run,), name=f"ntp-relay-{name}", daemon=True)
                         for name, run in (("mirror", self._mirror), ("beat", self._beat))]
        for thread in self._threads:
            thread.start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether every relay thread connected to both stores within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        acquired = 0
        while acquired < len(self._threads) and self._connected.acquire(
                timeout=max(0.0, deadline - time.monotonic())):
            acquired += 1
        for _ in range(acquired):
            self._connected.release()
        return acquired == len(self._threads)

    def wait_ended(self, generation: int, timeout_s: float) -> bool:
        """Whether ``generation``'s end reached the node store within ``timeout_s``."""
        with self._ended:
            return self._ended.wait_for(lambda: generation in self.ended_at, timeout_s)

    def stop(self, timeout_s: Optional[float] = None) -> bool:
        """Stop the threads and join them: the relay's connections are shut down, so a thread in a store call
        fails out of it at once. Returns whether every thread ended within ``timeout_s`` (default
        ``timing.relay_stop_s``; a thread left in a store call would abort the process at exit)."""
        timeout_s = timing.current().relay_stop_s if timeout_s is None else timeout_s
        self._stop.set()
        with self._sockets_lock:  # not _CONNECTING: a thread may hold it for as long as a connection takes
            shutdown_sockets(self._sockets)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [thread.name for thread in self._threads if thread.is_alive()]
        if alive:
            logger.warning("node %d relay: %s still running %.1f s after stop", self.node_rank, ", ".join(alive),
                           timeout_s)
        return not alive

    def _guarded(self, run: Callable[[], None]) -> None:
        """Run a relay thread; if a store call fails (a connection reset), say so and start it again on fresh
        connections: its place (the generation it follows) is kept, and what it writes is idempotent."""
        again = False
        while not self._stop.is_set():
            try:
                run(again)
                return
            except Exception as exc:  # noqa: BLE001 - a relay thread must say why it failed, not vanish
                if self._stop.is_set():
                    return
                logger.error("node %d relay: %s: %s; connecting again", self.node_rank, type(exc).__name__, exc)
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self._stop.wait(timing.current().relay_retry_s)
            again = True

    def _connect(self, local: bool, again: bool) -> tuple[Optional[dist.Store], dist.Store]:
        """A thread's own clients of the node store (if ``local``) and of the root; counted as connected the first
        time (:meth:`wait_ready`)."""
        clients = (self._polling(self._client(self.open_local)) if local else None,
                   self._polling_root(self._client(self._open_root_raw)))
        if not again:
            self._connected.release()
        return clients

    def _client(self, open_store: StoreFactory) -> dist.Store:
        """A new client, its sockets recorded (:meth:`stop`)."""
        with _CONNECTING:
            if self._stop.is_set():
                raise RuntimeError("the relay is stopping")
            with SocketScope() as scope:
                store = open_store(timing.current().relay_connect_timeout_s)
            sockets = scope.sockets
        server = getattr(store, "underlying_store", store)  # a PrefixStore's is the client
        if len(sockets) > 1 and hasattr(server, "port"):  # another thread opened one meanwhile
            sockets = connected_to(sockets, server.port)
        with self._sockets_lock:
            self._sockets.update(sockets)
            if self._stop.is_set():  # stop() shut the others down before these were recorded
                shutdown_sockets(sockets)
                raise RuntimeError("the relay is stopping")
        return store

    def _polling(self, store: dist.Store) -> dist.Store:
        """Connected with a long timeout (a connection can take seconds: torch's client looks the peer's name up);
        each call then blocks at most ``wait_s``."""
        store.set_timeout(timedelta(seconds=self.wait_s))
        return store

    def _beat(self, again: bool) -> None:
        _, root = self._connect(local=False, again=again)
        while not self._stop.wait(self.beat_s):
            keys.beat_node(root, self.node_rank, self.ranks())

    # -- mirror: the end of each generation -------------------------------------------------------------------------
    def _mirror(self, again: bool) -> None:
        local, root = self._connect(local=True, again=again)
        while self.published < 0:  # node 0's controller may not have published generation 0 yet
            if self._await(lambda: publication.latest(root)) is None:
                return  # stopped
            if publication.is_published(root):  # a wait also ends when a compare_set names the absent key
                self.published = copy_to_node(root, local)
        while not self._stop.is_set():
            g = self.generation
            ended = self._await(lambda: keys.end_value(root, g))
            if ended is None:
                return  # stopped
            copy = keys.to_copy(ended)
            if copy is None:  # a move, a stop: read what changed from the root
                copy = self._changed(root, g)
            latest, written = publication.split_latest(copy)
            if written:  # one request: the store applies it whole, so nothing of it is seen before the rest
                keys.copy(local, written)
            if latest > self.published:  # generations only grow: an older end's copy says less than a read since
                raise_latest(local, latest)
                self.published = latest  # once written: a thread that failed before copies it again
            keys.end(local, g, ended)
            with self._ended:
                self.ended_at[g] = time.time()
                self._ended.notify_all()
            self.generation = g + 1

    def _changed(self, root: dist.Store, g: int) -> list[tuple[str, bytes]]:
        """What a node store needs before generation ``g``'s end, read from the root (the controller did not write it
        into the end): the generations published since the last copy, the stop if there is one, and what ``g``
        decided that a rank of the node may still wait for (its last voter died, or the node's count never
        completed): its formation's verdict, the last committed iteration's decision (a rank that had not stepped
        it rolls forward) and the next one's."""
        committed = commit.committed_in_root(root)
        out = keys.stop_in_root(root) + commit.decided_in_root(root, g, committed)
        # Then what was published: a survivor reads the decision on the iteration it voted once it sees the new
        # generation.
        return out + published_since(root, self.published)

    def _await(self, read: Callable[[], Any]) -> Any:
        """What ``read`` (a wait on a key of the root) answers once the key is written; None if the relay stops
        first."""
        while not self._stop.is_set():
            try:
                return read()
            except dist.DistStoreError:
                continue
        return None
