"""The main job's config is the tiny CPU demo plus the main job's own settings, and scripts/pretrain_gpt.sh uses it
when (and only when) called with no arguments."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ntp_megatron.config.schema import DEFAULT_CONFIG, load_job_config
from tests.harness import REPO

MAIN_JOB = REPO / "configs" / "main_job.yaml"


def test_the_main_job_is_the_demo_with_a_failure_and_a_rejoin():
    main, demo = load_job_config(MAIN_JOB).model_dump(), load_job_config(DEFAULT_CONFIG).model_dump()
    own = {("training", "train_iters"): 120, ("training", "eval_interval"): 40, ("training", "eval_iters"): 4,
           ("ntp", "rejoin_after_s"): 2.0, ("ntp", "warm_spares"): 1,
           ("faults", "inject"): ["kill:rank=3,iter=15,phase=backward"]}
    for (section, key), value in own.items():
        assert main[section][key] == value, (section, key)
        main[section][key] = demo[section][key]
    assert main == demo
    assert load_job_config(MAIN_JOB, ["training.train_iters=300"]).training.train_iters == 300


def _script_command(root: Path, *args: str) -> list[str]:
    """The launcher command scripts/pretrain_gpt.sh runs with ``args``: the script in a copy of the repository's
    layout at ``root`` whose installed interpreter is a stub that prints its arguments."""
    if not (root / "scripts").exists():
        _fake_checkout(root)
    out = subprocess.run(["bash", str(root / "scripts" / "pretrain_gpt.sh"), *args], capture_output=True, text=True,
                         check=True, cwd=root)
    return out.stdout.splitlines()


def _fake_checkout(tmp_path: Path) -> None:
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    stub.chmod(0o755)
    venv = tmp_path / "venv"  # what scripts/_venv.sh checks: an interpreter and the stamp of pyproject.toml
    (venv / "bin").mkdir(parents=True)
    os.symlink(stub, venv / "bin" / "python")
    digest = subprocess.run(["sha256sum", str(REPO / "pyproject.toml")], capture_output=True, text=True, check=True)
    (venv / ".ntp-installed").write_text(digest.stdout.split()[0] + "\n")
    script = tmp_path / "scripts"
    script.mkdir()
    for name in ("pretrain_gpt.sh", "_venv.sh"):
        (script / name).write_text((REPO / "scripts" / name).read_text())
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    os.symlink(venv, tmp_path / ".venv")


def test_pretrain_gpt_sh_runs_the_main_job_without_arguments(tmp_path):
    assert _script_command(tmp_path) == ["-m", "ntp_megatron.launch.launcher", "--config",
                                         str(tmp_path / "configs" / "main_job.yaml")]
    assert _script_command(tmp_path, "--train-iters", "200") == ["-m", "ntp_megatron.launch.launcher", "--train-iters",
                                                                 "200"]
