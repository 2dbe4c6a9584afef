"""What ``checkpoint.load`` finds and restores, decided by the launcher before any rank starts: Megatron-LM's
directory layouts (``latest_checkpointed_iteration.txt`` naming an iteration or ``release``, a path straight to
one checkpoint directory), and what a load restores (``--finetune``, ``--no-load-optim``, ``--no-load-rng``, a
model-only or ``release`` checkpoint, one without optimizer or RNG state), pinned into the config the ranks read.
The checkpoints here are written by torch DCP itself, laid out as Megatron-Core's torch_dist backend lays them
out; real model-only Megatron-Core checkpoints loaded by real jobs: tests/jobs/checkpoint/test_ntp_checkpoint.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ntp_megatron.config.files import ConfigError
from ntp_megatron.config.flags import translate
from ntp_megatron.config.schema import load_job_config
from ntp_megatron.launch import preflight
from ntp_megatron.training import checkpoint
from ntp_megatron.training.checkpoint import LoadPlan
from tests.unit.launch.test_checkpoint_checks import _launch

# The launchers these tests start are forked from a zygote that each worker process starts once (its imports
# take seconds): the tests share one worker (pytest-xdist, --dist loadgroup), so one zygote serves them all.
pytestmark = pytest.mark.xdist_group("zygote")

MODEL_ONLY = LoadPlan(False, False, False)


def _write(path: Path, common: dict, optimizer: bool = False, rng: bool = False) -> Path:
    """A torch_dist checkpoint in ``path``: a model tensor, optionally Adam moments and an RNG object, and
    ``common``."""
    state = {"model": {"decoder.w": torch.ones(4, 2)}}
    if optimizer:
        state["optimizer"] = {"optimizer.state.exp_avg.decoder.w": torch.zeros(4, 2)}
    if rng:
        state["rng_state/shard_0_1"] = {"cpu": 1}  # the key Megatron-Core gives a ShardedObject in DCP
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    torch.save(common, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    return path


def _full(root: Path, iteration: int = 4) -> Path:
    path = _write(checkpoint.iteration_dir(root, iteration),
                  {"iteration": iteration, "consumed_samples": 48, "scheduler": {}, "optimizer": {"param_groups": []}},
                  optimizer=True, rng=True)
    (root / checkpoint.LATEST_FILE).write_text(f"{iteration}\n")
    return path


def _release(root: Path) -> Path:
    """What a checkpoint converter writes: the model alone in ``release/``, and the tracker file saying so."""
    path = _write(root / "release", {})
    (root / checkpoint.LATEST_FILE).write_text("release\n")
    return path


# -- which directory ------------------------------------------------------------------------------------------

def test_megatron_directory_layouts_resolve_to_one_checkpoint(tmp_path):
    release = _release(tmp_path / "converted")
    full = _full(tmp_path / "trained")
    resolve = checkpoint.resolve_load_dir
    assert resolve(tmp_path / "converted") == release  # latest says release
    assert resolve(release) == release  # a path straight to it
    assert resolve(tmp_path / "trained") == full  # latest says 4
    assert resolve(full) == full
    other = _write(tmp_path / "anywhere", {})
    assert resolve(other) == other  # any directory holding a checkpoint
    (tmp_path / "empty").mkdir()
    assert resolve(tmp_path / "empty") is None
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / checkpoint.LATEST_FILE).write_text("latest\n")
    assert resolve(tmp_path / "garbled") is None
    with pytest.raises(SystemExit, match="latest_checkpointed_iteration.txt holds 'latest', neither an iteration "
                                         "nor 'release'"):
        checkpoint.read_progress(tmp_path / "garbled")


def test_the_launcher_and_the_ranks_read_the_same_directory(tmp_path):
    """``read_progress`` (the launcher) pins the directory ``resolve_load_dir`` (what a rank's restart uses) names,
    and its progress."""
    _release(tmp_path / "converted")
    _full(tmp_path / "trained")
    for root in ("converted", "trained"):
        assert checkpoint.read_progress(tmp_path / root).path == checkpoint.resolve_load_dir(tmp_path / root)


# -- what a load restores -------------------------------------------------------------------------------------

def test_a_model_only_or_release_checkpoint_starts_at_iteration_0_with_fresh_state(tmp_path):
    model_only = _write(checkpoint.iteration_dir(tmp_path / "mo", 7), {})
    (tmp_path / "mo" / checkpoint.LATEST_FILE).write_text("7\n")
    progress = checkpoint.read_progress(tmp_path / "mo")
    assert (progress.path, progress.iteration, progress.samples(12), progress.plan) == (model_only, 0, 0, MODEL_ONLY)
    assert progress.notice == (f"checkpoint.load: {model_only} holds no iteration (a model-only checkpoint): "
                               "starting at iteration 0 from its model weights, with fresh optimizer, scheduler and "
                               "RNG state")
    # Megatron-LM: a release checkpoint is loaded for its model alone, whatever else it holds
    release = _full(tmp_path / "rel")
    release = release.rename(tmp_path / "rel" / "release")
    progress = checkpoint.read_progress(release)
    assert (progress.iteration, progress.plan) == (0, MODEL_ONLY)
    assert progress.notice.startswith(f"checkpoint.load: {release} is a release checkpoint: starting at iteration 0")


@pytest.mark.parametrize("flags, plan, iteration, samples, why", [
    ([], LoadPlan(), 4, 48, None),
    (["--finetune"], MODEL_ONLY, 0, 0, "--finetune (checkpoint.finetune) from {path}"),
    (["--no-load-optim"], LoadPlan(True, False, True), 4, 48, "{path}: --no-load-optim (checkpoint.no_load_optim)"),
    (["--no-load-rng"], LoadPlan(True, True, False), 4, 48, "{path}: --no-load-rng (checkpoint.no_load_rng)"),
    (["--no-load-optim", "--no-load-rng"], LoadPlan(True, False, False), 4, 48,
     "{path}: --no-load-optim (checkpoint.no_load_optim) and --no-load-rng (checkpoint.no_load_rng)"),
])
def test_megatron_load_flags_are_pinned_for_the_ranks(tmp_path, flags, plan, iteration, samples, why):
    path = _full(tmp_path / "ckpt")
    cfg = load_job_config(overrides=[f"checkpoint.load={tmp_path / 'ckpt'}", *translate(flags)])
    progress = preflight.pin_checkpoint_load(cfg)
    assert (progress.plan, progress.iteration, progress.samples(12)) == (plan, iteration, samples)
    assert LoadPlan.of(cfg.checkpoint) == plan, "what the ranks read from the config"
    assert cfg.checkpoint.load == str(path.resolve())
    if why is None:
        assert progress.notice is None
    else:
        assert progress.notice.startswith("checkpoint.load: " + why.format(path=path) + ": starting at iteration "
                                          f"{iteration} from its model weights"), progress.notice


def test_missing_optimizer_or_rng_state_starts_fresh_and_says_so(tmp_path):
    path = _write(tmp_path / "iter_0000004", {"iteration": 4, "consumed_samples": 48})
    progress = checkpoint.read_progress(path)
    assert (progress.iteration, progress.plan) == (4, LoadPlan(True, False, False))
    assert progress.notice == (f"checkpoint.load: {path}: it holds no optimizer state and it holds no RNG state: "
                               "starting at iteration 4 from its model weights, with fresh optimizer, scheduler and "
                               "RNG state")


def test_optimizer_state_without_its_scheduler_is_refused_once_before_any_rank_starts(tmp_path):
    """The one refusal left among the contents (besides damage and a model of another shape, which every rank
    checks against the model it built): one line, exit 2, nothing started — and ``--no-load-optim`` loads it."""
    path = _write(tmp_path / "ckpt" / "iter_0000004", {"iteration": 4, "optimizer": {"param_groups": []}},
                  optimizer=True)
    (tmp_path / "ckpt" / checkpoint.LATEST_FILE).write_text("4\n")
    code, lines = _launch(tmp_path, ["--load", "ckpt"])
    assert code == 2, lines
    assert lines == [f"ntp-launch: checkpoint.load: {path.relative_to(tmp_path)} holds optimizer state but no "
                     "scheduler state; "
                     "--no-load-optim (checkpoint.no_load_optim) starts both fresh"], lines
    assert not (tmp_path / "run").exists(), "nothing may start"
    cfg = load_job_config(overrides=[f"checkpoint.load={path}", "checkpoint.no_load_optim=true"])
    assert preflight.pin_checkpoint_load(cfg).plan == LoadPlan(True, False, False)
    with pytest.raises(ConfigError, match="holds optimizer state but no scheduler state"):
        preflight.pin_checkpoint_load(load_job_config(overrides=[f"checkpoint.load={path}"]))
