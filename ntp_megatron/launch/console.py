"""The launcher's output: its own lines, the ranks' relayed lines, and the records that go to the metrics sink.

Everything goes through one lock, so lines never interleave. While a failure report is pending (the controller
waits for the survivors to notice before it prints the "rank failed" line), rank output is held back and released
after the report, so that a rank's line about the failure ("re-formed ...") never comes before the failure it
answers.
"""

from __future__ import annotations

import sys
import threading
from typing import IO, Optional

from ntp_megatron import metrics


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
