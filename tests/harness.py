"""Run real jobs through the real launcher (multi-process gloo) and read what they recorded."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

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


class _Zygote:
    """Client of ``tests/zygote.py``: one long-lived process that imported torch and Megatron-Core once and
    forks a launcher per job (``NTP_TEST_ZYGOTE=0`` runs ``python -m ntp_megatron.launcher`` instead)."""

    _proc: Optional[subprocess.Popen] = None

    @classmethod
    def run(cls, args: list[str], stdout: Path, stderr: Path, timeout: float, module: Optional[str] = None,
            cwd: Path = REPO) -> int:
        if cls._proc is None or cls._proc.poll() is not None:
            cls._proc = subprocess.Popen([sys.executable, "-m", "tests.zygote"], cwd=REPO, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, bufsize=1)
        proc = cls._proc
        request = {"args": args, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        if module is not None:
            request["module"] = module
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        pid = json.loads(proc.stdout.readline())["pid"]
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            os.killpg(pid, signal.SIGKILL)
            json.loads(proc.stdout.readline())
            raise subprocess.TimeoutExpired(args, timeout)
        return json.loads(proc.stdout.readline())["returncode"]


def run_job(run_dir: Path, args: Sequence[str] = (), timeout: float = JOB_TIMEOUT_S) -> JobResult:
    """``ntp-launch`` with ``args`` in a fresh run dir; the metrics file is read back as records."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = run_dir / "metrics.jsonl"
    launcher_args = ["--run-dir", str(run_dir), "--metrics-file", str(metrics_file), *args]
    if os.environ.get("NTP_TEST_ZYGOTE", "1") == "1":
        stdout, stderr = run_dir / "launcher.stdout", run_dir / "launcher.stderr"
        returncode = _Zygote.run(launcher_args, stdout, stderr, timeout)
        out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
    else:
        proc = subprocess.run([sys.executable, "-m", "ntp_megatron.launcher", *launcher_args], cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)
        returncode, out, err = proc.returncode, proc.stdout, proc.stderr
    records = []
    if metrics_file.exists():
        records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return JobResult(returncode, out, err, records, run_dir)


def run_module(module: str, args: Sequence[str], out_dir: Path, timeout: float = JOB_TIMEOUT_S,
               cwd: Path = REPO) -> tuple[int, str]:
    """``python -m module args`` in ``cwd`` (forked from the zygote: no imports to pay); returns (exit code,
    stderr)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stdout, stderr = out_dir / f"{module}.stdout", out_dir / f"{module}.stderr"
    if os.environ.get("NTP_TEST_ZYGOTE", "1") == "1":
        returncode = _Zygote.run(list(args), stdout, stderr, timeout, module=module, cwd=cwd)
        return returncode, stderr.read_text(errors="replace")
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stderr


def layout_args(tp: int, dp: int, iters: int) -> list[str]:
    return ["--set", f"parallel.tensor_model_parallel_size={tp}", "--set", f"parallel.data_parallel_size={dp}",
            "--set", f"training.train_iters={iters}", *TINY]


def assert_ok(result: JobResult) -> None:
    assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stderr[-4000:]}"


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)
