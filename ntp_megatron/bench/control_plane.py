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
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

from ntp_megatron.elastic import keys, watchdog
from ntp_megatron.elastic.agent import Agent
from ntp_megatron.elastic.commit import CommitProtocol, NodeShare, note_aware
from ntp_megatron.elastic.controller import Controller, Death
from ntp_megatron.elastic.relay import NodeRelay
from ntp_megatron.plan.layout import make_topology
from ntp_megatron.plan.stages import load_topology, published_topology

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
                         lambda: ranks, fence=True, fence_progress=True)


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

def worker(args: argparse.Namespace) -> dict:
    """Simulate the nodes ``n`` with ``n % workers == index``; print a JSON record of what they saw."""

    nodes = args.ranks // RANKS_PER_NODE
    mine = [n for n in range(nodes) if n % args.workers == args.index]
    root_requests = [0]
    failed: list[str] = []
    """Why simulated ranks gave up (a store call that failed or timed out)."""
    latencies: list[tuple[int, int, float]] = []
    """(node, iteration, vote latency) of every real rank's vote."""
    node_latencies: list[float] = []
    """Per node and iteration: from the arrival to the decision in hand on every rank of the node (a real node: its
    slowest rank; a simulated one: its last voter's fetch from the root)."""
    late: list[float] = []
    fenced: list = []
    learned: list[float] = []
    read_bytes: list[int] = []
    stop, go = threading.Event(), threading.Event()
    halt = Halt()
    connected = threading.Barrier(1)  # replaced below once the thread count is known
    voted = threading.Event()
    still_voting: list[int] = []

    def done_voting() -> None:
        with lock:
            still_voting[0] -= 1
            if still_voting[0] == 0:
                voted.set()
    lock = threading.Lock()
    t0: list[float] = []

    def ready() -> None:
        """Connected: wait for the coordinator's start (every worker connected)."""
        connected.wait()
        go.wait()

    def arrive(k: int) -> float:
        """Wait for iteration ``k``'s scheduled end of step; returns when this rank's vote starts (later than
        scheduled if the previous vote ran over, or the thread was late)."""
        at = t0[0] + k * args.period
        while (left := at - time.time()) > 0:  # the simulated step's end (pacing, not synchronisation)
            stop.wait(left)
        now = time.time()
        late.append(now - at)
        return now

    def simulate(r: int, store, protocol, learn) -> None:
        """Simulated rank ``r``: begin and vote every iteration in ``store``, then wait there for the failure's
        generation to end, ``learn`` the new one (returns the bytes it read) and note in the root that it noticed
        (the controller's failure report waits for every survivor's note)."""
        ready()
        try:
            for k in range(1, args.iters + 1):
                at = arrive(k)
                protocol.begin(k)
                protocol.vote(k)
                with lock:
                    latencies.append((r // RANKS_PER_NODE, k, time.time() - at))
        except Exception as exc:  # noqa: BLE001 - a store that gives up (one store at 10K ranks): counted, not hung
            with lock:
                failed.append(f"{type(exc).__name__}: {str(exc)[:120]}")
            return
        finally:
            done_voting()
        try:
            store.wait([keys.abort(0)], timedelta(seconds=FAILURE_BUDGET_S))
            size = learn()
            at = time.time()
            size += len(store.get(keys.abort(0)))
            note_aware(protocol.root, 0, r, at)
        except Exception as exc:  # noqa: BLE001 - it never learned the failure's generation within the budget
            with lock:
                failed.append(f"{type(exc).__name__}: {str(exc)[:120]}")
            return
        with lock:
            learned.append(at)
            read_bytes.append(size)

    if args.design == "current":
        def root():
            return Counting(_client(args.port), root_requests)

        def rank(r: int) -> None:
            ctl = root()

            def learn() -> int:  # the new generation's whole topology, read from the root
                text = ctl.get(keys.topology(int(ctl.get(keys.LATEST))))
                if r % RANKS_PER_NODE == 0:  # parsing costs every rank its own CPU: one per node is parsed here
                    load_topology(json.loads(text))
                return len(text)

            simulate(r, ctl, CommitProtocol(ctl, 0, args.ranks), learn)  # the watchdog's wait too, on the root

        def beats(node: int, store) -> None:
            while halt.pace(HEARTBEAT_S):
                for r in _node_ranks(node):
                    store.set(keys.heartbeat(r), json.dumps(watchdog.beat()))

        agents = [_agent(root(), _node_ranks(n), fenced) for n in mine]
        ranks = [r for n in mine for r in _node_ranks(n)]
        connected = threading.Barrier(len(ranks) + 1)
        beat_threads = [threading.Thread(target=beats, args=(n, root()), daemon=True) for n in mine]
        for t in beat_threads:
            t.start()
        _run_agents(agents, halt)
        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in ranks]
        for t in threads:
            t.start()
        relays = []
    else:

        # The worker's nodes keep their stores in one server, each under its own prefix: one event loop thread
        # answers them all, as a node's own store would on the node's own CPUs.
        nodes_server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=CLIENT_TIMEOUT_S),
                                     wait_for_workers=False)

        def node_store(n: int):
            return lambda t=CLIENT_TIMEOUT_S: dist.PrefixStore(f"node{n}/", _client(nodes_server.port, t))

        relays = {n: NodeRelay(lambda t: _client(args.port, t), n, node_store(n), beat_s=NODE_BEAT_S,
                               ranks=lambda: RANKS_PER_NODE,
                               wrap_root=lambda s: Counting(s, root_requests))
                  for n in mine}
        for relay in relays.values():
            if not relay.wait_ready(CLIENT_TIMEOUT_S):
                raise RuntimeError(f"node {relay.node_rank}'s relay did not connect")
        real = mine[0]
        start = make_topology(TP, args.ranks // TP, {"layer": 80})

        def rank(r: int) -> None:
            local = relays[real].open_local(CLIENT_TIMEOUT_S)
            protocol = CommitProtocol(local, 0, args.ranks, node=NodeShare(members=RANKS_PER_NODE, nodes=nodes),
                                      root=Counting(_client(args.port), root_requests))

            def learn() -> int:  # what changed, from the node store: the topology is computed from it
                latest = int(local.get(keys.LATEST))
                info = local.get(keys.info(latest))
                if r % RANKS_PER_NODE == 0:  # computing costs every rank its own CPU: one per node computes here
                    published_topology(start, json.loads(info), latest)
                return len(info)

            protocol.form()  # every generation begins with its formation; not timed
            simulate(r, local, protocol, learn)

        def others(part: list[int]) -> None:
            """Other nodes: at the arrival time, each node's last voter carries the node's vote to the root and
            fetches the decision there (in parallel threads, as nodes do; the last, which only the harness can know).
            What a node's ranks do in its own store (their counts, the decision brought in, their waits for it)
            runs on that node's own CPUs on a cluster: not here, where 1,250 nodes share 2 cores."""
            share = NodeShare(members=RANKS_PER_NODE, nodes=nodes)
            protocols = [CommitProtocol(relays[n].open_local(CLIENT_TIMEOUT_S), 0, args.ranks, node=share,
                                        root=Counting(_client(args.port), root_requests)) for n in part]
            for protocol in protocols:  # the formation, not timed
                protocol.carry_ready()
            for protocol in protocols:
                protocol.bring(keys.formed(0))  # into the node store, where the relay and its end look
            ready()
            for k in range(1, args.iters + 1):
                at = arrive(k)
                for protocol in protocols:
                    protocol.carry_vote(k)
                for protocol in protocols:
                    protocol.fetch(keys.decision(0, k))
                    with lock:
                        node_latencies.append(time.time() - at)
            for n, protocol in zip(part, protocols):  # the failure: each of the node's ranks notes it in the root
                if relays[n].wait_ended(0, FAILURE_BUDGET_S):
                    for r in _node_ranks(n):
                        note_aware(protocol.root, 0, r, time.time())

        ranks = _node_ranks(real)
        simulated = [n for n in mine if n != real]
        parts = [simulated[i::DRIVERS] for i in range(DRIVERS) if simulated[i::DRIVERS]]
        connected = threading.Barrier(len(ranks) + len(parts) + 1)
        heartbeats = [watchdog.Heartbeat(relays[real].open_local, r, HEARTBEAT_S) for r in ranks]
        agents = [_agent(relays[real].open_local(CLIENT_TIMEOUT_S), ranks, fenced)]
        _run_agents(agents, halt)
        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in ranks]
        threads += [threading.Thread(target=others, args=(part,), daemon=True) for part in parts]
        for t in threads:
            t.start()
    still_voting.append(len(ranks))
    connected.wait()
    gc.freeze()  # what setup made lives to the end: the collector skips it (a thousand relays' objects made a pass of
    # it take a second, on whichever thread triggered it)
    print(json.dumps({"ready": True}), flush=True)
    t0.append(float(sys.stdin.readline()))
    counted_from = (_cpu_s(os.getpid()), root_requests[0])
    go.set()
    voted.wait(CLIENT_TIMEOUT_S)
    vote_requests = root_requests[0] - counted_from[1]  # what follows is the failure's
    deadline = time.monotonic() + FAILURE_BUDGET_S  # then the failure: ranks not done by then never learned it
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for relay in relays.values() if args.design == "two_level" else ():  # every node store, not only the real node's
        relay.wait_ended(0, max(0.0, deadline - time.monotonic()))
    stop.set()
    halt.halted = True
    slowest: dict[tuple[int, int], float] = {}  # (node, iteration) -> its slowest rank's vote, for the real ranks
    for node, k, latency in latencies:
        slowest[node, k] = max(slowest.get((node, k), 0.0), latency)
    record = {"failed": failed, "latencies": [latency for _, _, latency in latencies],
              "node_latencies": node_latencies + list(slowest.values()), "late": late, "fenced": len(fenced),
              "fence_causes": [c for _, c in fenced][:3],
              "oldest_beat_s": max((a.oldest_beat_s for a in agents), default=0.0), "learned": learned,
              "read_bytes": read_bytes, "simulated": len(ranks), "requests": vote_requests,
              "failure_requests": root_requests[0] - counted_from[1] - vote_requests,
              "cpu_s": _cpu_s(os.getpid()) - counted_from[0]}
    if args.design == "two_level":
        record["ended_at"] = [r.ended_at.get(0) for r in relays.values()]
        record["relay_errors"] = [e for r in relays.values() for e in r.errors]
        for heartbeat in heartbeats:
            heartbeat.stop()
    return record  # the relays' threads are left to os._exit


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


