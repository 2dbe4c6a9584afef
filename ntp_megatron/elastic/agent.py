"""The launcher's hands on its own ranks: fencing ranks that stopped responding, and controller-side failures.

*Fencing.* Every rank writes a heartbeat to the store (:class:`ntp_megatron.elastic.watchdog.Heartbeat`). A
rank silent for ``ntp.heartbeat_timeout_s`` — SIGSTOPped, or stuck so hard that even its heartbeat thread
cannot run — is SIGKILLed before anything else happens, so it can never come back and write; the reaper then
reports it dead like any other. *Injected failures from outside*: ``kill:rank=R,after=S`` and
``random:mtbf=S,...`` (:mod:`ntp_megatron.faults`) are executed here, on the ranks this launcher started.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Optional, Protocol

import torch.distributed as dist

from ntp_megatron import faults
from ntp_megatron.elastic import keys


class _Process(Protocol):
    rank: int
    pid: int

    def poll(self) -> Optional[int]: ...


class Agent:
    def __init__(self, store: dist.Store, processes: Callable[[], dict[int, _Process]], heartbeat_timeout_s: float,
                 startup_grace_s: float, specs: list, say: Callable[[str], None],
                 live: Callable[[], list[int]], fence: bool = True) -> None:
        self.store = store
        self.processes = processes
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_grace_s = startup_grace_s
        self.say = say
        self.live = live
        self.fence = fence
        """Fence by heartbeat (only ranks of an NTP job beat)."""
        self.started = time.time()
        self.notes: dict[int, tuple[float, str]] = {}
        """Launch rank -> (when, what) for ranks this agent killed: their death time and cause."""
        self._timed = sorted((s.after_s, s.rank) for s in specs if isinstance(s, faults.TimedKill))
        self._random = [(s, s.schedule()) for s in specs if isinstance(s, faults.RandomFailures)]
        self._next_random = [(s, next(gen, None), gen) for s, gen in self._random]

    def poll(self) -> None:
        now = time.time()
        self._fence(now)
        self._fire_timed(now)
        self._fire_random(now)

    def _fence(self, now: float) -> None:
        if not self.fence:
            return
        for rank, proc in self.processes().items():
            if proc.poll() is not None or rank in self.notes:
                continue
            key = keys.heartbeat(rank)
            try:
                last = float(self.store.get(key).decode()) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - the store is going away with the job
                return
            silent = now - (last if last is not None else self.started)
            limit = self.heartbeat_timeout_s if last is not None else self.startup_grace_s
            if silent > limit:
                # The rank stopped at about its last heartbeat: that is when it failed.
                self.notes[rank] = (last if last is not None else now,
                                    f"hung: fenced after {silent:.1f} s without a heartbeat")
                self.say(f"launch rank {rank} (pid {proc.pid}) stopped responding for {silent:.1f} s: fencing it")
                _signal(proc.pid, signal.SIGKILL)

    def _fire_timed(self, now: float) -> None:
        while self._timed and now - self.started >= self._timed[0][0]:
            after, rank = self._timed.pop(0)
            self._inject(rank, "kill", f"kill:rank={rank},after={after:g}")

    def _fire_random(self, now: float) -> None:
        updated = []
        for spec, due, gen in self._next_random:
            while due is not None and now - self.started >= due[0]:
                local = self.processes()
                candidates = sorted(r for r in self.live() if r in local and local[r].poll() is None
                                    and r not in self.notes)
                if candidates:
                    victim = due[1].choice(candidates)
                    self._inject(victim, spec.action, str(spec))
                due = next(gen, None)
            updated.append((spec, due, gen))
        self._next_random = updated

    def _inject(self, rank: int, action: str, spec: str) -> None:
        proc = self.processes().get(rank)
        if proc is None or proc.poll() is not None:
            return
        now = time.time()
        self.say(f"injecting {action} of launch rank {rank} (pid {proc.pid}) from outside: {spec}")
        if action == "kill":
            self.notes[rank] = (now, "was killed by signal SIGKILL (injected by the launcher)")
            _signal(proc.pid, signal.SIGKILL)
        else:  # hang: the heartbeat stops; the fence does the rest
            _signal(proc.pid, signal.SIGSTOP)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
