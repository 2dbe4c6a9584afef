"""A launcher's rank processes: how they start, their output relayed, their pids recorded, and stopping them all.

Every process starts through the launcher's :class:`~ntp_megatron.launch.forkserver.ForkServer`, so it dies with
the launcher from its first instruction. *Forked* (CPU): a fork of the launcher's imports (torch, Megatron-Core, the
prebuilt dataset) runs the rank in place, with nothing to import. *Spawned*: a fresh interpreter, wherever CUDA may
be used (a fork after these imports is safe only while nothing touched CUDA), and for restarts and cold
replacements. A *warm spare* (:mod:`ntp_megatron.training.spare`) is started like a rank of this node, imports
done, and waits for :meth:`RankProcesses.assign` to make it a launch rank's joining process.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Optional

from ntp_megatron import metrics
from ntp_megatron.elastic.agent import process_state
from ntp_megatron.launch.console import Console, NativeWarnings
from ntp_megatron.config import timing
from ntp_megatron.launch.forkserver import Child, ForkServer
from ntp_megatron.training import runtime

RANK_MODULE = "ntp_megatron.training.pretrain"
SPARE_MODULE = "ntp_megatron.training.spare"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    if returncode == runtime.EXIT_PEER_FAILED:
        return f"stopped after another rank's failure broke its collectives (exit code {returncode})"
    if returncode == runtime.EXIT_DEVICE_LOST:
        return f"lost its device to a CUDA error that sticks (exit code {returncode})"
    return f"exited with code {returncode}"


def is_echo(death) -> bool:
    """A death caused by another rank's (:data:`runtime.EXIT_PEER_FAILED`), not a failure of its own."""
    return death.cause == describe_exit(runtime.EXIT_PEER_FAILED)


class RankProcess:
    """One process of a launch rank (or a warm spare, ``rank`` None until it is assigned): pid, output streams,
    exit status once reaped."""

    def __init__(self, rank: Optional[int], child: Child, stdout: IO[str], stderr: IO[str],
                 assign: Optional[int] = None) -> None:
        self.rank, self.child = rank, child
        self.stdout, self.stderr = stdout, stderr
        self.assign_fd = assign
        """A warm spare's end of its assignment pipe (None once assigned, and for other processes)."""
        self.threads: list[threading.Thread] = []

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.child.returncode

    @property
    def ended_at(self) -> Optional[float]:
        return self.child.ended_at

    def poll(self) -> Optional[int]:
        return self.child.returncode

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.child.wait(timeout)


