"""Run real jobs through the real launcher (multi-process gloo) and read what they recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 300

# The tiny model of the equivalence tests: fp32, dropout off, short sequences.
TINY = [
    "--set", "ntp.enabled=false",  # the default config runs NTP; tests switch it on where they test it
    "--set", "model.hidden_dropout=0.0", "--set", "model.attention_dropout=0.0",
    "--set", "training.micro_batch_size=2", "--set", "training.global_batch_size=12",
    "--set", "training.lr_warmup_iters=1",
    "--set", "logging.log_interval=1", "--set", "logging.tensorboard_dir=",
]


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict]
    run_dir: Path

    def losses(self) -> dict[int, float]:
        return {r["iteration"]: r["lm_loss"] for r in self.records if r.get("kind") == "iteration"}

    def events(self, name: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == "event" and r.get("event") == name]


def run_job(run_dir: Path, args: Sequence[str] = (), timeout: float = JOB_TIMEOUT_S) -> JobResult:
    """``ntp-launch`` with ``args`` in a fresh run dir; the metrics file is read back as records."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "ntp_megatron.launcher", "--run-dir", str(run_dir),
           "--metrics-file", str(metrics_file), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    records = []
    if metrics_file.exists():
        records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return JobResult(proc.returncode, proc.stdout, proc.stderr, records, run_dir)


def layout_args(tp: int, dp: int, iters: int) -> list[str]:
    return ["--set", f"parallel.tensor_model_parallel_size={tp}", "--set", f"parallel.data_parallel_size={dp}",
            "--set", f"training.train_iters={iters}", *TINY]


def assert_ok(result: JobResult) -> None:
    assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stderr[-4000:]}"


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)
