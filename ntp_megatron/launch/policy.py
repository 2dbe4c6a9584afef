"""What a rank's death means to this launcher: the policy interface, and the policies of a run without NTP.

A policy is chosen once at start (:func:`ntp_megatron.launch.modes.choose`). The launcher's monitor only calls
:meth:`DeathPolicy.step` with the deaths it reaped; the policy absorbs them, restarts the job or ends it, starts
replacements where it may (NTP: :mod:`ntp_megatron.launch.ntp`), and on several nodes stops when another node
aborted the job. Without NTP the job restarts from the last checkpoint (:class:`RestartFromCheckpoint`) or stops
(:class:`StopOnFailure`); either names the failed rank, not the ranks that stopped because of it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Mapping, Optional, Protocol

import torch.distributed as dist

from ntp_megatron.plan import stages
from ntp_megatron.config import timing
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.plan.grid import Grid
from ntp_megatron.elastic.controller import Death
from ntp_megatron.elastic.failure_report import injected_failure
from ntp_megatron.elastic.errors import cause_behind_echoes, own_error_cause, reported_error
from ntp_megatron.launch.console import Console
from ntp_megatron.launch.describe import spans
from ntp_megatron.launch.nodes import Nodes, mark_node_lost, publish_death, published_deaths, read_abort, set_abort
from ntp_megatron.launch.processes import RankProcesses, is_echo


class LauncherView(Protocol):
    """What a policy uses of the launcher."""

    cfg: JobConfig
    start: object
    args: argparse.Namespace
    store: dist.Store
    nodes: Nodes
    console: Console
    processes: RankProcesses
    agent: Optional[object]
    local_ranks: list[int]
    launch_slots: list[tuple[int, int]]
    placement: object
    world_size: int
    run_dir: Path
    failures: list
    restarts: int
    finished: set[int]

    def rank_env(self, rank: int, joining: bool = False) -> dict[str, str]: ...

    def spare_env(self) -> dict[str, str]: ...

    def respawn(self) -> None: ...

    def relaunch(self, cfg: JobConfig, start) -> None: ...


class DeathPolicy:
    def __init__(self, launcher: LauncherView) -> None:
        self.launcher = launcher
        self.training_done = False
        """A rank of the running job completed the run."""
        self.node_lost_ranks: set[int] = set()
        """Node 0: launch ranks the job lost with their node (their deaths are said once, as the node's loss)."""

    def begin(self) -> None:
        """The ranks have started and node 0's metrics sink exists."""

    def step(self, deaths: list[Death]) -> Optional[int]:
        """One pass of the launcher's monitor with this node's new deaths: None to go on, or the exit code."""
        deaths += self.lost_nodes()
        outcome = self.news(deaths)
        if outcome is not None:
            return outcome
        if self.launcher.nodes.multi:
            reason, death = read_abort(self.launcher.store)
            if reason is not None:
                if death is not None:
                    self.report_failure(death)  # the failure the aborting node named
                else:
                    self.launcher.console.say(f"another node aborted the job: {reason}")
                self.launcher.processes.stop_all()
                return 1
        if deaths:
            outcome = self.handle(deaths)
            if outcome is not None:
                return outcome
        self.after()
        return None

    def news(self, deaths: list[Death]) -> Optional[int]:
        """What other nodes said since the last pass (added to ``deaths``), or an exit code."""
        return None

    # -- lost nodes ----------------------------------------------------------------------------------------------
    def lost_nodes(self) -> list[Death]:
        """Node 0: one death for every rank the job counts on a node lost since the last pass
        (:meth:`~ntp_megatron.launch.nodes.Nodes.lost_nodes`), all in this pass's batch; the loss said in one line
        and recorded (``node_lost`` event, the node's lost key)."""
        launcher = self.launcher
        if launcher.args.node_rank != 0 or not launcher.nodes.multi:
            return []
        out = []
        for loss in launcher.nodes.lost_nodes(launcher.store):
            on_node = list(launcher.placement.node_ranks(loss.node, launcher.launch_slots))
            ranks = [r for r in on_node if self.counts(r)]
            self.forget([r for r in on_node if r not in ranks])
            mark_node_lost(launcher.store, loss.node, loss.pid, loss.reason, ranks)
            when = time.time() - (time.monotonic() - loss.at)  # node 0's clocks only
            named = f"launch ranks {spans(ranks)}" if ranks else "no rank the job still counts"
            launcher.console.say(f"node {loss.node} lost ({loss.reason}): {named}")
            launcher.console.emit({"kind": "event", "event": "node_lost", "node": loss.node, "pid": loss.pid,
                                   "reason": loss.reason, "launch_ranks": ranks, "time": when})
            self.node_lost_ranks.update(ranks)
            out += [Death(r, when, f"was lost with node {loss.node} ({loss.reason})") for r in ranks]
        return out

    def counts(self, launch_rank: int) -> bool:
        """Whether the job counts on ``launch_rank`` now (a node's loss is a death of each such rank)."""
        return True

    def forget(self, launch_ranks: list[int]) -> None:
        """A lost node's ranks the job did not count on (dead already, or replacements not yet admitted)."""

    def fenced(self) -> Optional[int]:
        """Another node: node 0 declared this node lost while this launcher was stopped (it resumed): stop its ranks
        (the job went on without them) and exit 1, in one line; else None."""
        launcher = self.launcher
        if not launcher.nodes.multi or launcher.args.node_rank == 0:
            return None
        record = launcher.nodes.fenced(launcher.store)
        if record is None:
            return None
        launcher.console.say(f"node {launcher.args.node_rank} was declared lost by node 0 ({record['reason']}) and the "
                             f"job went on without its launch ranks {spans(record['launch_ranks']) or '(none)'}: "
                             "killing this node's ranks")
        launcher.processes.kill_all()
        return 1

    def handle(self, deaths: list[Death]) -> Optional[int]:
        raise NotImplementedError

    def after(self) -> None:
        """The rest of a pass (replacements)."""

    def rank_finished(self, launch_rank: int) -> None:
        """``launch_rank``'s process exited 0."""
        self.training_done = True

    def idle(self) -> bool:
        """Nothing is left to start (once every rank has ended, the launcher is done)."""
        return True

    def live_launch_ranks(self) -> list[int]:
        """The launch ranks the job runs now (for failures injected from outside)."""
        return [r for r, p in self.launcher.processes.ranks.items() if p.poll() is None]

    def close(self) -> None:
        """The run is over."""

    # -- shared by the policies ------------------------------------------------------------------------------
    def report_failure(self, death: Death) -> None:
        """Say which rank failed (another node's: say so) and record it as a ``rank_failed`` event (node 0)."""
        launcher = self.launcher
        mine = death.launch_rank in launcher.local_ranks or death.launch_rank in self.node_lost_ranks
        where = "" if mine else "another node aborted the job: "
        launcher.console.say(f"{where}rank {death.launch_rank} (pid {death.pid}) {death.cause}")
        record = (injected_failure(launcher.store, death.launch_rank, death.pid)
                  or reported_error(launcher.store, death.launch_rank, death.pid) or {})
        launcher.console.emit({"kind": "event", "event": "rank_failed", "launch_rank": death.launch_rank,
                           "cause": death.cause, "time": record.get("time", death.time),
                           "iteration": record.get("iteration"), "phase": record.get("phase", "unknown")})

    def stop_job(self, deaths: list[Death]) -> int:
        """End the job on every node, naming ``deaths``; the launcher's exit code."""
        launcher = self.launcher
        set_abort(launcher.store, "; ".join(f"rank {d.launch_rank} {d.cause}" for d in deaths),
                  deaths[0] if len(deaths) == 1 else None)
        live = sum(p.poll() is None for p in launcher.processes.ranks.values())
        launcher.console.say(f"stopping the other {live} local rank(s)")
        launcher.processes.stop_all()
        launcher.console.say("all ranks stopped")
        return 1


class StopOnFailure(DeathPolicy):
    """NTP off: a failure ends the job. Its peers stop right after it; the failure is named, not its echoes."""

    def handle(self, deaths: list[Death]) -> Optional[int]:
        failed = self.failure_behind(deaths)
        self.report_failure(failed)
        return self.after_failure(failed)

    def after_failure(self, failed: Death) -> Optional[int]:
        return self.stop_job([failed])

    def failure_behind(self, local: list[Death]) -> Death:
        """The death the others echo — an injected failure's, else one that is not an echo (:func:`is_echo`),
        else the earliest. With several nodes every launcher publishes its deaths in the store and waits up to
        ``timing.echo_settle_s`` for one that is not an echo, so each names the same rank whichever node's deaths it saw
        first."""
        launcher, store = self.launcher, self.launcher.store
        deaths = list(local)
        if all(is_echo(d) for d in deaths):
            deaths += [Death(p.rank, time.time(), "is stopped (hung): its peers' collectives timed out", p.pid)
                       for p in launcher.processes.stalled()]
        if launcher.nodes.multi:
            for d in deaths:
                publish_death(store, d, launcher.args.node_rank)
            deadline = time.monotonic() + timing.current().echo_settle_s
            while all(is_echo(d) or d.echo for d in deaths) and time.monotonic() < deadline:
                time.sleep(timing.current().echo_settle_poll_s)
                _, decided = read_abort(store)
                if decided is not None:  # another node has named the failure already
                    return decided
                try:
                    deaths = published_deaths(store) or deaths
                except Exception:  # noqa: BLE001 - node 0 and its store are gone: decide from what is known
                    break
        failed = min(deaths, key=lambda d: (d.error is None, d.echo, injected_failure(store, d.launch_rank, d.pid) is None,
                                            is_echo(d), d.time))
        if failed.echo:  # the rank whose error it echoes may exit a moment later: name that one
            others = [r for r in range(launcher.world_size) if r not in {d.launch_rank for d in deaths}]
            found = cause_behind_echoes(store, others)
            if found is not None:
                rank, report = found
                proc = launcher.processes.ranks.get(rank)  # None: a rank of another node
                failed = Death(rank, report["time"], own_error_cause(report), proc.pid if proc else 0, report["error"])
        return failed


class RestartFromCheckpoint(StopOnFailure):
    """NTP off with ``checkpoint.save``, one node: the baseline every benchmark compares against. Stop every rank,
    start them all again (fresh processes) from the newest checkpoint, at most ``checkpoint.max_restarts`` times."""

    def after_failure(self, failed: Death) -> Optional[int]:
        launcher, ck = self.launcher, self.launcher.cfg.checkpoint
        if failed.error is not None:
            launcher.console.say("not restarting: the rank's own error would stop the restarted job again")
            return super().after_failure(failed)
        if launcher.restarts >= ck.max_restarts:
            return super().after_failure(failed)
        launcher.restarts += 1
        launcher.console.say(f"restarting all {launcher.world_size} ranks from the last checkpoint in {ck.save} (restart "
                         f"{launcher.restarts} of at most {ck.max_restarts})")
        launcher.processes.stop_all()
        launcher.console.emit({"kind": "event", "event": "restarted", "restart": launcher.restarts, "time": time.time()})
        launcher.respawn()
        return None


def ending(training_done: bool, exits: Mapping[int, Optional[int]]) -> tuple[int, str]:
    """Every rank of a node has ended (``exits``: launch rank -> exit code): the launcher's exit code and its line. 0
    if the job finished (a rank of the running job completed the run) or every rank ended cleanly (a rank of a
    replica dropped live retires with 0: the job goes on without this node's part), else 1 naming the ranks that
    failed: a scheduler must not take a job that did not finish for a success."""
    if training_done or all(code == 0 for code in exits.values()):
        return 0, f"all {sum(code == 0 for code in exits.values())} ranks finished"
    failed = ", ".join(str(rank) for rank, code in sorted(exits.items()) if code != 0)
    return 1, f"every rank of this node has ended and the job did not finish: launch rank(s) {failed} failed"


def tp_per_replica(cfg: JobConfig) -> list:
    """TP degree per replica index (0: a dropped replica; with pipeline stages one per stage), as the iteration
    records give it."""
    p = cfg.parallel
    if cfg.ntp.enabled:
        return stages.tp_per_replica(cfg.topology(), p.data_parallel_size)
    return Grid(p.tensor_model_parallel_size, p.data_parallel_size, p.pipeline_model_parallel_size).tp_per_replica()
