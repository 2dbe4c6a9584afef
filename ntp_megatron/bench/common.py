"""What the benchmark's parts share: running a module, the benchmark's model, a job's layout flags, a job's
iteration records, a ratio that a zero baseline leaves out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

RunModule = Callable[[str, Sequence[str], Path], tuple[int, str, str]]
"""``run(module, args, out_dir)``: ``python -m module args`` (its output files go under ``out_dir``); returns
(exit code, stdout, stderr)."""


def run_in_subprocess(module: str, args: Sequence[str], out_dir: Path) -> tuple[int, str, str]:
    """A fresh interpreter per run, as a user's job starts. The plain Megatron-Core reference (``tests.*``) runs
    from the repository's root with one intra-op thread per rank, as ``ntp-launch`` starts its ranks (its
    ``OMP_NUM_THREADS`` default): with every rank's threads on every core, its steps measured about 18x slower here."""
    cwd, env = None, None
    if module.startswith("tests."):
        cwd, env = Path(__file__).resolve().parents[2], {"OMP_NUM_THREADS": "1", **os.environ}
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd, env=env)
    return proc.returncode, proc.stdout, proc.stderr


MODEL = ["--set", "model.num_layers=2", "--set", "model.hidden_size=128", "--set", "model.num_attention_heads=8",
         "--set", "model.seq_length=128", "--set", "model.hidden_dropout=0", "--set", "model.attention_dropout=0",
         "--set", "training.micro_batch_size=4", "--set", "training.global_batch_size=16",
         "--set", "training.lr_warmup_iters=1", "--set", "logging.tensorboard_dir=", "--set", "logging.log_interval=1000"]


def layout_args(tp: int, dp: int, ntp: bool, dead: Sequence[str] = (), pp: int = 1) -> tuple[str, ...]:
    args = ["--set", f"parallel.tensor_model_parallel_size={tp}", "--set", f"parallel.data_parallel_size={dp}",
            "--set", f"ntp.enabled={'true' if ntp else 'false'}", "--set", f"parallel.pipeline_model_parallel_size={pp}"]
    if dead:
        args += ["--set", f"ntp.dead_slots=[{','.join(dead)}]"]
    return tuple(args)


def run_job_records(args: Sequence[str], iters: int, workdir: Path, run: RunModule, name: str,
                    model: Sequence[str] = tuple(MODEL)) -> list[dict]:
    run_dir = Path(tempfile.mkdtemp(prefix=name.replace(" ", "_").replace("(", "").replace(")", "")
                                    .replace("=", ""), dir=workdir))
    metrics = run_dir / "metrics.jsonl"
    code, _, err = run("ntp_megatron.launch.launcher", ["--run-dir", str(run_dir), "--metrics-file", str(metrics), *model,
                                                 "--set", f"training.train_iters={iters}", *args], run_dir)
    if code != 0:
        raise SystemExit(f"bench: case {name!r} failed ({code}):\n{err[-3000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def ratio(a: float, b: float) -> Optional[float]:
    """``a / b``, or None where the baseline is not above zero (the table shows a dash)."""
    return a / b if b > 0 else None
