"""The launcher's output: its own lines, the ranks' relayed lines, and the records that go to the metrics sink (and
where that is: :func:`run_outputs`).

Everything goes through one lock, so lines never interleave. While a failure report is pending (the controller
waits for the survivors to notice before it prints the "rank failed" line), rank output is held back and released
after the report, so that a rank's line about the failure ("re-formed ...") never comes before the failure it
answers. torch's C++ warnings of the store and transport (``[W... TCPStore.cpp:106] [c10d] sendBytes failed ...``, each
with a C++ stack) are relayed without their stacks, and one site's at most once every ``NativeWarnings.every_s`` per
stream (:class:`NativeWarnings`): a rank whose store went away repeats them at every call.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Optional

from ntp_megatron import metrics
from ntp_megatron.config.schema import JobConfig


class Console:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sink: Optional[metrics.MetricsSink] = None
        self._holds = 0
        self._held: list[tuple[Optional[IO[str]], object]] = []

    def say(self, message: str) -> None:
        with self.lock:
            print(f"ntp-launch: {message}", file=sys.stderr, flush=True)

    def emit(self, record: dict) -> None:
        """A record of the launcher's own (an event): to the metrics sink, if this node has one."""
        with self.lock:
            if self.sink is not None:
                self.sink.write(record)

    def relayed(self, out: Optional[IO[str]], item) -> None:
        """A rank's line (``out``: where it goes) or record (``out`` None), unless rank output is held."""
        with self.lock:
            if self._holds:
                self._held.append((out, item))
            else:
                self._write(out, item)

    def hold(self) -> None:
        """Hold rank output back until :meth:`release` (calls nest)."""
        with self.lock:
            self._holds += 1

    def release(self) -> None:
        with self.lock:
            self._holds -= 1
            if not self._holds:
                for out, item in self._held:
                    self._write(out, item)
                self._held.clear()

    def _write(self, out: Optional[IO[str]], item) -> None:
        if out is None:
            if self.sink is not None:
                self.sink.write(item)
        else:
            out.write(item)
            out.flush()


_NATIVE_WARNING = re.compile(r"\[W\d{4} [\d:.]+ (?P<site>[\w.]+:\d+)\] \[c10d\]")
"""torch's C++ warning of c10d (its store and transport), with the source site that raised it."""
_STACK_LINE = re.compile(r"^(Exception raised from |frame #\d+: |<omitting python frames>|\s*$)")
"""A line of the C++ stack such a warning carries."""


class NativeWarnings:
    """One stream's filter of torch's C++ c10d warnings (module docstring): :meth:`keep` gives the line to relay, or
    None. ``every_s``: a site said is not said again sooner; the next line of it says how many were left out."""

    every_s = 30.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._in_stack = False
        self._said: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def keep(self, line: str) -> Optional[str]:
        if self._in_stack and _STACK_LINE.match(line):
            return None
        self._in_stack = False
        warning = _NATIVE_WARNING.search(line)
        if warning is None:
            return line
        self._in_stack = True
        site, now = warning.group("site"), self._clock()
        if now - self._said.get(site, -self.every_s) < self.every_s:
            self._left_out[site] = self._left_out.get(site, 0) + 1
            return None
        self._said[site] = now
        left_out = self._left_out.pop(site, 0)
        if not left_out:
            return line
        return f"{line.rstrip()} ({left_out} more from {site} left out)\n"


def run_outputs(cfg: JobConfig, run_dir: Path) -> tuple[Optional[Path], Optional[Path]]:
    """The metrics file (default ``<run_dir>/metrics.jsonl``, appended to) and this run's TensorBoard directory
    (default ``<run_dir>/tensorboard/<start time>``: each run its own series, so two runs in one run dir do not
    merge into one whose steps restart); the empty string switches either off."""
    lg = cfg.logging
    metrics_file = None if lg.metrics_file == "" else Path(lg.metrics_file or run_dir / "metrics.jsonl").resolve()
    tb_dir = None
    if lg.tensorboard_dir == "":
        pass
    elif lg.tensorboard_dir:
        tb_dir = Path(lg.tensorboard_dir).resolve()
    else:
        tb_dir = _new_run_series(run_dir / "tensorboard", time.strftime("%Y%m%d-%H%M%S"))
    return metrics_file, tb_dir


def _new_run_series(parent: Path, stamp: str) -> Path:
    """``parent/stamp``, created now, or ``stamp-2``, ``-3``, ... when a run that started in the same second has
    it (a finished run's relaunch can start within its second)."""
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = parent / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"no free TensorBoard directory for {stamp} under {parent}")
