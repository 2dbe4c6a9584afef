"""Run real jobs through the real launcher (multi-process gloo) and read what they recorded.

Every job :func:`run_job` runs is also checked for what every re-formation moved: the ``moved_bytes`` of each
``reformed`` event must equal a lower bound computed from the job's model dimensions and the two topologies the
controller published (:mod:`tests.harness.bounds`; ``tests/conftest.py`` applies the same check to metrics files
written by jobs started another way). :func:`assert_replicas_agree` (:mod:`tests.harness.checks`) is the one check
that every live (replica, TP rank) reported the same state checksums at every iteration. Starting processes, every
wait bounded: :mod:`tests.harness.processes`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

# The names the tests use, whichever module of the harness holds them.
__all__ = ["CHECKED_METRICS", "ReformationBoundError", "check_reformations", "check_shard_moves",
           "reformation_lower_bound", "unit_counts", "unit_elements",
           "assert_groups_as_planned", "assert_ok", "assert_replicas_agree", "relative_difference", "JOB_TIMEOUT_S",
           "REPO", "Forked", "JobResult", "_Zygote", "alive", "launch", "read_records", "run_module", "store_client",
           "store_server", "wait_until", "kill_remaining", "TINY", "layout_args", "run_job"]

from tests.harness.bounds import CHECKED_METRICS, ReformationBoundError, check_reformations, check_shard_moves, \
    reformation_lower_bound, unit_counts, unit_elements
from tests.harness.checks import assert_groups_as_planned, assert_ok, assert_replicas_agree, relative_difference
from tests.harness.processes import JOB_TIMEOUT_S, REPO, Forked, JobResult, _Zygote, alive, launch, read_records, \
    kill_remaining, run_module, store_client, store_server, wait_until

TINY = [
    "--set", "ntp.enabled=false",  # the default config runs NTP; tests switch it on where they test it
    "--set", "ntp.rebalance=false",  # a loaded machine can make a rank look slow for a window: on where tested
    "--set", "model.hidden_dropout=0.0", "--set", "model.attention_dropout=0.0",
    "--set", "training.micro_batch_size=2", "--set", "training.global_batch_size=12",
    "--set", "training.lr_warmup_iters=1",
    "--set", "logging.log_interval=1", "--set", "logging.tensorboard_dir=",
]


def layout_args(tp: int, dp: int, iters: int) -> list[str]:
    return ["--set", f"parallel.tensor_model_parallel_size={tp}", "--set", f"parallel.data_parallel_size={dp}",
            "--set", f"training.train_iters={iters}", *TINY]


def run_job(run_dir: Path, args: Sequence[str] = (), timeout: float = JOB_TIMEOUT_S) -> JobResult:
    """``ntp-launch`` with ``args`` in a fresh run dir; the metrics file is read back as records, and every
    re-formation's moved bytes are checked against the lower bound (:func:`check_reformations`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = run_dir / "metrics.jsonl"
    returncode, out, err = launch(run_dir, ["--run-dir", str(run_dir), "--metrics-file", str(metrics_file), *args],
                                  timeout)
    records = read_records(metrics_file)
    result = JobResult(returncode, out, err, records, run_dir)
    CHECKED_METRICS.add(metrics_file.resolve())
    try:
        result.reformations = check_reformations(records, run_dir)
    except ReformationBoundError as exc:
        exc.result = result
        raise
    return result
