"""The launcher's command line: a config error is one line and exit code 2 (the real CLI, a process per case)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import REPO


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "model.hidden_sise=64"], "ntp-launch: unknown config key 'model.hidden_sise'"),
        (["--set", "parallel.backend=mpi"], "ntp-launch: bad value for 'parallel.backend'"),
        (["--inject-failure", "explode:rank=1,iter=2"], "ntp-launch: --inject-failure 'explode:rank=1,iter=2': expected"),
        (["--set", "checkpoint.load=no/such/dir"], "ntp-launch: checkpoint.load: no such directory: "),
    ],
    ids=["bad-key", "bad-value", "bad-failure-spec", "no-checkpoint"],
)
def test_cli_config_error_is_one_line_and_exit_2(tmp_path, args, expected):
    proc = subprocess.run([sys.executable, "-m", "ntp_megatron.launcher", "--run-dir", str(tmp_path), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(expected), lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
