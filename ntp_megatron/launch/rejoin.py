"""Replacement processes for this node's failed launch ranks (NTP with ``ntp.rejoin_after_s``).

A replacement is due ``ntp.rejoin_after_s`` after its rank's failure (the repair delay). It is a warm spare when
this node has one (``ntp.warm_spares``: started with the ranks, imports done, so its admission does not wait for an
interpreter to boot; a new one is started for the next failure), else a fresh interpreter. Either announces
itself in the store and node 0's controller admits it at an iteration boundary. One that dies before its admission
completed counts as an attempt (at most ``ntp.max_rejoin_attempts`` in a row); once the generation that admits it
has formed, its rank's count starts over, so every later failure of the slot gets its replacements again.
"""

from __future__ import annotations

import signal
import time
from typing import Callable

import torch.distributed as dist

from ntp_megatron.elastic import commit, keys, publication
from ntp_megatron.launch.processes import describe_exit, signal_group


class Rejoins:
    def __init__(self, launcher, admitted: Callable[[int], bool]) -> None:
        """``launcher``: what a policy sees of it (:class:`ntp_megatron.launch.policy.LauncherView`);
        ``admitted(launch_rank)``: whether the newest published generation has the rank's slot."""
        self.launcher = launcher
        self.admitted = admitted
        self.due: dict[int, float] = {}
        """Launch rank -> when to start a replacement process for it."""
        self.attempts: dict[int, int] = {}
        """Launch rank -> replacements started since its slot last completed an admission (a key for every rank
        this node ever started a replacement for)."""
        self.started_after: dict[int, int] = {}
        """Launch rank -> the newest generation published when its current replacement started (the one that
        admits it comes later)."""
        self.spare_deaths = 0

    @property
    def ntp(self):
        return self.launcher.cfg.ntp

    def is_replacement(self, launch_rank: int) -> bool:
        """This node started a replacement for ``launch_rank`` at some point."""
        return launch_rank in self.attempts

    def schedule(self, launch_rank: int) -> None:
        """Plan a replacement for a failed rank after the repair delay, a bounded number of times in a row."""
        after = self.ntp.rejoin_after_s
        if after is None or launch_rank not in self.launcher.local_ranks:
            return
        attempts = self.attempts.get(launch_rank, 0)
        if attempts >= self.ntp.max_rejoin_attempts:
            self.launcher.console.say(f"launch rank {launch_rank}: {attempts} replacements failed; its replica stays "
                                  "degraded")
            return
        self.due[launch_rank] = time.time() + after

    def step(self, training_done: bool) -> None:
        """Start the replacements that are due; count completed admissions. Once the run is complete, replacements
        whose admission has not completed are stopped: there is nothing left to join (a generation may have been
        published for one at the last iteration boundary, which the other ranks never crossed)."""
        processes = self.launcher.processes
        if training_done:
            self.due.clear()
            for rank in self.attempts:
                proc = processes.ranks.get(rank)
                if proc is not None and proc.poll() is None and self.stranded(rank):
                    try:
                        keys.mark_stopped_at_end(self.launcher.store, rank, proc.pid)
                    except Exception:  # noqa: BLE001 - the store may be gone at the end of the run
                        pass
                    signal_group(proc.pid, signal.SIGTERM)
            return
        for rank, count in self.attempts.items():
            proc = processes.ranks.get(rank)
            if count and proc is not None and proc.poll() is None and self._formed_with(rank):
                self.attempts[rank] = 0
        now = time.time()
        for rank, due in list(self.due.items()):
            if now >= due:
                del self.due[rank]
                self._start(rank, now)
        self.fill_spares()

    def _start(self, rank: int, now: float, fresh: bool = True) -> None:
        """A replacement for ``rank``: a warm spare if there is one, else a new process (``fresh``: a new
        interpreter; else started as this node's ranks are at the launcher's start)."""
        launcher, processes = self.launcher, self.launcher.processes
        self.attempts[rank] = self.attempts.get(rank, 0) + 1
        self.started_after[rank] = _generation(launcher.store, publication.newest)
        if launcher.agent is not None:
            launcher.agent.forget(rank)
        spare = processes.idle_spare()
        env = launcher.rank_env(rank, joining=True)
        if spare is not None:
            processes.assign(spare, rank, env)
            proc = spare
        else:
            proc = processes.start(rank, env, fresh=fresh)
        processes.record_pids()
        launcher.console.emit({"kind": "event", "event": "replacement_started", "launch_rank": rank, "pid": proc.pid,
                           "attempt": self.attempts[rank], "warm": spare is not None, "time": now})
        how = ", a warm spare" if spare is not None else ""
        launcher.console.say(f"starting a replacement for launch rank {rank} (pid {proc.pid}{how}, attempt "
                         f"{self.attempts[rank]} of {self.ntp.max_rejoin_attempts})")

    def replace_node(self) -> None:
        """This launcher replaces a node node 0 declared lost: every slot of the node starts now as a replacement
        process, which node 0 admits at an iteration boundary; started as any node's ranks are at its launcher's
        start (forked where they run on CPU: no interpreter to boot)."""
        launcher, now = self.launcher, time.time()
        launcher.console.say(f"node {launcher.args.node_rank} was lost before this launcher started: its launch ranks "
                             f"{', '.join(map(str, launcher.local_ranks))} start as replacements")
        for rank in launcher.local_ranks:
            self._start(rank, now, fresh=False)

    def fill_spares(self) -> None:
        """Keep ``ntp.warm_spares`` spares on this node (none without ``ntp.rejoin_after_s``). A spare that dies
        unassigned is replaced until ``ntp.max_rejoin_attempts`` spares have died; after that replacements start cold."""
        ntp, processes, say = self.ntp, self.launcher.processes, self.launcher.console.say
        if ntp.rejoin_after_s is None or not ntp.warm_spares:
            return
        for dead in processes.dead_spares():
            self.spare_deaths += 1
            say(f"warm spare (pid {dead.pid}) {describe_exit(dead.returncode)} before it was needed"
                + ("; replacements start cold from now on" if self.spare_deaths == ntp.max_rejoin_attempts else ""))
        if self.spare_deaths >= ntp.max_rejoin_attempts:
            return
        while len(processes.spares) < ntp.warm_spares:
            processes.start_spare(self.launcher.spare_env())

    def reset(self) -> None:
        """The job restarted on fresh processes: nothing is due, no attempt counts."""
        self.due.clear()
        self.attempts.clear()
        self.started_after.clear()
        self.fill_spares()

    def stranded(self, launch_rank: int) -> bool:
        """Once the run is complete: this node's replacement for ``launch_rank`` was never part of a completed
        formation, admitted or not, so nothing trained with it (False when the store cannot say)."""
        return (self.is_replacement(launch_rank) and _generation(self.launcher.store, commit.newest_completed) >= 0
                and not self._formed_with(launch_rank))

    def stopped_at_end(self, launch_rank: int) -> bool:
        """Some node's launcher stopped ``launch_rank``'s replacement at the end of the run (:meth:`step`)."""
        try:
            return keys.was_stopped_at_end(self.launcher.store, launch_rank)
        except Exception:  # noqa: BLE001 - the store may be gone at the end of the run
            return False

    def _formed_with(self, launch_rank: int) -> bool:
        """Whether a generation that admitted ``launch_rank``'s current replacement completed its formation (a
        completed generation from before the replacement started may have the slot too: its dead process's)."""
        store = self.launcher.store
        return (_generation(store, commit.newest_completed) > self.started_after.get(launch_rank, -1)
                and slot_live(store, commit.newest_completed, self.launcher.launch_slots[launch_rank]))


def _generation(store: dist.Store, newest: Callable[[dist.Store], int]) -> int:
    """The generation ``newest`` reads (:func:`~ntp_megatron.elastic.publication.newest`, the newest published, or
    :func:`~ntp_megatron.elastic.commit.newest_completed`), -1 if there is none (or the store cannot say)."""
    try:
        return newest(store)
    except Exception:  # noqa: BLE001 - the store may be gone at the end of the run
        return -1


def slot_live(store: dist.Store, newest: Callable[[dist.Store], int], slot: tuple[int, int]) -> bool:
    """Whether the generation ``newest`` reads (:func:`~ntp_megatron.elastic.publication.newest`,
    :func:`~ntp_megatron.elastic.commit.newest_completed`) has ``slot`` live (False if the store cannot say)."""
    generation = _generation(store, newest)
    if generation < 0:
        return False
    try:
        topology = publication.topology(store, generation)
    except Exception:  # noqa: BLE001 - the store may be gone at the end of the run
        return False
    return topology.rank_of(*slot) is not None
