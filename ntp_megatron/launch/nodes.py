"""The launchers of a job's nodes, and what they tell each other through node 0's store.

Node 0 hosts the ``TCPStore`` (on ``--store-port``, or one the store picks when that is 0: it says which, and
writes it to ``<run dir>/store.json`` for the other nodes' ``--store-port``); every other node connects to it and
announces itself (:func:`node_key`). What a node's launcher sees of its own ranks it publishes there: a death
(:func:`publish_death`, read by node 0's controller under NTP, by every node without), and when the job must end
everywhere, the abort key with the reason and the failure it named.

This module owns the keys between the launchers (:mod:`ntp_megatron.elastic.keys` lists the other owners), their
writers and their readers:

- ``launcher/node<n>``: node n's launcher connected to node 0's store (its pid). Written by it (:meth:`Nodes.join`),
  again by a replacement launcher for a lost node (a new pid); read by node 0's launcher (:meth:`Nodes.wait_for_nodes`).
- ``launcher/link``: the port of node 0's link listener (:mod:`ntp_megatron.launch.node_link`), on node 0's
  ``--store-host``. Written by node 0's launcher (:meth:`Nodes.join`); read by every other node's (:meth:`Nodes.join`).
- ``launcher/lost/node<n>``: node n was declared lost (JSON: a list of ``{"pid", "reason", "launch_ranks"}``, one per
  launcher of the node declared lost). Written by node 0's launcher (:func:`mark_node_lost`); read by node n's
  launcher (:func:`node_losses`): one whose pid is listed is fenced (it stops its ranks and exits 1); one started
  later for node n finds the node lost and starts every one of its slots as a replacement.
- ``launcher/ended``: the job has ended on node 0 (its launcher's exit code). Written by node 0's launcher as it ends
  (:func:`set_ended`); read by a node's launcher whose ranks all ended before the job did (:func:`read_ended`).
- ``launcher/left/node<n>``: node n's launcher is leaving (JSON: its pid, its exit code). Written by it as it ends
  (:func:`set_left`); read by node 0's launcher, which keeps its store up until every node's current launcher has left,
  a bounded while (:meth:`Nodes.wait_for_leaving`, :func:`has_left`).
- ``launcher/probe``: written by nobody: another node's launcher asks whether it exists, for an answer from node 0's
  store (:func:`probe`, by :mod:`ntp_megatron.launch.root_watch` while node 0 is silent).
- ``launcher/abort``: a node's launcher ended the job (JSON ``{"reason", "death"}``). Written by it
  (:func:`set_abort`); read by every other node's launcher (:func:`read_abort`).
- ``elastic/deaths`` and ``elastic/death/<n>``: how many rank deaths launchers have published, and the n-th (JSON,
  1-based, with the launcher that published it: node 0 ignores one from a launcher it declared lost). Written by the
  launcher that saw it (:func:`publish_death`); read by node 0's controller under NTP, by every node without
  (:meth:`Nodes.remote_deaths`, :func:`published_deaths`).
- ``elastic/rebalance_requests`` and ``elastic/rebalance/<n>``: how many rebalance requests nodes other than 0 have
  made, and the n-th (JSON: the node, the generation its measurements ran in, the decisions). Written by that node's
  launcher (:func:`request_rebalance`); read, then deleted, by node 0's launcher (:func:`new_rebalance_requests`,
  :func:`rebalance_requests`, :func:`delete_rebalance_requests`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from ntp_megatron.config import timing
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.controller import Death
from ntp_megatron.elastic.relay import NodeRelay
from ntp_megatron.elastic.watchdog import store_factory, wait_for_port
from ntp_megatron.launch.node_link import LinkClient, LinkServer
from ntp_megatron.launch.node_liveness import Loss, NodeLiveness

ADDRESS_FILE = "store.json"

LAUNCHER_PREFIX = "launcher/"
ABORT = LAUNCHER_PREFIX + "abort"
"""JSON ``{"reason", "death"}``: a node's launcher ended the job; every other node stops its ranks and names the
same failure."""
PROBE = LAUNCHER_PREFIX + "probe"
"""Written by nobody: a request whose answer says node 0's store answers."""
ENDED = LAUNCHER_PREFIX + "ended"
"""Node 0's launcher's exit code: the job has ended (0: it finished)."""
DEATHS = keys.PREFIX + "deaths"
"""How many rank deaths launchers have published (node 0's controller reads them in order under NTP; without NTP
every node reads them to name the same failure)."""
LINK = LAUNCHER_PREFIX + "link"
"""The port of node 0's link listener (:class:`~ntp_megatron.launch.node_link.LinkServer`)."""
REBALANCE_REQUESTS = keys.PREFIX + "rebalance_requests"
"""How many rebalance requests nodes other than 0 have made (``add``): node 0's controller polls this one key."""


