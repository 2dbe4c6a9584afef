"""Shared fixtures, and the two tiers of the suite.

``tests/unit/`` holds tests that start no rank process (pure layout math, config, the protocol over an in-memory
store, one-process Megatron-Core models): ``scripts/test.sh -m unit -n auto`` runs them in about a minute.
``tests/jobs/`` holds multi-process runs (real launcher, real gloo ranks). Every test runs under a timeout, so a
hang fails that test, never the suite.

Every job a test runs has its re-formations checked (``tests.harness.check_reformations``): :func:`run_job` does
it at once, and after each test the fixture below does it for metrics files under the test's ``tmp_path`` that
a job started another way wrote (two launchers, a script run from another directory).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from tests import equivalence_cases
from tests.harness import CHECKED_METRICS, JobResult, check_reformations, read_records, run_job

# torch's store client looks up the name of its socket's address (``::ffff:127.0.0.1``, not in /etc/hosts) at every
# connection; this machine's resolver drops about one such lookup in 40 and the client then waits glibc's 5 s
# timeout. Every job makes dozens of connections (each rank's clients, each generation's own): with a 1 s timeout a
# dropped lookup costs 1 s. Set here, so every launcher and rank the suite starts inherits it.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

UNIT_TIMEOUT_S = 60
JOB_TIMEOUT_S = 900
"""Per test, fixtures included (a module's shared jobs run in its first test)."""

_UNIT_DIR = Path(__file__).resolve().parent / "unit"
FILE_SECONDS = _UNIT_DIR.parent / "jobs" / "file_seconds.json"
"""The job files' seconds (setup, call and teardown of their tests as measured here; only their order matters): the
job tier runs the longest files first, so that its two workers end together rather than one running a long file
alone at the end (``scripts/test.sh`` passes ``--no-loadscope-reorder``: pytest-xdist would order files by their
number of tests). Written by a run with ``NTP_RECORD_FILE_SECONDS=<path>``; a file missing from it counts as short."""
RECORD = os.environ.get("NTP_RECORD_FILE_SECONDS")
_seconds: defaultdict[str, float] = defaultdict(float)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        unit = _UNIT_DIR in Path(str(item.fspath)).resolve().parents
        item.add_marker(pytest.mark.unit if unit else pytest.mark.job)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S if unit else JOB_TIMEOUT_S))
    weights = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    items.sort(key=lambda item: -weights.get(item.nodeid.split("::")[0], 0.0))  # stable: within a file as collected


def pytest_runtest_logreport(report) -> None:
    if RECORD:
        _seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session) -> None:
    """With ``NTP_RECORD_FILE_SECONDS``: every job file's seconds in this run, merged into that file."""
    if not RECORD or hasattr(session.config, "workerinput"):  # the controller records, from every worker's reports
        return
    path = Path(RECORD)
    table = json.loads(path.read_text()) if path.exists() else {}
    table.update({f: round(s, 1) for f, s in _seconds.items() if f.startswith("tests/jobs/")})
    path.write_text(json.dumps(dict(sorted(table.items(), key=lambda kv: -kv[1])), indent=1) + "\n")


def _seed_line() -> str:
    seed = equivalence_cases.FRESH_SEED
    return f"fresh equivalence cases: seed {seed} (replay with NTP_EQUIVALENCE_SEED={seed})"


def pytest_report_header(config) -> str:
    return _seed_line()


def pytest_collection_finish(session) -> None:
    session.config._fresh_cases = any(item.name.startswith("test_fresh_cases") for item in session.items)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if getattr(config, "_fresh_cases", False):  # at the end too, where a failure is read (and under -q)
        terminalreporter.write_line(_seed_line())


@pytest.fixture(autouse=True)
def _reformations_of_other_jobs(request):
    """After the test: the moved-bytes check for every metrics file under its ``tmp_path`` not read by run_job."""
    tmp_path = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp_path is None:
        return
    for metrics in sorted(tmp_path.rglob("*.jsonl")):
        if metrics.resolve() in CHECKED_METRICS:
            continue
        try:
            records = read_records(metrics)
        except ValueError:  # JSON lines of another kind (a corpus, say)
            continue
        if any(isinstance(r, dict) and r.get("event") == "reformed" for r in records):
            check_reformations(records, metrics.parent)
        CHECKED_METRICS.add(metrics.resolve())


class JobCache:
    def __init__(self, factory) -> None:
        self._factory = factory
        self._results: dict[tuple[str, ...], JobResult] = {}

    def run(self, name: str, args: list[str]) -> JobResult:
        """The result of ``ntp-launch args`` (with a state dump under its run dir), run at most once per session."""
        key = tuple(args)
        if key not in self._results:
            run_dir = self._factory.mktemp(name)
            dump = ["--set", f"logging.dump_state={run_dir / 'state'}"]
            self._results[key] = run_job(run_dir, [*args, *dump])
        return self._results[key]


@pytest.fixture(scope="session")
def jobs(tmp_path_factory) -> JobCache:
    return JobCache(tmp_path_factory)
