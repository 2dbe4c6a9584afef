"""``ntp-launch``: starts a job's rank processes, hosts its store, relays logs, reports and cleans up.

The launcher owns the ``TCPStore`` (so no rank, rank 0 included, takes it down by dying) and the metrics
sink. It prefixes each rank's output with ``[rank N]``, and when a rank exits non-zero it says which rank
failed and how (exit code or signal), stops every other rank, and exits non-zero. Ctrl-C does the same.
Children die with the launcher even if it is killed outright (``PR_SET_PDEATHSIG``), so nothing is left
behind.

Multi-node: run one launcher per node with the same ``--nnodes`` and ``--store-host/--store-port``; node 0
hosts the store and the metrics sink, every node starts the ranks of its replicas, each on its slot's device
(:mod:`ntp_megatron.placement`), and replacements for them. A failing node sets an abort key in the store so
the other launchers stop their ranks too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import IO, Optional, Sequence

from ntp_megatron.config import JobConfig, load_job_config
from ntp_megatron.elastic import keys as elastic_keys
from ntp_megatron.elastic.watchdog import wait_for_port
from ntp_megatron import faults, megatron_flags, metrics, preflight
from ntp_megatron.preflight import pin_checkpoint_load
from ntp_megatron.config_io import EXIT_CONFIG_ERROR, ConfigError
from ntp_megatron.placement import Placement, launch_slots
from ntp_megatron.training import runtime

ABORT_KEY = "launcher/abort"
STOP_KEY = elastic_keys.STOP
DEATHS_KEY = elastic_keys.DEATHS
death_key = elastic_keys.death
STOP_GRACE_S = 5.0
POLL_S = 0.02
DEBOUNCE_S = 0.05
"""Deaths within this long of each other are handled as one failure (one new generation)."""
NODE_WAIT_FRACTION = 0.8
"""Node 0 waits this fraction of ``parallel.timeout_s`` for the other nodes, so that its message comes before
its ranks' rendezvous times out."""
NODE_WAIT_QUIET_S = 1.0
"""Nodes that connect within this long after node 0 started are not worth a "waiting for" line."""
SETTLE_S = 2.0
"""NTP off, several nodes: how long a launcher waits for the other nodes' reports of a failure before it names
the failed rank from what it has (the first death that is not an echo of another)."""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    if returncode == runtime.EXIT_PEER_FAILED:
        return f"stopped after another rank's failure broke its collectives (exit code {returncode})"
    return f"exited with code {returncode}"


def is_echo(death) -> bool:
    """A death caused by another rank's (:data:`runtime.EXIT_PEER_FAILED`), not a failure of its own."""
    return death.cause == describe_exit(runtime.EXIT_PEER_FAILED)


class RankProcess:
    """One rank process (forked on CPU; spawned where CUDA may be used, and for restarts and replacements): pid,
    output streams, exit status once reaped."""

    def __init__(self, rank: int, pid: int, stdout: IO[str], stderr: IO[str]) -> None:
        self.rank, self.pid = rank, pid
        self.stdout, self.stderr = stdout, stderr
        self.returncode: Optional[int] = None
        self.threads: list[threading.Thread] = []
        self._done = threading.Event()

    @classmethod
    def from_fds(cls, rank: int, pid: int, stdout_fd: int, stderr_fd: int) -> "RankProcess":
        return cls(rank, pid, os.fdopen(stdout_fd, "r", encoding="utf-8", errors="replace"),
                   os.fdopen(stderr_fd, "r", encoding="utf-8", errors="replace"))

    def reap(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)
        self._done.set()
        return self.returncode

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _run_rank_in_child(env: dict[str, str], stdout_w: int, stderr_w: int, close_fds: list[int]) -> None:
    """The forked child: become its own session, route output to the pipes, run ``ntp-pretrain``, exit.

    Never returns; nothing of the launcher (threads, store, sink) exists yet when ranks are forked.
    """
    code = 1
    try:
        os.setsid()
        runtime.become_rank_process(int(env[runtime.ENV_RANK]))
        os.dup2(stdout_w, 1)
        os.dup2(stderr_w, 2)
        for fd in [stdout_w, stderr_w, *close_fds]:
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        from ntp_megatron.training import pretrain

        code = pretrain.main()
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a rank's crash must become its exit code, with the traceback
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


