"""The one process that starts every process of a launcher: single-threaded, forked before the launcher's threads.

Why a server: every process the launcher starts must die with it, from its first instruction, however it starts
(a fork that runs a rank in place, or a fresh interpreter) and however the launcher dies (SIGKILL included). The
kernel's parent-death signal (``PR_SET_PDEATHSIG``) does that, but it has to be armed in the child before it runs
anything else, and it fires when the *thread* that forked the child ends. A launcher with threads (log relays, the
store's loop, the controller's reports) cannot arm it safely: between ``fork`` and ``exec`` a child of a threaded
process may only make async-signal-safe calls, so subprocess's ``preexec_fn`` (Python code there) can deadlock on
a lock some other thread held at the fork, and arming it after ``exec`` leaves the whole interpreter start-up (the
torch and Megatron-Core imports, up to ~25 s under load) unprotected. This server is forked from the launcher's main
thread before it starts any thread of its own (a native library's worker pool, e.g. OpenMP's in the dataset build
before it, holds no lock the child's Python code takes) and stays single-threaded, so its children may run Python
between ``fork`` and ``exec``: each arms the signal first thing, and exits at once if its parent died before that
(``getppid``). The server arms it for itself the same way, so a launcher that dies takes the server with it, and
the server its children.

Protocol, over a ``SOCK_SEQPACKET`` socket pair (one JSON object per message, descriptors passed alongside):
the launcher sends ``{"env", "title", "argv" | "target", "pass_fd_env"}`` with the child's stdout and stderr write
ends (and an optional extra descriptor, whose number the child finds in its environment under ``pass_fd_env``);
the server forks, answers ``{"pid"}``, and later
``{"exit": pid, "returncode", "time"}`` when it reaps the child. ``argv``: the child ``exec``s it (a fresh
interpreter). ``target`` (``"module:function"``, imported already): the child runs it in place, as a fork of the
launcher's imports, and exits with its return value.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Callable, NoReturn, Optional

from ntp_megatron.config import timing
from ntp_megatron.training.runtime import die_with_parent, set_process_name

_MAX_MESSAGE = 1 << 20


class Child:
    """A process the server started: its pid, and its exit status once the server reaped it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self.ended_at: Optional[float] = None
        """When the server reaped it (wall clock)."""
        self._done = threading.Event()
        self._on_exit: list[Callable[["Child"], None]] = []
        self._lock = threading.Lock()

    def on_exit(self, callback: Callable[["Child"], None]) -> None:
        """Call ``callback(child)`` once it has exited (at once if it has)."""
        with self._lock:
            if not self._done.is_set():
                self._on_exit.append(callback)
                return
        callback(self)

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def _exited(self, returncode: int, ended_at: float) -> None:
        with self._lock:
            self.returncode, self.ended_at = returncode, ended_at
            self._done.set()
            callbacks, self._on_exit = self._on_exit, []
        for callback in callbacks:
            callback(self)


class ForkServer:
    """The launcher's side: :meth:`start` a child, learn of its exit. Create it before the launcher starts any
    thread; :meth:`close` ends the server (after every child has ended)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        launcher = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _serve(theirs, launcher)  # never returns
        theirs.close()
        self.pid, self._sock = pid, ours
        self._children: dict[int, Child] = {}
        self._started: list[Child] = []
        self._cond = threading.Condition()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="fork-server-reader", daemon=True)
        self._reader.start()

    def start(self, env: dict[str, str], stdout: int, stderr: int, title: str, argv: Optional[list[str]] = None,
              target: Optional[str] = None, pass_fd: Optional[tuple[str, int]] = None) -> Child:
        """Start a child with ``env``, its stdout and stderr on the given descriptors (which the caller closes
        after this returns); either ``exec`` ``argv`` or run ``target`` in place. ``pass_fd``: (environment
        variable, descriptor) — one more descriptor for the child, its number under that name."""
        request = {"env": env, "title": title, "argv": argv, "target": target,
                   "pass_fd_env": pass_fd[0] if pass_fd else None}
        fds = [stdout, stderr] + ([pass_fd[1]] if pass_fd is not None else [])
        with self._cond:
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            deadline = time.monotonic() + timing.current().process_start_timeout_s
            while not self._started:
                if self._closed or not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise RuntimeError("the launcher's fork server did not start the process")
            return self._started.pop(0)

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "pid" in message:
                child = Child(message["pid"])
                with self._cond:
                    self._children[child.pid] = child
                    self._started.append(child)
                    self._cond.notify_all()
            else:
                with self._cond:
                    child = self._children.pop(message["exit"], None)
                if child is not None:
                    child._exited(message["returncode"], message["time"])
        # The server is gone (closed, or killed): its children died with it (parent-death signal).
        with self._cond:
            self._closed = True
            orphans, self._children = list(self._children.values()), {}
            self._cond.notify_all()
        for child in orphans:
            child._exited(-signal.SIGKILL, time.time())

    def close(self) -> None:
        """End the server: it exits when its end of the socket closes (children still alive die with it)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(timeout=timing.current().fork_server_close_s)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


# -- the server process ------------------------------------------------------------------------------------------

def _serve(sock: socket.socket, launcher: int) -> None:
    """The server's loop: start children on request, report their exits. Never returns."""
    code = 0
    try:
        die_with_parent(launcher)
        set_process_name("ntp-forkserver")
        # Ctrl-C and a scheduler's SIGTERM are for the launcher, which stops the children in order; the server
        # ends when the launcher closes the socket or dies.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        server = os.getpid()
        while True:
            ready, _, _ = select.select([sock, wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 4096)
                _reap(sock)
            if sock in ready:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
                except OSError:
                    data, fds = b"", []
                if not data:
                    break
                # Everything imported so far lives as long as the child: a garbage collection there (one per
                # re-formation) skips it instead of walking it, seconds per pass otherwise (Python's gc docs).
                gc.freeze()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    for fd in (sock.fileno(), wake_r, wake_w):
                        os.close(fd)
                    _child(json.loads(data), fds, server)  # never returns
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"pid": pid}).encode())
    except BaseException:  # noqa: BLE001 - a broken server must end, and say why
        traceback.print_exc()
        code = 1
    os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            sock.send(json.dumps({"exit": pid, "returncode": os.waitstatus_to_exitcode(status),
                                  "time": time.time()}).encode())
        except OSError:  # the launcher is gone: so are we, in a moment
            pass


def _child(request: dict, fds: list[int], server: int) -> None:
    """A new child of the server: die with it, take the output descriptors, then ``exec`` or run the target."""

    def start() -> object:
        die_with_parent(server)
        os.setsid()  # its own process group: the launcher stops it (and what it starts) as one
        set_process_name(request["title"])
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stdout, stderr, *extra = fds
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        env = dict(request["env"])
        for fd in extra:
            os.set_inheritable(fd, True)
            env[request["pass_fd_env"]] = str(fd)
        if request["argv"] is not None:
            argv = request["argv"]
            os.execve(argv[0], argv, env)
        os.environ.clear()
        os.environ.update(env)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        module, _, function = request["target"].partition(":")
        return getattr(importlib.import_module(module), function)()

    run_forked_child(start)


def run_forked_child(main: Callable[[], object]) -> NoReturn:
    """End a forked child with ``main``'s outcome as its exit code, never returning into the parent's code.

    An int return or ``SystemExit`` code is the exit code (a string one is printed, exit 1); any other exception
    prints its traceback and exits 1. The streams are flushed first, then ``os._exit`` (no cleanup handlers the
    child inherited from its parent run)."""
    code = 1
    try:
        result = main()
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a child's crash must become its exit code, with the traceback
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)
