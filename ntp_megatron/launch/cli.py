"""``ntp-launch``'s command line: its own flags, and Megatron-style flags translated into config keys."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ntp_megatron import faults
from ntp_megatron.config import flags
from ntp_megatron.config.files import ConfigError
from ntp_megatron.config.schema import JobConfig, load_job_config
from ntp_megatron.launch import preflight
from ntp_megatron.plan import memory_plan


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ntp-launch",
        description="Start a GPT pretraining job on Megatron-Core with ntp-megatron. Other --flags are "
                    "Megatron-style: --train-iters 20 is --set training.train_iters=20 (list below). Paths are "
                    "relative to the current directory.",
        epilog=flags.help_text(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, default=None, help="YAML job config (default: configs/tiny_cpu.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallel.tensor_model_parallel_size=2")
    p.add_argument("--metrics-file", type=Path, default=None, help="JSON lines: one per iteration and event")
    p.add_argument("--inject-failure", dest="failures", action="append", default=[], metavar="SPEC",
                   help="ACTION:rank=R,iter=N[,phase=P][,code=C] (ACTION in " + ", ".join(faults.ACTIONS) + "; P in "
                        + ", ".join(faults.PHASES) + "), kill:rank=R,after=S, or random:mtbf=S[,seed=K][,max=M]"
                        "[,action=kill|hang]; R is a launch rank; repeatable; replaces faults.inject of the config")
    p.add_argument("--run-dir", type=Path, default=None, help="override logging.run_dir")
    p.add_argument("--print-memory-plan", action="store_true",
                   help="print the training state a rank holds at each TP degree down to ntp.min_tp, and exit")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes in the job: run one ntp-launch per node, all with the same config, --nnodes, "
                        "--store-host and node 0's --store-port (default 1)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks (devices) per node, torchrun's name (default: world size / NNODES); with "
                        "--nnodes-per-domain it may be smaller than the TP size: a TP group then spans nodes")
    p.add_argument("--nnodes-per-domain", type=int, default=1,
                   help="consecutive nodes that make one scale-up domain (an NVL72 rack's trays): a TP group lies "
                        "inside one domain and may span its nodes (default 1: each node is its own domain)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index, 0..NNODES-1; node 0 hosts the store, the metrics and the controller")
    p.add_argument("--store-host", default="127.0.0.1", help="host of node 0, which hosts the store")
    p.add_argument("--store-port", type=int, default=0,
                   help="node 0: the port its store listens on (default 0: a free one, which node 0 says and writes "
                        "to <run dir>/store.json); other nodes: node 0's port")
    return p


def resolve_config(args: argparse.Namespace, extra: Sequence[str]) -> JobConfig:
    overrides = list(args.overrides) + flags.translate(extra)
    if args.metrics_file is not None:
        overrides.append(f"logging.metrics_file={json.dumps(str(args.metrics_file))}")
    if args.run_dir is not None:
        overrides.append(f"logging.run_dir={json.dumps(str(args.run_dir))}")
    return load_job_config(args.config, overrides)


@dataclass(frozen=True)
class Job:
    """What the command line asks this launcher to run, checked before any rank starts."""

    cfg: JobConfig
    config_path: Path
    """Where the resolved config is written for the ranks to read."""
    failures: list
    """The ``--inject-failure`` specs (:func:`ntp_megatron.faults.parse_failure_spec`)."""
    start: Optional[Any]
    """The checkpoint the run resumes from (:class:`ntp_megatron.training.checkpoint.Progress`), or None."""


def prepare(args: argparse.Namespace, extra: Sequence[str]) -> Union[Job, int]:
    """The job the command line describes, or an exit code when there is nothing to start (``--print-memory-plan``,
    a run already complete). Raises :class:`ConfigError` (one line, exit code 2) for bad input."""
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.node_rank > 0 and args.store_port == 0:
        raise ConfigError(f"--store-port: node {args.node_rank} needs the port of node 0's store (node 0 says it, "
                          "and writes it to <run dir>/store.json)")
    cfg = resolve_config(args, extra)
    if args.print_memory_plan:
        if not cfg.ntp.enabled:
            raise ConfigError("--print-memory-plan: the plan is NTP's (layouts down to ntp.min_tp); set "
                              "ntp.enabled: true")
        print(memory_plan.table(cfg))
        return 0
    if cfg.ntp.enabled and cfg.ntp.on_unrecoverable == "restart" and args.nnodes > 1:
        raise ConfigError(f"ntp.on_unrecoverable 'restart' runs on one node only (got --nnodes {args.nnodes}); "
                          "use drop_replica or stop")
    preflight.check_data(cfg)
    preflight.check_device(cfg)
    preflight.check_checkpoint_save(cfg)
    start, note = preflight.resume_point(cfg)
    if note:
        print(f"ntp-launch: {note}", file=sys.stderr)
    done = preflight.nothing_to_do(cfg, start)
    if done:
        print(f"ntp-launch: {done}", file=sys.stderr)
        return 0
    specs = args.failures if args.failures else cfg.faults.inject
    checkpoints = cfg.checkpoint.save is not None and cfg.checkpoint.save_interval is not None
    eval_interval = cfg.training.eval_interval if cfg.training.evaluates else None
    # gloo for sure (random failures draw the connect phase only there): set, or a CPU job
    gloo = cfg.parallel.backend == "gloo" or (cfg.parallel.backend == "auto" and cfg.training.device == "cpu")
    failures = [faults.parse_failure_spec(f, cfg.world_size, cfg.training.train_iters, checkpoints, cfg.ntp.enabled,
                                          start.iteration if start else 0, eval_interval, gloo,
                                          cfg.ntp.enabled and cfg.ntp.progress_fence) for f in specs]
    config_path = Path(cfg.logging.run_dir).resolve() / f"config.node{args.node_rank}.json"
    return Job(cfg, config_path, failures, start)
