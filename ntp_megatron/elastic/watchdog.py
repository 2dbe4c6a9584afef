"""Getting a rank out of a dead generation fast, and telling the launcher it is alive.

gloo in torch 2.13 cannot abort an in-flight collective (``abort()``/``shutdown()`` do nothing), and only the
direct peers of a dead rank see "connection closed"; a rank blocked on a survivor would wait for the whole
group timeout. What works (measured: every survivor out within ~40 ms of a kill): a thread per rank, blocked
on the store until the controller marks the generation over, shuts down the sockets that generation opened —
its store client and every gloo pair — except listening sockets (shutting down gloo's listener makes gloo
abort the process). Any collective or store call of the generation then fails at once, and the rank moves on
to the next generation with fresh connections — except a wait gloo never wakes (a message in mid-transfer),
which the watchdog's :meth:`GenerationWatchdog.reason` lets the rank give up.

Which sockets belong to a generation is measured, not guessed: the file descriptors of type socket that
appeared while the generation's store client and process groups were created (:class:`ntp_megatron.sockets.SocketScope`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable, Optional

import torch.distributed as dist

from ntp_megatron import phases
from ntp_megatron.config import timing
from ntp_megatron.elastic import keys, sequences
from ntp_megatron.elastic.group_backend import GlooBackend, GroupBackend
from ntp_megatron.patches.torch_distributed_work import AbandonedWait

logger = logging.getLogger(__name__)


StoreFactory = Callable[[float], dist.Store]
"""Opens a new client of the launcher's store with the given timeout (seconds)."""


COMPUTE_PHASES = frozenset({"forward", "backward"})
"""Where a rank waits only on its own replica's groups (tensor-parallel collectives, pipeline transfers)."""


def escape_grace(phase: str, replica: Optional[int], dead: Optional[set[tuple[int, ...]]]) -> float:
    """How long after its generation ended a rank still waits on a collective of it: ``timing.replica_grace_s`` while
    it computes in a replica the end named no dead member of (its peers there compute on and arrive), else
    ``timing.escape_grace_s``."""
    t = timing.current()
    whole = replica is not None and dead is not None and all(identity[0] != replica for identity in dead)
    return t.replica_grace_s if whole and phase in COMPUTE_PHASES else t.escape_grace_s