def node_key(node_rank: int) -> str:
    """Set (to its pid) by node ``node_rank``'s launcher once it has connected to node 0's store."""
    return f"{LAUNCHER_PREFIX}node{node_rank}"


def left_key(node_rank: int) -> str:
    """Set (to its exit code) by node ``node_rank``'s launcher as it ends."""
    return f"{LAUNCHER_PREFIX}left/node{node_rank}"


def lost_key(node_rank: int) -> str:
    """JSON list of node ``node_rank``'s launchers declared lost (:func:`mark_node_lost`)."""
    return f"{LAUNCHER_PREFIX}lost/node{node_rank}"


def death_key(n: int) -> str:
    """JSON of the ``n``-th death a launcher published (1-based)."""
    return f"{keys.PREFIX}death/{n}"


def rebalance_request_key(n: int) -> str:
    """JSON of the ``n``-th rebalance request (1-based): a node other than 0 found slow ranks among its own
    (:mod:`ntp_megatron.plan.rebalance`): the node, the generation its measurements ran in, the decisions."""
    return f"{keys.PREFIX}rebalance/{n}"


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """Host a store on ``port`` (0: a free port the store binds itself; ``store.port`` says which)."""
    return dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class NodeTaken(RuntimeError):
    """A launcher was started for a node whose launcher still runs (node 0 has not declared it lost)."""


