"""Load test of the control plane: today's one-store design against the two-level one, at thousands of simulated
ranks on one machine (``scripts/bench.sh --only control-plane``).

What runs is the real code: a root ``TCPStore`` in a process of its own, :class:`CommitProtocol` votes,
:class:`~ntp_megatron.elastic.agent.Agent` fencing (its kill only counted: nothing is stuck, so every fence is a
false one), :class:`~ntp_megatron.elastic.relay.NodeRelay` and the real :class:`Controller` publishing a failure's
generation. Simulated ranks are threads in a few worker processes, grouped in nodes of 8. Each iteration every rank
arrives at the commit point at the same scheduled time (the end of a simulated step), begins and votes as a rank
does, and its vote latency is from that time to the decision in hand.

- ``current``: every rank counts and waits in the root store; per node, one thread writes its ranks' heartbeats
  every 0.2 s (one connection per node instead of one per rank: the same requests, and 10K ranks' four
  connections each would not fit one process's 20,000 file descriptors here) and an Agent reads them from the root
  every 20 ms, as a node's launcher does.
- ``two_level``: every node has its relay and node store (a worker's nodes keep theirs in one store server, each
  under its own prefix). The ranks of one node per worker are real: threads that vote through the node store (the
  node's last voter carries the node's vote to the root and brings the decision back), real heartbeat threads, an
  Agent on the node store. On every other node only what reaches the root is simulated: at the arrival time the
  node's last voter counts the node in the root and waits there for the decision (from a few threads per worker,
  in parallel as nodes do). What a node's ranks do in their own store runs on that node's own CPUs on a cluster;
  here 1,250 nodes would share 2 cores. Each relay beats to the root every 2.5 s (a quarter of
  ``ntp.heartbeat_timeout_s``), and the coordinator reads every node's beat every 1.25 s.

After the iterations one rank dies: the controller settles and publishes the next generation; the figure is from the
death to the last simulated rank holding the new topology (``current``: read whole from the root;
``two_level``: every node store has the generation's end, and the real ranks computed the topology from its
publication), and what a rank read for it. One rank per node parses or computes the topology: on a cluster every
rank has its own CPU for it, here eight in one worker would hold its interpreter against the relays.

The harness shares 2 cores with the store: each row says how late the threads arrived (``arrival_late_p99_ms``)
and what CPU went to the workers and to the root store.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from ntp_megatron.elastic import commit, keys, publication, watchdog
from ntp_megatron.elastic.agent import Agent
from ntp_megatron.elastic.commit import CommitProtocol, NodeShare, note_aware
from ntp_megatron.elastic.controller import Controller, Death
from ntp_megatron.elastic.relay import NodeRelay
from ntp_megatron.plan.layout import make_topology
from ntp_megatron.plan.stages import JobTopology

RANKS_PER_NODE = 8
TP = 8
HEARTBEAT_S = 0.2
AGENT_POLL_S = 0.02
HEARTBEAT_TIMEOUT_S = 10.0
WORKERS = 8
DRIVERS = 8
"""Threads per worker that carry the simulated nodes' votes (more only queue for the same 2 cores)."""
NODE_BEAT_S = 2.5
"""A node relay's heartbeat to the root: a quarter of ``ntp.heartbeat_timeout_s`` (10 s), which judges a node."""
NODE_POLL_S = 1.25
"""How often the coordinator reads every node's heartbeat from the root (half the beat)."""
CLIENT_TIMEOUT_S = 300.0
FAILURE_BUDGET_S = 60.0
"""How long the simulated ranks wait to learn the failure's generation (a design that takes longer reports none)."""
ENV = {"RES_OPTIONS": "timeout:1 attempts:1"}
"""torch's store client looks up the peer's name at every connection; this machine's resolver drops some of those
lookups (5 s each): set up faster with a 1 s resolver timeout. Connection set-up is not measured."""


class Counting:
    """A store client that counts its requests (what the root store serves)."""

    def __init__(self, store, counter: list) -> None:
        self._store, self._counter = store, counter

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._counter[0] += 1
            return attr(*args, **kwargs)

        return call