class Launcher:
    def __init__(self, cfg: JobConfig, config_path: Path, args: argparse.Namespace,
                 failures: list[faults.FailureSpec], start=None) -> None:
        """``start``: the checkpoint the run resumes from (:class:`ntp_megatron.training.checkpoint.Progress`)."""
        self.cfg = cfg
        self.start = start
        self.failures = failures
        self.config_path = config_path
        self.args = args
        self.world_size = cfg.world_size
        self._place(cfg)
        self.ranks: dict[int, RankProcess] = {}
        self.exits: queue.Queue[tuple[RankProcess, int]] = queue.Queue()
        self.sink: Optional[metrics.MetricsSink] = None
        self.print_lock = threading.Lock()
        self.controller = None
        self.restarts = 0
        self.agent = None
        self.replacements: dict[int, float] = {}
        """Launch rank -> when to start a replacement process for it (NTP with ntp.rejoin_after_s)."""
        self.rejoin_attempts: dict[int, int] = {}
        self.training_done = False
        self.pid_history: dict[str, list[int]] = {}

    def _place(self, cfg: JobConfig) -> None:
        """This node's launch ranks and the local device of each (:mod:`ntp_megatron.placement`): every slot has a
        fixed device of a fixed node, live or not, so a dead slot leaves its device idle and a replacement starts
        on the same device. Every node computes the same map from the config alone."""
        p = cfg.parallel
        placement = Placement(p.tensor_model_parallel_size, p.data_parallel_size, self.args.nnodes)
        slots = launch_slots(p.tensor_model_parallel_size, p.data_parallel_size,
                             cfg.topology() if cfg.ntp.enabled else None)
        if not placement.node_ranks(0, slots):
            raise ConfigError(f"node 0 (which hosts the store and the controller) would run no rank: its replicas "
                              f"{list(placement.replicas_on(0))} are all dropped (ntp.dropped_replicas); "
                              f"drop replicas of other nodes, or use fewer --nnodes")
        self.placement, self.launch_slots = placement, slots
        self.devices: dict[int, int] = placement.node_ranks(self.args.node_rank, slots)
        """Launch rank -> local device index (``LOCAL_RANK``), for the ranks this node runs."""
        self.local_ranks = list(self.devices)

    def _where(self) -> str:
        """Where this node's ranks run, for the start message: which local devices, and which stay idle."""
        idle = [i for i in range(self.placement.devices_per_node) if i not in self.devices.values()]
        if self.args.nnodes == 1 and not idle:
            return ""
        used = _spans(sorted(self.devices.values())) or "none"
        idle_text = f" (device{'s' if len(idle) > 1 else ''} {_spans(idle)} idle)" if idle else ""
        return f" on node {self.args.node_rank}, devices {used}{idle_text}"

    # -- output ------------------------------------------------------------------------------------
    def _say(self, message: str) -> None:
        with self.print_lock:
            print(f"ntp-launch: {message}", file=sys.stderr, flush=True)

    def _emit(self, record: dict) -> None:
        with self.print_lock:
            if self.sink is not None:
                self.sink.write(record)

    def _relay(self, rank: int, stream: IO[str], out: IO[str], restart: int) -> None:
        """``restart``: how many restarts preceded the process; its iteration records say so (the same iteration
        and generation recur in a job restarted from a checkpoint)."""
        prefix = f"[rank {rank}] "
        for line in stream:
            record = metrics.parse(line)
            with self.print_lock:
                if record is not None:
                    if restart and record.get("kind") == "iteration":
                        record["restart"] = restart
                    if self.sink is not None:
                        self.sink.write(record)
                else:
                    out.write(prefix + line)
                    out.flush()

    # -- processes -----------------------------------------------------------------------------------
    def _start_store(self, port: int):
        import torch.distributed as dist

        a = self.args
        timeout = timedelta(seconds=self.cfg.parallel.timeout_s)
        is_server = a.node_rank == 0
        return dist.TCPStore(a.store_host, port, None, is_server, timeout=timeout, wait_for_workers=False)

    def _join_store(self):
        """Host the store (node 0) or connect to node 0's, saying so while it waits; then announce this node."""
        a = self.args
        if a.node_rank > 0:
            try:
                wait_for_port(a.store_host, self.store_port, 0.0)
            except TimeoutError:
                self._say(f"waiting for node 0 of {a.nnodes} at {a.store_host}:{self.store_port}")
                wait_for_port(a.store_host, self.store_port, self.cfg.parallel.timeout_s)
        store = self._start_store(self.store_port)
        store.set(_node_key(a.node_rank), str(os.getpid()))
        return store

    def _wait_for_nodes(self) -> bool:
        """Node 0: wait until every other node's launcher has connected, saying which ones it waits for; at
        ``NODE_WAIT_FRACTION`` of the timeout (before the ranks' own rendezvous gives up) one line and False."""
        a = self.args
        if a.node_rank != 0 or a.nnodes == 1:
            return True
        limit = NODE_WAIT_FRACTION * self.cfg.parallel.timeout_s
        waiting_for: set[int] = set()
        while True:
            missing = [i for i in range(1, a.nnodes) if not _try_check(self.store, _node_key(i))]
            if not missing:
                return True
            waited = time.time() - self.started
            if waited > limit:
                self._say(f"node {missing[0]} of {a.nnodes} did not join within {limit:.0f} s: start ntp-launch "
                          f"with the same config and --nnodes {a.nnodes} --node-rank {missing[0]} --store-host "
                          f"<this host> --store-port {self.store_port} there")
                _set_abort(self.store, f"node {missing[0]} did not join")
                self._stop_all()
                return False
            for i in missing:
                if i not in waiting_for and waited > NODE_WAIT_QUIET_S:
                    self._say(f"waiting for node {i} of {a.nnodes} at {a.store_host}:{self.store_port}")
                    waiting_for.add(i)
            time.sleep(POLL_S * 5)

    def _rank_env(self, rank: int, store_port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            runtime.ENV_RANK: str(rank),
            runtime.ENV_WORLD_SIZE: str(self.world_size),
            runtime.ENV_LOCAL_RANK: str(self.devices[rank]),
            runtime.ENV_STORE_HOST: self.args.store_host,
            runtime.ENV_STORE_PORT: str(store_port),
            runtime.ENV_RUN_DIR: str(self.run_dir),
            runtime.ENV_CONFIG: str(self.config_path),
            runtime.ENV_RESTART: str(self.restarts),
            faults.ENV_FAILURES: faults.to_env(self.failures),
            # Ranks share the machine's cores; one intra-op thread each keeps them from oversubscribing.
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            # Megatron's recommendation for TP communication ordering on GPUs; harmless on CPU.
            "CUDA_DEVICE_MAX_CONNECTIONS": env.get("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
        })
        return env

    def _start_ranks(self, store_port: int) -> dict[int, RankProcess]:
        """This node's ranks: forked where they run on CPU, fresh interpreters where CUDA may be used
        (:func:`ntp_megatron.training.runtime.rank_start_method`)."""
        if runtime.rank_start_method(self.cfg.training.device) == "spawn":
            self._say("CUDA may be used here: ranks start as fresh processes, not forks")
            return {rank: self._spawn_rank(rank, store_port) for rank in self.local_ranks}
        return self._fork_ranks(store_port)

    def _fork_ranks(self, store_port: int) -> dict[int, RankProcess]:
        """Fork every local rank from this process, which has imported torch and Megatron-Core already.

        Called before the launcher starts any thread, store or file writer, so the children inherit none.
        """
        import torch

        if torch.cuda.is_initialized():  # a forked child cannot use a CUDA context made by its parent
            raise RuntimeError("CUDA was initialised in the launcher before forking ranks (by an import?)")
        sys.stdout.flush()
        sys.stderr.flush()
        ranks: dict[int, RankProcess] = {}
        for rank in self.local_ranks:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                inherited = [fd for r in ranks.values() for fd in (r.stdout.fileno(), r.stderr.fileno())]
                _run_rank_in_child(self._rank_env(rank, store_port), out_w, err_w, [out_r, err_r, *inherited])
            os.close(out_w)
            os.close(err_w)
            ranks[rank] = RankProcess.from_fds(rank, pid, out_r, err_r)
        return ranks

    def _spawn_rank(self, rank: int, store_port: int, joining: bool = False) -> RankProcess:
        """Start a rank as a fresh interpreter: the launcher has threads now, and a forked child of a threaded
        process may inherit locks held by threads that do not exist in it. ``joining``: a replacement for a
        failed rank of a running NTP job (it waits to be admitted)."""
        env = self._rank_env(rank, store_port)
        if joining:
            env[runtime.ENV_JOINING] = "1"
        proc = subprocess.Popen([sys.executable, "-m", "ntp_megatron.training.pretrain"],
                                env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        return RankProcess(rank, proc.pid, proc.stdout, proc.stderr)

    def _watch(self, r: RankProcess) -> None:
        for stream, out in ((r.stdout, sys.stdout), (r.stderr, sys.stderr)):
            t = threading.Thread(target=self._relay, args=(r.rank, stream, out, self.restarts), daemon=True)
            t.start()
            r.threads.append(t)
        threading.Thread(target=lambda: self.exits.put((r, r.reap())), daemon=True).start()

    def _dump_stacks(self, launch_ranks: list[int]) -> None:
        """Ask ranks for a traceback of every thread (``faulthandler`` on SIGUSR1), for a report."""
        for rank in launch_ranks:
            proc = self.ranks.get(rank)
            if proc is not None and proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass

    def _record_pids(self) -> None:
        """``ranks.node<n>.json``: every pid each launch rank has had (a restart adds one), for tools and tests
        that must find every process of the job."""
        for r in self.ranks.values():
            self.pid_history.setdefault(str(r.rank), [])
            if r.pid not in self.pid_history[str(r.rank)]:
                self.pid_history[str(r.rank)].append(r.pid)
        (self.run_dir / f"ranks.node{self.args.node_rank}.json").write_text(json.dumps(self.pid_history) + "\n")

    def _stop_all(self) -> None:
        """SIGTERM every live rank's process group, then SIGKILL what is left after a grace period."""
        live = [r for r in self.ranks.values() if r.poll() is None]
        for r in live:
            _signal_group(r.pid, signal.SIGCONT)  # a stopped (hung) rank cannot act on SIGTERM
            _signal_group(r.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for r in live:
            r.wait(timeout=max(0.0, deadline - time.monotonic()))
        for r in self.ranks.values():
            _signal_group(r.pid, signal.SIGKILL)  # also takes any grandchildren left in the group
            r.wait()

    # -- the job -------------------------------------------------------------------------------------
    def run(self) -> int:
        self.run_dir = Path(self.cfg.logging.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.store_port = self.args.store_port or _free_port(self.args.store_host)
        from ntp_megatron.training import pretrain  # the import every forked rank then skips

        if self.args.node_rank == 0:
            # Megatron's dataset index caches are written here, once, before any rank or process group exists;
            # forked ranks inherit the dataset, other nodes' ranks read the caches after node 0's store is up.
            pretrain.prebuild_dataset(self.run_dir, self.cfg)
            from ntp_megatron.training import data

            self._say(data.describe(self.cfg))
        self.ranks = self._start_ranks(self.store_port)
        self._record_pids()
        self.started = time.time()
        try:
            store = self._join_store()
        except Exception as exc:  # noqa: BLE001 - a C++ error from the store: one line instead
            a, why = self.args, str(exc).splitlines()[0][:120]
            if a.node_rank == 0:
                self._say(f"cannot host the store on port {self.store_port} ({why}); is the port in use? choose "
                          "another --store-port")
            else:
                self._say(f"could not reach node 0's store at {a.store_host}:{self.store_port} within "
                          f"{self.cfg.parallel.timeout_s:.0f} s ({why}); is ntp-launch --node-rank 0 running there "
                          f"with --store-port {self.store_port}?")
            for r in self.ranks.values():
                self._watch(r)  # reaps them
            self._stop_all()
            return 1
        self.store = store
        if self.args.node_rank == 0:
            self.metrics_file, self.tensorboard_dir = run_outputs(self.cfg, self.run_dir)
            self.sink = metrics.MetricsSink(self.metrics_file, self.tensorboard_dir)
            self.sink.event("job_started", world_size=self.world_size, tp_per_replica=tp_per_replica(self.cfg))
            if self.cfg.ntp.enabled:
                from ntp_megatron.elastic.controller import Controller

                ntp = self.cfg.ntp
                resume = {} if self.start is None else {
                    "start_iteration": self.start.iteration,
                    "start_consumed": self.start.samples(self.cfg.training.global_batch_size)}
                self.controller = Controller(store, self.cfg.topology(), ntp.min_tp, ntp.on_unrecoverable,
                                             self._say, self._emit, dump_stacks=self._dump_stacks, **resume)
        if self.start is not None:
            self._say(f"resuming from checkpoint {self.start.path} (iteration {self.start.iteration})")
        self._say(f"started ranks {_spans(self.local_ranks) or 'none'} of {self.world_size}{self._where()} "
                  f"(store {self.args.store_host}:{self.store_port}, run dir {self.run_dir})")
        for r in self.ranks.values():
            self._watch(r)

        def on_signal(signum, _frame):
            raise KeyboardInterrupt(signal.Signals(signum).name)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        exit_code = 0
        try:
            exit_code = self._monitor()
        except KeyboardInterrupt as exc:
            self._say(f"interrupted ({exc or 'SIGINT'}): stopping all ranks")
            self._stop_all()
            exit_code = 130
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            for r in self.ranks.values():
                for t in r.threads:
                    t.join(timeout=2.0)
            if self.controller is not None:
                self.controller.close()
            if self.sink is not None:
                self.sink.event("job_ended", exit_code=exit_code)
                self._summarize(exit_code)
                self.sink.close()
        return exit_code

    def _monitor(self) -> int:
        """Wait for the ranks. A death is absorbed by NTP (a new generation), or restarts the job from the last
        checkpoint (NTP off, checkpoints on), or ends the job."""
        self.agent = None
        if not self._wait_for_nodes():
            return 1
        if self.cfg.ntp.enabled or any(not isinstance(f, faults.RankFailure) for f in self.failures):
            from ntp_megatron.elastic.agent import Agent

            self.agent = Agent(self.store, lambda: self.ranks, self.cfg.ntp.heartbeat_timeout_s,
                               startup_grace_s=self.cfg.parallel.timeout_s, specs=self.failures,
                               say=self._say, live=self._live_launch_ranks, fence=self.cfg.ntp.enabled)
        finished: set[int] = set()
        self._remote_deaths_seen = 0
        while True:
            store, agent = self.store, self.agent  # an NTP restart replaces the store
            if agent is not None:
                agent.poll(inject=not self.training_done)
            deaths = self._collect_exits(finished, agent)
            if self.args.nnodes > 1 and self.cfg.ntp.enabled:
                if self.controller is not None:
                    deaths += self._remote_deaths(store)
                elif _try_check(store, STOP_KEY):
                    self._say(f"the job was stopped: {store.get(STOP_KEY).decode()}")
                    self._stop_all()
                    return 1
            if self.args.nnodes > 1 and _try_check(store, ABORT_KEY):
                reason, death = _read_abort(store)
                if death is not None:
                    self._report_failure(death, store)  # the failure the aborting node named
                else:
                    self._say(f"another node aborted the job: {reason}")
                self._stop_all()
                return 1
            if deaths:
                outcome = self._handle_deaths(deaths, store, finished)
                if outcome is not None:
                    return outcome
            if self.cfg.ntp.enabled:
                self._rejoin(self.store, finished)
            running = [r for r in self.ranks.values() if r.poll() is None]
            if not running and not self.replacements:
                self._say(f"all {len(finished)} ranks finished")
                return 0

    def _collect_exits(self, finished: set[int], agent) -> list:
        """Reaped ranks since the last poll; deaths (non-zero exits) as ``Death`` records. A death waits
        ``DEBOUNCE_S`` for its companions, so simultaneous failures make one generation."""
        from ntp_megatron.elastic.controller import Death

        deaths = []
        timeout = POLL_S
        while True:
            try:
                proc, returncode = self.exits.get(timeout=timeout)
            except queue.Empty:
                return deaths
            if proc is not self.ranks.get(proc.rank):
                continue  # a process of an earlier restart
            if returncode == 0:
                finished.add(proc.rank)
                if not self.cfg.ntp.enabled or self._admitted(self.store, proc.rank):
                    self.training_done = True  # a rank of the running generation completed the run (a retired
                continue                       # one, of a dropped replica, exits 0 too)
            when, cause = time.time(), describe_exit(returncode)
            if agent is not None and proc.rank in agent.notes:
                when, cause = agent.notes[proc.rank]
            deaths.append(Death(proc.rank, when, cause, proc.pid))
            timeout = DEBOUNCE_S

    def _live_launch_ranks(self) -> list[int]:
        if self.controller is not None:
            return self.controller.live_launch_ranks()
        return [r for r, p in self.ranks.items() if p.poll() is None]

    def _handle_deaths(self, deaths: list, store, finished: set[int]) -> Optional[int]:
        """None to keep going, or the launcher's exit code."""
        if self.cfg.ntp.enabled:
            # Replacements this node started, or (node 0) another node's, that died before they were admitted.
            booting = [d for d in deaths
                       if (d.launch_rank in self.rejoin_attempts or d.launch_rank not in self.local_ranks)
                       and not self._admitted(store, d.launch_rank)]
            for d in booting:  # a replacement that died before it was admitted: the job never relied on it
                _try_delete(store, elastic_keys.joining(d.launch_rank))  # so that it is never admitted
                if self.controller is None:
                    _try_publish_death(store, d)  # node 0 may have admitted it meanwhile: it decides
                if self.training_done:
                    continue  # stopped by us: the run completed before it was admitted
                self._say(f"replacement for launch rank {d.launch_rank} (pid {d.pid}) {d.cause} before it was "
                          f"admitted; the job goes on without it")
                self._schedule_rejoin(d.launch_rank)
            deaths = [d for d in deaths if d not in booting]
            if not deaths:
                return None
        if self.controller is not None:
            for d in deaths:
                self._say(f"rank {d.launch_rank} (pid {d.pid}) {d.cause}")
            reason = self.controller.handle(deaths)
            if reason is None:
                for d in deaths:
                    self._schedule_rejoin(d.launch_rank)
                return None
            self._say(reason)
            if self.cfg.ntp.on_unrecoverable == "restart":
                if self._can_restart() and self._restart_ntp(finished):
                    return None
                self._say(f"no restart left ({self.restarts} of at most {self.cfg.checkpoint.max_restarts} done)"
                          if self.restarts >= self.cfg.checkpoint.max_restarts else "the job cannot restart")
            self._emit({"kind": "event", "event": "job_stopped", "reason": reason, "time": time.time()})
        elif self.cfg.ntp.enabled:
            # Node 0's launcher runs the controller: report the deaths to it through the store. Replacements start
            # here, on the dead slots' own devices; node 0 admits them.
            for d in deaths:
                self._say(f"rank {d.launch_rank} (pid {d.pid}) {d.cause}")
                _try_publish_death(store, d)
                self._schedule_rejoin(d.launch_rank)
            return None
        else:
            # Without NTP the dead rank's peers stop right after it: report the failure, not its echoes.
            first = self._failure_behind(deaths, store)
            self._report_failure(first, store)
            if self._can_restart():
                return self._restart(store)
            deaths = [first]
        _set_abort(store, "; ".join(f"rank {d.launch_rank} {d.cause}" for d in deaths),
                   deaths[0] if len(deaths) == 1 else None)
        live = sum(r.poll() is None for r in self.ranks.values())
        self._say(f"stopping the other {live} local rank(s)")
        self._stop_all()
        self._say("all ranks stopped")
        return 1

    def _failure_behind(self, local: list, store):
        """NTP off: the death the others echo — an injected failure's, else one that is not an echo
        (:func:`is_echo`), else the earliest. With several nodes every launcher publishes its deaths in the store
        and waits up to ``SETTLE_S`` for one that is not an echo, so each names the same rank whichever node's
        deaths it saw first."""
        from ntp_megatron.elastic.controller import injected_failure

        deaths = list(local)
        if all(is_echo(d) for d in deaths):
            deaths += self._stalled_ranks()
        if self.args.nnodes > 1:
            for d in deaths:
                _try_publish_death(store, d)
            deadline = time.monotonic() + SETTLE_S
            while not any(not is_echo(d) for d in deaths) and time.monotonic() < deadline:
                time.sleep(POLL_S)
                _, decided = _read_abort(store)
                if decided is not None:  # another node has named the failure already
                    return decided
                try:
                    deaths = _published_deaths(store) or deaths
                except Exception:  # noqa: BLE001 - node 0 and its store are gone: decide from what is known
                    break
        return min(deaths, key=lambda d: (injected_failure(store, d.launch_rank) is None, is_echo(d), d.time))

    def _stalled_ranks(self) -> list:
        """Local ranks still alive but stopped (SIGSTOP, a hang): when every death is an echo, the rank its peers
        were waiting for is one of these."""
        from ntp_megatron.elastic.controller import Death

        out = []
        for r in self.ranks.values():
            if r.poll() is None and _process_state(r.pid) in ("T", "t"):
                out.append(Death(r.rank, time.time(), "is stopped (hung): its peers' collectives timed out", r.pid))
        return out

    def _report_failure(self, death, store) -> None:
        """Say which rank failed (another node's: say so) and record it as a ``rank_failed`` event (node 0)."""
        from ntp_megatron.elastic.controller import injected_failure

        where = "" if death.launch_rank in self.local_ranks else "another node aborted the job: "
        self._say(f"{where}rank {death.launch_rank} (pid {death.pid}) {death.cause}")
        record = injected_failure(store, death.launch_rank) or {}
        self._emit({"kind": "event", "event": "rank_failed", "launch_rank": death.launch_rank,
                    "cause": death.cause, "time": record.get("time", death.time),
                    "iteration": record.get("iteration"), "phase": record.get("phase", "unknown")})

    def _schedule_rejoin(self, launch_rank: int) -> None:
        """Plan a replacement for a failed rank after the repair delay, a bounded number of times."""
        after = self.cfg.ntp.rejoin_after_s
        if after is None or launch_rank not in self.local_ranks:
            return
        attempts = self.rejoin_attempts.get(launch_rank, 0)
        if attempts >= self.cfg.ntp.max_rejoin_attempts:
            self._say(f"launch rank {launch_rank}: {attempts} replacements failed; its replica stays degraded")
            return
        self.replacements[launch_rank] = time.time() + after

    def _rejoin(self, store, finished: set[int]) -> None:
        """Start replacements that are due; admit the ones that announced themselves (node 0). Once the run is
        complete, replacements still waiting to be admitted are stopped: there is nothing left to join."""
        if self.training_done:
            self.replacements.clear()
            for rank in self.rejoin_attempts:
                proc = self.ranks.get(rank)
                if proc is not None and proc.poll() is None and not self._admitted(store, rank):
                    _signal_group(proc.pid, signal.SIGTERM)
            return
        now = time.time()
        for rank, due in list(self.replacements.items()):
            if now >= due:
                del self.replacements[rank]
                self.rejoin_attempts[rank] = self.rejoin_attempts.get(rank, 0) + 1
                if self.agent is not None:
                    self.agent.forget(rank)
                proc = self._spawn_rank(rank, self.store_port, joining=True)
                self.ranks[rank] = proc
                self._record_pids()
                self._watch(proc)
                self._emit({"kind": "event", "event": "replacement_started", "launch_rank": rank, "pid": proc.pid,
                            "attempt": self.rejoin_attempts[rank], "time": now})
                self._say(f"starting a replacement for launch rank {rank} (pid {proc.pid}, attempt "
                          f"{self.rejoin_attempts[rank]} of {self.cfg.ntp.max_rejoin_attempts})")
        if self.controller is None or self.cfg.ntp.rejoin_after_s is None:
            return
        # Any node's replacements: each announces itself in the store.
        ready = [lr for lr in self.controller.identity if not self._admitted(store, lr)
                 and _try_check(store, elastic_keys.joining(lr))]
        if ready and self.controller.admit(ready):
            for lr in ready:
                store.delete_key(elastic_keys.joining(lr))

    def _admitted(self, store, launch_rank: int) -> bool:
        """Whether ``launch_rank``'s slot is live in the newest published generation: node 0's controller knows,
        other nodes read it from the store (False if they cannot)."""
        if self.controller is not None:
            return self.controller.latest.rank_of(*self.controller.identity[launch_rank]) is not None
        from ntp_megatron.layout import Topology

        if not _try_check(store, elastic_keys.LATEST):  # a get would wait for it
            return False
        try:
            latest = int(store.get(elastic_keys.LATEST).decode())
            topology = Topology.from_json(json.loads(store.get(elastic_keys.topology(latest)).decode()))
        except Exception:  # noqa: BLE001 - the store may be gone at the end of the run
            return False
        return topology.rank_of(*self.launch_slots[launch_rank]) is not None

    def _remote_deaths(self, store) -> list:
        """Deaths other nodes' launchers reported since the last poll (node 0)."""
        out = []
        reported = int(store.add(DEATHS_KEY, 0))
        while self._remote_deaths_seen < reported:
            self._remote_deaths_seen += 1
            death = _published_death(store, self._remote_deaths_seen)
            self._say(f"node report: launch rank {death.launch_rank} {death.cause}")
            out.append(death)
        return out

    def _can_restart(self) -> bool:
        ck = self.cfg.checkpoint
        return ck.save is not None and self.restarts < ck.max_restarts and self.args.nnodes == 1

    def _restart(self, store) -> Optional[int]:
        """The restart-from-checkpoint baseline: stop every rank, start them all again (fresh processes), and
        resume from the newest checkpoint in ``checkpoint.save``."""
        self.restarts += 1
        self._say(f"restarting all {self.world_size} ranks from the last checkpoint in {self.cfg.checkpoint.save} "
                  f"(restart {self.restarts} of at most {self.cfg.checkpoint.max_restarts})")
        self._stop_all()
        self._emit({"kind": "event", "event": "restarted", "restart": self.restarts, "time": time.time()})
        self._respawn_ranks()
        return None

    def _respawn_ranks(self) -> None:
        """A fresh process for every local rank (spawned: the launcher has threads now), watched."""
        self.ranks = {rank: self._spawn_rank(rank, self.store_port) for rank in self.local_ranks}
        self._record_pids()
        for r in self.ranks.values():
            self._watch(r)

    def _restart_ntp(self, finished: set[int]) -> bool:
        """``ntp.on_unrecoverable: restart``: stop every rank and start the job again from the newest checkpoint,
        on fresh processes for the slots that survived: each replica with its live slots, replicas below
        ``ntp.min_tp`` dropped (:func:`ntp_megatron.layout.restart_layout`), the global batch and data order
        unchanged. The restarted job has its own launch ranks (0..), store and controller; injected failures that
        fired stay fired. False if no layout or configuration is possible (the caller stops the job)."""
        from ntp_megatron.elastic.controller import Controller
        from ntp_megatron.layout import TopologyError, restart_layout
        from ntp_megatron.training import checkpoint

        c, p = self.controller, self.cfg.parallel
        live = [c.identity[lr] for lr in sorted(c.identity) if lr not in c.dead]
        try:
            dropped, dead_slots = restart_layout(p.tensor_model_parallel_size, p.data_parallel_size, live,
                                                 self.cfg.ntp.min_tp)
            data = self.cfg.model_dump()
            data["ntp"]["dropped_replicas"] = dropped
            data["ntp"]["dead_slots"] = [f"{r}:{s}" for r, s in dead_slots]
            if checkpoint.resolve_load_dir(Path(self.cfg.checkpoint.save)) is not None:
                data["checkpoint"]["load"] = self.cfg.checkpoint.save
            cfg = JobConfig.model_validate(data)
            start = pin_checkpoint_load(cfg)
        except (TopologyError, ValueError, ConfigError) as exc:
            self._say(f"cannot restart on the surviving processes: {exc}")
            return False
        self.restarts += 1
        at = f"checkpoint {start.path} (iteration {start.iteration})" if start else "the start (no checkpoint yet)"
        self._say(f"restarting from {at} with {cfg.world_size} fresh processes for the surviving slots: TP per "
                  f"replica {tp_per_replica(cfg)} (restart {self.restarts} of at most {cfg.checkpoint.max_restarts})")
        self._stop_all()
        c.close()
        fired = [spec for spec in self.failures if _try_check(self.store, elastic_keys.fired(str(spec)))]
        self.cfg, self.start, self.world_size = cfg, start, cfg.world_size
        self._place(cfg)  # one node: every surviving slot keeps its device
        self.config_path = self.run_dir / f"config.node0.restart{self.restarts}.json"
        self.config_path.write_text(cfg.model_dump_json(indent=2))
        self.store_port = _free_port(self.args.store_host)
        self.store = self._start_store(self.store_port)
        for spec in fired:
            self.store.set(elastic_keys.fired(str(spec)), "1")
        resume = {} if start is None else {"start_iteration": start.iteration,
                                           "start_consumed": start.samples(cfg.training.global_batch_size)}
        self.controller = Controller(self.store, cfg.topology(), cfg.ntp.min_tp, cfg.ntp.on_unrecoverable,
                                     self._say, self._emit, dump_stacks=self._dump_stacks, **resume)
        self.replacements.clear()
        self.rejoin_attempts.clear()
        finished.clear()
        self.training_done = False
        self._respawn_ranks()
        if self.agent is not None:
            self.agent.restart(self.store)
        self._emit({"kind": "event", "event": "restarted", "restart": self.restarts, "time": time.time(),
                    "iteration": start.iteration if start else 0, "tp_per_replica": tp_per_replica(cfg)})
        return True

    def _summarize(self, exit_code: int) -> None:
        """The end-of-run summary (goodput, iterations lost) and ``<run_dir>/run.png``."""
        from ntp_megatron import run_report

        summary = run_report.summarize(self.sink.records, wall_s=time.time() - self.started)
        self.sink.write({"kind": "event", "event": "job_summary", "time": time.time(), **summary})
        for line in run_report.summary_lines(summary):
            self._say(line)
        saves = [r for r in self.sink.records if r.get("event") == "checkpoint_saved"]
        if saves:
            self._say(f"checkpoints: {Path(self.cfg.checkpoint.save).resolve()} (latest: iteration "
                      f"{saves[-1]['iteration']})")
        self._say(f"metrics: {self.metrics_file or 'off'} | tensorboard: {self.tensorboard_dir or 'off'}")
        try:
            path = run_report.plot(self.sink.records, self.run_dir / "run.png")
            if path is not None:
                self._say(f"run plot: {path}")
        except Exception as exc:  # noqa: BLE001 - a plot must never fail a run
            self._say(f"could not draw the run plot: {exc}")


def run_outputs(cfg: JobConfig, run_dir: Path) -> tuple[Optional[Path], Optional[Path]]:
    """The metrics file (default ``<run_dir>/metrics.jsonl``, appended to) and this run's TensorBoard directory
    (default ``<run_dir>/tensorboard/<start time>``: each run its own series, so two runs in one run dir do not
    merge into one whose steps restart); the empty string switches either off."""
    lg = cfg.logging
    metrics_file = None if lg.metrics_file == "" else Path(lg.metrics_file or run_dir / "metrics.jsonl").resolve()
    tb_dir = None
    if lg.tensorboard_dir != "":
        tb_dir = Path(lg.tensorboard_dir).resolve() if lg.tensorboard_dir else (
            run_dir / "tensorboard" / time.strftime("%Y%m%d-%H%M%S"))
    return metrics_file, tb_dir


def tp_per_replica(cfg: JobConfig) -> list[int]:
    """TP degree per replica index (0: a dropped replica), as the iteration records give it."""
    if cfg.ntp.enabled:
        widths = {replica.index: replica.width for replica in cfg.topology().replicas}
        return [widths.get(r, 0) for r in range(cfg.parallel.data_parallel_size)]
    return [cfg.parallel.tensor_model_parallel_size] * cfg.parallel.data_parallel_size


def _spans(numbers: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs)


def _node_key(node: int) -> str:
    return f"launcher/node{node}"


def _try_publish_death(store, death) -> None:
    """Append a death to the job's list in the store, for node 0's controller (NTP) or every node (NTP off)."""
    try:
        n = store.add(DEATHS_KEY, 1)
        store.set(death_key(n), json.dumps(dataclasses.asdict(death)))
    except Exception:  # noqa: BLE001 - the store may be unreachable on a failing node; reporting must not crash
        pass


def _published_death(store, n: int):
    """The ``n``-th death (1-based) any node published (:func:`_try_publish_death`)."""
    from ntp_megatron.elastic.controller import Death

    return Death(**json.loads(store.get(death_key(n))))


def _published_deaths(store) -> list:
    """Every death any node has published so far (raises if the store is unreachable)."""
    return [_published_death(store, n) for n in range(1, int(store.add(DEATHS_KEY, 0)) + 1)]


def _set_abort(store, reason: str, death=None) -> None:
    """Tell every node to stop: why, and the failure this node named (so they all name the same one)."""
    _try_set(store, ABORT_KEY, json.dumps({"reason": reason,
                                           "death": dataclasses.asdict(death) if death is not None else None}))


def _read_abort(store) -> tuple[Optional[str], object]:
    """(reason, the named failure as a ``Death`` or None) if a node has aborted the job, else (None, None)."""
    from ntp_megatron.elastic.controller import Death

    if not _try_check(store, ABORT_KEY):
        return None, None
    try:
        record = json.loads(store.get(ABORT_KEY).decode())
    except Exception:  # noqa: BLE001
        return "unknown", None
    return record["reason"], Death(**record["death"]) if record.get("death") else None


def _process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` ("R", "S", "T" stopped, ...), "" if unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _try_set(store, key: str, value: str) -> None:
    try:
        store.set(key, value)
    except Exception:  # the store may be unreachable on a failing node; reporting must not crash
        pass


def _try_delete(store, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception:  # noqa: BLE001
        pass


def _try_check(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:
        return False


# -- command line ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ntp-launch",
        description="Start a GPT pretraining job on Megatron-Core with ntp-megatron. Other --flags are "
                    "Megatron-style: --train-iters 20 is --set training.train_iters=20 (list below). Paths are "
                    "relative to the current directory.",
        epilog=megatron_flags.help_text(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, default=None, help="YAML job config (default: configs/tiny_cpu.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallel.tensor_model_parallel_size=2")
    p.add_argument("--metrics-file", type=Path, default=None, help="JSON lines: one per iteration and event")
    p.add_argument("--inject-failure", dest="failures", action="append", default=[], metavar="SPEC",
                   help="ACTION:rank=R,iter=N[,phase=P][,code=C] (ACTION in kill, hang, exit; P in "
                        + ", ".join(faults.PHASES) + "), kill:rank=R,after=S, or random:mtbf=S[,seed=K][,max=M]"
                        "[,action=kill|hang]; R is a launch rank; repeatable; replaces faults.inject of the config")
    p.add_argument("--run-dir", type=Path, default=None, help="override logging.run_dir")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes in the job: run one ntp-launch per node, all with the same config, --nnodes, "
                        "--store-host and --store-port (default 1)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index, 0..NNODES-1; node 0 hosts the store, the metrics and the controller")
    p.add_argument("--store-host", default="127.0.0.1", help="host of node 0, which hosts the store")
    p.add_argument("--store-port", type=int, default=0, help="0: any free port (single node only)")
    return p


def resolve_config(args: argparse.Namespace, extra: Sequence[str]) -> JobConfig:
    overrides = list(args.overrides) + megatron_flags.translate(extra)
    if args.metrics_file is not None:
        overrides.append(f"logging.metrics_file={json.dumps(str(args.metrics_file))}")
    if args.run_dir is not None:
        overrides.append(f"logging.run_dir={json.dumps(str(args.run_dir))}")
    return load_job_config(args.config, overrides)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if not 0 <= args.node_rank < args.nnodes:
            raise ConfigError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
        if args.nnodes > 1 and args.store_port == 0:
            raise ConfigError("--store-port must be a fixed port when --nnodes > 1")
        cfg = resolve_config(args, extra)
        if cfg.ntp.enabled and cfg.ntp.on_unrecoverable == "restart" and args.nnodes > 1:
            raise ConfigError(f"ntp.on_unrecoverable 'restart' runs on one node only (got --nnodes {args.nnodes}); "
                              "use drop_replica or stop")
        preflight.check_data(cfg)
        preflight.check_device(cfg)
        preflight.check_checkpoint_save(cfg)
        start, note = preflight.resume_point(cfg)
        if note:
            print(f"ntp-launch: {note}", file=sys.stderr)
        done = preflight.nothing_to_do(cfg, start)
        if done:
            print(f"ntp-launch: {done}", file=sys.stderr)
            return 0
        specs = args.failures if args.failures else cfg.faults.inject
        checkpoints = cfg.checkpoint.save is not None and cfg.checkpoint.save_interval is not None
        eval_interval = cfg.training.eval_interval if cfg.training.evaluates else None
        failures = [faults.parse_failure_spec(f, cfg.world_size, cfg.training.train_iters, checkpoints,
                                              cfg.ntp.enabled, start.iteration if start else 0, eval_interval)
                    for f in specs]
        run_dir = Path(cfg.logging.run_dir).resolve()
        config_path = run_dir / f"config.node{args.node_rank}.json"
        launcher = Launcher(cfg, config_path, args, failures, start)  # refuses a placement before anything is made
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path.write_text(cfg.model_dump_json(indent=2))
    except ConfigError as exc:
        print(f"ntp-launch: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
