"""The wait escape (``patches/torch_distributed_work.py``) with real gloo processes.

gloo wakes no one waiting on a message in mid-transfer when its pair fails. Made deterministic here: rank 1
posts a receive of 64 MB and stops (SIGSTOP), rank 0 sends — the kernel takes a few MB, the rest stays in
gloo's send queue — then rank 0's generation ends and its watchdog shuts the sockets down. Upstream's wait
then sleeps until the collective timeout; with the escape the rank is out within a fraction of a second.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

NUMEL = 16 * 1024 * 1024  # 64 MB of float32: far more than loopback's socket buffers hold
GROUP_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(port: int, timeout_s: float = 60.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _receiver(port: int) -> None:
    import torch

    store = _client(port)
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=1, world_size=2,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    buffer = torch.empty(NUMEL)
    dist.irecv(buffer, src=0)
    time.sleep(0.2)  # the "ready to receive" notice reaches rank 0
    store.set("receiver", str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)  # the whole process, gloo's threads included, stops reading
    time.sleep(3600)


def _sender(port: int, escape: bool) -> None:
    import torch

    from ntp_megatron.elastic import keys
    from ntp_megatron.elastic.watchdog import GenerationWatchdog, SocketScope, store_factory
    from ntp_megatron.patches import torch_distributed_work

    torch_distributed_work.apply()
    store = _client(port)
    with SocketScope() as scope:
        dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", _client(port)), rank=0, world_size=2,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    watchdog = GenerationWatchdog(store_factory("127.0.0.1", port), 0, scope.sockets, 60.0)
    if escape:
        torch_distributed_work.set_escape(watchdog)
    receiver = int(store.get("receiver").decode())
    while not _stopped(receiver):
        time.sleep(0.01)
    work = dist.isend(torch.ones(NUMEL), dst=1)
    time.sleep(0.2)  # the kernel's buffers fill; the rest of the message waits in gloo's send queue
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


def _run(escape: bool) -> list[str]:
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True, timeout=timedelta(seconds=60),
                           wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    receiver = ctx.Process(target=_receiver, args=(port,), daemon=True)
    sender = ctx.Process(target=_sender, args=(port, escape), daemon=True)
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
    assert float(seconds) < 1.0, seconds  # grace 0.2 s + one 50 ms slice, not the 30 s group timeout
    assert finished == "[False]"  # the helper thread is still blocked: the group must be held, not destroyed


def test_collective_waits_in_slices_and_keeps_its_own_outcome():
    """With an escape installed and no reason to give up, a collective returns its result and a failed one
    raises its own error; once the escape gives a reason, a collective a peer never joins is given up."""
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True, timeout=timedelta(seconds=60),
                           wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_collective_rank, args=(port, rank), daemon=True) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        master.wait(["result"], timedelta(seconds=60))
        result = master.get("result").decode()
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
    summed, abandoned_after, error = result.split("|")
    assert summed == "3.0"
    assert float(abandoned_after) < 0.5, abandoned_after
    assert "CollectiveAbandoned" not in error and error, error


class _SwitchEscape:
    def __init__(self) -> None:
        self.over: bool = False
        self.waits: list = []

    def reason(self):
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
    escape = _SwitchEscape()
    torch_distributed_work.set_escape(escape)
    t = torch.full((4,), float(rank + 1))
    time.sleep(0.3 * rank)  # rank 0 waits several slices for rank 1
    dist.all_reduce(t)
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
    store.set("result", f"{t[0].item()}|{abandoned_after}|{error}")
    os._exit(0)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-v"])