class Nodes:
    """This launcher's node: ``node_rank`` of ``nnodes``, node 0's store at ``host:port``."""

    def __init__(self, nnodes: int, node_rank: int, host: str, port: int, timeout_s: float,
                 say: Callable[[str], None], node_timeout_s: float = 30.0, replaceable: bool = True) -> None:
        """``replaceable``: a lost node can be replaced (NTP: its slots join the running job); without, a launcher for
        a lost node gives up (:class:`NodeTaken`)."""
        self.nnodes, self.node_rank = nnodes, node_rank
        self.host, self.port = host, port
        """``port``: as given (0: node 0 lets the store choose); the store's own once :meth:`join` returned."""
        self.timeout_s = timeout_s
        self.say = say
        self._remote_deaths_seen = 0
        self._unwritten_at: dict[int, float] = {}
        """Death number -> when it was first seen counted and not written (monotonic)."""
        self.liveness = NodeLiveness(node_timeout_s)
        """Node 0: what its links say of the other nodes' launchers (:mod:`ntp_megatron.launch.node_liveness`)."""
        self._links: Optional[LinkServer] = None
        self._link: Optional[LinkClient] = None
        self.replacing = False
        """Another node: it was declared lost before this launcher joined, so this launcher replaces it (every
        slot of the node starts as a replacement process)."""
        self._fence_checked = -math.inf
        self.replaceable = replaceable

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    def join(self, run_dir: Path) -> dist.TCPStore:
        """Host the store (node 0: its address then goes to ``run_dir/store.json``) or connect to node 0's, saying so
        while it waits; then announce this node."""
        if self.node_rank == 0:
            store = host_store(self.host, self.port, self.timeout_s)
            self.port = store.port
            write_address(run_dir, self.host, self.port)
            if self.multi:
                self.say(f"node 0 of {self.nnodes}: store at {self.host}:{self.port} (also in "
                         f"{run_dir / ADDRESS_FILE}); start the other nodes with --store-port {self.port}")
        else:
            try:
                wait_for_port(self.host, self.port, 0.0)
            except TimeoutError:
                self.say(f"waiting for node 0 of {self.nnodes} at {self.host}:{self.port}")
                wait_for_port(self.host, self.port, self.timeout_s)
            store = dist.TCPStore(self.host, self.port, None, False, timeout=timedelta(seconds=self.timeout_s),
                                  wait_for_workers=False)
        if self.multi:
            self._open_link(store)
        store.set(node_key(self.node_rank), str(os.getpid()))
        return store

    def _open_link(self, store: dist.Store) -> None:
        """Node 0: listen for the other launchers' links and publish the port. Another node: find whether this node
        was declared lost before (then this launcher replaces it), and hold a link to node 0."""
        if self.node_rank == 0:
            self._links = LinkServer()
            store.set(LINK, str(self._links.port))
            return
        previous = keys.read_if_set(store, node_key(self.node_rank))  # before this launcher writes its own pid
        if previous is not None:
            self._await_loss(store, int(previous.decode()))
        self.replacing = bool(node_losses(store, self.node_rank))
        if self.replacing and not self.replaceable:
            raise NodeTaken(f"node {self.node_rank} was declared lost and the job has no NTP to replace it in")
        beat_s = timing.current().node_beat_fraction * self.liveness.timeout_s
        self._link = LinkClient(self.host, int(store.get(LINK).decode()), self.node_rank, os.getpid(), beat_s,
                                self.timeout_s)

    def _await_loss(self, store: dist.Store, pid: int) -> None:
        """Another launcher (``pid``) joined as this node before: this one may only replace it once node 0 has
        declared it lost (else two launchers would run the node's slots). Waits for that up to ``ntp.node_timeout_s``
        and ``timing.node_takeover_s`` more; raises :class:`NodeTaken` if it does not come."""
        if any(r["pid"] == pid for r in node_losses(store, self.node_rank)):
            return
        limit = self.liveness.timeout_s + timing.current().node_takeover_s
        self.say(f"node {self.node_rank}'s launcher before this one (pid {pid}) is not declared lost yet: waiting up "
                 f"to {limit:.0f} s for node 0 to declare it lost")
        deadline = time.monotonic() + limit
        while not any(r["pid"] == pid for r in node_losses(store, self.node_rank)):
            if time.monotonic() > deadline:
                raise NodeTaken(f"node {self.node_rank} still has a launcher (pid {pid}) that node 0 has not declared "
                                f"lost within {limit:.0f} s: stop it, or start this one with another --node-rank")
            time.sleep(timing.current().node_poll_s)

    def close(self, clean: bool) -> None:
        """The links end with the launcher; ``clean``: it exits in order, having reported what became of its ranks
        (node 0 is told: not a lost node)."""
        if self._links is not None:
            self._links.close()
        if self._link is not None:
            self._link.close(clean)

    def lost_nodes(self, store: dist.Store) -> list[Loss]:
        """Node 0: the other nodes' launchers lost since the last call (:class:`NodeLiveness`, on node 0's monotonic
        clock), each marked lost in the store (:func:`mark_node_lost`, its launch ranks filled in by the caller) and
        its link closed."""
        if self._links is None:
            return []
        said = {"connected": self.liveness.connected, "heard": self.liveness.heard, "left": self.liveness.left,
                "closed": self.liveness.closed}
        for event in self._links.events():
            said[event.kind](event.node, event.pid, event.at)
        losses = self.liveness.lost(time.monotonic())
        for loss in losses:
            self._links.drop(loss.node, loss.pid)
        return losses

    def fenced(self, store: dist.Store) -> Optional[dict]:
        """Another node: node 0's record of this launcher declared lost (checked every ``timing.node_fence_poll_s``),
        or None. A launcher that finds one stops its ranks and exits: the job has gone on without them."""
        now = time.monotonic()
        if self.node_rank == 0 or now - self._fence_checked < timing.current().node_fence_poll_s:
            return None
        self._fence_checked = now
        pid = os.getpid()
        try:
            return next((r for r in node_losses(store, self.node_rank) if r["pid"] == pid), None)
        except Exception:  # noqa: BLE001 - node 0 silent: root_watch says so
            return None

    def wait_for_nodes(self, store: dist.Store, started: float) -> bool:
        """Node 0: wait until every other node's launcher has connected, saying which ones it waits for; at
        ``timing.node_wait_fraction`` of the timeout (before the ranks' own rendezvous gives up) one line, the abort key
        set, and False."""
        if self.node_rank != 0 or not self.multi:
            return True
        limit = timing.current().node_wait_fraction * self.timeout_s
        waiting_for: set[int] = set()
        while True:
            missing = [i for i in range(1, self.nnodes) if not keys.quietly(store.check, [node_key(i)], default=False)]
            if not missing:
                return True
            waited = time.time() - started
            if waited > limit:
                self.say(f"node {missing[0]} of {self.nnodes} did not join within {limit:.0f} s: start ntp-launch "
                         f"with the same config and --nnodes {self.nnodes} --node-rank {missing[0]} --store-host "
                         f"<this host> --store-port {self.port} there")
                set_abort(store, f"node {missing[0]} did not join")
                return False
            for i in missing:
                if i not in waiting_for and waited > timing.current().node_wait_quiet_s:
                    self.say(f"waiting for node {i} of {self.nnodes} at {self.host}:{self.port}")
                    waiting_for.add(i)
            time.sleep(timing.current().node_poll_s)

    def wait_for_leaving(self, store: dist.Store) -> list[int]:
        """Node 0, as it ends: keep the store up until every other node's launcher has said it leaves, at most
        ``timing.node_leave_wait_s`` (a node lost or stopped does not hold the end up longer). The nodes that did not."""
        deadline = time.monotonic() + timing.current().node_leave_wait_s
        while True:
            staying = [i for i in range(1, self.nnodes) if not has_left(store, i)]
            if not staying or time.monotonic() >= deadline:
                return staying
            time.sleep(timing.current().node_poll_s)

    def remote_deaths(self, store: dist.Store) -> list[Death]:
        """Deaths other nodes' launchers published since the last call (node 0), each said as a node report."""
        out = []
        reported = int(store.add(DEATHS, 0))
        while self._remote_deaths_seen < reported:
            n = self._remote_deaths_seen + 1
            if not store.check([death_key(n)]):  # counted, not written yet: a get would block for it
                if not self._unwritten_given_up(n):
                    break  # read at a later pass
                self._remote_deaths_seen = n
                continue
            self._remote_deaths_seen = n
            death, by = published_death(store, n)
            if by is not None and self.liveness.is_lost(*by):  # a fenced launcher that ran on for a moment
                self.say(f"ignored: node {by[0]}'s launcher (pid {by[1]}), declared lost, reported launch rank "
                         f"{death.launch_rank} {death.cause}")
                continue
            self.say(f"node report: launch rank {death.launch_rank} {death.cause}")
            out.append(death)
        return out

    def leave(self, store: Optional[dist.Store], exit_code: int) -> None:
        """This launcher ends with ``exit_code``: node 0 says the job ended, another node that it leaves."""
        if not self.multi or store is None:
            return
        if self.node_rank == 0:
            set_ended(store, exit_code)
        else:
            set_left(store, self.node_rank, exit_code)

    def job_end(self, store: dist.Store) -> Optional[int]:
        """A node whose ranks all ended before the job did: once the job has ended on node 0, this launcher's exit code
        (0 if it finished), said in one line; None until then."""
        ended = read_ended(store)
        if ended is None:
            return None
        self.say("the job finished on the other nodes" if ended == 0 else f"the job ended on node 0 with exit code "
                 f"{ended}")
        return 0 if ended == 0 else 1

    def _unwritten_given_up(self, n: int) -> bool:
        """Death ``n`` is counted and not written: whether it has been so for ``timing.node_call_s`` (its launcher died
        between the two; its node's loss names its ranks), said once, and skipped."""
        first = self._unwritten_at.setdefault(n, time.monotonic())
        if time.monotonic() - first < timing.current().node_call_s:
            return False
        self.say(f"node report {n} was counted but never written (its launcher ended in between): skipped")
        return True

    def restart(self) -> None:
        """A fresh store (a restarted job): no death of it was read yet."""
        self._remote_deaths_seen = 0
        self._unwritten_at.clear()


