"""The report of a batch of deaths (launcher side): one ``rank_failed`` event and log line per death, written once
the survivors noticed it, so the detection latency is known.

The controller publishes the next generation at once and leaves the waiting to a thread of this module: the
survivors note that their generation is over (:func:`ntp_megatron.elastic.commit.note_aware`), and the report reads
their notes from the store with two small requests per pass (one count, then every note once the count says they
are all in), never one request per survivor per pass.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Callable, Optional

import torch.distributed as dist

from ntp_megatron.config import timing
from ntp_megatron.elastic import commit, keys
from ntp_megatron.plan.stages import JobTopology, named_stage



def injected_failure(store: dist.Store, launch_rank: int, pid: Optional[int] = None) -> Optional[dict]:
    """What an injected failure of process ``pid`` recorded just before it happened (spec, phase, iteration, time), if
    any."""
    try:
        return keys.injected_failure(store, launch_rank, pid)
    except Exception:  # noqa: BLE001
        pass
    return None


class FailureReports:
    """Reports of the controller's batches of deaths, each from a thread of its own (bounded by
    ``timing.report_wait_s``)."""

    def __init__(self, store: dist.Store, identity: dict[int, tuple[int, ...]], dead: set[int], policy: str,
                 say: Callable[[str], None], emit: Callable[[dict], None],
                 dump_stacks: Callable[[list[int]], None] = lambda ranks: None,
                 hold: Callable[[], None] = lambda: None, release: Callable[[], None] = lambda: None) -> None:
        """``identity``: launch rank -> (replica, slot[, stage]); ``dead``: the controller's set of dead launch ranks
        (read live: a survivor that dies while a report waits cannot notice). ``hold`` / ``release``: hold the ranks'
        output back while a report waits, so that what they print about the failure comes after its line."""
        self.store, self.identity, self.dead, self.policy = store, identity, dead, policy
        self.say, self.emit, self.dump_stacks = say, emit, dump_stacks
        self.hold, self.release = hold, release
        self._threads: list[threading.Thread] = []

    def start(self, deaths: list, old: JobTopology, settled: Optional[dict]) -> None:
        """Report ``deaths`` once the survivors of ``old`` noticed them, from a thread (the controller moves on)."""
        survivors = [lr for lr, slot in self.identity.items()
                     if old.rank_of(*slot) is not None and lr not in self.dead]

        def report() -> None:
            try:
                self.report(deaths, old, settled, survivors)
            finally:
                self.release()

        self.hold()
        thread = threading.Thread(target=report, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        """Wait (bounded) for the reports still waiting on survivors, before the store goes away."""
        deadline = time.monotonic() + timing.current().report_wait_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def report(self, deaths: list, old: JobTopology, settled: Optional[dict], survivors: list[int],
               wait_s: Optional[float] = None) -> None:
        """Wait up to ``wait_s`` for ``survivors`` to note the end of ``old``'s generation, then write the report
        (``wait_s`` 0: nobody re-forms, report now; None: ``timing.report_wait_s``)."""
        wait_s = timing.current().report_wait_s if wait_s is None else wait_s
        outcome = self._wait_aware(old.generation, survivors, wait_s)
        if outcome is None:
            return  # the store is shutting down with the job
        aware, missing, survivors = outcome
        if missing:
            self.say(f"launch ranks {missing} did not notice the failure within {wait_s:.0f} s; "
                     "their stacks follow")
            self.dump_stacks(missing)
        for d in deaths:
            self._report_one(d, old, settled, aware, bool(survivors))

    def _wait_aware(self, generation: int, survivors: list[int],
                    wait_s: float) -> Optional[tuple[list[float], list[int], list[int]]]:
        """(when each survivor noted the end, those that did not within ``wait_s``, the survivors still alive); None
        if the store is gone."""
        deadline = time.monotonic() + wait_s
        aware: list[float] = []
        stopped = False
        full_check_at = 0.0
        while time.monotonic() < deadline and survivors:
            survivors = [lr for lr in survivors if lr not in self.dead]  # one that died meanwhile cannot notice
            try:
                if keys.is_stopped(self.store):  # the job stops: the survivors are being ended, not noticing
                    stopped = True
                    break
                # Two small requests per pass (one per survivor would load the root with the job's size every
                # 10 ms just after a failure); the count may include ranks that noted and died since, so every
                # survivor's note is checked (one request) once it says all are in.
                if (commit.aware_count(self.store, generation) >= len(survivors)
                        and time.monotonic() >= full_check_at):
                    got = self._aware(generation, survivors)
                    if got is not None:
                        aware = got
                        break
                    full_check_at = time.monotonic() + timing.current().report_full_check_s
            except Exception:  # noqa: BLE001 - the store is shutting down with the job
                return None
            time.sleep(timing.current().report_poll_s)
        missing: list[int] = []
        if survivors and not aware and not stopped and wait_s > 0:  # out of time: name the ranks that did not notice
            try:
                missing = [lr for lr in survivors if not commit.noted_aware(self.store, generation, lr)]
                if not missing:  # all noted, the count short of them (a note's count lost with its rank's request)
                    aware = self._aware(generation, survivors) or []
            except Exception:  # noqa: BLE001 - as above
                return None
        return aware, missing, survivors

    def _aware(self, generation: int, survivors: list[int]) -> Optional[list[float]]:
        """When each survivor noted that ``generation`` is over, if every one did (one request each way)."""
        return commit.aware_times(self.store, generation, survivors)

    def _report_one(self, d, old: JobTopology, settled: Optional[dict], aware: list[float], survivors: bool) -> None:
        replica, slot = self.identity[d.launch_rank][:2]
        stage = self.stage(d.launch_rank)
        record = injected_failure(self.store, d.launch_rank, d.pid)
        failed_at = record["time"] if record else d.time
        if aware:
            # The failure happened no later than the first survivor noticed it. A death known only from its exit is
            # stamped when the launcher reaped it, which can be after its direct peers saw their connections close
            # (and clocks of other nodes differ).
            failed_at = min(failed_at, min(aware))
        detect_s = (max(aware) - failed_at) if aware else None
        iteration = record["iteration"] if record else (settled or {}).get("iteration")
        phase = record["phase"] if record else "unknown"
        self.emit({"kind": "event", "event": "rank_failed", "launch_rank": d.launch_rank, "replica": replica,
                   "slot": slot, **stage, "generation": old.generation, "iteration": iteration, "phase": phase,
                   "cause": d.cause, "detect_s": detect_s, "time": failed_at})
        stamp = datetime.fromtimestamp(failed_at).strftime("%Y-%m-%d %H:%M:%S")
        aware_text = (f"{len(aware)} survivors aware in {detect_s:.3f} s" if aware
                      else "survivors not all aware" if survivors else f"beyond NTP (policy {self.policy!r})")
        where = f"replica {replica}, slot {slot}" + "".join(f", stage {p}" for p in stage.values())
        self.say(f"[{stamp}] rank failed | launch rank {d.launch_rank} ({where}) | "
                 f"iteration {iteration}, phase {phase} | {d.cause} | {aware_text}")

    def stage(self, launch_rank: int) -> dict:
        """``{"stage": p}`` for a launch rank of a job with pipeline stages (its identity names it), else empty."""
        stage = named_stage(self.identity[launch_rank])
        return {} if stage is None else {"stage": stage}
