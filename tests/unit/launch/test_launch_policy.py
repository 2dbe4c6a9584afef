"""Node 0's NTP policy over the real controller on an in-memory store: the ranks' side of each generation (forming
it, a replacement announcing itself) is played by the test, processes are stand-ins.

A slot that fails again after its replacement was admitted gets a replacement again, however often: the
``ntp.max_rejoin_attempts`` bound is on failed attempts in a row, and an admission ends the row.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch.distributed as dist

from ntp_megatron.config.schema import load_job_config
from ntp_megatron.elastic import commit, keys
from ntp_megatron.elastic.commit import note_aware
from ntp_megatron.elastic.controller import Death
from ntp_megatron.launch import modes
from ntp_megatron.launch.console import Console
from ntp_megatron.launch.forkserver import Child
from ntp_megatron.launch.nodes import Nodes
from ntp_megatron.launch.ntp import ControllerPolicy
from ntp_megatron.plan.placement import launch_slots


class _Proc:
    def __init__(self, rank: int, pid: int) -> None:
        self.rank, self.child = rank, Child(pid)
        self.pid = pid

    def poll(self):
        return self.child.returncode

    def die(self) -> Death:
        self.child._exited(-9, time.time())
        return Death(self.rank, time.time(), "was killed by signal SIGKILL", self.pid)


class _Processes:
    """What the policy asks of a node's processes; ``start`` makes a stand-in process."""

    def __init__(self) -> None:
        self.ranks = {rank: _Proc(rank, 100 + rank) for rank in range(4)}
        self.spares: list = []
        self.started: list[int] = []

    def start(self, rank: int, env: dict, fresh: bool = False) -> _Proc:
        self.started.append(rank)
        self.ranks[rank] = _Proc(rank, 1000 + len(self.started))
        return self.ranks[rank]

    def idle_spare(self):
        return None

    def dead_spares(self) -> list:
        return []

    def record_pids(self) -> None:
        pass

    def dump_stacks(self, ranks: list[int]) -> None:
        pass


class _Sink:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)


class _Launcher:
    def __init__(self, *overrides: str) -> None:
        self.cfg = load_job_config(None, ["ntp.enabled=true", "ntp.rejoin_after_s=0", *overrides])
        self.args = argparse.Namespace(nnodes=1, node_rank=0)
        self.start = None
        self.store = dist.HashStore()
        self.console = Console()
        self.console.sink = _Sink()
        self.nodes = Nodes(1, 0, "127.0.0.1", 0, 60.0, self.console.say)
        self.processes = _Processes()
        self.agent = None
        self.local_ranks = [0, 1, 2, 3]
        self.launch_slots = launch_slots(2, 2, self.cfg.topology())
        self.world_size, self.failures, self.restarts, self.finished = 4, [], 0, set()

    def rank_env(self, rank: int, joining: bool = False) -> dict:
        return {}

    def spare_env(self) -> dict:
        return {}

    def events(self, name: str) -> list[dict]:
        return [r for r in self.console.sink.records if r.get("event") == name]


def _formed(launcher: _Launcher, generation: int) -> None:
    """The ranks of ``generation`` finished forming it (as the last ready rank records)."""
    launcher.store.set(commit.COMPLETED, str(generation))


def _aware(launcher: _Launcher, generation: int) -> None:
    """The survivors noticed that ``generation`` is over."""
    for rank in (0, 1, 2):
        note_aware(launcher.store, generation, rank, time.time())


def test_a_slot_that_fails_four_times_gets_its_fourth_replacement():
    launcher = _Launcher("ntp.max_rejoin_attempts=3")
    ntp = modes.choose(launcher)
    assert isinstance(ntp, ControllerPolicy)
    ntp.begin()
    generation = 0
    _formed(launcher, generation)
    for failure in range(1, 5):
        death = launcher.processes.ranks[3].die()
        assert ntp.step([death]) is None  # absorbed: generation + 1 without launch rank 3
        _aware(launcher, generation)
        generation += 1
        _formed(launcher, generation)
        assert ntp.step([]) is None  # the replacement is due at once (rejoin_after_s 0)
        assert launcher.processes.started == [3] * failure, f"failure {failure}: no replacement started"
        launcher.store.set(keys.joining(3), "{}")  # the replacement announces itself ...
        assert ntp.step([]) is None  # ... and is admitted: generation + 1 with launch rank 3
        generation += 1
        assert ntp.controller.latest.generation == generation
        _formed(launcher, generation)
        assert ntp.step([]) is None
    ntp.close()
    assert [e["attempt"] for e in launcher.events("replacement_started")] == [1, 1, 1, 1]
    assert [e["launch_rank"] for e in launcher.events("rank_failed")] == [3, 3, 3, 3]


