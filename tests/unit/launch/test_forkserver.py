"""The launcher's fork server: every process it starts — run in place (a fork) or a fresh program (exec) — reports
its exit, and dies with the launcher however the launcher dies, from its first instruction.

The "launcher" here is a fork of the test process that makes a fork server and starts two children through it, one
of each kind; the test SIGKILLs that launcher alone (as the OOM killer would) and every process of the tree must be
gone. A child whose parent died before it armed the parent-death signal must end at once too.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time

import psutil
import pytest

from ntp_megatron.launch.forkserver import ForkServer
from ntp_megatron.training import runtime
from tests.harness import alive

SLEEPER = ["/bin/sleep", "600"]


def idle() -> int:
    """A child's target: wait to be killed."""
    signal.pause()
    return 0


def exits_7() -> int:
    return 7


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive(pids)


def _start(server: ForkServer, **how):
    out_r, out_w = os.pipe()
    try:
        return server.start(dict(os.environ), out_w, out_w, "ntp-test", **how)
    finally:
        os.close(out_w)
        os.close(out_r)


def test_children_report_their_exit():
    server = ForkServer()
    try:
        in_place = _start(server, target=f"{__name__}:exits_7")
        program = _start(server, argv=["/bin/sh", "-c", "exit 3"])
        killed = _start(server, target=f"{__name__}:idle")
        os.kill(killed.pid, signal.SIGKILL)
        for child in (in_place, program, killed):
            assert child.wait(timeout=30)
        assert (in_place.returncode, program.returncode, killed.returncode) == (7, 3, -signal.SIGKILL)
        assert all(c.ended_at is not None and abs(c.ended_at - time.time()) < 30 for c in (in_place, program, killed))
    finally:
        server.close()


@pytest.mark.parametrize("how", ["target", "argv"])
def test_every_process_dies_with_a_sigkilled_launcher(how):
    read, write = os.pipe()
    launcher = os.fork()
    if launcher == 0:  # the launcher: a fork server, a child through it, then it waits to be killed
        try:
            os.close(read)
            server = ForkServer()
            child = _start(server, **({"target": f"{__name__}:idle"} if how == "target" else {"argv": SLEEPER}))
            os.write(write, json.dumps({"server": server.pid, "child": child.pid}).encode())
            signal.pause()
        finally:
            os._exit(1)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 30)
        assert ready, "the launcher did not start its children"
        pids = json.loads(os.read(read, 4096))  # one small write: whole (the server holds the pipe open)
        assert alive([pids["server"], pids["child"]]) == [pids["server"], pids["child"]]
        assert psutil.Process(pids["child"]).ppid() == pids["server"]
    finally:
        os.close(read)
        os.kill(launcher, signal.SIGKILL)
        os.waitpid(launcher, 0)
    left = _wait_gone([pids["server"], pids["child"]], timeout=10)
    for pid in left:  # a broken build leaves them: end them here, not with the session
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_a_child_whose_parent_died_before_it_armed_the_signal_ends():
    """``die_with_parent`` compares the parent it should have with the one it has: a child reparented before the
    signal was armed would otherwise run on with nobody to kill it."""
    pid = os.fork()
    if pid == 0:
        runtime.die_with_parent(os.getppid() + 1_000_000)  # as if our parent were gone already
        os._exit(0)  # not reached
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