def join_failure(exc: Exception, nodes: Nodes) -> str:
    """The one line a launcher says when :meth:`Nodes.join` failed (instead of the store's C++ error)."""
    if isinstance(exc, NodeTaken):
        return str(exc)
    port, why = nodes.port, str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
    if nodes.node_rank == 0:
        return f"cannot host the store on port {port} ({why}); is the port in use? choose another --store-port"
    return (f"could not reach node 0's store at {nodes.host}:{port} within {nodes.timeout_s:.0f} s ({why}); is "
            f"ntp-launch --node-rank 0 running there with --store-port {port}?")


def host_node_store(root_host: str, root_port: int, node_rank: int, timeout_s: float, beat_s: float,
                    ranks: Callable[[], int], say: Callable[[str], None]) -> tuple[dist.TCPStore, NodeRelay]:
    """Under NTP on a node other than node 0: host the node's store on this host, where its ranks vote, beat and wait,
    and the relay that ends the root's generations in it (``ranks``: how many of the node's ranks run, for its
    heartbeat)."""
    node_store = host_store("127.0.0.1", 0, timeout_s)
    stop = threading.Event()  # ends a connection to a root that has gone (node 0's launcher ended first)
    relay = NodeRelay(store_factory(root_host, root_port, stop), node_rank,
                      store_factory("127.0.0.1", node_store.port, stop), beat_s=beat_s, ranks=ranks, stop=stop)
    say(f"node {node_rank}: its ranks vote, beat and wait in the node's store on port {node_store.port}; a relay "
        f"follows node 0's store at {root_host}:{root_port}")
    return node_store, relay


