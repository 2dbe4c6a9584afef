"""What a launcher tells the processes it starts: the environment of a warm spare, and of a launch rank.

A rank learns its identity, its node, the store and the run from these variables
(:mod:`ntp_megatron.training.runtime` reads them); a warm spare starts with the plain environment and is told its
rank when it is assigned one.
"""

from __future__ import annotations

import os
from typing import Any

from ntp_megatron import faults
from ntp_megatron.training import runtime


def spare_env() -> dict[str, str]:
    """The environment every process starts with (a warm spare's until it is assigned a rank)."""
    env = dict(os.environ)
    # Ranks share the machine's cores; one intra-op thread each keeps them from oversubscribing.
    env.setdefault("OMP_NUM_THREADS", "1")
    # Megatron's recommendation for TP communication ordering on GPUs; harmless on CPU.
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return env


def rank_env(launcher: Any, rank: int, joining: bool = False) -> dict[str, str]:
    """Launch rank ``rank``'s environment, as ``launcher`` (:class:`ntp_megatron.launch.launcher.Launcher`) starts it
    (``joining``: a replacement for a failed rank of a running NTP job, which waits to be admitted)."""
    args = launcher.args
    env = spare_env()
    env.update({
        runtime.ENV_RANK: str(rank),
        runtime.ENV_WORLD_SIZE: str(launcher.world_size),
        runtime.ENV_LOCAL_RANK: str(launcher.devices[rank]),
        runtime.ENV_STORE_HOST: args.store_host,
        runtime.ENV_STORE_PORT: str(launcher.nodes.port),
        runtime.ENV_RUN_DIR: str(launcher.run_dir),
        runtime.ENV_CONFIG: str(launcher.config_path),
        runtime.ENV_RESTART: str(launcher.restarts),
        runtime.ENV_NNODES: str(args.nnodes),
        runtime.ENV_NODE: str(args.node_rank),
        runtime.ENV_NNODES_PER_DOMAIN: str(args.nnodes_per_domain),
        faults.ENV_FAILURES: faults.to_env(launcher.failures),
    })
    if launcher.relay is not None:
        env[runtime.ENV_NODE_STORE_PORT] = str(launcher.node_store.port)
    if joining:
        env[runtime.ENV_JOINING] = "1"
    return env