class GenerationWatchdog:
    """One thread per generation: waits for the generation's abort key, then cuts what something can be blocked on
    (:class:`ntp_megatron.elastic.group_backend.GroupBackend`): the generation's own connections (its store client,
    its default group) and the process groups the backend says (the value of the key names the dead,
    :func:`ntp_megatron.elastic.keys.abort_value`). On gloo those with a dead member; one without is left as it is
    (it may go on into the next generation, :mod:`ntp_megatron.plan.group_plan`), and a rank blocked in it gives its
    wait up after a grace (:func:`escape_grace`).

    The thread ends when the key appears (the controller always sets it when a generation ends) or when its
    own store client fails; :meth:`join` waits for that. ``fired_at`` is when it acted (wall clock).
    """

    def __init__(self, open_store: StoreFactory, generation: int, sockets: dict[int, str], timeout_s: float,
                 backend: Optional[GroupBackend] = None, replica: Optional[int] = None) -> None:
        self.generation = generation
        self.replica = replica
        """The rank's replica (None: unknown, every wait gets the short grace)."""
        self.backend = backend or GlooBackend()
        self.default_group = None
        """The generation's default group, once made (the NCCL backend aborts it; gloo cuts its sockets)."""
        self.sockets = dict(sockets)
        """The generation's own sockets (fd -> identity)."""
        self.groups: list = []
        """Its process groups (:class:`ntp_megatron.core.groups.PooledGroup`: a key naming the members, the sockets)."""
        self.cut: set = set()
        """Keys of the groups it cut (they cannot go on)."""
        self.dead: Optional[set[tuple[int, ...]]] = None
        """Once fired: the dead the abort key named (None: all groups were shut down)."""
        self.fired_at: Optional[float] = None
        self._fired_monotonic: Optional[float] = None
        self.abandoned_waits: list[AbandonedWait] = []
        """Waits on this generation's collectives the rank gave up (see :meth:`reason`)."""
        self._lock = threading.Lock()
        self._store = open_store(timeout_s)
        self._thread = threading.Thread(target=self._watch, name=f"ntp-watchdog-gen{generation}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            try:
                keys.wait_end(self._store, self.generation)
                break
            except Exception as exc:  # noqa: BLE001 - a store timeout: keep watching; a dead store: give up
                try:
                    if keys.is_ended(self._store, self.generation):
                        break
                except Exception:  # noqa: BLE001
                    logger.warning("watchdog of generation %d lost the store (%s); it stops watching",
                                   self.generation, exc)
                    return
        try:
            dead = keys.dead_named(keys.end_value(self._store, self.generation))
        except Exception:  # noqa: BLE001 - the key was seen: a store gone now shuts everything
            dead = None
        with self._lock:
            self.fired_at = time.time()
            self.dead = dead
            closed = self.backend.get_out(self._blocked(self.groups), self.sockets, self.default_group)
            self._fired_monotonic = time.monotonic()
        logger.debug("generation %d over: shut down %d of its %d sockets", self.generation, closed,
                     len(self.sockets))

    def reason(self) -> Optional[str]:
        """Part of the wait escape (:mod:`ntp_megatron.patches.torch_distributed_work`): a collective of this
        generation still waited on a grace (:func:`escape_grace`) after its sockets were shut down is one gloo will not
        wake before the collective timeout (a message in mid-transfer), or one whose peers left it; the rank gives it
        up."""
        fired = self._fired_monotonic
        if fired is None or time.monotonic() - fired < escape_grace(phases.current()[1], self.replica, self.dead):
            return None
        return (f"generation {self.generation} ended {time.monotonic() - fired:.2f} s ago and a collective of it "
                f"was still blocked: given up")

    def abandoned(self, wait: AbandonedWait) -> None:
        logger.warning("generation %d: %s was still blocked %.2f s after the generation ended; given up",
                       self.generation, wait.what, time.monotonic() - self._fired_monotonic)
        self.abandoned_waits.append(wait)

    def _blocked(self, groups: list) -> list:
        cut = set(self.backend.cut_at_end([pooled.key for pooled in groups], self.dead))
        self.cut |= cut
        return [pooled for pooled in groups if pooled.key in cut]

    def add(self, sockets: dict[int, str]) -> None:
        """More sockets of the generation (opened while it formed); shut down at once if it is already over."""
        with self._lock:
            self.sockets.update(sockets)
            if self.fired_at is not None:
                self.backend.get_out([], sockets, None)

    def add_groups(self, groups: Iterable) -> None:
        """The generation's process groups (made or kept); those with a dead member are shut down at once if the
        generation is already over."""
        groups = list(groups)
        with self._lock:
            self.groups.extend(groups)
            if self.fired_at is not None:
                self.backend.get_out(self._blocked(groups), {}, None)

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._store = None  # drop the client (and its socket) with the generation


class Heartbeat:
    """A thread that writes this rank's heartbeat to the store every ``interval_s``, so the launcher can fence a
    rank that stopped responding (SIGSTOP, a hung device) without waiting for a collective timeout, and one that
    is alive but makes no progress while its peers wait on it (a kernel that never returns;
    ``ntp.progress_fence``): the heartbeat (:func:`beat`) says when, where the rank is (iteration, phase), how far
    it got (its progress count: phase marks, micro-batches, layers, finished collective waits), how many
    collectives it entered on each of its groups and what it waits on (:mod:`ntp_megatron.elastic.blame`)."""

    def __init__(self, open_store: StoreFactory, launch_rank: int, interval_s: float) -> None:
        self._open_store, self._timeout = open_store, max(timing.current().heartbeat_store_timeout_s, 10 * interval_s)
        self._store = open_store(self._timeout)
        self._launch_rank = launch_rank
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ntp-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                keys.beat(self._store, self._launch_rank, beat())
            except Exception:  # noqa: BLE001 - a broken connection: open a new one (the launcher may be gone)
                try:
                    self._store = self._open_store(self._timeout)
                except Exception:  # noqa: BLE001
                    return
                continue
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def beat() -> dict:
    """This rank's heartbeat: ``t`` (now, on the host's monotonic clock, which its launcher shares: a step of the
    wall clock must not make every beat of a node look old), ``iteration``, ``phase``, ``progress`` (a count that
    grows while the rank works: its marks, plus the collectives its device completed where the source counts them), the collective
    sequence numbers it entered per group (``seq``) and its wait on its peers (``wait``: for how long, on what where
    known; :mod:`ntp_megatron.elastic.sequences`), and ``compute`` (its last iterations' compute times,
    ``[iteration, seconds]``: what the launcher's rebalance monitor reads, with no request of its own)."""
    iteration, phase = phases.current()
    reported = sequences.report()
    return {"t": time.monotonic(), "iteration": iteration, "phase": phase,
            "progress": phases.progress() + reported["device"], "seq": reported["seq"], "wait": reported["wait"],
            "compute": [[k, round(seconds, 6)] for k, seconds in phases.computed()]}


def wait_for_port(host: str, port: int, timeout_s: float, stop: Optional[threading.Event] = None) -> None:
    """Return once ``host:port`` accepts a connection; TimeoutError after ``timeout_s``, InterruptedError once
    ``stop`` is set. Used before creating a store client, whose own retries log C++ errors and stacks while a node's
    store is not up yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=timing.current().port_connect_timeout_s) as sock:
                if sock.getsockname() != sock.getpeername():  # not TCP's self-connect to a free local port
                    return
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(exc.strerror or str(exc)) from None
            if stop is None:
                time.sleep(timing.current().port_retry_s)
            elif stop.wait(timing.current().port_retry_s):
                raise InterruptedError(f"stopped while waiting for {host}:{port}") from None


def store_factory(host: str, port: int, stop: Optional[threading.Event] = None) -> StoreFactory:
    """Opens clients of ``host:port``; a client still waiting for the port gives up once ``stop`` is set."""
    def open_store(timeout_s: float) -> dist.Store:
        wait_for_port(host, port, timeout_s, stop)
        return dist.TCPStore(host, port, world_size=None, is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    return open_store
