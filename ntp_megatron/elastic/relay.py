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
  ranks themselves at an admission boundary), the relay copies into the node store what changed (``latest``, each
  new generation's ``info``: the dead or admitted slots, from which every rank computes the topology with the same
  pure function, :func:`~ntp_megatron.stages.published_topology`), the stop if there is one, the decisions of the
  generation a rank of the node may still wait for (its last voter died, or the node's count never completed: the
  controller writes a decision for whatever the ranks wait on before it ends a generation), then the end itself,
  where the ranks' watchdogs wait;
- it writes one heartbeat per node to the root (:func:`~ntp_megatron.elastic.keys.node_beat`); the ranks'
  heartbeats stay in the node store, read by the node's launcher.

The root store stays the single point of truth: a node store only holds copies of what the root decided. Every
blocking call of the relay is bounded by ``wait_s`` and retried until :meth:`NodeRelay.stop`, which joins the
threads: a thread still blocked in a store call when the interpreter exits aborts the process (``terminate called
without an active exception``). One relay per node waits 1 s (a timed-out store call raises an error whose C++
backtrace costs milliseconds of CPU: nothing to a node); the load test, with a thousand relays on one machine,
waits longer.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from ntp_megatron.elastic import keys
from ntp_megatron.elastic.commit import copy_published, read_if_set

logger = logging.getLogger(__name__)

StoreFactory = Callable[[float], dist.Store]
"""Opens a new client of a store with the given timeout (seconds)."""

WAIT_S = 1.0
"""How long a relay thread blocks on one store call before it looks whether it should stop (so also how long
:meth:`NodeRelay.stop` may take)."""
CONNECT_TIMEOUT_S = 60.0


class NodeRelay:
    """Node ``node_rank``'s relay between the root store and the node store. ``open_root`` opens clients of the
    root store (one per thread: each blocks on its own); ``open_local`` clients of the node store (default: a store
    the relay hosts itself on ``host``); ``ranks`` says how many of the node's ranks are alive (for the node's
    heartbeat). ``wrap_root`` wraps each client of the root store (a load test counts requests with it)."""

    def __init__(self, open_root: StoreFactory, node_rank: int, open_local: Optional[StoreFactory] = None,
                 host: str = "127.0.0.1", beat_s: float = 1.0, wait_s: float = WAIT_S,
                 ranks: Callable[[], int] = lambda: 0,
                 wrap_root: Callable[[dist.Store], dist.Store] = lambda store: store) -> None:
        self.node_rank = node_rank
        self.beat_s, self.wait_s = beat_s, wait_s
        self.ranks = ranks
        self._open_root = lambda: wrap_root(self._polling(open_root(CONNECT_TIMEOUT_S)))
        self._server: Optional[dist.TCPStore] = None
        if open_local is None:
            self._server = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
                                         wait_for_workers=False)
            port = self._server.port
            open_local = lambda timeout_s: dist.TCPStore(host, port, None, False,  # noqa: E731
                                                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.open_local: StoreFactory = open_local
        """Opens a client of the node store (what the node's ranks hold)."""
        self._stop = threading.Event()
        self.generation = 0
        """The generation the relay follows."""
        self.published = -1
        """The newest generation whose ``info`` is in the node store."""
        self.ended_at: dict[int, float] = {}
        """Generation -> when its end was written into the node store (wall clock)."""
        self._ended = threading.Condition()
        self._connected = threading.Semaphore(0)
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

    def stop(self) -> bool:
        """Stop the threads and join them: woken where the relay can wake them, else out of their store call
        within ``wait_s``. Returns whether every thread ended (a thread left blocked in a store call would abort
        the process at exit)."""
        self._stop.set()
        deadline = time.monotonic() + self.wait_s + 1.0
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [thread.name for thread in self._threads if thread.is_alive()]
        if alive:
            logger.warning("node %d relay: %s still in a store call after %.1f s", self.node_rank,
                           ", ".join(alive), self.wait_s + 1.0)
        return not alive

    def _guarded(self, run: Callable[[], None]) -> None:
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - a relay thread must say why it stopped, not vanish
            if not self._stop.is_set():
                logger.error("node %d relay thread stopped: %s", self.node_rank, exc)
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def _connect(self) -> tuple[dist.Store, dist.Store]:
        """A thread's own clients of the node store and of the root; counted as connected (:meth:`wait_ready`)."""
        clients = (self._polling(self.open_local(CONNECT_TIMEOUT_S)), self._open_root())
        self._connected.release()
        return clients

    def _polling(self, store: dist.Store) -> dist.Store:
        """Connected with a long timeout (a connection can take seconds: torch's client looks the peer's name up);
        each call then blocks at most ``wait_s``."""
        store.set_timeout(timedelta(seconds=self.wait_s))
        return store

    def _beat(self) -> None:
        _, root = self._connect()
        while not self._stop.wait(self.beat_s):
            root.set(keys.node_beat(self.node_rank), json.dumps({"t": time.time(), "ranks": self.ranks()}))

    # -- mirror: the end of each generation -------------------------------------------------------------------------
    def _mirror(self) -> None:
        local, root = self._connect()
        while not self._stop.is_set() and self.published < 0:
            self.published = copy_published(root, local)
            if self.published < 0:  # the controller publishes generation 0 before any rank starts
                self._stop.wait(self.wait_s)
        while not self._stop.is_set():
            g = self.generation
            ended = self._await(root, keys.abort(g))
            if ended is None:
                return  # stopped
            copy = keys.to_copy(ended)
            if copy is None:  # a move, a stop: read what changed from the root
                copy = self._changed(root, g)
            for key, value in copy:
                local.set(key, value)
                if key == keys.LATEST:
                    self.published = max(self.published, int(value))
            local.set(keys.abort(g), ended)
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
        out = []
        committed = int(read_if_set(root, keys.COMMITTED).decode())
        for key in (keys.STOP, keys.formed(g), keys.decision(g, committed), keys.decision(g, committed + 1)):
            value = read_if_set(root, key)
            if value is not None:  # the same value where a rank of the node brought it already
                out.append((key, value))
        # Then what was published: a survivor reads the decision on the iteration it voted once it sees the new
        # generation.
        latest = int(read_if_set(root, keys.LATEST).decode())
        out += [(keys.info(h), read_if_set(root, keys.info(h))) for h in range(self.published + 1, latest + 1)]
        out.append((keys.LATEST, str(latest)))
        return out

    def _await(self, root: dist.Store, key: str) -> Optional[bytes]:
        """The root's value of ``key`` once it is written; None if the relay stops first."""
        while not self._stop.is_set():
            try:
                return root.get(key)
            except dist.DistStoreError:
                continue
        return None