def _client(port: int, timeout_s: float = CLIENT_TIMEOUT_S):
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _pct(values: Sequence[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _node_ranks(node: int) -> list[int]:
    return list(range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE))


class _FakeProcess:
    """A simulated rank as the Agent sees a process. Its pid is the coordinator's: the Agent reads the state of a
    rank's process from ``/proc/<pid>/stat``, which for a worker with a thousand threads costs the kernel a walk over
    all of them, every poll (4 % of a worker's CPU)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.pid = rank, os.getppid()

    def poll(self) -> Optional[int]:
        return None


def _agent(store, ranks: list[int], fenced: list):
    class CountingAgent(Agent):
        def _kill(self, rank, proc, failed_at, cause):  # nothing is stuck here: a fence is a false one
            self.notes[rank] = (failed_at, cause)
            fenced.append((rank, cause))

    processes = {r: _FakeProcess(r) for r in ranks}
    return CountingAgent(store, lambda: processes, HEARTBEAT_TIMEOUT_S, CLIENT_TIMEOUT_S, [], lambda _: None,
                         lambda: ranks, fence=True, fence_progress=True, beat_interval_s=HEARTBEAT_S)


class Halt:
    """The end of the periodic loops (agents, heartbeats): a flag each loop reads between its periods. Not an Event:
    with hundreds of loops waiting on one, the thread that sets it queues behind all of them for its lock (the
    one-store design's worker at 10K ranks took minutes to stop)."""

    def __init__(self) -> None:
        self.halted = False

    def pace(self, period_s: float) -> bool:
        """Sleep one period (pacing, not synchronisation); whether to go on."""
        time.sleep(period_s)
        return not self.halted


def _run_agents(agents: list, halt: Halt) -> list[threading.Thread]:
    def loop(agent):
        while halt.pace(AGENT_POLL_S):
            agent.poll(inject=False)

    threads = [threading.Thread(target=loop, args=(a,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    return threads


# -- one worker process ----------------------------------------------------------------------------------------------

class _Worker:
    """One worker process: its nodes (``n % workers == index``), its threads, and what they saw (under ``lock``).
    Every thread waits at ``connected`` with the main thread, then for ``go``: connections are made before the
    clock starts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.nodes = args.ranks // RANKS_PER_NODE
        self.mine = [n for n in range(self.nodes) if n % args.workers == args.index]
        self.root_requests = [0]
        self.failed: list[str] = []
        """Why simulated ranks gave up (a store call that failed or timed out)."""
        self.latencies: list[tuple[int, int, float]] = []
        """(node, iteration, vote latency) of every real rank's vote."""
        self.node_latencies: list[float] = []
        """Per node and iteration: from the arrival to the decision in hand on every rank of the node (a real node:
        its slowest rank; a simulated one: its last voter's fetch from the root)."""
        self.late: list[float] = []
        self.fenced: list = []
        self.learned: list[float] = []
        self.read_bytes: list[int] = []
        self.stop, self.go, self.voted = threading.Event(), threading.Event(), threading.Event()
        self.halt = Halt()
        self.lock = threading.Lock()
        self.t0 = 0.0
        self.ranks: list[int] = []
        self.still_voting = 0
        self.connected = threading.Barrier(1)
        self.threads: list[threading.Thread] = []
        self.agents: list = []
        self.relays: dict[int, NodeRelay] = {}
        self.nodes_server: Optional[dist.TCPStore] = None
        """Two levels: the server of the worker's node stores (held here: it lives as long as the worker)."""
        self.heartbeats: list = []

    def root(self) -> Counting:
        """A client of the root store whose requests count."""
        return Counting(_client(self.args.port), self.root_requests)

    def expect(self, ranks: list[int], drivers: int = 0) -> None:
        """The real ranks (the last to finish voting sets ``voted``); ``connected`` waits for them, ``drivers``
        more threads and the main thread."""
        self.ranks, self.still_voting = ranks, len(ranks)
        self.connected = threading.Barrier(len(ranks) + drivers + 1)

    def start(self, threads: list[threading.Thread]) -> None:
        self.threads += threads
        for t in threads:
            t.start()

    def ready(self) -> None:
        """Connected: wait for the coordinator's start (every worker connected)."""
        self.connected.wait()
        self.go.wait()

    def arrive(self, k: int) -> float:
        """Wait for iteration ``k``'s scheduled end of step; returns when this rank's vote starts (later than
        scheduled if the previous vote ran over, or the thread was late)."""
        at = self.t0 + k * self.args.period
        while (left := at - time.time()) > 0:  # the simulated step's end (pacing, not synchronisation)
            self.stop.wait(left)
        now = time.time()
        self.late.append(now - at)
        return now

    def _gave_up(self, exc: Exception) -> None:
        with self.lock:
            self.failed.append(f"{type(exc).__name__}: {str(exc)[:120]}")

    def _done_voting(self) -> None:
        with self.lock:
            self.still_voting -= 1
            if self.still_voting == 0:
                self.voted.set()

    def simulate(self, r: int, store, protocol: CommitProtocol, learn: Callable[[], int]) -> None:
        """Simulated rank ``r``: begin and vote every iteration in ``store``, then wait there for the failure's
        generation to end, ``learn`` the new one (returns the bytes it read) and note in the root that it noticed
        (the controller's failure report waits for every survivor's note)."""
        self.ready()
        try:
            for k in range(1, self.args.iters + 1):
                at = self.arrive(k)
                protocol.begin(k)
                protocol.vote(k)
                with self.lock:
                    self.latencies.append((r // RANKS_PER_NODE, k, time.time() - at))
        except Exception as exc:  # noqa: BLE001 - a store that gives up (one store at 10K ranks): counted, not hung
            self._gave_up(exc)
            return
        finally:
            self._done_voting()
        try:
            keys.wait_end(store, 0, timedelta(seconds=FAILURE_BUDGET_S))
            size = learn()
            at = time.time()
            size += len(keys.end_value(store, 0))
            note_aware(protocol.root, 0, r, at)
        except Exception as exc:  # noqa: BLE001 - it never learned the failure's generation within the budget
            self._gave_up(exc)
            return
        with self.lock:
            self.learned.append(at)
            self.read_bytes.append(size)


def _current_rank(w: _Worker, r: int) -> None:
    """A rank of the one-store design: it votes, waits and reads the new generation in the root."""
    ctl = w.root()

    def learn() -> int:  # the new generation's whole topology, read from the root
        text = publication.topology_bytes(ctl, publication.latest(ctl))
        if r % RANKS_PER_NODE == 0:  # parsing costs every rank its own CPU: one per node is parsed here
            publication.parsed(text)
        return len(text)

    w.simulate(r, ctl, CommitProtocol(ctl, 0, w.args.ranks), learn)  # the watchdog's wait too, on the root


def _node_beats(w: _Worker, node: int, store) -> None:
    """One store: a node's ranks' heartbeats in the root, every ``HEARTBEAT_S``, through one connection."""
    while w.halt.pace(HEARTBEAT_S):
        for r in _node_ranks(node):
            keys.beat(store, r, watchdog.beat())


def _start_current(w: _Worker) -> None:
    """One store: every rank of the worker's nodes is a thread; per node a heartbeat thread and an Agent."""
    w.agents = [_agent(w.root(), _node_ranks(n), w.fenced) for n in w.mine]
    w.expect([r for n in w.mine for r in _node_ranks(n)])
    beats = [threading.Thread(target=_node_beats, args=(w, n, w.root()), daemon=True) for n in w.mine]
    for t in beats:
        t.start()
    _run_agents(w.agents, w.halt)
    w.start([threading.Thread(target=_current_rank, args=(w, r), daemon=True) for r in w.ranks])


def _start_relays(w: _Worker) -> None:
    """Two levels: a relay and a node store per node, connected. The worker's nodes keep their stores in one
    server, each under its own prefix: one event loop thread answers them all, as a node's own store would on the
    node's own CPUs."""
    w.nodes_server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=CLIENT_TIMEOUT_S),
                                   wait_for_workers=False)

    def node_store(n: int):
        return lambda t=CLIENT_TIMEOUT_S: dist.PrefixStore(f"node{n}/", _client(w.nodes_server.port, t))

    w.relays = {n: NodeRelay(lambda t: _client(w.args.port, t), n, node_store(n), beat_s=NODE_BEAT_S,
                             ranks=lambda: RANKS_PER_NODE, wrap_root=lambda s: Counting(s, w.root_requests))
                for n in w.mine}
    for relay in w.relays.values():
        if not relay.wait_ready(CLIENT_TIMEOUT_S):
            raise RuntimeError(f"node {relay.node_rank}'s relay did not connect")


def _two_level_rank(w: _Worker, r: int, relay: NodeRelay, start) -> None:
    """A real rank of two levels: it votes through its node store and computes the new topology from it."""
    local = relay.open_local(CLIENT_TIMEOUT_S)
    protocol = CommitProtocol(local, 0, w.args.ranks, node=NodeShare(members=RANKS_PER_NODE, nodes=w.nodes),
                              root=w.root())

    def learn() -> int:  # what changed, from the node store: the topology is computed from it
        latest = publication.latest(local)
        info = publication.info_bytes(local, latest)
        if r % RANKS_PER_NODE == 0:  # computing costs every rank its own CPU: one per node computes here
            publication.computed(start, json.loads(info), latest)
        return len(info)

    protocol.form()  # every generation begins with its formation; not timed
    w.simulate(r, local, protocol, learn)


def _other_nodes(w: _Worker, part: list[int]) -> None:
    """Other nodes: at the arrival time, each node's last voter carries the node's vote to the root and fetches the
    decision there (in parallel threads, as nodes do; the last, which only the harness can know). What a node's
    ranks do in its own store (their counts, the decision brought in, their waits for it) runs on that node's own
    CPUs on a cluster: not here, where 1,250 nodes share 2 cores."""
    share = NodeShare(members=RANKS_PER_NODE, nodes=w.nodes)
    protocols = [CommitProtocol(w.relays[n].open_local(CLIENT_TIMEOUT_S), 0, w.args.ranks, node=share,
                                root=w.root()) for n in part]
    for protocol in protocols:  # the formation, not timed
        protocol.carry_ready()
    for protocol in protocols:
        protocol.bring(commit.formed_key(0))  # into the node store, where the relay and its end look
    w.ready()
    for k in range(1, w.args.iters + 1):
        at = w.arrive(k)
        for protocol in protocols:
            protocol.carry_vote(k)
        for protocol in protocols:
            protocol.fetch(commit.decision_key(0, k))
            with w.lock:
                w.node_latencies.append(time.time() - at)
    for n, protocol in zip(part, protocols):  # the failure: each of the node's ranks notes it in the root
        if w.relays[n].wait_ended(0, FAILURE_BUDGET_S):
            for r in _node_ranks(n):
                note_aware(protocol.root, 0, r, time.time())


def _start_two_level(w: _Worker) -> None:
    """Two levels: the first node's ranks are real (threads, heartbeats, an Agent on its node store); the other
    nodes are carried by ``DRIVERS`` threads."""
    _start_relays(w)
    real = w.mine[0]
    start = JobTopology.one_stage(make_topology(TP, w.args.ranks // TP, {"layer": 80}))
    simulated = [n for n in w.mine if n != real]
    parts = [simulated[i::DRIVERS] for i in range(DRIVERS) if simulated[i::DRIVERS]]
    w.expect(_node_ranks(real), drivers=len(parts))
    w.heartbeats = [watchdog.Heartbeat(w.relays[real].open_local, r, HEARTBEAT_S) for r in w.ranks]
    w.agents = [_agent(w.relays[real].open_local(CLIENT_TIMEOUT_S), w.ranks, w.fenced)]
    _run_agents(w.agents, w.halt)
    w.start([threading.Thread(target=_two_level_rank, args=(w, r, w.relays[real], start), daemon=True)
             for r in w.ranks]
            + [threading.Thread(target=_other_nodes, args=(w, part), daemon=True) for part in parts])


def _run(w: _Worker) -> tuple[tuple[float, int], int]:
    """Tell the coordinator this worker is connected, take its start time, let the threads go; wait for the votes,
    then for the failure to reach every rank and node store (or the budget to run out). Returns the CPU time and
    root requests at the start, and the root requests of the votes."""
    w.connected.wait()
    gc.freeze()  # what setup made lives to the end: the collector skips it (a thousand relays' objects made a pass of
    # it take a second, on whichever thread triggered it)
    print(json.dumps({"ready": True}), flush=True)
    w.t0 = float(sys.stdin.readline())
    counted_from = (_cpu_s(os.getpid()), w.root_requests[0])
    w.go.set()
    w.voted.wait(CLIENT_TIMEOUT_S)
    vote_requests = w.root_requests[0] - counted_from[1]  # what follows is the failure's
    deadline = time.monotonic() + FAILURE_BUDGET_S  # then the failure: ranks not done by then never learned it
    for t in w.threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for relay in w.relays.values():  # every node store, not only the real node's (one store: none)
        relay.wait_ended(0, max(0.0, deadline - time.monotonic()))
    w.stop.set()
    w.halt.halted = True
    return counted_from, vote_requests


def _record(w: _Worker, counted_from: tuple[float, int], vote_requests: int) -> dict:
    """What the worker's ranks saw, for the coordinator's row."""
    slowest: dict[tuple[int, int], float] = {}  # (node, iteration) -> its slowest rank's vote, for the real ranks
    for node, k, latency in w.latencies:
        slowest[node, k] = max(slowest.get((node, k), 0.0), latency)
    record = {"failed": w.failed, "latencies": [latency for _, _, latency in w.latencies],
              "node_latencies": w.node_latencies + list(slowest.values()), "late": w.late, "fenced": len(w.fenced),
              "fence_causes": [c for _, c in w.fenced][:3],
              "oldest_beat_s": max((a.oldest_beat_s for a in w.agents), default=0.0), "learned": w.learned,
              "read_bytes": w.read_bytes, "simulated": len(w.ranks), "requests": vote_requests,
              "failure_requests": w.root_requests[0] - counted_from[1] - vote_requests,
              "cpu_s": _cpu_s(os.getpid()) - counted_from[0]}
    if w.args.design == "two_level":
        record["ended_at"] = [r.ended_at.get(0) for r in w.relays.values()]
        record["relay_errors"] = [e for r in w.relays.values() for e in r.errors]
        for heartbeat in w.heartbeats:
            heartbeat.stop()
    return record


def worker(args: argparse.Namespace) -> dict:
    """Simulate the nodes ``n`` with ``n % workers == index``; the record of what they saw."""
    w = _Worker(args)
    (_start_current if args.design == "current" else _start_two_level)(w)
    counted_from, vote_requests = _run(w)
    return _record(w, counted_from, vote_requests)  # the relays' threads are left to os._exit


# -- the coordinator ---------------------------------------------------------------------------------------------------

def _spawn(argv: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ntp_megatron.bench.control_plane", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV}, **kw)


def serve() -> None:
    """The root store, in a process of its own (its CPU time is the store's)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=CLIENT_TIMEOUT_S),
                          wait_for_workers=False)
    print(store.port, flush=True)
    sys.stdin.read()


@dataclass
class _Clock:
    """When a row's phases happened, and what the coordinator itself saw of them."""

    setup_s: float
    t0: float
    """The first iteration's start, the same in every worker."""
    votes_done: float = 0.0
    died: float = 0.0
    noted: list[float] = field(default_factory=list)
    """When the controller's failure report had every survivor's note (it waits 10 s)."""
    monitor_requests: int = 0
    oldest_node_beat: float = 0.0
    store_cpu_s: float = 0.0


def _controller(root, ranks: int, noted: list[float]) -> Controller:
    """The real controller on the root; its failure report's time lands in ``noted``."""
    start = JobTopology.one_stage(make_topology(TP, ranks // TP, {"layer": 80}))

    def emit(event: dict) -> None:
        if event.get("event") == "rank_failed" and event["detect_s"] is not None:
            noted.append(time.time())
    return Controller(root, start, min_tp=1, policy="drop_replica", say=lambda _: None, emit=emit)


def _spawn_workers(design: str, ranks: int, iters: int, period: float, port: int) -> list[subprocess.Popen]:
    count = min(WORKERS, ranks // RANKS_PER_NODE)
    return [_spawn(["worker", "--design", design, "--ranks", str(ranks), "--index", str(i), "--workers", str(count),
                    "--port", str(port), "--iters", str(iters), "--period", str(period)]) for i in range(count)]


def _start_clock(workers: list[subprocess.Popen]) -> _Clock:
    """Wait for every worker's connections, then give them all the same start, a second from now."""
    setup = time.time()
    for w in workers:
        if json.loads(w.stdout.readline()).get("ready") is not True:
            raise RuntimeError("a worker failed to start")
    clock = _Clock(setup_s=time.time() - setup, t0=time.time() + 1.0)
    for w in workers:
        w.stdin.write(f"{clock.t0}\n")
        w.stdin.flush()
    return clock


def _watch_votes(design: str, ranks: int, iters: int, period: float, port: int, root, clock: _Clock) -> None:
    """Until the last iteration's decision (or the ranks' give-up): two levels, the controller's look at every node's
    heartbeat, one request each time."""
    monitor_requests = [0]
    monitor = Counting(_client(port), monitor_requests)
    nodes = range(ranks // RANKS_PER_NODE)
    end_votes = clock.t0 + iters * period
    give_up = end_votes + CLIENT_TIMEOUT_S  # a rank whose store call timed out votes no more: no decision comes
    while (time.time() < end_votes + 0.5 or not commit.is_decided(root, 0, iters)) and time.time() < give_up:
        if design == "two_level":
            now = time.time()
            beats = [json.loads(v)["t"] for v in keys.node_beats(monitor, nodes)]
            clock.oldest_node_beat = max(clock.oldest_node_beat, now - min(beats))
        time.sleep(NODE_POLL_S if design == "two_level" else AGENT_POLL_S)
    clock.votes_done = time.time()
    clock.monitor_requests = monitor_requests[0]


def _row(design: str, ranks: int, iters: int, records: list[dict], clock: _Clock) -> dict:
    """The row of the table and the JSON, from the workers' records and the coordinator's clock."""
    died = clock.died
    latencies = [x for r in records for x in r["latencies"]]
    node_latencies = [x for r in records for x in r["node_latencies"]]
    learned = [x for r in records for x in r["learned"]]
    everyone = sum(r["simulated"] for r in records) == len(learned)
    spread = {"ranks_learned_p50_s": _pct([x - died for x in learned], 0.5)}
    if design == "two_level":
        ended = [x for r in records for x in r["ended_at"]]
        everyone = everyone and None not in ended
        spread["node_stores_p50_s"] = _pct([x - died for x in ended if x is not None], 0.5)
        spread["node_stores_max_s"] = max((x - died for x in ended if x is not None), default=None)
        learned += [x for x in ended if x is not None]
    window = clock.votes_done - clock.t0
    requests = sum(r["requests"] for r in records) + clock.monitor_requests  # while the ranks voted
    return {"design": design, "ranks": ranks, "nodes": ranks // RANKS_PER_NODE, "iterations": iters,
            "vote_p50_ms": 1e3 * _pct(latencies, 0.5), "vote_p99_ms": 1e3 * _pct(latencies, 0.99),
            "votes_timed": len(latencies),
            "node_vote_p99_ms": 1e3 * _pct(node_latencies, 0.99), "node_votes_timed": len(node_latencies),
            "heartbeat_staleness_max_s": max([r["oldest_beat_s"] for r in records] + [clock.oldest_node_beat]),
            "requests_per_s": requests / window, "requests_per_iteration": requests / iters,
            "failure_requests": sum(r["failure_requests"] for r in records),
            "false_fences": sum(r["fenced"] for r in records),
            "fence_causes": [c for r in records for c in r["fence_causes"]][:3],
            "failure_to_generation_s": max(learned) - died if learned and everyone else None, **spread,
            "survivors_noted_s": clock.noted[0] - died if clock.noted else None,
            "learned_generation": len(learned) if everyone else f"{len(learned)} (not every rank within "
                                                                  f"{FAILURE_BUDGET_S:.0f} s)",
            "generation_bytes_per_rank": max((b for r in records for b in r["read_bytes"]), default=None),
            "arrival_late_p99_ms": 1e3 * _pct([x for r in records for x in r["late"]], 0.99),
            "harness_cpu_s": sum(r["cpu_s"] for r in records), "store_cpu_s": clock.store_cpu_s, "wall_s": window,
            "setup_s": clock.setup_s, "relay_errors": [e for r in records for e in r.get("relay_errors", [])],
            "ranks_failed": sum(len(r["failed"]) for r in records),
            "failures_seen": sorted({f for r in records for f in r["failed"]})[:3]}


def run(design: str, ranks: int, iters: int, period: float) -> dict:
    """One row: ``design`` at ``ranks`` simulated ranks, ``iters`` iterations, then one death."""
    server = _spawn(["serve"])
    workers: list[subprocess.Popen] = []
    try:
        port = int(server.stdout.readline())
        root = _client(port)
        noted: list[float] = []
        controller = _controller(root, ranks, noted)
        workers += _spawn_workers(design, ranks, iters, period, port)
        clock = _start_clock(workers)
        clock.noted = noted
        cpu_store = _cpu_s(server.pid)
        _watch_votes(design, ranks, iters, period, port, root, clock)
        print(f"control plane {design} {ranks} ranks: {iters} iterations voted in {clock.votes_done - clock.t0:.1f} s",
              file=sys.stderr)
        clock.died = time.time()
        assert controller.handle([Death(ranks - 1, clock.died, "killed (simulated)")]) is None
        budget = CLIENT_TIMEOUT_S + 2 * FAILURE_BUDGET_S
        records = [json.loads(w.communicate(timeout=budget)[0].strip().splitlines()[-1]) for w in workers]
        controller.close()  # its failure report, which waited for every survivor's note
        clock.store_cpu_s = _cpu_s(server.pid) - cpu_store
        server.stdin.close()
        server.wait(30)
        return _row(design, ranks, iters, records, clock)
    finally:  # a row that failed leaves no process behind to load the next ones
        for process in [*workers, server]:
            if process.poll() is None:
                process.kill()
                process.wait()


def measure(sizes: Sequence[int], iters: int, period: float,
            designs: Sequence[str] = ("two_level", "current")) -> list[dict]:
    rows = []
    for design in designs:  # every size of two levels first: one store's rows leave the machine loaded for a while
        for ranks in sizes:
            row = run(design, ranks, iters, period)
            print(f"control plane {design:<9} {ranks:>6} ranks: vote p99 {row['vote_p99_ms']:.0f} ms", file=sys.stderr)
            rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve")
    w = sub.add_parser("worker")
    for name, kind in (("--design", str), ("--ranks", int), ("--index", int), ("--workers", int), ("--port", int),
                       ("--iters", int), ("--period", float)):
        w.add_argument(name, type=kind, required=True)
    m = sub.add_parser("measure")
    m.add_argument("--ranks", type=int, nargs="+", default=[1000, 4000, 10000])
    m.add_argument("--iters", type=int, default=8)
    m.add_argument("--period", type=float, default=0.5)
    m.add_argument("--designs", nargs="+", choices=["current", "two_level"], default=["two_level", "current"])
    args = p.parse_args(argv)
    if args.cmd == "serve":
        serve()
    elif args.cmd == "worker":
        print(json.dumps(worker(args)), flush=True)
        os._exit(0)  # threads still blocked in a store call must not hold the exit
    else:
        print(json.dumps(measure(args.ranks, args.iters, args.period, args.designs), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
