"""A job's own checkpoint, damaged. Loading it is refused before any rank starts, in one line naming the file
(exit 2, no run dir), under NTP as without; a rank that reads it anyway names it: at a restart from the save
directory (which the launcher does not check) the file, and for bytes changed inside an item (files whole) the
checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from ntp_megatron.training import checkpoint
from tests.harness import assert_ok, layout_args, run_job, run_module

DAMAGED = "__0_1.distcp"
"""The data file the tests damage (written by launch rank 0; every rank reads from it)."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint of iteration 2 written by a TP1 x DP2 job (NTP off)."""
    root = tmp_path_factory.mktemp("saved")
    result = run_job(root / "job", layout_args(1, 2, 2) + ["--set", f"checkpoint.save={root / 'ckpt'}",
                                                          "--set", "checkpoint.save_interval=2"])
    assert_ok(result)
    return root / "ckpt"


def _copy(saved: Path, to: Path) -> Path:
    """A copy of the saved checkpoint's root at ``to``; returns its ``iter_*`` directory."""
    shutil.copytree(saved, to)
    return checkpoint.iteration_dir(to, 2)


def _damage(path: Path, how: str) -> str:
    """Damage ``path``'s data file; what a refusal says about it."""
    data = path / DAMAGED
    size = data.stat().st_size
    if how == "truncated":
        os.truncate(data, size // 2)
        return f"truncated: {size // 2} bytes, but the checkpoint's .metadata has data up to byte {size}"
    if how == "deleted":
        data.unlink()
        return "missing"
    if how == "overwritten":
        data.write_bytes(os.urandom(size))
        return "corrupt: bytes 0.."
    raise ValueError(how)


def test_the_saved_checkpoint_is_whole(saved):
    checkpoint.verify_checkpoint(checkpoint.iteration_dir(saved, 2))


@pytest.mark.parametrize("ntp", [True, False], ids=["ntp", "plain"])
@pytest.mark.parametrize("how", ["truncated", "deleted", "overwritten"])
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file(saved, tmp_path, how, ntp):
    path = _copy(saved, tmp_path / "ckpt")
    why = _damage(path, how)
    args = ["--run-dir", "run", "--load", "ckpt", *layout_args(1, 2, 4), "--set", f"ntp.enabled={str(ntp).lower()}"]
    code, stderr = run_module("ntp_megatron.launch.launcher", args, tmp_path / "out", cwd=tmp_path, timeout=120)
    lines = (stderr + (tmp_path / "out" / "ntp_megatron.launch.launcher.stdout").read_text()).strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"ntp-launch: checkpoint.load: {path / DAMAGED}: {why}"), lines
    assert not (tmp_path / "run").exists(), "nothing may start"


def _output(result) -> str:
    return result.stdout + result.stderr


def test_a_rank_restarting_from_a_damaged_checkpoint_names_the_file(saved, tmp_path):
    """The run resumes from an intact checkpoint; its save directory holds a damaged one (iteration 2 too), which
    the launcher does not check. A kill at iteration 3 restarts the ranks from the save directory's checkpoint:
    each rank refuses it naming the file, and the job ends."""
    _copy(saved, tmp_path / "load")
    damaged = _copy(saved, tmp_path / "save")
    why = _damage(damaged, "truncated")
    result = run_job(tmp_path / "run", layout_args(1, 2, 4) + [
        "--set", f"checkpoint.load={tmp_path / 'load'}", "--set", f"checkpoint.save={tmp_path / 'save'}",
        "--set", "checkpoint.save_interval=100", "--set", "checkpoint.max_restarts=1",
        "--inject-failure", "kill:rank=1,iter=3"])
    assert result.returncode != 0, _output(result)[-3000:]
    assert result.events("restarted"), "the kill restarts the job from the save directory"
    assert f"CheckpointError: checkpoint.load: {damaged / DAMAGED}: {why}" in _output(result), _output(result)[-3000:]


def test_a_checkpoint_changed_inside_an_item_is_named_by_the_ranks(saved, tmp_path):
    """One byte changed inside an item of the data file: the files look whole, so the launcher starts the
    ranks, whose read fails; they name the checkpoint in one line."""
    path = _copy(saved, tmp_path / "ckpt")
    first = min((item for item in FileSystemReader(str(path)).read_metadata().storage_data.values()
                 if item.relative_path == DAMAGED), key=lambda item: item.offset)
    data = bytearray((path / DAMAGED).read_bytes())
    data[first.offset + 64] ^= 0xFF  # the first byte of the item's pickle (torch.save aligns record data to 64)
    (path / DAMAGED).write_bytes(data)
    checkpoint.verify_checkpoint(path)
    result = run_job(tmp_path / "run", layout_args(1, 2, 4) + ["--set", f"checkpoint.load={tmp_path / 'ckpt'}"])
    assert result.returncode != 0, _output(result)[-3000:]
    assert f"CheckpointError: checkpoint.load: cannot read {path}: " in _output(result), _output(result)[-3000:]
