"""The wait escape (``patches/torch_distributed_work.py``) with real gloo processes.

gloo wakes no one waiting on a message in mid-transfer when its pair fails. Made deterministic here: rank 1
posts a receive of 64 MB and stops (SIGSTOP), rank 0 sends — the kernel takes a few MB, the rest stays in
gloo's send queue — then rank 0's generation ends and its watchdog shuts the sockets down. Upstream's wait
then sleeps until the collective timeout; with the escape the rank is out within a fraction of a second.

Nothing here waits a fixed time: each step waits (bounded) for the state the next one needs — a small message
behind the receive's notice on the same socket, the receiver stopped, the sender's socket holding unsent bytes,
a given number of wait slices — and the processes meet on a store the test hosts on a port the OS picks.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.harness import store_client as _client
from tests.harness import store_server, wait_until

# Asserts how soon a wait is given up: scripts/test.sh runs it alone.
pytestmark = pytest.mark.timed

NUMEL = 16 * 1024 * 1024  # 64 MB of float32: far more than loopback's socket buffers hold
GROUP_TIMEOUT_S = 30.0
STEP_S = 20.0  # bound on each wait for a state


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _unsent_bytes(sockets: dict[int, str]) -> int:
    """Bytes the kernel holds in the send queues of ``sockets`` (``/proc/net/tcp``'s tx_queue, by inode)."""
    inodes = {ident[len("socket:["):-1] for ident in sockets.values()}
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[9] in inodes:
                    total += int(fields[4].split(":")[0], 16)
    return total


def _receiver(port: int) -> None:
    import torch

    store = _client(port)
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=1, world_size=2,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    buffer = torch.empty(NUMEL)
    dist.irecv(buffer, src=0)
    # A small message on the same socket, behind the receive's "ready to receive" notice: once rank 0 has it,
    # it has the notice too.
    dist.send(torch.zeros(1), dst=0)
    store.set("receiver", str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)  # the whole process, gloo's threads included, stops reading
    while True:  # stopped; the test kills it
        signal.pause()


def _sender(port: int, escape: bool) -> None:
    import torch

    from ntp_megatron.elastic import keys
    from ntp_megatron.elastic.watchdog import GenerationWatchdog, store_factory
    from ntp_megatron.sockets import SocketScope
    from ntp_megatron.patches import torch_distributed_work

    torch_distributed_work.apply()
    store = _client(port)
    with SocketScope() as scope:
        dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", _client(port)), rank=0, world_size=2,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    dist.recv(torch.empty(1), src=1)  # behind the receiver's notice: rank 1 is ready to receive
    watchdog = GenerationWatchdog(store_factory("127.0.0.1", port), 0, scope.sockets, 60.0)
    if escape:
        torch_distributed_work.set_escape(watchdog)
    receiver = int(store.get("receiver").decode())
    wait_until(lambda: _stopped(receiver), STEP_S, "the receiver stopping")
    work = dist.isend(torch.ones(NUMEL), dst=1)
    # The message is in mid-transfer once the kernel holds unsent bytes of it (the stopped receiver's buffer is
    # full); the rest of its 64 MB waits in gloo's send queue.
    wait_until(lambda: _unsent_bytes(scope.sockets) > 0, STEP_S, "the sender's socket holding unsent bytes")
    store.set(keys.abort(0), "test")  # the generation ends: the watchdog shuts its sockets down
    start = time.monotonic()
    if escape:
        try:
            work.wait()
            outcome = "returned"
        except torch_distributed_work.CollectiveAbandoned:
            outcome = "abandoned"
        finished = [wait.finished() for wait in watchdog.abandoned_waits]
        store.set("result", f"{outcome} {time.monotonic() - start:.3f} {finished}")
    else:
        import threading

        waiter = threading.Thread(target=lambda: _swallow(work.wait), daemon=True)
        waiter.start()
        waiter.join(3.0)
        store.set("result", f"{'blocked' if waiter.is_alive() else 'returned'} {time.monotonic() - start:.3f}")
    os._exit(0)


def _swallow(action) -> None:
    try:
        action()
    except Exception:  # noqa: BLE001 - only whether it returns matters here
        pass


def _context():
    """Fresh processes, not forks of this test process (whose threads and native thread pools a fork would
    copy), started from one server process that imported this module (torch.distributed with it) once: each skips
    the imports a spawned interpreter pays."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _run(escape: bool) -> list[str]:
    master = store_server()
    ctx = _context()
    receiver = ctx.Process(target=_receiver, args=(master.port,), daemon=True)
    sender = ctx.Process(target=_sender, args=(master.port, escape), daemon=True)
    receiver.start()
    sender.start()
    try:
        master.wait(["result"], timedelta(seconds=60))
        return master.get("result").decode().split(" ", 2)
    finally:
        for proc in (sender, receiver):
            proc.kill()
            proc.join(10)


def test_upstream_wait_sleeps_through_a_shutdown_in_mid_transfer():
    """The gloo behaviour the escape exists for (if a future torch fixes it, this test says so)."""
    outcome, seconds = _run(escape=False)
    assert outcome == "blocked", f"the wait returned after {seconds} s: gloo now wakes it, the escape may go"


def test_escape_gets_the_rank_out_at_once():
    outcome, seconds, finished = _run(escape=True)
    assert outcome == "abandoned"
    assert float(seconds) < 1.0, seconds  # grace 50 ms + one 50 ms slice, not the 30 s group timeout
    assert finished == "[False]"  # the helper thread is still blocked: the group must be held, not destroyed


def test_collective_waits_in_slices_and_keeps_its_own_outcome():
    """With an escape installed and no reason to give up, a collective returns its result and a failed one
    raises its own error; once the escape gives a reason, a collective a peer never joins is given up."""
    master = store_server()
    ctx = _context()
    procs = [ctx.Process(target=_collective_rank, args=(master.port, rank), daemon=True) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        master.wait(["result"], timedelta(seconds=60))
        result = master.get("result").decode()
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
    summed, slices, abandoned_after, error = result.split("|")
    assert summed == "3.0"
    assert int(slices) >= SLICES, slices  # the first all-reduce was waited on in slices until rank 1 joined
    assert float(abandoned_after) < 0.5, abandoned_after
    # gloo's own error for a peer that is gone, raised from a wait in slices: neither given up nor swallowed.
    assert error.split(":")[0] in ("RuntimeError", "DistBackendError", "DistNetworkError"), error


SLICES = 3
"""Wait slices rank 0 spends in the first all-reduce before rank 1 joins it."""


class _SwitchEscape:
    """Gives a reason to give up once ``over``; counts the slices waited and, after ``SLICES`` of them, lets the
    peer know (``on_slices``)."""

    def __init__(self, on_slices=lambda: None) -> None:
        self.over: bool = False
        self.waits: list = []
        self.slices = 0
        self.on_slices = on_slices

    def reason(self):
        self.slices += 1
        if self.slices == SLICES:
            self.on_slices()
        return "test: generation over" if self.over else None

    def abandoned(self, wait) -> None:
        self.waits.append(wait)


def _collective_rank(port: int, rank: int) -> None:
    import torch

    from ntp_megatron.patches import torch_distributed_work

    torch_distributed_work.apply()
    store = _client(port)
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    escape = _SwitchEscape(lambda: store.set("sliced", "1"))
    torch_distributed_work.set_escape(escape)
    t = torch.full((4,), float(rank + 1))
    if rank == 1:
        store.wait(["sliced"])  # rank 0 has waited SLICES slices for this all-reduce
    dist.all_reduce(t)
    slices = escape.slices
    if rank == 1:
        store.wait(["abandoned"])
        os._exit(0)  # never joins the next collective; dies after rank 0 gave up on it
    escape.over = True
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        abandoned_after = "not abandoned"
    except torch_distributed_work.CollectiveAbandoned:
        abandoned_after = f"{time.monotonic() - start:.3f}"
    store.set("abandoned", "1")
    escape.over = False
    try:
        dist.all_reduce(torch.ones(4))  # rank 1 is gone: gloo's own error, waited for in slices
        error = "no error"
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {str(exc)[:80]}"
    store.set("result", f"{t[0].item()}|{slices}|{abandoned_after}|{error}")
    os._exit(0)


# -- gloo's connect (patches/torch_distributed_c10d.py: EscapableGloo) ---------------------------------------------
# A two-rank group whose rank 1 dies after publishing its address: rank 0 (the survivor) reads it and, being the
# listener of the pair (gloo lets the side with the larger address connect: the victim's device is on 127.0.0.2, the
# survivor's on 127.0.0.1), waits for a connection that never comes — 5 x the group's timeout upstream.


def _gloo_options(host: str):
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    return options


def _victim(port: int) -> None:
    from torch.distributed import ProcessGroupGloo

    ProcessGroupGloo(dist.PrefixStore("gen0/", _client(port)), 1, 2, _gloo_options("127.0.0.2"))  # killed in here


def _connecting_survivor(port: int, escape: bool) -> None:
    from torch.distributed import distributed_c10d

    from ntp_megatron.elastic.watchdog import GenerationWatchdog, store_factory
    from ntp_megatron.patches import torch_distributed_c10d, torch_distributed_work

    torch_distributed_c10d.apply_connect_escape()
    store = _client(port)
    store.wait(["victim_dead"])
    # No socket of the generation is the watchdog's to shut: only the escape can get the rank out.
    watchdog = GenerationWatchdog(store_factory("127.0.0.1", port), 0, {}, 60.0)
    if escape:
        torch_distributed_work.set_escape(watchdog)
    make = lambda: distributed_c10d.ProcessGroupGloo(dist.PrefixStore("gen0/", _client(port)), 0, 2,
                                                     _gloo_options("127.0.0.1"))
    if escape:
        try:
            make()
            outcome = "connected"
        except torch_distributed_work.CollectiveAbandoned:
            outcome = "abandoned"
        after = time.time() - watchdog.fired_at
        finished = [(wait.what, wait.finished()) for wait in watchdog.abandoned_waits]
        store.set("result", f"{outcome}|{after:.3f}|{finished}")
    else:
        import threading

        connecting = threading.Thread(target=lambda: _swallow(make), daemon=True)
        connecting.start()
        connecting.join(3.0)
        store.set("result", f"{'blocked' if connecting.is_alive() else 'returned'}|{time.time() - watchdog.fired_at:.3f}")
    os._exit(0)


def _run_connect(escape: bool) -> list[str]:
    from ntp_megatron.elastic import keys

    master = store_server()
    ctx = _context()
    victim = ctx.Process(target=_victim, args=(master.port,), daemon=True)
    survivor = ctx.Process(target=_connecting_survivor, args=(master.port, escape), daemon=True)
    victim.start()
    survivor.start()
    published = lambda: [k for k in master.list_keys() if k.startswith("gen0/")]
    try:
        wait_until(lambda: len(published()) == 1, STEP_S, "the victim publishing its address")
        victim.kill()
        victim.join(STEP_S)
        master.set("victim_dead", "1")
        wait_until(lambda: len(published()) == 2, STEP_S, "the survivor publishing its address")
        master.set(keys.abort(0), "test")  # the generation ends while the survivor connects
        master.wait(["result"], timedelta(seconds=60))
        return master.get("result").decode().split("|")
    finally:
        for proc in (survivor, victim):
            proc.kill()
            proc.join(10)


def test_upstream_connect_waits_for_a_member_that_died_after_publishing_its_address():
    """The gloo behaviour the connect escape exists for (if a future torch bounds the wait, this test says so)."""
    outcome, seconds = _run_connect(escape=False)
    assert outcome == "blocked", f"the connect returned {seconds} s after the generation ended"


def test_connect_escape_gets_the_rank_out_once_its_generation_ends():
    outcome, seconds, finished = _run_connect(escape=True)
    assert outcome == "abandoned"
    assert float(seconds) < 1.0, seconds  # grace 50 ms + one 50 ms slice, not 5 x the 30 s group timeout
    # The helper thread is still in gloo's connect: the generation's groups must be held, not destroyed.
    assert finished == "[(\"gloo's connect of a process group\", False)]", finished


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-v"])
