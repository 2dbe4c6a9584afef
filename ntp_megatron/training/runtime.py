"""What one rank process learns from the launcher, and how it joins the job.

The launcher hosts the ``TCPStore`` (so any rank, rank 0 included, can die without taking the store with
it) and passes its address plus this rank's identity in environment variables. Each process-group
generation uses its own key prefix in that store (``gen<g>/``), so a later re-formation can build fresh
groups on the same store.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ntp_megatron.elastic import keys
from ntp_megatron.elastic.watchdog import wait_for_port

logger = logging.getLogger(__name__)

ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_STORE_HOST = "NTP_STORE_HOST"
ENV_STORE_PORT = "NTP_STORE_PORT"
ENV_RUN_DIR = "NTP_RUN_DIR"
ENV_CONFIG = "NTP_RESOLVED_CONFIG"
ENV_JOINING = "NTP_JOINING"
"""Set for a replacement process that the launcher started for a failed rank of a running NTP job."""
ENV_SPARE_FD = "NTP_SPARE_FD"
"""A warm spare's end of its assignment pipe (:mod:`ntp_megatron.training.spare`)."""
ENV_NNODES = "NTP_NNODES"
"""How many nodes (launchers) the job runs on."""
ENV_NODE = "NTP_NODE"
"""This process's node."""
ENV_NNODES_PER_DOMAIN = "NTP_NNODES_PER_DOMAIN"
"""How many consecutive nodes make one scale-up domain (``--nnodes-per-domain``): a TP group lies inside one."""
ENV_NODE_STORE_PORT = "NTP_NODE_STORE_PORT"
"""Under NTP on several nodes: the port of this node's store on this host, which its launcher hosts (node 0's is the
root store: :mod:`ntp_megatron.elastic.relay`)."""
ENV_RESTART = "NTP_RESTART"
"""How many times the launcher restarted every rank from the last checkpoint (NTP off); 0 at first."""

EXIT_PEER_FAILED = 3
"""Exit code of a rank (NTP off) whose collective failed because another rank failed: an echo of that failure,
not its cause. The launcher names the cause."""
EXIT_DEVICE_LOST = 4
"""Under NTP: the rank's device failed for good (:func:`ntp_megatron.elastic.errors.is_device_lost`); it counts as
dead."""

@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    store_host: str
    store_port: int
    run_dir: Path
    config_path: Path
    restart: int = 0
    joining: bool = False
    nnodes: int = 1
    node: int = 0
    node_store_port: Optional[int] = None
    nnodes_per_domain: int = 1

    @classmethod
    def from_environ(cls) -> "RankEnv":
        missing = [k for k in (ENV_RANK, ENV_WORLD_SIZE, ENV_STORE_HOST, ENV_STORE_PORT, ENV_RUN_DIR, ENV_CONFIG)
                   if k not in os.environ]
        if missing:
            raise SystemExit(
                f"ntp-pretrain: missing environment {', '.join(missing)}; start ranks with ntp-launch "
                "(scripts/pretrain_gpt.sh), not by hand"
            )
        return cls(
            rank=int(os.environ[ENV_RANK]),
            world_size=int(os.environ[ENV_WORLD_SIZE]),
            local_rank=int(os.environ.get(ENV_LOCAL_RANK, os.environ[ENV_RANK])),
            store_host=os.environ[ENV_STORE_HOST],
            store_port=int(os.environ[ENV_STORE_PORT]),
            run_dir=Path(os.environ[ENV_RUN_DIR]),
            config_path=Path(os.environ[ENV_CONFIG]),
            restart=int(os.environ.get(ENV_RESTART, "0")),
            joining=os.environ.get(ENV_JOINING) == "1",
            nnodes=int(os.environ.get(ENV_NNODES, "1")),
            node=int(os.environ.get(ENV_NODE, "0")),
            node_store_port=int(os.environ[ENV_NODE_STORE_PORT]) if ENV_NODE_STORE_PORT in os.environ else None,
            nnodes_per_domain=int(os.environ.get(ENV_NNODES_PER_DOMAIN, "1")),
        )


def quiet_optional_dependency_warnings() -> None:
    """Warnings a user cannot act on: Megatron-Core warns once per module that TE/Apex are missing (on CPU that
    is expected, not news), and every rank's checkpoint load prints torch's deprecation notices for the APIs
    Megatron-Core 0.16's ``dist_checkpointing`` calls (``load_state_dict``, ShardedTensor)."""
    for pattern in (r".*Transformer Engine and Apex are not installed.*", r".*Apex is not installed.*",
                    r".*Transformer Engine is not installed.*"):
        warnings.filterwarnings("ignore", message=pattern)
    for pattern in (r"`load_state_dict` is deprecated", r"Please use DTensor instead and we are deprecating ShardedTensor"):
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)


NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")
"""One entry per GPU the NVIDIA kernel driver sees (a module constant so tests can point it elsewhere)."""
HIDDEN_DEVICES = ("", "-1", "NoDevFiles")
"""``CUDA_VISIBLE_DEVICES`` values that name no GPU (Slurm sets ``NoDevFiles`` on a job without GPUs)."""