def test_replacements_that_die_before_their_admission_are_bounded():
    """The bound itself: replacements in a row that die before they are admitted — the first one started while
    the degraded generation still forms (the completed one before it has the slot: its dead process's) — then
    none."""
    launcher = _Launcher("ntp.max_rejoin_attempts=3")
    ntp = modes.choose(launcher)
    ntp.begin()
    _formed(launcher, 0)
    ntp.step([launcher.processes.ranks[3].die()])
    for attempt in range(1, 4):
        ntp.step([])
        assert launcher.processes.started == [3] * attempt
        if attempt == 1:
            _aware(launcher, 0)
            _formed(launcher, 1)
            ntp.step([])
        ntp.step([launcher.processes.ranks[3].die()])  # dies while booting: never admitted
    ntp.step([])
    ntp.close()
    assert launcher.processes.started == [3, 3, 3]
    assert [e["attempt"] for e in launcher.events("replacement_started")] == [1, 2, 3]


def test_a_replacement_admitted_at_the_last_boundary_is_stopped_when_the_run_completes(monkeypatch):
    """Launch rank 3 died; its replacement is admitted (generation 2 published, asking generation 1 to move at the
    next iteration boundary), but the other ranks complete the run first and never cross it. The replacement,
    waiting in generation 2's formation, is stopped, and its exit is not a failure of the job."""
    from ntp_megatron.launch import rejoin

    stopped = []
    monkeypatch.setattr(rejoin, "signal_group", lambda pid, sig: stopped.append(pid))
    launcher = _Launcher()
    ntp = modes.choose(launcher)
    ntp.begin()
    _formed(launcher, 0)
    ntp.step([launcher.processes.ranks[3].die()])
    _aware(launcher, 0)
    _formed(launcher, 1)
    ntp.step([])
    replacement = launcher.processes.ranks[3]
    assert launcher.processes.started == [3]
    launcher.store.set(keys.joining(3), "{}")
    ntp.step([])
    assert ntp.controller.latest.generation == 2 and ntp.admitted(3)  # published, never formed
    ntp.rank_finished(0)  # a rank of generation 1 completed the run
    ntp.step([])
    assert stopped == [replacement.pid]
    assert launcher.store.check([keys.stopped_at_end(3)])  # whichever node's controller sees the exit reads it
    assert ntp.step([replacement.die()]) is None
    assert ntp.controller.failures == 1, "the stopped replacement is no failure"
    ntp.step([launcher.processes.ranks[1].die()])  # a rank that trained, dying now: a failure as ever
    assert ntp.controller.failures == 2
    for rank in range(4):  # every survivor noticed, so that the report of rank 1's death does not wait for them
        note_aware(launcher.store, 2, rank, time.time())
    ntp.close()
    assert sorted(e["launch_rank"] for e in launcher.events("rank_failed")) == [1, 3]  # reported by threads


# -- a rank's own error stops the job in every mode ------------------------------------------------------------------

class _StoppingProcesses(_Processes):
    def __init__(self) -> None:
        super().__init__()
        self.stopped = 0

    def stop_all(self) -> None:
        self.stopped += 1

    def live(self) -> list:
        return []

    def stalled(self) -> list:
        return []


def _error_death(launcher: _Launcher, rank: int) -> Death:
    """What the launcher makes of a rank that reported an error of its own and exited 1."""
    launcher.processes.ranks[rank].child._exited(1, time.time())
    return Death(rank, time.time(), "failed with an error of its own (iteration 3, phase checkpoint): OSError: x",
                 100 + rank, error="OSError: [Errno 30] Read-only file system: '/ck'")


def test_a_rank_error_is_not_restarted_from_a_checkpoint_without_ntp(tmp_path):
    launcher = _Launcher("ntp.enabled=false", f"checkpoint.save={tmp_path}", "checkpoint.save_interval=2")
    launcher.processes = _StoppingProcesses()
    respawned = []
    launcher.respawn = lambda: respawned.append(True)
    policy = modes.choose(launcher)
    assert type(policy).__name__ == "RestartFromCheckpoint"
    policy.begin()
    echo = Death(1, time.time() - 1, "stopped after another rank's failure broke its collectives (exit code 3)", 101)
    assert policy.step([echo, _error_death(launcher, 2)]) == 1  # the job ends: no restart
    assert respawned == [] and launcher.restarts == 0 and launcher.processes.stopped >= 1
    failed = launcher.events("rank_failed")
    assert [e["launch_rank"] for e in failed] == [2], failed  # the error, not the echo, is named


