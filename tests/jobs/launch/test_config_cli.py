"""The launcher's command line: a config error is one line and exit code 2 (the real CLI, a process per case:
forked from the test zygote, and once as a fresh interpreter, whose imports must print nothing either)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import REPO, run_module

CASES = {
    "bad-key": (["--set", "model.hidden_sise=64"], "ntp-launch: unknown config key 'model.hidden_sise'"),
    "bad-value": (["--set", "parallel.backend=mpi"], "ntp-launch: bad value for 'parallel.backend'"),
    "bad-failure-spec": (["--inject-failure", "explode:rank=1,iter=2"],
                         "ntp-launch: --inject-failure 'explode:rank=1,iter=2': expected"),
    "no-checkpoint": (["--set", "checkpoint.load=no/such/dir"], "ntp-launch: checkpoint.load: no such directory: "),
}


def assert_one_line_exit_2(returncode: int, stdout: str, stderr: str, expected: str) -> None:
    assert returncode == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(expected), lines[0]
    assert "Traceback" not in stderr and stdout == ""


@pytest.mark.parametrize("case", list(CASES))
def test_cli_config_error_is_one_line_and_exit_2(tmp_path, case):
    args, expected = CASES[case]
    out = tmp_path / "out"
    returncode, stderr = run_module("ntp_megatron.launch.launcher", ["--run-dir", str(tmp_path / "run"), *args], out,
                                    timeout=120)
    assert_one_line_exit_2(returncode, (out / "ntp_megatron.launch.launcher.stdout").read_text(), stderr, expected)


def test_cli_config_error_from_a_fresh_interpreter(tmp_path):
    """``python -m ntp_megatron.launch.launcher`` as a user starts it: the one line is all, no import-time warning
    (Megatron-Core's about Apex and Transformer Engine) before it. The case that gets furthest: the checkpoint
    to load is looked for after the whole config is valid."""
    args, expected = CASES["no-checkpoint"]
    proc = subprocess.run([sys.executable, "-m", "ntp_megatron.launch.launcher", "--run-dir", str(tmp_path), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert_one_line_exit_2(proc.returncode, proc.stdout, proc.stderr, expected)