def expected_gpus() -> Optional[str]:
    """Why this machine is meant to have usable GPUs (None if nothing says so): ``CUDA_VISIBLE_DEVICES`` names
    some, or the NVIDIA driver sees some. ``training.device: auto`` then requires CUDA to work."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in HIDDEN_DEVICES:
        return f"CUDA_VISIBLE_DEVICES={visible} names GPUs"
    try:
        count = len(list(NVIDIA_GPUS_DIR.iterdir()))
    except OSError:
        count = 0
    if count:
        return f"the NVIDIA driver sees {count} GPU(s) ({NVIDIA_GPUS_DIR})"
    return None


def _cuda_unusable(why: str) -> SystemExit:
    return SystemExit(f"training.device: CUDA is unusable: {why} (torch {torch.__version__}, built for CUDA "
                      f"{torch.version.cuda}); fix the CUDA setup, or set training.device: cpu to train on CPU")


def select_device(requested: str) -> torch.device:
    """The rank's device. ``auto`` is CUDA where CUDA works and CPU where there is no GPU at all; a GPU machine
    whose CUDA is broken (the check raises, torch sees no device although the environment or the driver names
    some, or the device fails to initialise) ends the rank with a message instead of training on CPU unnoticed."""
    if requested == "cpu":
        return torch.device("cpu")
    try:
        available = torch.cuda.is_available()
    except Exception as exc:  # noqa: BLE001 - any failure of the check itself means a broken CUDA
        raise _cuda_unusable(f"torch.cuda.is_available() failed: {exc}") from exc
    if not available:
        if requested == "cuda":
            raise SystemExit("training.device is 'cuda' but CUDA is not available; use 'auto' or 'cpu'")
        reason = expected_gpus()
        if reason is not None:
            raise _cuda_unusable(f"{reason}, but torch.cuda.is_available() is False")
        return torch.device("cpu")
    local_rank = int(os.environ.get(ENV_LOCAL_RANK, "0"))
    try:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(f"this rank's device is {local_rank} ({ENV_LOCAL_RANK}) but {count} device(s) are "
                               f"visible")
        torch.cuda.set_device(local_rank)
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001
        raise _cuda_unusable(f"device {local_rank}: {exc}") from exc
    return torch.device("cuda", local_rank)


def rank_start_method(requested: str) -> str:
    """How the launcher starts ranks: ``"fork"`` from itself (CPU: it has imported torch and Megatron-Core once,
    and the ranks skip those seconds), or ``"spawn"`` fresh interpreters wherever CUDA may be used. A fork after
    these imports is safe only while nothing touched CUDA, and an import (Transformer Engine's, for one) can touch
    it in ways ``torch.cuda.is_initialized()`` does not see. A CUDA check that fails also spawns: each rank then
    reports the broken CUDA (:func:`select_device`)."""
    if requested == "cpu":
        return "fork"
    if requested == "cuda":
        return "spawn"
    try:
        gpu = torch.cuda.is_available() or expected_gpus() is not None
    except Exception:  # noqa: BLE001
        gpu = True
    return "spawn" if gpu else "fork"


def select_backend(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise SystemExit("parallel.backend 'nccl' needs CUDA; use 'gloo' or 'auto' on CPU")
    return requested


def connect_store(env: RankEnv, timeout_s: float) -> dist.TCPStore:
    """A client of the launcher's store (the launcher is the server; ranks never host it)."""
    wait_for_port(env.store_host, env.store_port, timeout_s)
    return dist.TCPStore(
        env.store_host, env.store_port, world_size=None, is_master=False,
        timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
    )


def init_process_group(
    env: RankEnv, store: dist.Store, backend: str, timeout_s: float, generation: int = 0
) -> None:
    """Join generation ``generation`` of the job's default process group on its own store prefix."""
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(keys.process_group_prefix(generation), store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_libc: Optional[ctypes.CDLL] = None


def _prctl(option: int, arg) -> None:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        _libc.prctl(option, arg)
    except (OSError, AttributeError):  # not Linux: no parent-death signal, no process name
        pass


def die_with_parent(parent: int) -> None:
    """Arm ``SIGKILL`` for when the thread that started this process ends (``PR_SET_PDEATHSIG``; it survives
    ``exec``), then exit at once if ``parent`` is already gone: it died before the signal was armed, and nobody
    would send it. Called first thing in every process the launcher starts
    (:mod:`ntp_megatron.launch.forkserver`)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def set_process_name(name: str) -> None:
    """The name ``ps`` and ``top`` show (15 bytes at most; ``exec`` resets it)."""
    _prctl(_PR_SET_NAME, ctypes.create_string_buffer(name.encode()[:15]))


def become_rank_process(rank: int) -> None:
    """Show as ``ntp-rankN`` in ``ps``/``top`` (the process already dies with the launcher: its start armed that)."""
    set_process_name(f"ntp-rank{rank}")