class RankProcesses:
    """This node's processes: ``ranks`` (launch rank -> its current process) and the warm spares not yet assigned.
    Exits arrive in ``exits`` as (process, exit code)."""

    def __init__(self, server: ForkServer, console: Console, method: str, run_dir: Path, node_rank: int) -> None:
        self.server, self.console = server, console
        self.method = method
        """``fork`` or ``spawn`` (:func:`ntp_megatron.training.runtime.rank_start_method`): how ranks and spares
        start; restarts and cold replacements always spawn."""
        self.run_dir, self.node_rank = run_dir, node_rank
        self.ranks: dict[int, RankProcess] = {}
        self.spares: list[RankProcess] = []
        self.exits: queue.Queue[tuple[RankProcess, int]] = queue.Queue()
        self.pid_history: dict[str, list[int]] = {}
        self.restart = 0
        """Restarts before the processes started now (their iteration records say so)."""
        self.first_iteration_at: Optional[float] = None
        """When a rank of this node first reported an iteration (the run began training; monotonic: the agent's)."""

    # -- starting ---------------------------------------------------------------------------------------------
    def start(self, rank: int, env: dict[str, str], fresh: bool = False) -> RankProcess:
        """Start launch rank ``rank`` (forked or spawned as ``method`` says; ``fresh``: spawned in any case), make
        it the rank's current process and relay its output."""
        if self.method == "fork" and not fresh:
            proc = self._start(rank, env, f"ntp-rank{rank}", target=f"{RANK_MODULE}:main")
        else:
            proc = self._start(rank, env, f"ntp-rank{rank}", argv=[sys.executable, "-m", RANK_MODULE])
        self.ranks[rank] = proc
        self.watch(proc)
        return proc

    def start_spare(self, env: dict[str, str]) -> RankProcess:
        """A warm spare: started like a rank of this node (imports done), waiting for :meth:`assign`."""
        read, write = os.pipe()
        try:
            if self.method == "fork":
                proc = self._start(None, env, "ntp-spare", target=f"{SPARE_MODULE}:serve",
                                   pass_fd=(runtime.ENV_SPARE_FD, read))
            else:
                proc = self._start(None, env, "ntp-spare", argv=[sys.executable, "-m", SPARE_MODULE],
                                   pass_fd=(runtime.ENV_SPARE_FD, read))
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        proc.assign_fd = write
        self.spares.append(proc)
        self._relay_output(proc)
        self.record_pids()
        return proc

    def idle_spare(self) -> Optional[RankProcess]:
        """A live warm spare not yet assigned, if there is one."""
        return next((p for p in self.spares if p.poll() is None), None)

    def dead_spares(self) -> list[RankProcess]:
        """Spares that ended before they were assigned (forgotten now)."""
        dead = [p for p in self.spares if p.poll() is not None]
        for proc in dead:
            self.spares.remove(proc)
            os.close(proc.assign_fd)
        return dead

    def assign(self, spare: RankProcess, rank: int, env: dict[str, str]) -> None:
        """Make ``spare`` the process of launch rank ``rank``, with that rank's environment (it selects its device
        only now)."""
        self.spares.remove(spare)
        spare.rank = rank
        self.ranks[rank] = spare
        data = json.dumps(env).encode()
        fd, spare.assign_fd = spare.assign_fd, None
        try:  # the spare reads to the end of the pipe
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:  # it died meanwhile: its exit is reported like any rank's
            pass
        finally:
            os.close(fd)
        spare.child.on_exit(lambda child: self.exits.put((spare, child.returncode)))

    def _start(self, rank: Optional[int], env: dict[str, str], title: str, argv: Optional[list[str]] = None,
               target: Optional[str] = None, pass_fd: Optional[tuple[str, int]] = None) -> RankProcess:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            child = self.server.start(env, out_w, err_w, title, argv=argv, target=target, pass_fd=pass_fd)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return RankProcess(rank, child, os.fdopen(out_r, "r", encoding="utf-8", errors="replace"),
                           os.fdopen(err_r, "r", encoding="utf-8", errors="replace"))

    # -- output and exits -------------------------------------------------------------------------------------
    def watch(self, proc: RankProcess) -> None:
        """Relay its output (``[rank N]`` lines, records to the sink) and report its exit in ``exits``."""
        self._relay_output(proc)
        proc.child.on_exit(lambda child: self.exits.put((proc, child.returncode)))

    def _relay_output(self, proc: RankProcess) -> None:
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=self._relay, args=(proc, stream, out, self.restart), daemon=True)
            t.start()
            proc.threads.append(t)

    def _relay(self, proc: RankProcess, stream: IO[str], out: IO[str], restart: int) -> None:
        """``restart``: how many restarts preceded the process; its iteration records say so (the same iteration
        and generation recur in a job restarted from a checkpoint). A spare's lines say ``[spare <pid>]`` until it
        is assigned a launch rank. torch's C++ c10d warnings come without their stacks, rate-limited
        (:class:`~ntp_megatron.launch.console.NativeWarnings`)."""
        native = NativeWarnings()
        for line in stream:
            record = metrics.parse(line)
            if record is not None:
                if record.get("kind") == "iteration":
                    if self.first_iteration_at is None:
                        self.first_iteration_at = time.monotonic()  # the agent's clock
                    if restart:
                        record["restart"] = restart
                self.console.relayed(None, record)
            elif (kept := native.keep(line)) is not None:
                prefix = f"[rank {proc.rank}] " if proc.rank is not None else f"[spare {proc.pid}] "
                self.console.relayed(out, prefix + kept)

    def join_relays(self, timeout: float) -> None:
        for proc in self.ranks.values():
            for t in proc.threads:
                t.join(timeout=timeout)

    def record_pids(self) -> None:
        """``ranks.node<n>.json``: every pid each launch rank has had (a restart or a replacement adds one), and the
        warm spares' under ``spares``, for tools and tests that must find every process of the job."""
        for proc in self.ranks.values():
            history = self.pid_history.setdefault(str(proc.rank), [])
            if proc.pid not in history:
                history.append(proc.pid)
        for proc in self.spares:
            history = self.pid_history.setdefault("spares", [])
            if proc.pid not in history:
                history.append(proc.pid)
        path = self.run_dir / f"ranks.node{self.node_rank}.json"
        path.write_text(json.dumps(self.pid_history) + "\n")

    # -- stopping -----------------------------------------------------------------------------------------------
    def live(self) -> list[RankProcess]:
        return [p for p in [*self.ranks.values(), *self.spares] if p.poll() is None]

    def stop_all(self) -> None:
        """SIGTERM every live process's group (ranks and spares), then SIGKILL what is left after a grace period."""
        live = self.live()
        for proc in live:
            signal_group(proc.pid, signal.SIGCONT)  # a stopped (hung) rank cannot act on SIGTERM
            signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timing.current().stop_grace_s
        for proc in live:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in [*self.ranks.values(), *self.spares]:
            signal_group(proc.pid, signal.SIGKILL)  # also takes any grandchildren left in the group
        deadline = time.monotonic() + timing.current().stop_grace_s
        for proc in [*self.ranks.values(), *self.spares]:
            if not proc.wait(timeout=max(0.0, deadline - time.monotonic())):  # in the kernel (D state): say so
                self.console.say(f"process {proc.pid} has not exited {timing.current().stop_grace_s:.0f} s after SIGKILL")

    def kill_all(self) -> None:
        """SIGKILL every process's group at once (a fence: they must not write anything more), then wait for them
        (bounded)."""
        procs = [*self.ranks.values(), *self.spares]
        for proc in procs:
            signal_group(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + timing.current().stop_grace_s
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def stalled(self) -> list[RankProcess]:
        """Live ranks that are stopped (SIGSTOP, a hang)."""
        return [p for p in self.ranks.values() if p.poll() is None and process_state(p.pid) in ("T", "t")]

    def dump_stacks(self, launch_ranks: list[int]) -> None:
        """Ask ranks for a traceback of every thread (``faulthandler`` on SIGUSR1), for a report."""
        for rank in launch_ranks:
            proc = self.ranks.get(rank)
            if proc is not None and proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
