"""A node's relay: the middle of the two-level control plane.

One store for every rank of a large job does not scale: each rank's votes, heartbeats and generation reads are
requests to node 0, and a saturated store delays heartbeats until healthy ranks are fenced
(``scripts/bench.sh --only control-plane`` measures both designs). With two levels each node's launcher hosts a
store of its own (the *node store*) and a relay between it and the root store on node 0:

- ranks count their votes (and their re-formation) in the node store (:class:`~ntp_megatron.elastic.commit.
  NodeShare`); the last rank of the node to vote queues one message, and the relay adds one count per node to the
  root. The node whose count completes the root's decides there, first writer wins against the controller, as
  with one level (:func:`~ntp_megatron.elastic.commit.decide_iteration`);
- the first rank of the node to vote asks the relay to bring the decision back: the relay waits on the root and
  writes it into the node store, where the ranks wait. A node whose other ranks died still hears the controller's
  ``abort``;
- the relay follows the generations: when one ends at the root it copies what changed (``latest``, each new
  generation's ``info``: the dead or admitted slots, from which every rank computes the topology with the same
  pure function, :func:`~ntp_megatron.stages.published_topology`) and then the end itself into the node
  store, where the ranks' watchdogs wait;
- it writes one heartbeat per node to the root (:func:`~ntp_megatron.elastic.keys.node_beat`); the ranks'
  heartbeats stay in the node store, read by the node's launcher.

The root store stays the single point of truth; a relay only copies what the root decided. Every blocking call is
bounded by ``wait_s`` and retried until :meth:`NodeRelay.stop`, which joins the threads: a thread still blocked in a
store call when the interpreter exits aborts the process (``terminate called without an active exception``). One
relay per node waits 1 s (a timed-out store call raises an error whose C++ backtrace costs milliseconds of CPU:
nothing to a node); the load test, with a thousand relays on one machine, waits longer.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from ntp_megatron.elastic import keys
from ntp_megatron.elastic.commit import COMMIT_REFORM, decide_formation, decide_iteration

logger = logging.getLogger(__name__)

StoreFactory = Callable[[float], dist.Store]
"""Opens a new client of a store with the given timeout (seconds)."""

WAIT_S = 1.0
"""How long a relay thread blocks on one store call before it looks whether it should stop (so also how long
:meth:`NodeRelay.stop` may take)."""
CONNECT_TIMEOUT_S = 60.0


class NodeRelay:
    """Node ``node_rank``'s store and relay. ``open_root`` opens clients of the root store (four, one per
    thread: each blocks on its own); ``ranks`` says how many of the node's ranks are alive (for the node's
    heartbeat). ``wrap_root`` wraps each client of the root store (a load test counts requests with it)."""

    def __init__(self, open_root: StoreFactory, node_rank: int, host: str = "127.0.0.1",
                 beat_s: float = 1.0, wait_s: float = WAIT_S, ranks: Callable[[], int] = lambda: 0,
                 wrap_root: Callable[[dist.Store], dist.Store] = lambda store: store) -> None:
        self.node_rank = node_rank
        self.host = host
        self.beat_s, self.wait_s = beat_s, wait_s
        self.ranks = ranks
        self._open_root = lambda: wrap_root(self._polling(open_root(CONNECT_TIMEOUT_S)))
        self._server = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
                                     wait_for_workers=False)
        self.port = self._server.port
        self._stop = threading.Event()
        self._awaits: queue.Queue = queue.Queue()
        self.generation = 0
        """The generation whose end the relay waits for."""
        self.published = -1
        """The newest generation whose ``info`` is in the node store."""
        self._publishing = threading.Lock()
        self.ended_at: dict[int, float] = {}
        """Generation -> when its end was written into the node store (wall clock)."""
        self._connected = threading.Semaphore(0)
        self.errors: list[str] = []
        """What went wrong in a relay thread (it then stops; the node's ranks time out on their waits)."""
        self._threads = [threading.Thread(target=self._guarded, args=(run,), name=f"ntp-relay-{name}", daemon=True)
                         for name, run in (("up", self._carry_up), ("back", self._bring_back),
                                           ("follow", self._follow), ("beat", self._beat))]
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

    def open_local(self, timeout_s: float) -> dist.Store:
        """A client of the node store (what the node's ranks hold)."""
        return dist.TCPStore(self.host, self.port, None, False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    def stop(self) -> bool:
        """Stop the threads and join them: woken where the relay can wake them, else out of their store call
        within ``wait_s``. Returns whether every thread ended (a thread left blocked in a store call would abort
        the process at exit)."""
        self._stop.set()
        self._awaits.put(None)
        try:
            self._server.queue_push(keys.RELAY_QUEUE, json.dumps({"stop": True}))
        except Exception:  # noqa: BLE001 - the node store may be gone already
            pass
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

    def _connect(self, local: bool = True) -> tuple[Optional[dist.Store], dist.Store]:
        """A thread's own clients of the node store (unless ``local`` is off) and of the root; counted as connected
        (:meth:`wait_ready`)."""
        clients = (self._local() if local else None, self._open_root())
        self._connected.release()
        return clients

    def _local(self) -> dist.Store:
        return self._polling(self.open_local(CONNECT_TIMEOUT_S))

    def _polling(self, store: dist.Store) -> dist.Store:
        """Connected with a long timeout (a connection can take seconds: torch's client looks the peer's name up);
        each call then blocks at most ``wait_s``."""
        store.set_timeout(timedelta(seconds=self.wait_s))
        return store

    # -- up: what the node's ranks queued -------------------------------------------------------------------------
    def _carry_up(self) -> None:
        local, root = self._connect()
        while not self._stop.is_set():
            try:
                raw = local.queue_pop(keys.RELAY_QUEUE, block=True)
            except dist.DistStoreError:
                continue
            self._carry(root, json.loads(raw))

    def _beat(self) -> None:
        _, root = self._connect(local=False)
        while not self._stop.wait(self.beat_s):
            root.set(keys.node_beat(self.node_rank), json.dumps({"t": time.time(), "ranks": self.ranks()}))

    def _carry(self, root: dist.Store, message: dict) -> None:
        if "stop" in message:
            return
        if "await" in message:
            self._awaits.put((message["await"], message["generation"]))
        elif "vote" in message:
            generation, iteration = message["vote"]
            if root.add(keys.node_votes(generation, iteration), 1) == message["nodes"]:
                decide_iteration(root, generation, iteration)
        elif "form" in message:
            if root.add(keys.node_ready(message["form"]), 1) == message["nodes"]:
                decide_formation(root, message["form"])
        else:
            raise ValueError(f"unknown relay message {message!r}")

    # -- back: decisions the node's ranks wait for ----------------------------------------------------------------
    def _bring_back(self) -> None:
        local, root = self._connect()
        while not self._stop.is_set():
            item = self._awaits.get()
            if item is None:  # stop
                return
            key, generation = item
            value = self._decided(root, key, generation)
            if value is None:
                continue
            if value.decode() == COMMIT_REFORM:  # the ranks move to the generation published for it: copy it first
                self._copy_published(root, local)
            local.set(key, value)

    def _decided(self, root: dist.Store, key: str, generation: int) -> Optional[bytes]:
        """The root's value of ``key`` once it is written; None if the generation ended without one (a stop: the
        ranks' own waits then see the generation over) or the relay stops."""
        while not self._stop.is_set():
            try:
                return root.get(key)
            except dist.DistStoreError:
                if root.check([keys.abort(generation)]) and not root.check([key]):
                    return None
        return None

    # -- follow: generations ----------------------------------------------------------------------------------------
    def _follow(self) -> None:
        local, root = self._connect()
        while not self._stop.is_set():
            try:
                ended = root.get(keys.abort(self.generation))
            except dist.DistStoreError:
                if self.published < 0:  # the job's first generation, published before its ranks start
                    self._copy_published(root, local)
                continue
            self._copy_published(root, local)
            if root.check([keys.STOP]):
                local.set(keys.STOP, root.get(keys.STOP))
            local.set(keys.abort(self.generation), ended)
            self.ended_at[self.generation] = time.time()
            self.generation += 1

    def _copy_published(self, root: dist.Store, local: dist.Store) -> None:
        """Copy the generations published since the last call (their ``info``, then ``latest``)."""
        with self._publishing:
            if not root.check([keys.LATEST]):
                return
            latest = int(root.get(keys.LATEST).decode())
            for generation in range(self.published + 1, latest + 1):
                local.set(keys.info(generation), root.get(keys.info(generation)))
            if latest > self.published:
                local.set(keys.LATEST, str(latest))
                self.published = latest
