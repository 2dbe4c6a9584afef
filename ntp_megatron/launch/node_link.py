"""The link from every other node's launcher to node 0's: how node 0 learns at once that a node's launcher is gone.

Node 0's launcher listens on a small TCP port of its own (:class:`LinkServer`; its address goes through the root
store, :func:`ntp_megatron.launch.nodes.publish_link`); every other node's launcher holds one connection to it
(:class:`LinkClient`), says which node and which launcher (pid) it is, then writes one byte every beat. The kernel
closes the connection when the launcher's process ends however it ends (SIGKILL included), so node 0 reads end of
file within milliseconds; a stopped host closes nothing but sends no beat. What the link says is timed on node 0's
own monotonic clock, and what it means is decided by :class:`ntp_megatron.launch.node_liveness.NodeLiveness`.

No torch here: plain sockets, one thread on each side. The sockets are not inherited by the ranks (Python's are
close-on-exec, and every rank is forked from the fork server, which was forked before any of them existed).
"""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

BEAT = b"."
BYE = b"!"
"""The launcher ends as it should (its ranks finished, or it stops the job): not a lost node."""


@dataclass(frozen=True)
class LinkEvent:
    """What node 0 read on a link: ``kind`` is ``connected``, ``heard`` (a beat), ``left`` (its launcher ended as it
    should) or ``closed``; ``at``: node 0's monotonic
    time, ``wall``: its wall clock (for the records)."""

    kind: str
    node: int
    pid: int
    at: float
    wall: float


class LinkServer:
    """Node 0's end: accepts the links and reads them in one thread; :meth:`events` hands over what was read."""

    def __init__(self, host: str = "0.0.0.0") -> None:
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._events: queue.SimpleQueue[LinkEvent] = queue.SimpleQueue()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._who: dict[socket.socket, Optional[tuple[int, int]]] = {}
        self._pending: dict[socket.socket, bytes] = {}
        self._drop: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ntp-node-links", daemon=True)
        self._thread.start()

    def events(self) -> list[LinkEvent]:
        """Everything read since the last call, in order."""
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def drop(self, node: int, pid: int) -> None:
        """Close ``pid``'s link (its node was declared lost: a launcher that resumes finds its link gone)."""
        self._drop.put((node, pid))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        for sock in [self._listener, *self._who]:
            sock.close()
        self._selector.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)
            self._drop_requested()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        self._who[sock] = None
        self._pending[sock] = b""
        self._selector.register(sock, selectors.EVENT_READ, None)

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        who = self._who.get(sock)
        if not data:
            self._forget(sock)
            if who is not None:
                self._emit("closed", *who)
            return
        if who is None:  # the hello: "node <n> <pid>\n"
            self._pending[sock] += data
            line, newline, rest = self._pending[sock].partition(b"\n")
            if not newline:
                return
            try:
                _, node, pid = line.decode().split()
                who = self._who[sock] = (int(node), int(pid))
            except ValueError:
                logger.warning("a node link said %r instead of its hello: closed", line[:80])
                self._forget(sock)
                return
            self._emit("connected", *who)
            data = rest
        if BYE in data:
            self._forget(sock)
            self._emit("left", *who)
        elif data:
            self._emit("heard", *who)

    def _drop_requested(self) -> None:
        while True:
            try:
                node, pid = self._drop.get_nowait()
            except queue.Empty:
                return
            for sock, who in list(self._who.items()):
                if who == (node, pid):
                    self._forget(sock)

    def _forget(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        self._who.pop(sock, None)
        self._pending.pop(sock, None)
        sock.close()

    def _emit(self, kind: str, node: int, pid: int) -> None:
        self._events.put(LinkEvent(kind, node, pid, time.monotonic(), time.time()))


class LinkClient:
    """Another node's end: connects to node 0's link, says hello, beats every ``beat_s`` until :meth:`close` (or
    until node 0 closes it: node 0 gone, or this node declared lost; the launcher learns either elsewhere)."""

    def __init__(self, host: str, port: int, node: int, pid: int, beat_s: float, connect_timeout_s: float) -> None:
        self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        self._sock.sendall(f"node {node} {pid}\n".encode())
        self._sock.settimeout(beat_s)
        self.beat_s = beat_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ntp-node-link", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._sock.sendall(BEAT)
            except OSError:
                return

    def close(self, clean: bool) -> None:
        """``clean``: the launcher ends as it should, and says so (node 0 then does not count the closed link as a
        lost node); otherwise node 0 reads end of file and counts the node's ranks lost."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        if clean:
            try:
                self._sock.sendall(BYE)
            except OSError:
                pass
        self._sock.close()
