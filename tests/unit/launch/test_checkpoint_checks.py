"""Checkpoint inputs refused before any rank starts, in one line (exit 2, no run dir): a ``checkpoint.save`` that
is not a directory this process can create or write, and a checkpoint to load with a file missing, truncated,
overwritten or unreadable. A rank that reads such a checkpoint anyway (a restart, which the launcher does not
check) raises an error naming the file. The checkpoints here are written by torch DCP itself, laid out as
Megatron-Core's torch_dist backend lays them out; tests/jobs/checkpoint/test_checkpoint_inputs.py uses a job's own."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ntp_megatron.launch import preflight
from ntp_megatron.config.schema import load_job_config
from ntp_megatron.config.files import ConfigError
from ntp_megatron.training import checkpoint
from tests.harness import run_module

# The launchers these tests start are forked from a zygote that each worker process starts once (its imports
# take seconds): the tests share one worker (pytest-xdist, --dist loadgroup), so one zygote serves them all.
pytestmark = pytest.mark.xdist_group("zygote")

REFUSAL_TIMEOUT_S = 20
"""A refusal takes a second; without the check a job would start: stop it (and fail) before the test's own
timeout, so that the harness, not the test's timeout, ends it."""


def _launch(cwd: Path, args: list[str]) -> tuple[int, list[str]]:
    """ntp-launch in ``cwd`` with a run dir ``run``: exit code and every line it and its ranks printed."""
    out = cwd / "out"
    code, stderr = run_module("ntp_megatron.launch.launcher", ["--run-dir", "run", *args], out, cwd=cwd,
                              timeout=REFUSAL_TIMEOUT_S)
    return code, (stderr + (out / "ntp_megatron.launch.launcher.stdout").read_text()).strip().splitlines()


def _refused(cwd: Path, args: list[str], expected: str) -> None:
    code, lines = _launch(cwd, args)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"ntp-launch: {expected}"), lines
    assert not (cwd / "run").exists(), "nothing may start"


# -- checkpoint.save ------------------------------------------------------------------------------------------

def _read_only(directory: Path) -> None:
    """Make ``directory`` unwritable, for root too (which file modes do not stop): immutable where chattr works."""
    directory.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"root, and chattr +i does not work here: {done.stderr.decode().strip()}")


def _writable(directory: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(directory)], capture_output=True)
    directory.chmod(stat.S_IRWXU)


@pytest.mark.parametrize("case", ["file", "under a file", "read-only", "under a read-only directory"])
def test_an_unwritable_save_directory_is_refused_before_any_rank_starts(tmp_path, case):
    (tmp_path / "a_file").write_text("not a directory\n")
    locked = tmp_path / "locked"
    locked.mkdir()
    save, why = {
        "file": (tmp_path / "a_file", "is not a directory (a file is there)"),
        "under a file": (tmp_path / "a_file" / "ckpt", f"cannot be created: {tmp_path / 'a_file'} is not a directory"),
        "read-only": (locked, "is not writable ("),
        "under a read-only directory": (locked / "new" / "ckpt", f"cannot be created: {locked} is not writable ("),
    }[case]
    if "read-only" in case:
        _read_only(locked)
    try:
        _refused(tmp_path, ["--save", str(save), "--save-interval", "1"], f"checkpoint.save: {save} {why}")
    finally:
        _writable(locked)
    assert not (locked / "new").exists()


def test_a_save_directory_that_can_be_made_is_accepted_and_not_made_yet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for save in ["ckpt", "deeper/still/ckpt", str(tmp_path)]:
        preflight.check_checkpoint_save(load_job_config(overrides=[f"checkpoint.save={save}"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    preflight.check_checkpoint_save(load_job_config(overrides=[]))  # no checkpoint.save: nothing to check
    with pytest.raises(ConfigError, match="checkpoint.save: .* is not a directory"):
        (tmp_path / "f").touch()
        preflight.check_checkpoint_save(load_job_config(overrides=["checkpoint.save=f"]))


# -- the checkpoint to load -----------------------------------------------------------------------------------

def _checkpoint(root: Path, iteration: int = 2) -> Path:
    """``root/iter_<iteration>`` as Megatron-Core's torch_dist backend writes it: tensors and an object through
    torch DCP (``.metadata`` and a data file), ``common.pt``, ``metadata.json``, and ``latest`` pointing at it."""
    path = checkpoint.iteration_dir(root, iteration)
    generator = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(64, 8, generator=generator), "b": torch.zeros(8)}, "rng_state": {"cpu": 1}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    torch.save({"iteration": iteration, "scheduler": {}, "consumed_samples": 24}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    (root / checkpoint.LATEST_FILE).write_text(f"{iteration}\n")
    return path


def _data_file(path: Path) -> Path:
    return next(path.glob("__*.distcp"))


def _damage(path: Path, how: str) -> tuple[Path, str]:
    """Damage one file of the checkpoint in ``path``: the file, and what the refusal must say about it."""
    data = _data_file(path)
    if how == "truncated":
        size = data.stat().st_size
        os.truncate(data, size // 2)
        return data, f"truncated: {size // 2} bytes, but the checkpoint's .metadata has data up to byte {size}"
    if how == "deleted":
        data.unlink()
        return data, "missing"
    if how == "overwritten":
        data.write_bytes(os.urandom(data.stat().st_size))
        return data, "corrupt: bytes 0.."
    if how == "metadata deleted":
        (path / ".metadata").unlink()
        return path / ".metadata", "missing"
    if how == "common truncated":
        common = path / "common.pt"
        os.truncate(common, common.stat().st_size - 10)
        return common, "unreadable or truncated"
    if how == "metadata.json garbled":
        (path / "metadata.json").write_text("{not json")
        return path / "metadata.json", "unreadable"
    raise ValueError(how)


DAMAGE = ["truncated", "deleted", "overwritten", "metadata deleted", "common truncated", "metadata.json garbled"]


def test_an_intact_checkpoint_passes(tmp_path):
    path = _checkpoint(tmp_path / "ckpt")
    checkpoint.verify_checkpoint(path)
    assert checkpoint.read_progress(tmp_path / "ckpt").iteration == 2


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_checkpoint_is_named_by_its_file(tmp_path, how):
    path = _checkpoint(tmp_path / "ckpt")
    file, why = _damage(path, how)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.verify_checkpoint(path)
    assert str(err.value).startswith(f"checkpoint.load: {file}: {why}"), err.value
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("how", ["truncated", "overwritten"])
def test_a_damaged_checkpoint_to_load_is_refused_before_any_rank_starts(tmp_path, how):
    path = _checkpoint(tmp_path / "ckpt")
    file, why = _damage(path, how)
    _refused(tmp_path, ["--load", "ckpt"], f"checkpoint.load: {file}: {why}")


def test_a_rank_loading_a_damaged_checkpoint_names_the_file(tmp_path):
    """What a rank does at a restart from the save directory (the launcher checked only the load directory): its
    read fails, then it looks for the damaged file and names it. Here the first read, ``common.pt``'s, fails (so
    no model is needed); a tensor read failing: tests/jobs/checkpoint/test_checkpoint_inputs.py."""
    path = _checkpoint(tmp_path / "ckpt")
    file, why = _damage(path, "common truncated")
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(f"checkpoint.load: {file}: {why}")):
        checkpoint.load_checkpoint(tmp_path / "ckpt", model=None, optimizer=None, scheduler=None, coords=None)
