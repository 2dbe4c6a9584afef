"""``ntp-launch``: starts a job's rank processes, hosts its store, watches them, reports and cleans up.

The launcher owns the ``TCPStore`` (so no rank, rank 0 included, takes it down by dying) and the metrics
sink. It places this node's ranks on their slots' devices (:mod:`ntp_megatron.plan.placement`), starts them
(:mod:`ntp_megatron.launch.processes`: every process dies with the launcher, even if it is killed outright),
prefixes each rank's output with ``[rank N]``, and watches them: a death goes to the run's policy
(:mod:`ntp_megatron.launch.policy`), which absorbs it (NTP), restarts the job, or names the rank that failed and
how (exit code or signal), stops every other rank and exits non-zero. Ctrl-C exits 130, SIGTERM 143, after
stopping every rank. At the end it summarises the run (goodput, the run plot).

Multi-node: run one launcher per node with the same ``--nnodes`` and ``--store-host``; node 0 hosts the store
(on ``--store-port``, or any free port with 0: it says which, and writes it to ``<run dir>/store.json``) and the
metrics sink, every node starts the ranks of its replicas and replacements for them
(:mod:`ntp_megatron.launch.nodes`). A failing node sets an abort key in the store so the other launchers stop
their ranks too.
"""

from __future__ import annotations

import argparse
import queue
import signal
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ntp_megatron import faults, metrics

from ntp_megatron.launch import describe, rank_env, root_watch, summary

from ntp_megatron.plan import memory_plan
from ntp_megatron.config import timing
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.config.files import EXIT_CONFIG_ERROR, ConfigError
from ntp_megatron.elastic.agent import Agent
from ntp_megatron.elastic.controller import Death
from ntp_megatron.elastic.errors import own_error_cause, reported_error
from ntp_megatron.launch.cli import Job, build_parser, prepare
from ntp_megatron.launch.console import Console, run_outputs
from ntp_megatron.launch.forkserver import ForkServer
from ntp_megatron.launch.nodes import Nodes, host_node_store, host_store, join_failure, write_address
from ntp_megatron.launch.modes import choose
from ntp_megatron.launch.policy import DeathPolicy, ending, tp_per_replica
from ntp_megatron.launch.processes import RankProcesses, describe_exit
from ntp_megatron.plan.placement import Placement, launch_slots
from ntp_megatron.training import runtime