def test_without_ntp_the_error_a_rank_only_echoed_is_not_the_one_named(tmp_path):
    """A failed checkpoint write reaches every rank of the save; the one that gathered the results names the
    cause, the others report an echo of it, earlier or not."""
    launcher = _Launcher("ntp.enabled=false", f"checkpoint.save={tmp_path}", "checkpoint.save_interval=2")
    launcher.processes = _StoppingProcesses()
    policy = modes.choose(launcher)
    policy.begin()
    echo = _error_death(launcher, 1)
    echo = Death(1, echo.time - 1, echo.cause, echo.pid, error="CheckpointError: a write failed on another rank",
                 echo=True)
    assert policy.step([echo, _error_death(launcher, 2)]) == 1
    assert [e["launch_rank"] for e in launcher.events("rank_failed")] == [2]


def test_without_ntp_an_echo_that_dies_first_waits_for_the_report_of_the_cause(tmp_path):
    launcher = _Launcher("ntp.enabled=false", f"checkpoint.save={tmp_path}", "checkpoint.save_interval=2")
    launcher.processes = _StoppingProcesses()
    policy = modes.choose(launcher)
    policy.begin()
    echo = _error_death(launcher, 1)
    echo = Death(1, echo.time, echo.cause, echo.pid, error="CheckpointError: another rank failed", echo=True)
    report = ('{"error": "CheckpointError: this rank\'s write failed: OSError: [Errno 28] No space left on device", '
              '"iteration": 2, "phase": "checkpoint", "time": 0, "echo": false}')
    timer = threading.Timer(0.3, lambda: launcher.store.set(keys.rank_error(3), report))
    timer.start()
    try:
        assert policy.step([echo]) == 1
    finally:
        timer.join()
    [failed] = launcher.events("rank_failed")
    assert failed["launch_rank"] == 3 and "No space left" in failed["cause"] and failed["iteration"] == 2


def test_under_ntp_an_own_error_is_the_job_stopped_event_not_a_failure():
    """docs/metrics.md: a rank's own error under NTP is recorded as the job_stopped event only, naming the rank and
    where it failed; the summary's failures (and the plot) count rank_failed events, and a kill earlier in the run
    is one. (Seen failing when the controller emitted the error as a rank_failed event: failures 2.)"""
    from ntp_megatron.launch.run_report import summarize

    launcher = _Launcher()
    launcher.processes = _StoppingProcesses()
    policy = modes.choose(launcher)
    policy.begin()
    _formed(launcher, 0)
    assert policy.step([launcher.processes.ranks[3].die()]) is None  # absorbed: generation 1
    _aware(launcher, 0)
    policy.close()  # the failure's report is written
    _formed(launcher, 1)
    launcher.store.set(keys.rank_error(2), '{"error": "OSError: x", "iteration": 7, "phase": "checkpoint", "time": 5}')
    assert policy.step([_error_death(launcher, 2)]) == 1
    assert [e["launch_rank"] for e in launcher.events("rank_failed")] == [3]
    [stopped] = launcher.events("job_stopped")
    assert "launch rank 2 failed with an error of its own (iteration 7, phase checkpoint)" in stopped["reason"]
    assert (stopped["launch_rank"], stopped["replica"], stopped["slot"], stopped["iteration"], stopped["phase"]) == \
        (2, 1, 0, 7, "checkpoint")
    assert summarize(launcher.console.sink.records, 10.0)["failures"] == 1


def test_a_rank_error_is_not_restarted_by_ntp_on_unrecoverable_restart(tmp_path):
    launcher = _Launcher("ntp.on_unrecoverable=restart", f"checkpoint.save={tmp_path}", "checkpoint.save_interval=2")
    launcher.processes = _StoppingProcesses()
    launcher.relaunch = lambda cfg, start: (_ for _ in ()).throw(AssertionError("restarted"))
    policy = modes.choose(launcher)
    assert type(policy).__name__ == "RestartSurvivorsPolicy"
    policy.begin()
    _formed(launcher, 0)
    launcher.store.set(keys.rank_error(2), '{"error": "OSError: x", "iteration": 3, "phase": "checkpoint", "time": 0}')
    assert policy.step([_error_death(launcher, 2)]) == 1
    assert launcher.restarts == 0 and launcher.store.check([keys.STOP])
    assert "error of its own" in launcher.store.get(keys.STOP).decode()