def write_address(run_dir: Path, host: str, port: int) -> None:
    """``run_dir/store.json``: node 0's store, for the other nodes' ``--store-host`` and ``--store-port``."""
    path = run_dir / ADDRESS_FILE
    tmp = path.with_name(f".{ADDRESS_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"host": host, "port": port}) + "\n")
    os.replace(tmp, path)  # readers never see half a file


def mark_node_lost(store: dist.Store, node_rank: int, pid: int, reason: str, launch_ranks: list[int]) -> None:
    """Node 0: node ``node_rank``'s launcher ``pid`` is lost (appended to the node's list; one writer, node 0)."""
    records = node_losses(store, node_rank)
    records.append({"pid": pid, "reason": reason, "launch_ranks": launch_ranks})
    store.set(lost_key(node_rank), json.dumps(records))


def node_losses(store: dist.Store, node_rank: int) -> list[dict]:
    """Node ``node_rank``'s launchers declared lost so far (:func:`mark_node_lost`), oldest first."""
    raw = keys.read_if_set(store, lost_key(node_rank))
    return json.loads(raw.decode()) if raw is not None else []


def publish_death(store: dist.Store, death: Death, node_rank: int) -> None:
    """Append a death to the job's list in the store, for node 0's controller (NTP) or every node (NTP off), with
    the launcher that saw it (node ``node_rank``, this process)."""
    try:
        n = store.add(DEATHS, 1)
        store.set(death_key(n), json.dumps({**dataclasses.asdict(death), "by": [node_rank, os.getpid()]}))
    except Exception:  # noqa: BLE001 - the store may be unreachable on a failing node; reporting must not crash
        pass


def published_death(store: dist.Store, n: int) -> tuple[Death, Optional[tuple[int, int]]]:
    """The ``n``-th death (1-based) any node published (:func:`publish_death`) and who published it (node, pid)."""
    record = json.loads(store.get(death_key(n)))
    by = record.pop("by", None)
    return Death(**record), tuple(by) if by is not None else None


def published_deaths(store: dist.Store) -> list[Death]:
    """Every death any node has published so far (raises if the store is unreachable)."""
    return [published_death(store, n)[0] for n in range(1, int(store.add(DEATHS, 0)) + 1)]


def probe(store: dist.Store) -> bool:
    """A request node 0's store answers without a key of its own (it says whether ``launcher/probe`` exists)."""
    return store.check([PROBE])


def set_ended(store: dist.Store, exit_code: int) -> None:
    """Node 0: the job has ended with ``exit_code`` (0: it finished)."""
    keys.quietly(store.set, ENDED, str(exit_code))


def read_ended(store: dist.Store) -> Optional[int]:
    """Node 0's exit code once the job has ended there, else None (also while node 0's store does not answer)."""
    if not keys.quietly(store.check, [ENDED], default=False):
        return None
    return int(keys.quietly(store.get, ENDED, default=b"1"))


def set_left(store: dist.Store, node_rank: int, exit_code: int) -> None:
    """A node other than 0 is leaving with ``exit_code`` (node 0 may close its store once every node has): this
    launcher (its pid), so that a fenced launcher of the node leaving does not stand for its replacement."""
    keys.quietly(store.set, left_key(node_rank), json.dumps({"pid": os.getpid(), "exit_code": exit_code}))


def has_left(store: dist.Store, node_rank: int) -> bool:
    """Node 0: whether node ``node_rank``'s current launcher (the pid in ``launcher/node<n>``) has left (True also when
    the store cannot say: nothing to wait for)."""
    try:
        if not store.check([left_key(node_rank)]):
            return False
        left = json.loads(store.get(left_key(node_rank)))
        return not store.check([node_key(node_rank)]) or str(left["pid"]) == store.get(node_key(node_rank)).decode()
    except Exception:  # noqa: BLE001 - the store is going: nothing to wait for
        return True


def set_abort(store: dist.Store, reason: str, death: Optional[Death] = None) -> None:
    """Tell every node to stop: why, and the failure this node named (so they all name the same one)."""
    named = dataclasses.asdict(death) if death is not None else None
    keys.quietly(store.set, ABORT, json.dumps({"reason": reason, "death": named}))


def read_abort(store: dist.Store) -> tuple[Optional[str], Optional[Death]]:
    """(reason, the named failure or None) if a node has aborted the job, else (None, None)."""
    if not keys.quietly(store.check, [ABORT], default=False):
        return None, None
    try:
        record = json.loads(store.get(ABORT).decode())
    except Exception:  # noqa: BLE001
        return "unknown", None
    return record["reason"], Death(**record["death"]) if record.get("death") else None


def request_rebalance(store: dist.Store, node_rank: int, generation: int, decisions: list) -> None:
    """A node other than 0: ask node 0's controller to rebalance this node's TP groups with slow ranks."""
    n = int(store.add(REBALANCE_REQUESTS, 1))
    store.set(rebalance_request_key(n), json.dumps({"node": node_rank, "generation": generation,
                                                    "decisions": decisions}))


def new_rebalance_requests(store: dist.Store, seen: int) -> list[int]:
    """Node 0: the numbers of the rebalance requests made after the ``seen`` first ones, once all are written (one
    request when there are none; a request counted whose value is not written yet: none now, all at a later call)."""
    made = int(store.add(REBALANCE_REQUESTS, 0))
    if made <= seen:
        return []
    numbers = list(range(seen + 1, made + 1))
    return numbers if store.check([rebalance_request_key(n) for n in numbers]) else []


def rebalance_requests(store: dist.Store, numbers: list[int]) -> list[dict]:
    """Node 0: the requests :func:`new_rebalance_requests` numbered, in one request."""
    return [json.loads(raw.decode()) for raw in store.multi_get([rebalance_request_key(n) for n in numbers])]


def delete_rebalance_requests(store: dist.Store, numbers: list[int]) -> None:
    """Node 0: the requests are dealt with."""
    for n in numbers:
        keys.quietly(store.delete_key, rebalance_request_key(n))
