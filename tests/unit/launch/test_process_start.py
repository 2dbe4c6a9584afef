"""Process start and device choice on GPU machines, checked without a GPU (CUDA mocked).

Ranks are forked from the launcher's imports only where no CUDA can be involved; where a GPU is present (or the
CUDA check itself fails) they start as fresh interpreters. ``training.device: auto`` on a machine whose CUDA is broken stops
the rank with a message instead of training on CPU unnoticed.
"""

from __future__ import annotations

import sys

import pytest
import torch

from ntp_megatron.launch import launcher
from ntp_megatron.config.schema import load_job_config
from ntp_megatron.launch.console import Console
from ntp_megatron.launch.forkserver import Child
from ntp_megatron.launch.processes import RankProcesses
from ntp_megatron.training import runtime


def _broken(*_args, **_kwargs):
    raise RuntimeError("CUDA driver initialization failed")


@pytest.fixture
def no_gpu_evidence(tmp_path, monkeypatch):
    """A machine with no GPU: no CUDA_VISIBLE_DEVICES, an NVIDIA driver that lists no GPU."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(runtime, "NVIDIA_GPUS_DIR", tmp_path / "no-driver", raising=False)


@pytest.mark.parametrize("requested, available, method", [
    ("auto", True, "spawn"), ("auto", False, "fork"), ("auto", _broken, "spawn"),
    ("cuda", True, "spawn"), ("cuda", False, "spawn"), ("cpu", True, "fork"), ("cpu", _broken, "fork"),
])
def test_start_method(monkeypatch, no_gpu_evidence, requested, available, method):
    monkeypatch.setattr(torch.cuda, "is_available", available if callable(available) else lambda: available)
    assert runtime.rank_start_method(requested) == method


def test_start_method_spawns_where_the_environment_names_gpus(monkeypatch, no_gpu_evidence):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert runtime.rank_start_method("auto") == "spawn"


class _RecordingServer:
    """Stands in for the fork server: records what it is asked to start (each child "runs" nothing)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def start(self, env, stdout, stderr, title, argv=None, target=None, pass_fd=None) -> Child:
        self.requests.append({"title": title, "argv": argv, "target": target, "pass_fd": pass_fd})
        return Child(10_000 + len(self.requests))


@pytest.mark.parametrize("cuda, method", [(True, "spawn"), (False, "fork")])
def test_launcher_spawns_ranks_when_cuda_is_present(tmp_path, monkeypatch, no_gpu_evidence, cuda, method):
    """The launcher starts its ranks and its warm spares as fresh interpreters with CUDA present, as forks of its
    imports without; restarts and cold replacements are fresh interpreters in any case."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = launcher.build_parser().parse_args([])
    cfg = load_job_config(None, [f"logging.run_dir={tmp_path}", "parallel.tensor_model_parallel_size=2",
                                 "parallel.data_parallel_size=2"])
    job = launcher.Launcher(cfg, tmp_path / "config.json", args, [])
    assert job.start_method == method
    server = _RecordingServer()
    job.processes = RankProcesses(server, Console(), job.start_method, tmp_path, 0)
    job._start_ranks()
    job.processes.start_spare(job.spare_env())
    job.processes.start(3, job.rank_env(3, joining=True), fresh=True)
    fresh = [sys.executable, "-m", "ntp_megatron.training.pretrain"]
    ranks, (spare, replacement) = server.requests[:4], server.requests[4:]
    assert [r["title"] for r in ranks] == [f"ntp-rank{r}" for r in range(4)] and spare["title"] == "ntp-spare"
    if method == "spawn":
        assert all(r["argv"] == fresh and r["target"] is None for r in ranks)
        assert spare["argv"] == [sys.executable, "-m", "ntp_megatron.training.spare"]
    else:
        assert all(r["argv"] is None and r["target"] == "ntp_megatron.training.pretrain:main" for r in ranks)
        assert spare["target"] == "ntp_megatron.training.spare:serve"
    assert spare["pass_fd"][0] == runtime.ENV_SPARE_FD
    assert replacement["argv"] == fresh
    assert sorted(job.processes.ranks) == [0, 1, 2, 3] and len(job.processes.spares) == 1


def test_auto_fails_loudly_when_the_cuda_check_raises(monkeypatch, no_gpu_evidence):
    monkeypatch.setattr(torch.cuda, "is_available", _broken)
    with pytest.raises(SystemExit, match="CUDA is unusable: torch.cuda.is_available.. failed: CUDA driver"):
        runtime.select_device("auto")
    assert runtime.select_device("cpu") == torch.device("cpu")  # an explicit CPU run never asks


@pytest.mark.parametrize("visible", ["0", "GPU-3f2a", "0,1,2,3"])
def test_auto_fails_loudly_when_visible_gpus_are_unusable(monkeypatch, no_gpu_evidence, visible):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(SystemExit, match=f"CUDA_VISIBLE_DEVICES={visible} names GPUs, but torch.cuda.is_available"):
        runtime.select_device("auto")


def test_auto_fails_loudly_when_the_driver_sees_gpus_torch_cannot_use(tmp_path, monkeypatch, no_gpu_evidence):
    gpus = tmp_path / "gpus"
    (gpus / "0000:07:00.0").mkdir(parents=True)
    monkeypatch.setattr(runtime, "NVIDIA_GPUS_DIR", gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="the NVIDIA driver sees 1 GPU"):
        runtime.select_device("auto")


@pytest.mark.parametrize("visible", [None, "", "-1", "NoDevFiles"])
def test_auto_is_cpu_where_there_is_no_gpu(monkeypatch, no_gpu_evidence, visible):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert runtime.select_device("auto") == torch.device("cpu")
    assert runtime.rank_start_method("auto") == "fork"


def _cuda_present(monkeypatch, count: int, set_device) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)


def test_auto_fails_loudly_when_the_device_does_not_initialise(monkeypatch, no_gpu_evidence):
    _cuda_present(monkeypatch, 2, _broken)
    monkeypatch.setenv(runtime.ENV_LOCAL_RANK, "1")
    with pytest.raises(SystemExit, match="CUDA is unusable: device 1: CUDA driver initialization failed"):
        runtime.select_device("auto")


def test_each_rank_takes_its_own_visible_device(monkeypatch, no_gpu_evidence):
    chosen = []
    _cuda_present(monkeypatch, 4, chosen.append)
    monkeypatch.setenv(runtime.ENV_LOCAL_RANK, "2")
    assert runtime.select_device("auto") == torch.device("cuda", 2)
    assert chosen == [2]
    monkeypatch.setenv(runtime.ENV_LOCAL_RANK, "4")
    with pytest.raises(SystemExit, match=r"device is 4 \(LOCAL_RANK\) but 4 device\(s\) are visible"):
        runtime.select_device("auto")
    assert chosen == [2]
