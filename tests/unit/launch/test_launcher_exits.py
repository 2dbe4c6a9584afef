"""The launcher's monitor ends the job only once every rank's exit has been handled: ``poll()`` can say a process
has exited before its relay has delivered the exit (a death the policy must still see; seen in the suite as a node
that printed "all 0 ranks finished" and exited 0 while its ranks had stopped on a peer's failure)."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest

from ntp_megatron.config import timing
from ntp_megatron.launch import launcher, policy


class Exited:
    def __init__(self, rank: int) -> None:
        self.rank, self.pid, self.ended_at = rank, 1000 + rank, None

    def poll(self) -> int:
        return 3


def monitor(ranks: dict) -> launcher.Launcher:
    mon = object.__new__(launcher.Launcher)
    mon.processes = SimpleNamespace(ranks=ranks, exits=queue.Queue())
    mon.finished, mon._collected, mon._exited_since = set(), set(), None
    mon.agent, mon.store = None, None
    return mon


def test_a_rank_that_has_exited_is_not_done_until_its_exit_is_handled(monkeypatch):
    procs = {2: Exited(2), 3: Exited(3)}
    mon = monitor(procs)
    assert not mon._all_collected()  # both exited, neither exit delivered yet
    monkeypatch.setattr(launcher, "reported_error", lambda store, rank, pid=None: None)
    for proc in procs.values():
        mon.processes.exits.put((proc, 3))
    deaths = mon._collect_exits()
    assert [d.launch_rank for d in deaths] == [2, 3]  # the policy sees both deaths
    assert mon._all_collected()


def test_an_exit_never_delivered_ends_the_wait_after_a_bound():
    mon = monitor({0: Exited(0)})
    assert not mon._all_collected()
    mon._exited_since -= timing.current().exit_delivery_s + 0.1  # as if that long had passed
    assert mon._all_collected()


@pytest.mark.parametrize("training_done, exits, code, line", [
    (True, {2: 0, 3: 0}, 0, "all 2 ranks finished"),
    (True, {2: 0, 3: -9}, 0, "all 1 ranks finished"),  # a rank of a job that finished died at its end
    (False, {2: 0, 3: 0}, 0, "all 2 ranks finished"),  # retired cleanly with a replica dropped live
    # What a node that lost node 0 met: its ranks failed, nothing finished. A scheduler must not see a success.
    (False, {2: 1, 3: 4}, 1, "every rank of this node has ended and the job did not finish: launch rank(s) 2, 3 failed"),
    (False, {}, 0, "all 0 ranks finished"),
])
def test_a_node_exits_0_only_if_the_job_finished_or_its_ranks_ended_cleanly(training_done, exits, code, line):
    assert policy.ending(training_done, exits) == (code, line)
