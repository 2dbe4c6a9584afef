"""The controller's report of a failure, over an in-memory store: the "rank failed" line, the ``rank_failed`` event,
and where they come among the ranks' relayed output.

- Survivors that noticed a death before the launcher reaped it (a direct peer sees its connection close within
  milliseconds, and a death known only from its exit is stamped when it was reaped): the detection latency is
  never negative.
- The line comes before anything a rank prints about the failure (rank 0's "re-formed" line), although the
  report waits for every survivor to notice while rank output is relayed at once.
"""

from __future__ import annotations

import io
import json
import re
import time

import torch.distributed as dist

from ntp_megatron.elastic import commit, publication
from ntp_megatron.elastic.commit import note_aware
from ntp_megatron.elastic.controller import Controller, Death
from ntp_megatron.launch.console import Console
from ntp_megatron.plan.layout import make_topology
from ntp_megatron.plan.stages import JobTopology

UNITS = {"heads": 8, "ffn": 16, "vocab": 32}


def _controller(console: Console, records: list[dict]) -> tuple[dist.Store, Controller]:
    store = dist.HashStore()
    controller = Controller(store, JobTopology.one_stage(make_topology(2, 2, UNITS)), 1, "drop_replica", console.say,
                            records.append, hold=console.hold, release=console.release)
    store.set(commit.COMPLETED, "0")  # generation 0 formed: its ranks train
    return store, controller


def _aware(store: dist.Store, at: float) -> None:
    for rank in (0, 1, 2):
        note_aware(store, 0, rank, at)


def test_survivors_that_noticed_before_the_reap_give_no_negative_latency(capsys):
    records: list[dict] = []
    store, controller = _controller(Console(), records)
    reaped = time.time()
    _aware(store, reaped - 0.017)  # its peers' connections closed before the launcher reaped it
    assert controller.handle([Death(3, reaped, "was killed by signal SIGKILL", 4242)]) is None
    controller.close()
    [failed] = [r for r in records if r.get("event") == "rank_failed"]
    assert failed["detect_s"] is not None and failed["detect_s"] >= 0, failed
    assert failed["time"] <= reaped - 0.017 + 1e-6
    line = next(l for l in capsys.readouterr().err.splitlines() if "rank failed" in l)
    assert re.search(r"3 survivors aware in \d+\.\d{3} s$", line), line


def test_the_failure_line_comes_before_the_ranks_lines_about_it(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    console = Console()
    store, controller = _controller(console, [])
    assert controller.handle([Death(3, time.time(), "was killed by signal SIGKILL", 4242)]) is None
    # Rank 0 re-formed and says so while the report still waits for a survivor to notice.
    console.relayed(out, "[rank 0]  re-formed | generation 1 | tp per replica: [2, 1] |\n")
    console.relayed(None, {"kind": "event", "event": "reformed", "generation": 1})
    _aware(store, time.time())
    controller.close()
    lines = out.getvalue().splitlines()
    failed = next(i for i, l in enumerate(lines) if "rank failed | launch rank 3" in l)
    reformed = next(i for i, l in enumerate(lines) if "re-formed | generation 1" in l)
    assert failed < reformed, lines
    assert json.loads(store.get(publication.info_key(1)))["dead"] == [[1, 1]]


class _Requests:
    """A store that records each request's method and keys."""

    def __init__(self, store: dist.Store) -> None:
        self._store, self.log = store, []

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def call(*args, **kwargs):
            self.log.append((name, args[0] if args else None))
            return method(*args, **kwargs)
        return call


def test_the_report_waits_for_the_survivors_on_one_key_not_one_per_survivor():
    """Just after a failure the report polls every 10 ms until every survivor noted it: at 10K ranks a request per
    survivor and pass would load the root while the survivors re-form on it. It polls one count; the survivors' own
    keys are read once, when the count says they are all in."""
    store = _Requests(dist.HashStore())
    records: list[dict] = []
    controller = Controller(store, JobTopology.one_stage(make_topology(2, 32, UNITS)), 1, "drop_replica", Console().say,
                            records.append)
    store.set(commit.COMPLETED, "0")
    assert controller.handle([Death(5, time.time(), "was killed by signal SIGKILL", 4242)]) is None
    deadline = time.monotonic() + 10
    while sum(name == "add" and key == commit.aware_count_key(0) for name, key in list(store.log)) < 5:
        assert time.monotonic() < deadline, "the report did not poll the count"
        time.sleep(0.01)
    per_survivor = [(name, key) for name, key in list(store.log) if isinstance(key, (list, str))
                    and "/aware/" in (key if isinstance(key, str) else " ".join(key))]
    assert not per_survivor, per_survivor[:5]
    for rank in range(64):
        if rank != 5:
            note_aware(store, 0, rank, time.time())
    controller.close()
    [failed] = [r for r in records if r.get("event") == "rank_failed"]
    assert failed["detect_s"] is not None, failed


def test_notes_whose_count_was_lost_are_still_reported_once_the_wait_is_over():
    """A note is two requests (the note, then its count): a rank that noted and lost the second leaves the count short.
    Once the report's wait is over it finds every note and reports the detection latency, not 'not all aware'."""
    records: list[dict] = []
    store, controller = _controller(Console(), records)
    old = JobTopology.one_stage(make_topology(2, 2, UNITS))
    for rank in (0, 1, 2):
        store.set(commit.aware_key(0, rank), repr(time.time()))  # no count
    controller.reports.report([Death(3, time.time(), "was killed by signal SIGKILL", 4242)], old, None, [0, 1, 2],
                       wait_s=0.2)
    [failed] = [r for r in records if r.get("event") == "rank_failed"]
    assert failed["detect_s"] is not None, failed
