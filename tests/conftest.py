"""Shared fixtures: real jobs are expensive (process start-up dominates), so identical ones run once."""

from __future__ import annotations

import pytest

from tests.jobs import JobResult, run_job


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
