"""The launcher's hands on its own ranks: fencing ranks that stopped responding, and controller-side failures.

*Fencing.* A rank that stopped (``T`` in ``/proc/<pid>/stat``: SIGSTOP) for ``timing.stopped_grace_s``, or whose
heartbeat (:class:`ntp_megatron.elastic.watchdog.Heartbeat`) is older than ``ntp.heartbeat_timeout_s`` —
stuck so hard that even its heartbeat thread cannot run — is SIGKILLed before anything else happens, so it can
never come back and write; the reaper then reports it dead like any other. The heartbeat is a Python thread,
which long GIL-holding work (unpickling, building a dataset index) can delay by seconds: its timeout must stay
well above that.

*Progress, not liveness* (``ntp.progress_fence``, on by default). A rank stuck in a kernel keeps its heartbeat
alive while its peers block on it. Its heartbeat says how far it got (its progress count), how many collectives it
entered on each of its groups and what it waits on (:mod:`ntp_megatron.elastic.sequences`). A launcher whose rank
has waited at least half ``ntp.heartbeat_timeout_s`` (``timing.stall_fraction``, the *patience*) publishes that
wait with the rank's counts in the root store (:data:`~ntp_megatron.elastic.keys.WAITS`, refreshed while it waits,
emptied when it ends); every launcher then fences those of its own ranks that hold a published wait up — behind the
waiter in a group it waits in, making no progress for the patience, not waiting themselves, in a phase of an
iteration — by name (:mod:`ntp_megatron.elastic.blame`, the rule). How long a rank's progress stood still is
measured on its launcher's monotonic clock; a wait's length on its rank's: no clocks of two hosts are compared.

*Injected failures from outside*: ``kill:rank=R,after=S`` and ``random:mtbf=S,...`` (:mod:`ntp_megatron.faults`) are
executed here, on the ranks this launcher started:
``after=S`` on the job's clock (it can hit the start-up), ``random:`` on a clock that starts with the first
iteration (:meth:`Agent.begin_training`), so its failures are spaced as drawn and none fall on the start-up. With
``random:...,kinds=`` a draw at a phase of the rank's own is *armed* in the root store (the rank takes it at its next
iteration's start and fires there, :class:`ntp_megatron.faults.FailureTrigger`); the launcher says so in one line,
``arming KIND at phase P in launch rank R (pid N): SPEC`` (``scripts/soak.sh`` counts them). A rank armed with a
failure is not picked again; one armed with a slowdown is once it took it. Armed draws are paced
(:class:`ntp_megatron.faults.DrawPacer`): one outstanding per class, the others keep their gaps.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Callable, Optional, Protocol

import torch.distributed as dist

from ntp_megatron import faults, phases
from ntp_megatron.config import timing
from ntp_megatron.elastic import blame, keys


class _Process(Protocol):
    rank: int
    pid: int

    def poll(self) -> Optional[int]: ...


NO_BEAT = keys.NO_BEAT
"""A rank's heartbeat key before its first beat (:meth:`Agent._read_beats`)."""