def run(design: str, ranks: int, iters: int, period: float) -> dict:
    """One row: ``design`` at ``ranks`` simulated ranks, ``iters`` iterations, then one death."""

    server = _spawn(["serve"])
    workers: list[subprocess.Popen] = []
    try:
        port = int(server.stdout.readline())
        root = _client(port)
        start = make_topology(TP, ranks // TP, {"layer": 80})
        noted: list[float] = []  # when the controller's failure report had every survivor's note (it waits 10 s)

        def emit(event: dict) -> None:
            if event.get("event") == "rank_failed" and event["detect_s"] is not None:
                noted.append(time.time())
        controller = Controller(root, start, min_tp=1, policy="drop_replica", say=lambda _: None, emit=emit)
        count = min(WORKERS, ranks // RANKS_PER_NODE)
        workers += [_spawn(["worker", "--design", design, "--ranks", str(ranks), "--index", str(i), "--workers",
                            str(count), "--port", str(port), "--iters", str(iters), "--period", str(period)])
                    for i in range(count)]
        setup = time.time()
        for w in workers:
            if json.loads(w.stdout.readline()).get("ready") is not True:
                raise RuntimeError("a worker failed to start")
        setup_s = time.time() - setup
        t0 = time.time() + 1.0
        for w in workers:
            w.stdin.write(f"{t0}\n")
            w.stdin.flush()
        cpu_store = _cpu_s(server.pid)
        monitor_requests = [0]
        monitor = Counting(_client(port), monitor_requests)
        oldest_node_beat = 0.0
        node_keys = [keys.node_beat(n) for n in range(ranks // RANKS_PER_NODE)]
        end_votes = t0 + iters * period
        give_up = end_votes + CLIENT_TIMEOUT_S  # a rank whose store call timed out votes no more: no decision comes
        while (time.time() < end_votes + 0.5 or not root.check([keys.decision(0, iters)])) and time.time() < give_up:
            if design == "two_level":  # the controller's look at every node's heartbeat: one request
                now = time.time()
                beats = [json.loads(v)["t"] for v in monitor.multi_get(node_keys)]
                oldest_node_beat = max(oldest_node_beat, now - min(beats))
            time.sleep(NODE_POLL_S if design == "two_level" else AGENT_POLL_S)
        votes_done = time.time()
        print(f"control plane {design} {ranks} ranks: {iters} iterations voted in {votes_done - t0:.1f} s",
              file=sys.stderr)
        died = time.time()
        assert controller.handle([Death(ranks - 1, died, "killed (simulated)")]) is None
        budget = CLIENT_TIMEOUT_S + 2 * FAILURE_BUDGET_S
        records = [json.loads(w.communicate(timeout=budget)[0].strip().splitlines()[-1]) for w in workers]
        controller.close()  # its failure report, which waited for every survivor's note
        cpu_store = _cpu_s(server.pid) - cpu_store
        server.stdin.close()
        server.wait(30)
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
        window = votes_done - t0
        requests = sum(r["requests"] for r in records) + monitor_requests[0]  # while the ranks voted
        return {"design": design, "ranks": ranks, "nodes": ranks // RANKS_PER_NODE, "iterations": iters,
                "vote_p50_ms": 1e3 * _pct(latencies, 0.5), "vote_p99_ms": 1e3 * _pct(latencies, 0.99),
                "votes_timed": len(latencies),
                "node_vote_p99_ms": 1e3 * _pct(node_latencies, 0.99), "node_votes_timed": len(node_latencies),
                "heartbeat_staleness_max_s": max([r["oldest_beat_s"] for r in records] + [oldest_node_beat]),
                "requests_per_s": requests / window, "requests_per_iteration": requests / iters,
                "failure_requests": sum(r["failure_requests"] for r in records),
                "false_fences": sum(r["fenced"] for r in records),
                "fence_causes": [c for r in records for c in r["fence_causes"]][:3],
                "failure_to_generation_s": max(learned) - died if learned and everyone else None, **spread,
                "survivors_noted_s": noted[0] - died if noted else None,
                "learned_generation": len(learned) if everyone else f"{len(learned)} (not every rank within "
                                                                      f"{FAILURE_BUDGET_S:.0f} s)",
                "generation_bytes_per_rank": max((b for r in records for b in r["read_bytes"]), default=None),
                "arrival_late_p99_ms": 1e3 * _pct([x for r in records for x in r["late"]], 0.99),
                "harness_cpu_s": sum(r["cpu_s"] for r in records), "store_cpu_s": cpu_store, "wall_s": window,
                "setup_s": setup_s, "relay_errors": [e for r in records for e in r.get("relay_errors", [])],
                "ranks_failed": sum(len(r["failed"]) for r in records),
                "failures_seen": sorted({f for r in records for f in r["failed"]})[:3]}
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
