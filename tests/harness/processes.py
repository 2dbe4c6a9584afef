"""Starting the suite's processes (jobs through the real launcher, modules, stores), every wait bounded."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, Sequence

import psutil

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 300

# The tiny model of the equivalence tests: fp32, dropout off, short sequences.
@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict]
    run_dir: Path
    reformations: list[dict] = field(default_factory=list)
    """What :func:`check_reformations` found: per ``reformed`` event its generation, moved bytes and bound."""

    def losses(self) -> dict[int, float]:
        return {r["iteration"]: r["lm_loss"] for r in self.records if r.get("kind") == "iteration"}

    def events(self, name: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == "event" and r.get("event") == name]


# -- starting processes, every wait bounded ------------------------------------------------------------------------

class _Lines:
    """Lines from a pipe, each read with a deadline (``readline`` alone waits forever on a silent writer)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def read(self, deadline: float) -> str:
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(remaining, 0.0))
            if not ready:
                raise TimeoutError("no answer before the deadline")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise EOFError("the writer closed the pipe")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Zygote:
    """Client of ``tests/zygote.py``: one long-lived process that imported torch and Megatron-Core once and
    forks a launcher per job (``NTP_TEST_ZYGOTE=0`` runs ``python -m ntp_megatron.launch.launcher`` instead).

    Every answer is read with a deadline. When a job does not end in time, or the test is interrupted while it
    runs (pytest-timeout raises inside the test), the job's process group is killed and its exit is collected,
    so the zygote is free for the next test; a zygote that does not answer then is killed and started again."""

    COMMAND: tuple[str, ...] = ("-m", "tests.zygote")
    """The server's arguments to the interpreter (a subclass serves other requests the same way)."""
    _proc: Optional[subprocess.Popen] = None
    _lines: Optional[_Lines] = None
    START_S = 120.0
    """Bound on the zygote's own start (its imports) and on collecting a killed job's exit."""

    @classmethod
    def run(cls, args: list[str], stdout: Path, stderr: Path, timeout: float, module: Optional[str] = None,
            cwd: Path = REPO) -> int:
        if cls._proc is None or cls._proc.poll() is not None:
            cls._proc = subprocess.Popen([sys.executable, *cls.COMMAND], cwd=REPO, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE)
            cls._lines = _Lines(cls._proc.stdout.fileno())
        proc, lines = cls._proc, cls._lines
        request = {"args": args, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        if module is not None:
            request["module"] = module
        pid = None
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            pid = json.loads(lines.read(time.monotonic() + cls.START_S))["pid"]
            try:
                return json.loads(lines.read(time.monotonic() + timeout))["returncode"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(args, timeout) from None
        except BaseException:
            cls._abandon(pid)
            raise

    @classmethod
    def _abandon(cls, pid: Optional[int]) -> None:
        """Kill the job (its whole process group) and collect its exit; restart the zygote if that fails."""
        proc = cls._proc
        if pid is not None:
            _kill_group(pid)
            try:
                os.kill(pid, signal.SIGKILL)  # also before its setsid(): then the group does not exist yet
            except ProcessLookupError:
                pass
            try:
                cls._lines.read(time.monotonic() + cls.START_S)
                return
            except (TimeoutError, EOFError, OSError):
                pass
        proc.kill()
        proc.wait(timeout=cls.START_S)
        cls._proc = None


class Forked:
    """A process forked from a zygote of its own, running while the test acts on it (signals it, reads its files,
    starts another node against it): ``ntp-launch args``, or ``python -m module args``, with
    ``subprocess.Popen``'s ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal`` and ``kill``. Like a process
    started with ``start_new_session=True``, it leads a process group of its own.

    Its zygote (``tests/zygote.py``, one per process running at a time) answers only when the process has ended, so
    it runs no other process meanwhile; once the exit has been read, the next :meth:`start` reuses it. The
    imports are paid once per zygote, not once per process."""

    _idle: list[tuple[subprocess.Popen, _Lines]] = []
    _busy: list["Forked"] = []

    def __init__(self, zygote: subprocess.Popen, lines: _Lines, pid: int) -> None:
        self._zygote, self._lines, self.pid = zygote, lines, pid
        self.returncode: Optional[int] = None

    @classmethod
    def start(cls, args: Sequence[str], stdout: Path, stderr: Path, module: Optional[str] = None,
              cwd: Path = REPO) -> "Forked":
        for forked in list(cls._busy):  # a test that killed its process and did not wait: collect it now
            forked.poll()
        for path in (stdout, stderr):  # there to read at once (the child truncates and writes them)
            path.touch()
        if cls._idle:
            zygote, lines = cls._idle.pop()
        else:
            zygote = subprocess.Popen([sys.executable, "-m", "tests.zygote"], cwd=REPO, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
            lines = _Lines(zygote.stdout.fileno())
        request = {"args": list(args), "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        if module is not None:
            request["module"] = module
        try:
            zygote.stdin.write((json.dumps(request) + "\n").encode())
            zygote.stdin.flush()
            pid = json.loads(lines.read(time.monotonic() + _Zygote.START_S))["pid"]
        except BaseException:
            zygote.kill()
            zygote.wait(timeout=_Zygote.START_S)
            raise
        forked = cls(zygote, lines, pid)
        cls._busy.append(forked)
        return forked

    @classmethod
    def ready(cls, count: int, out_dir: Path) -> None:
        """At least ``count`` zygotes started and idle: processes started together then wait for no one's imports
        (a node that must join another within a timeout)."""
        # All started before any ends: each takes an idle zygote or starts one, and all come back idle.
        starting = [cls.start(["--help"], out_dir / f"zygote{i}.stdout", out_dir / f"zygote{i}.stderr",
                              module="ntp_megatron.launch.launcher") for i in range(count)]
        assert [forked.wait() for forked in starting] == [0] * count

    def _read_exit(self, timeout: float) -> Optional[int]:
        if self.returncode is None:
            try:
                self.returncode = json.loads(self._lines.read(time.monotonic() + timeout))["returncode"]
            except TimeoutError:
                return None
            except (EOFError, OSError):  # the zygote itself died: the process went with it
                self.returncode = -signal.SIGKILL
                self._busy.remove(self)
                return self.returncode
            self._busy.remove(self)
            self._idle.append((self._zygote, self._lines))
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._read_exit(0.0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._read_exit(_Zygote.START_S if timeout is None else timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_process(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str, str]:
    """``cmd`` in a process group of its own, killed whole on a timeout or an interruption."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_group(proc.pid)
        proc.communicate(timeout=_Zygote.START_S)
        raise
    return proc.returncode, out, err


def alive(pids: Sequence[int]) -> list[int]:
    """The processes of ``pids`` that still run (a zombie has ended: only its exit status is left to reap)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def launch(run_dir: Path, launcher_args: Sequence[str], timeout: float = JOB_TIMEOUT_S) -> tuple[int, str, str]:
    """``ntp-launch`` with ``launcher_args``, forked from the zygote (or a fresh interpreter with
    ``NTP_TEST_ZYGOTE=0``); (exit code, stdout, stderr)."""
    if os.environ.get("NTP_TEST_ZYGOTE", "1") == "1":
        stdout, stderr = run_dir / "launcher.stdout", run_dir / "launcher.stderr"
        returncode = _Zygote.run(list(launcher_args), stdout, stderr, timeout)
        return returncode, stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
    return _run_process([sys.executable, "-m", "ntp_megatron.launch.launcher", *launcher_args], REPO, timeout)


def run_module(module: str, args: Sequence[str], out_dir: Path, timeout: float = JOB_TIMEOUT_S,
               cwd: Path = REPO) -> tuple[int, str]:
    """``python -m module args`` in ``cwd`` (forked from the zygote: no imports to pay); returns (exit code,
    stderr)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stdout, stderr = out_dir / f"{module}.stdout", out_dir / f"{module}.stderr"
    if os.environ.get("NTP_TEST_ZYGOTE", "1") == "1":
        returncode = _Zygote.run(list(args), stdout, stderr, timeout, module=module, cwd=cwd)
        return returncode, stderr.read_text(errors="replace")
    returncode, out, err = _run_process([sys.executable, "-m", module, *args], cwd, timeout)
    stdout.write_text(out)
    return returncode, err


def read_records(metrics_file: Path) -> list[dict]:
    if not metrics_file.exists():
        return []
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip().endswith("}")]


def kill_remaining(procs) -> None:
    """SIGKILL every process of ``procs`` (``subprocess.Popen``-like) still running, and collect its exit: a test's
    cleanup, whatever it asserted."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.01) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(poll_s)


def store_server(timeout_s: float = 60.0):
    """A TCPStore hosted by the calling (test) process on a port the OS picks; processes it starts connect to
    ``store.port`` with :func:`store_client`. No port is bound, released and hoped to be free again."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def store_client(port: int, timeout_s: float = 60.0):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)