class Launcher:
    def __init__(self, cfg: JobConfig, config_path: Path, args: argparse.Namespace,
                 failures: list[faults.FailureSpec], start=None) -> None:
        """``start``: the checkpoint the run resumes from (:class:`ntp_megatron.training.checkpoint.Progress`)."""
        self.cfg, self.start, self.failures = cfg, start, failures
        self.config_path, self.args = config_path, args
        self.world_size = cfg.world_size
        self._place(cfg)
        self.run_dir = Path(cfg.logging.run_dir).resolve()
        self.console = Console()
        self.nodes = Nodes(args.nnodes, args.node_rank, args.store_host, args.store_port, cfg.parallel.timeout_s,
                           self.console.say, cfg.ntp.node_timeout_s, replaceable=cfg.ntp.enabled)
        self.start_method = runtime.rank_start_method(cfg.training.device)
        """How this node's ranks and warm spares start: ``fork`` (CPU) or ``spawn`` (where CUDA may be used)."""
        self.store = None
        self.node_store = None
        """The store this node's ranks vote, beat and wait in: the root store on one node and on node 0; under NTP
        on other nodes one this launcher hosts, with a relay (:mod:`ntp_megatron.elastic.relay`)."""
        self.relay = None
        self.processes: Optional[RankProcesses] = None
        self.policy: Optional[DeathPolicy] = None
        self.agent = None
        self.restarts = 0
        self.finished: set[int] = set()
        """Launch ranks whose process completed the run (exit 0)."""
        self._collected: set[int] = set()
        self._exited_since: Optional[float] = None
        self._awaiting_end = False
        """A node other than 0 whose ranks all ended before the job did: it waits for the job's end on node 0."""
        """``id`` of every rank process whose exit :meth:`_collect_exits` handled: one that ``poll`` says has exited
        may not have delivered its exit yet (a death the policy must still see)."""

    def _place(self, cfg: JobConfig) -> None:
        """This node's launch ranks and the local device of each (:mod:`ntp_megatron.plan.placement`): every slot has a
        fixed device of a fixed node, live or not, so a dead slot leaves its device idle and a replacement starts
        on the same device. Every node computes the same map from the config alone."""
        p = cfg.parallel
        placement = Placement(p.tensor_model_parallel_size, p.data_parallel_size, self.args.nnodes,
                              p.pipeline_model_parallel_size, self.args.nproc_per_node, self.args.nnodes_per_domain)
        slots = launch_slots(p.tensor_model_parallel_size, p.data_parallel_size,
                             cfg.topology() if cfg.ntp.enabled else None, p.pipeline_model_parallel_size)
        if not placement.node_ranks(0, slots):
            raise ConfigError(f"node 0 (which hosts the store and the controller) would run no rank: its replicas "
                              f"{list(placement.replicas_on(0))} are all dropped (ntp.dropped_replicas); "
                              f"drop replicas of other nodes, or use fewer --nnodes")
        self.placement, self.launch_slots = placement, slots
        self.devices: dict[int, int] = placement.node_ranks(self.args.node_rank, slots)
        """Launch rank -> local device index (``LOCAL_RANK``), for the ranks this node runs."""
        self.local_ranks = list(self.devices)

    def _where(self) -> str:
        """Where this node's ranks run, for the start message (:func:`ntp_megatron.launch.describe.where`)."""
        return describe.where(self.devices, self.placement.devices_per_node, self.args.nnodes, self.args.node_rank)

    # -- what the ranks are told (:mod:`ntp_megatron.launch.rank_env`) -------------------------------------------
    def spare_env(self) -> dict[str, str]:
        return rank_env.spare_env()

    def rank_env(self, rank: int, joining: bool = False) -> dict[str, str]:
        return rank_env.rank_env(self, rank, joining)

    # -- starting ---------------------------------------------------------------------------------------------
    def _start_ranks(self) -> None:
        """This node's ranks: forked where they run on CPU, fresh interpreters where CUDA may be used
        (:func:`ntp_megatron.training.runtime.rank_start_method`)."""
        if self.start_method == "spawn":
            self.console.say("CUDA may be used here: ranks start as fresh processes, not forks")
        if self.nodes.replacing:
            return  # a lost node's replacement: its slots start as replacements (the policy's begin)
        for rank in self.local_ranks:
            self.processes.start(rank, self.rank_env(rank))
        self.processes.record_pids()

    def respawn(self) -> None:
        """A fresh process for every local rank (a restart of the job), watched."""
        self.processes.restart = self.restarts
        self.processes.ranks = {}  # the old job's launch ranks are not this one's
        for rank in self.local_ranks:
            self.processes.start(rank, self.rank_env(rank), fresh=True)
        self.processes.record_pids()

    def relaunch(self, cfg: JobConfig, start) -> None:
        """The job starts again as ``cfg`` (one node), from ``start``, on a fresh store (its processes:
        :meth:`respawn` starts them next)."""
        self.cfg, self.start, self.world_size = cfg, start, cfg.world_size
        self._place(cfg)  # one node: every surviving slot keeps its device
        self.config_path = self.run_dir / f"config.node0.restart{self.restarts}.json"
        self.config_path.write_text(cfg.model_dump_json(indent=2))
        self.store = self.node_store = host_store(self.args.store_host, 0, cfg.parallel.timeout_s)
        self.nodes.port = self.store.port
        self.nodes.restart()
        write_address(self.run_dir, self.args.store_host, self.nodes.port)

    # -- the job -------------------------------------------------------------------------------------------
    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Megatron-Core loads here, not at start-up (a bad flag fails in a second), and before any fork: the import
        # every forked rank then skips
        from ntp_megatron.training import data, pretrain

        if self.args.node_rank == 0:
            # Megatron's dataset index caches are written here, once, before any rank or process group exists;
            # forked ranks inherit the dataset, other nodes' ranks read the caches after node 0's store is up.
            pretrain.prebuild_dataset(self.run_dir, self.cfg)
            self.console.say(data.describe(self.cfg))
            if self.cfg.ntp.enabled:
                self.console.say(memory_plan.describe(memory_plan.plan_of(self.cfg)))
        if self.start_method == "fork":
            if torch.cuda.is_initialized():  # a forked child cannot use a CUDA context made by its parent
                raise RuntimeError("CUDA was initialised in the launcher before forking ranks (by an import?)")
        server = ForkServer()  # before any thread of this process: see ntp_megatron.launch.forkserver
        code = None
        try:
            code = self._run(server)
            return code
        finally:
            if self.relay is not None:  # its threads must not be in a store call when the interpreter exits
                self.relay.stop()
            # An orderly exit (finished, or ending its part of a stopped job, which it reported) says goodbye on its
            # link; an interrupted one (130, 143) or a crash leaves node 0 to count the node's ranks lost.
            self.nodes.close(clean=code is not None and code < 128)
            server.close()

    def _run(self, server: ForkServer) -> int:
        self.processes = RankProcesses(server, self.console, self.start_method, self.run_dir, self.args.node_rank)
        self.started = time.time()
        try:
            self.store = self.nodes.join(self.run_dir)
        except Exception as exc:  # noqa: BLE001 - a C++ error from the store: one line instead
            self.console.say(join_failure(exc, self.nodes))
            return 1
        if self.args.node_rank > 0:  # node 0 may go: its store is called through a guard (root_watch)
            self.store = root_watch.guard(self.store, self.args.store_host, self.nodes.port,
                                          self.cfg.ntp.node_timeout_s, self.cfg.parallel.timeout_s)
        self.node_store = self.store
        if self.cfg.ntp.enabled and self.args.node_rank > 0:
            self._host_node_store()
        self._start_ranks()
        if self.args.node_rank == 0:
            self.metrics_file, self.tensorboard_dir = run_outputs(self.cfg, self.run_dir)
            self.console.sink = metrics.MetricsSink(self.metrics_file, self.tensorboard_dir)
            self.console.sink.event("job_started", world_size=self.world_size, tp_per_replica=tp_per_replica(self.cfg),
                                    pipeline_stages=self.cfg.parallel.pipeline_model_parallel_size)
        elif self.cfg.logging.metrics_file != "":
            # Another node's ranks' own records (resources, memory, re-formations): beside node 0's metrics file.
            self.console.sink = metrics.MetricsSink(self.run_dir / f"metrics.node{self.args.node_rank}.jsonl", None)
        self.policy = choose(self)
        self.policy.begin()
        if self.start is not None:
            self.console.say(self.start.notice or
                             f"resuming from checkpoint {self.start.path} (iteration {self.start.iteration})")
        self.console.say(f"started ranks {describe.spans(self.local_ranks) or 'none'} of {self.world_size}"
                         f"{self._where()} (store {self.args.store_host}:{self.nodes.port}, run dir {self.run_dir})")
        for line in describe.stage_lines(self.cfg, self.placement, self.launch_slots):
            self.console.say(line)

        def on_signal(signum, _frame):
            raise KeyboardInterrupt(signal.Signals(signum).name)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        exit_code = 0
        try:
            exit_code = self._monitor()
        except KeyboardInterrupt as exc:
            name = str(exc) or "SIGINT"  # Ctrl-C in the middle of an import raises it without our handler
            self.console.say(f"interrupted ({name}): stopping all ranks")
            self.processes.stop_all()
            exit_code = 128 + signal.Signals[name]
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.processes.stop_all()  # the warm spares, once the ranks are done
            self.nodes.leave(self.store, exit_code)
            self.processes.join_relays(timeout=timing.current().output_join_s)
            self.policy.close()
            if self.console.sink is not None:
                if self.args.node_rank == 0:
                    self.console.sink.event("job_ended", exit_code=exit_code)
                    summary.summarize(self.cfg, self.console.sink, self.console.say, self.started, self.run_dir,
                                      (self.metrics_file, self.tensorboard_dir), self.store, self.failures)
                self.console.sink.close()
            if self.args.node_rank == 0 and self.nodes.multi:
                self.nodes.wait_for_leaving(self.store)
        return exit_code

    def _host_node_store(self) -> None:
        """Under NTP on a node other than node 0: the node's own store and the relay that follows the root's
        (:func:`ntp_megatron.launch.nodes.host_node_store`)."""
        self.node_store, self.relay = host_node_store(
            self.args.store_host, self.nodes.port, self.args.node_rank, self.cfg.parallel.timeout_s,
            self.cfg.ntp.heartbeat_timeout_s * timing.current().node_beat_fraction,
            lambda: sum(p.poll() is None for p in list(self.processes.ranks.values())), self.console.say)

    def _monitor(self) -> int:
        """Wait for the ranks: every pass hands the deaths reaped since the last one to the run's policy, which
        absorbs them (NTP), restarts the job, or ends it."""
        if not self.nodes.wait_for_nodes(self.store, self.started):
            self.processes.stop_all()
            return 1
        if self.cfg.ntp.enabled or any(not isinstance(f, faults.RankFailure) for f in self.failures):
            self.agent = Agent(self.node_store, lambda: self.processes.ranks, self.cfg.ntp.heartbeat_timeout_s,
                               startup_grace_s=self.cfg.parallel.timeout_s, specs=self.failures,
                               say=self.console.say, live=self.policy.live_launch_ranks, fence=self.cfg.ntp.enabled,
                               fence_progress=self.cfg.ntp.enabled and self.cfg.ntp.progress_fence,
                               shared=self.store, beat_interval_s=self.cfg.ntp.heartbeat_interval_s)
        while True:
            fenced = self.policy.fenced()  # before the agent, which would take its stopped ranks for hung ones
            if fenced is not None:
                return fenced
            if self.agent is not None:
                if self.processes.first_iteration_at is not None:
                    self.agent.begin_training(self.processes.first_iteration_at)
                self.agent.poll(inject=not self.policy.training_done)
            lost = self._node_0_lost()
            if lost is not None:
                return lost
            outcome = self.policy.step(self._collect_exits())
            if outcome is not None:
                return outcome
            if self._all_collected() and self.policy.idle():
                code = self._all_ended()
                if code is not None:
                    return code

    def _node_0_lost(self) -> Optional[int]:
        """On a node other than 0, node 0 lost (:func:`~ntp_megatron.launch.root_watch.lost_line`) ends this node's
        part of the job in one line: its ranks cannot go on without node 0's controller. The exit code, else None."""
        line = root_watch.lost_line(self.store, self.args.store_host, self.nodes.port, self.cfg.ntp.node_timeout_s)
        if line is None:
            return None
        self.console.say(line)
        self.processes.stop_all()
        return 1

    def _all_ended(self) -> Optional[int]:
        """Every rank of this node has ended: the exit code, said in one line (:func:`~ntp_megatron.launch.policy.ending`).
        Under NTP a node other than 0 whose ranks failed while the job goes on elsewhere waits for the job's end (None
        until then): 0 if it finished, else 1 — its own ranks' failures were absorbed, so they are not the answer."""
        if self._awaiting_end:
            return self.nodes.job_end(self.store)
        exits = {p.rank: p.returncode for p in self.processes.ranks.values()}
        code, line = ending(self.policy.training_done, exits)
        if code != 0 and self.cfg.ntp.enabled and self.args.node_rank > 0:
            self._awaiting_end = True
            failed = ", ".join(str(rank) for rank, c in sorted(exits.items()) if c != 0)
            self.console.say(f"every rank of this node has ended (launch rank(s) {failed} failed); the job goes on: "
                             "waiting for its end on node 0")
            return self._all_ended()
        self.console.say(line)
        return code

    def _all_collected(self) -> bool:
        """Every rank has exited and its exit was handled; bounded: an exit not delivered ``timing.exit_delivery_s`` after
        every process is seen to have exited counts as handled."""
        ranks = list(self.processes.ranks.values())
        if not all(p.poll() is not None for p in ranks):
            self._exited_since = None
            return False
        if all(id(p) in self._collected for p in ranks):
            return True
        now = time.monotonic()
        self._exited_since = self._exited_since or now
        return now - self._exited_since > timing.current().exit_delivery_s

    def _collect_exits(self) -> list[Death]:
        """Reaped ranks since the last poll; deaths (non-zero exits) as ``Death`` records. A death waits
        ``timing.death_debounce_s`` for its companions, so simultaneous failures make one generation."""
        deaths: list[Death] = []
        timeout = timing.current().exit_poll_s
        while True:
            try:
                proc, returncode = self.processes.exits.get(timeout=timeout)
            except queue.Empty:
                return deaths
            if proc is not self.processes.ranks.get(proc.rank):
                continue  # a process of an earlier restart
            self._collected.add(id(proc))
            if returncode == 0:
                self.finished.add(proc.rank)
                self.policy.rank_finished(proc.rank)
                continue
            when, cause = proc.ended_at or time.time(), describe_exit(returncode)
            if self.agent is not None and proc.rank in self.agent.notes:
                when, cause = self.agent.notes[proc.rank]
            reported = reported_error(self.store, proc.rank, proc.pid)
            error = reported["error"] if reported is not None else None
            if error is not None:
                cause = own_error_cause(reported)
            deaths.append(Death(proc.rank, when, cause, proc.pid, error, bool(reported and reported.get("echo"))))
            timeout = timing.current().death_debounce_s


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        job = prepare(args, extra)
        if not isinstance(job, Job):
            return job  # done before any rank starts (--print-memory-plan, nothing left to train)
        timing.use(job.cfg.timing)
        launcher = Launcher(job.cfg, job.config_path, args, job.failures, job.start)  # refuses a placement first
        job.config_path.parent.mkdir(parents=True, exist_ok=True)
        job.config_path.write_text(job.cfg.model_dump_json(indent=2))
    except ConfigError as exc:
        print(f"ntp-launch: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