def process_state(pid: int) -> str:
    """The scheduler state letter of ``pid`` (``R``, ``S``, ``D``, ``T`` stopped, ``Z``...), "" if gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0]


class Agent:
    def __init__(self, store: dist.Store, processes: Callable[[], dict[int, _Process]], heartbeat_timeout_s: float,
                 startup_grace_s: float, specs: list, say: Callable[[str], None],
                 live: Callable[[], list[int]], fence: bool = True, fence_progress: bool = False,
                 shared: Optional[dist.Store] = None, beat_interval_s: float = 0.2) -> None:
        """``store``: where this node's ranks beat (the node's store); ``shared``: where the launchers of every
        node meet (the root store; ``store`` by default); ``beat_interval_s``: how often the ranks beat
        (``ntp.heartbeat_interval_s``)."""
        self.store = store
        self.shared = shared if shared is not None else store
        self.processes = processes
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_grace_s = startup_grace_s
        self.say = say
        self.live = live
        self.fence = fence
        """Fence by heartbeat (only ranks of an NTP job beat)."""
        self.beat_interval_s = beat_interval_s
        self.fence_progress = fence_progress
        """Fence by progress too (``ntp.progress_fence``): the causal rule of :mod:`ntp_megatron.elastic.blame`."""
        self.clock: Callable[[], float] = time.monotonic
        """How long a rank's progress stands still is measured on this clock (monotonic; tests pass their own)."""
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        """This launcher's entry in the published waits."""
        self.started = time.monotonic()
        """When this agent started, on the host's monotonic clock: the clock of heartbeats (a rank and its launcher
        share a host), stops and the schedule of injected failures; a step of the wall clock moves none of them."""
        self.born: dict[int, float] = {}
        """Launch rank -> when its current process started (a replacement later than the job; monotonic)."""
        self.stopped_since: dict[int, float] = {}
        self.hung: set[int] = set()
        """Ranks this agent hung itself (``random:...,action=hang``): never picked again."""
        self.notes: dict[int, tuple[float, str]] = {}
        """Launch rank -> (when, what) for ranks this agent killed: their death time (wall clock: only reported) and
        cause."""
        self.training_started: Optional[float] = None
        """When the first iteration of the run was reported (monotonic: the clock of ``random:`` failures)."""
        self.progress: dict[int, tuple[int, float]] = {}
        """Launch rank -> (its last progress count, since when it has had it on :attr:`clock`)."""
        self._placed: set[int] = set()
        """Ranks whose heartbeat key this agent has set if it was missing (:meth:`_read_beats`)."""
        self.compute_times: dict[int, list] = {}
        """Launch rank -> its last iterations' compute times, ``[iteration, seconds]``, as its heartbeat sent them
        (for the rebalance monitor, :mod:`ntp_megatron.plan.rebalance`)."""
        self.oldest_beat_s = 0.0
        """The oldest heartbeat seen so far, as its age when read (how far the store lags behind the ranks)."""
        self._waits_published: Optional[float] = None
        """When (:attr:`clock`) this launcher last published waits of its ranks; None: its entry is empty."""
        self._timed = sorted((s.after_s, s.rank) for s in specs if isinstance(s, faults.TimedKill))
        self.pacer = faults.DrawPacer([s for s in specs if isinstance(s, faults.RandomFailures)])
        self.doomed: set[int] = set()
        """Ranks armed with a failure they have not had yet (never picked again)."""
        self.slowed: set[int] = set()
        """Ranks armed with a slowdown (not picked again until they took it)."""
        self.pending: dict[int, tuple[int, bool]] = {}
        """Launch rank -> (pid, in a re-formation): armed with a failure it has not had yet."""

    def poll(self, inject: bool = True) -> None:
        """Fence, and (unless ``inject`` is off: the run is over) fire the failures that are due."""
        now = time.monotonic()
        self._fence(now)
        if inject:
            self._fire_timed(now)
            self._fire_random(now)

    def begin_training(self, at: float) -> None:
        """The run's first iteration was reported at ``at`` (monotonic): ``random:`` failures count from there."""
        if self.training_started is None:
            self.training_started = at

    def restart(self, store: dist.Store) -> None:
        """The job starts again on fresh processes and a fresh store (``ntp.on_unrecoverable: restart``, one node):
        nothing of the old processes counts; outside failures still due keep their schedule."""
        self.store = self.shared = store
        self.born = dict.fromkeys(self.processes(), time.monotonic())
        self.stopped_since.clear()
        self.progress.clear()
        self._waits_published = None  # a fresh store: this launcher has no entry there
        self.notes.clear()
        self.hung.clear()
        self.doomed.clear()
        self.slowed.clear()
        self._placed.clear()
        self.compute_times.clear()

    def forget(self, rank: int) -> None:
        """A new process takes over ``rank`` (a replacement): nothing of the old one counts against it."""
        self.notes.pop(rank, None)
        self.stopped_since.pop(rank, None)
        self.progress.pop(rank, None)
        self.compute_times.pop(rank, None)
        self.hung.discard(rank)
        self.doomed.discard(rank)
        self.slowed.discard(rank)
        self.born[rank] = time.monotonic()
        try:
            keys.reset_beat(self.store, rank)
            keys.disarm(self.shared, rank)
        except Exception:  # noqa: BLE001
            pass

    def _fence(self, now: float) -> None:
        """Fence stopped, silent and (with :attr:`fence_progress`) stuck ranks; ``now`` is the host's monotonic clock,
        the heartbeats' (:func:`ntp_megatron.elastic.watchdog.beat`)."""
        if not self.fence:
            return
        states: list[tuple[blame.RankState, object]] = []
        running = []
        for rank, proc in self.processes().items():
            if proc.poll() is not None or rank in self.notes:
                continue
            if process_state(proc.pid) in ("T", "t"):
                since = self.stopped_since.setdefault(rank, now)
                if now - since >= timing.current().stopped_grace_s:
                    self._kill(rank, proc, since, f"hung: stopped (SIGSTOP), fenced after {now - since:.1f} s")
                continue
            self.stopped_since.pop(rank, None)
            running.append((rank, proc))
        try:
            beats = self._read_beats([rank for rank, _ in running])
        except Exception:  # noqa: BLE001 - the store is going away with the job
            return
        for (rank, proc), beat in zip(running, beats):
            born = self.born.get(rank, self.started)
            last = beat["t"] if beat is not None and beat["t"] >= born else None
            silent = now - (last if last is not None else born)
            if last is not None:
                self.oldest_beat_s = max(self.oldest_beat_s, silent)
                self.compute_times[rank] = beat.get("compute", [])
            limit = self.heartbeat_timeout_s if last is not None else self.startup_grace_s
            if silent > limit:
                # The rank stopped at about its last heartbeat: that is when it failed.
                self._kill(rank, proc, last if last is not None else now,
                           f"hung: fenced after {silent:.1f} s without a heartbeat")
                continue
            if last is not None and self.fence_progress:
                states.append((self._state(rank, beat, silent), proc))
        if self.fence_progress:
            self._fence_stuck(states, now)

    def _read_beats(self, ranks: list[int]) -> list[Optional[dict]]:
        """The last heartbeat of each of ``ranks`` (None where it has none yet), in one request: every rank's key is
        set (to a beat of time 0 until the rank's first) the first time it is polled, so that ``multi_get`` never
        waits on a missing one (a check and a get per rank were three requests each, every 20 ms)."""
        for rank in ranks:
            if rank not in self._placed:
                keys.place_beat(self.store, rank)  # set unless the rank beat already
                self._placed.add(rank)
        if not ranks:
            return []
        beats = keys.beats(self.store, ranks)
        return [beat if beat["t"] > 0 else None for beat in beats]

    def _state(self, rank: int, beat: dict, age_s: float) -> blame.RankState:
        """``rank`` as its heartbeat (``age_s`` old) and this agent's record of its progress say it is."""
        count, now = beat.get("progress"), self.clock()
        seen = self.progress.get(rank)
        if seen is None or seen[0] != count:
            self.progress[rank] = seen = (count, now)
        still = still_s(now - seen[1], age_s, self.beat_interval_s * timing.current().stale_beats)
        return blame.RankState(rank, beat.get("phase", ""), beat.get("iteration", 0), beat.get("seq") or {},
                               blame.Wait.from_json(beat.get("wait")), still)

    def _fence_stuck(self, states: list[tuple[blame.RankState, object]], now: float) -> None:
        """Publish this launcher's waiting ranks; fence its own ranks that hold up a wait any launcher published
        (:func:`ntp_megatron.elastic.blame.culprits`)."""
        patience = self.heartbeat_timeout_s * timing.current().stall_fraction
        self._publish(blame.waiters([state for state, _ in states], patience))
        suspects = [(state, proc) for state, proc in states if blame.suspect(state, patience)]
        if not suspects:
            return
        try:
            published = [blame.Waiter.from_json(w) for w in keys.published_waits(self.shared)]
        except Exception:  # noqa: BLE001 - the store is going away with the job
            return
        procs = {state.launch_rank: proc for state, proc in suspects}
        for found in blame.culprits(published, [state for state, _ in suspects], patience):
            self._kill(found.culprit, procs[found.culprit], now - found.still_s, found.cause())

    def _publish(self, waiting: list[blame.Waiter]) -> None:
        """This launcher's entry in the published waits: refreshed every ``timing.stall_refresh_s`` while some of its
        ranks wait, emptied at once when none does."""
        now = self.clock()
        if waiting and self._waits_published is not None \
                and now - self._waits_published < timing.current().stall_refresh_s:
            return
        if not waiting and self._waits_published is None:
            return
        try:
            keys.publish_waits(self.shared, self.name, [w.to_json() for w in waiting])
        except Exception:  # noqa: BLE001 - the store is going away with the job
            return
        self._waits_published = now if waiting else None

    def _kill(self, rank: int, proc, failed_at: float, cause: str) -> None:
        """Fence ``rank``, which failed at ``failed_at`` (monotonic; noted as wall time, for the record)."""
        self.notes[rank] = (wall_time(failed_at), cause)
        self.say(f"launch rank {rank} (pid {proc.pid}) stopped responding ({cause}): fencing it")
        _signal(proc.pid, signal.SIGKILL)

    def _fire_timed(self, now: float) -> None:
        while self._timed and now - self.started >= self._timed[0][0]:
            after, rank = self._timed.pop(0)
            self._inject(rank, "kill", f"kill:rank={rank},after={after:g}")

    def _fire_random(self, now: float) -> None:
        if self.training_started is None:
            return
        self.pacer.due(now - self.training_started, self._busy, self._apply)

    def _busy(self, forming: bool) -> bool:
        """Whether a rank armed with a failure of this class has not had it yet (its process lives on)."""
        procs = self.processes()
        self.pending = {r: (pid, f) for r, (pid, f) in self.pending.items()
                        if r in procs and procs[r].pid == pid and procs[r].poll() is None}
        return any(f == forming for _, f in self.pending.values())

    def _apply(self, draw: faults.Draw, rng, spec: str) -> None:
        """A random failure that is due: on a live rank ``rng`` picks (none live: it is dropped)."""
        candidates = self._candidates()
        if not candidates:
            return
        victim = rng.choice(candidates)
        if draw.outside:
            self._inject(victim, draw.kind, spec)
        else:
            self._arm(victim, draw, spec)

    def _candidates(self) -> list[int]:
        """The live ranks of this node a random failure may pick: not failing already, not armed with a failure or
        with a slowdown not yet taken."""
        local = self.processes()
        self.slowed = {r for r in self.slowed if keys.quietly(keys.is_armed, self.shared, r, default=False)}
        return sorted(r for r in self.live() if r in local and local[r].poll() is None and r not in self.notes
                      and r not in self.hung and r not in self.doomed and r not in self.slowed)

    def _arm(self, rank: int, draw: faults.Draw, spec: str) -> None:
        """Arm ``rank`` with ``draw`` (it fires in the rank, at the drawn phase of its next iteration or after)."""
        proc = self.processes()[rank]
        detail = f" (factor {draw.factor:g} for {draw.iterations} iterations)" if draw.kind == "slow" else ""
        self.say(f"arming {draw.kind} at phase {draw.phase} in launch rank {rank} (pid {proc.pid}){detail}: {spec}")
        (self.slowed if draw.kind == "slow" else self.doomed).add(rank)
        if draw.kind != "slow":
            self.pending[rank] = (proc.pid, draw.phase in faults.FORMATION_PHASES)
        keys.quietly(keys.arm, self.shared, rank, draw.to_json())

    def _inject(self, rank: int, action: str, spec: str) -> None:
        proc = self.processes().get(rank)
        if proc is None or proc.poll() is not None:
            return
        now = time.time()
        self.say(f"injecting {action} of launch rank {rank} (pid {proc.pid}) from outside: {spec}")
        if action == "kill":
            self.notes[rank] = (now, "was killed by signal SIGKILL (injected by the launcher)")
            _signal(proc.pid, signal.SIGKILL)
        else:  # hang: the process stops; the fence does the rest
            self.hung.add(rank)
            _signal(proc.pid, signal.SIGSTOP)


def still_s(unchanged_s: float, age_s: float, stale_s: float) -> float:
    """How long a rank's progress is known to have stood still: its count has not changed for ``unchanged_s``, read
    from a heartbeat ``age_s`` old; 0 (unknown, not still) when that beat is older than ``stale_s`` (its thread was
    held up, by a main thread holding the GIL say: the rank may well be working)."""
    return 0.0 if age_s > stale_s else unchanged_s


def wall_time(monotonic: float) -> float:
    """The wall-clock time of an instant of this host's monotonic clock, for reports only (never compared)."""
    return time.time() - (time.monotonic() - monotonic)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
