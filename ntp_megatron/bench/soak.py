"""``scripts/soak.sh``: one CPU job for as long as it is told, with random failures of several kinds
(``--inject-failure random:mtbf=S,seed=K,kinds=...``), warm spares and rejoins, against the failure-free run of the
same config and iterations. A tool, not a test (the suite never runs it).

Both jobs run through the real launcher (``ntp_megatron.launch.launcher``, what ``scripts/pretrain_gpt.sh`` runs).
While the soak runs, every process of the job (the launcher and its descendants: ranks, warm spares, the fork
server) is sampled from /proc every ``--sample-s`` seconds: RSS, threads, open fds. The report
(:mod:`ntp_megatron.bench.soak_report`) is a JSON file and a text table. A lost host is not drawn yet
(:data:`ntp_megatron.faults.LATER_KINDS`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ntp_megatron import faults
from ntp_megatron.bench import soak_report
from ntp_megatron.bench.soak_report import Sample
from ntp_megatron.config.files import ConfigError

LAUNCHER = "ntp_megatron.launch.launcher"
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/soak.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=None, help="training iterations (default 400 without --duration)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds the soak should train: its iterations come from a 20-iteration failure-free probe")
    p.add_argument("--mtbf", type=float, default=7.0, help="mean seconds between failures (default 7)")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--kinds", default="kill+exit+hang+spin+slow",
                   help="'+'-joined, of " + ", ".join(faults.RANDOM_KINDS))
    p.add_argument("--max-failures", type=int, default=None, help="stop injecting after this many")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=3)
    p.add_argument("--warm-spares", type=int, default=2)
    p.add_argument("--rejoin-after-s", type=float, default=1.0)
    p.add_argument("--config", default=None, help="a job config (default: the launcher's, configs/tiny_cpu.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config, as the launcher's")
    p.add_argument("--reference", default=None, help="metrics.jsonl of a failure-free run of the same config and "
                                                     "iterations to reuse (default: run it)")
    p.add_argument("--run-dir", default="runs/soak", help="where both jobs write (default runs/soak)")
    p.add_argument("--out", default=None, help="the JSON report (default <run-dir>/soak.json)")
    p.add_argument("--sample-s", type=float, default=1.0, help="/proc sampling period (default 1 s)")
    p.add_argument("--timeout-s", type=float, default=6 * 3600.0, help="a job still running after this is stopped")
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> None:
    """Bad input: one line naming the option and what is allowed (exit 2)."""
    if args.iters is not None and args.duration is not None:
        raise ConfigError("--iters and --duration: give one")
    for name in ("mtbf", "sample_s", "timeout_s"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name):g}")
    for name in ("iters", "duration", "max_failures"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value:g}")
    if args.tp < 1 or args.dp < 1 or args.warm_spares < 0 or args.rejoin_after_s < 0:
        raise ConfigError("--tp and --dp must be >= 1, --warm-spares and --rejoin-after-s >= 0")
    faults.parse_failure_spec(failure_spec(args))  # the kinds, named as the launcher names them
    if args.reference and not Path(args.reference).is_file():
        raise ConfigError(f"--reference {args.reference}: no such file (a failure-free run's metrics.jsonl)")


def failure_spec(args: argparse.Namespace) -> str:
    spec = f"random:mtbf={args.mtbf:g},seed={args.seed},kinds={args.kinds}"
    return spec + (f",max={args.max_failures}" if args.max_failures else "")


def job_args(args: argparse.Namespace, iters: int) -> list[str]:
    """The launcher's arguments both jobs share (the soak adds its failures); ``--set`` after them wins."""
    out = ["--config", args.config] if args.config else []
    sets = {"parallel.tensor_model_parallel_size": args.tp, "parallel.data_parallel_size": args.dp,
            "training.train_iters": iters, "training.device": "cpu", "ntp.enabled": "true",
            "training.micro_batch_size": 4, "training.global_batch_size": 4 * args.dp,  # one micro-batch per replica
            "ntp.warm_spares": args.warm_spares, "ntp.rejoin_after_s": f"{args.rejoin_after_s:g}",
            "logging.tensorboard_dir": "", "logging.log_interval": 10}
    for key, value in sets.items():
        out += ["--set", f"{key}={value}"]
    for item in args.set:
        out += ["--set", item]
    return out


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


# -- /proc ------------------------------------------------------------------------------------------------------------

def _stat(pid: int) -> Optional[list[str]]:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (by parent pid), zombies left out."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] != "Z":
                children.setdefault(int(st[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def sample(pid: int, role: str, now: float) -> Optional[Sample]:
    """RSS, threads and open fds of ``pid`` (None: it is gone, or a zombie)."""
    st = _stat(pid)
    if st is None or st[0] == "Z":
        return None
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    return Sample(now, pid, role, int(st[21]) * PAGE_MB, int(st[17]), fds)


def roles(run_dir: Path) -> dict[int, str]:
    """pid -> ``rank <r>`` for every process the launcher recorded as a launch rank (``ranks.node0.json``)."""
    try:
        table = json.loads((run_dir / "ranks.node0.json").read_text())
    except (OSError, ValueError):
        return {}
    return {pid: f"rank {r}" for r, pids in table.items() if r.isdigit() for pid in pids}


def recorded_pids(run_dir: Path) -> set[int]:
    try:
        return {pid for pids in json.loads((run_dir / "ranks.node0.json").read_text()).values() for pid in pids}
    except (OSError, ValueError):
        return set()


def alive(pids: Sequence[int]) -> list[int]:
    return sorted(p for p in pids if (st := _stat(p)) is not None and st[0] != "Z")


# -- the jobs ---------------------------------------------------------------------------------------------------------

class Job:
    """One launcher run, its output in ``<run_dir>/launcher.log``, its processes sampled while it runs."""

    def __init__(self, run_dir: Path, launcher_args: list[str], sample_s: float, timeout_s: float) -> None:
        self.run_dir, self.args, self.sample_s, self.timeout_s = run_dir, launcher_args, sample_s, timeout_s
        self.samples: list[Sample] = []
        self.seen: set[int] = set()
        self.exit_code: Optional[int] = None

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics.unlink(missing_ok=True)  # the launcher appends: one run per file
        cmd = [sys.executable, "-m", LAUNCHER, "--run-dir", str(self.run_dir), "--metrics-file", str(self.metrics),
               *self.args]
        with open(self.run_dir / "launcher.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + self.timeout_s
            while True:
                self._sample(proc.pid)
                try:
                    self.exit_code = proc.wait(timeout=self.sample_s)  # the sampling period, and the exit
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        self.exit_code = self._stop(proc)
                        break
        return self.exit_code

    def _stop(self, proc: subprocess.Popen) -> int:
        """The job ran past ``--timeout-s`` (a hang): SIGTERM the launcher (it stops its ranks), then SIGKILL whatever
        of the job is left (each rank has a session of its own: a process group kill would miss them)."""
        print(f"soak: the job ran past --timeout-s {self.timeout_s:g}: stopping it", file=sys.stderr)
        tree = descendants(proc.pid)
        proc.terminate()
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = -signal.SIGKILL
        for pid in alive([*tree, *descendants(proc.pid)]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        return code

    def _sample(self, root: int) -> None:
        now, named = time.time(), roles(self.run_dir)
        for pid in descendants(root):
            self.seen.add(pid)
            s = sample(pid, "launcher" if pid == root else named.get(pid, "other"), now)
            if s is not None:
                self.samples.append(s)

    def leftover(self) -> list[int]:
        """Processes of the job still alive after the launcher ended (none, if nothing leaked)."""
        return alive(sorted((self.seen | recorded_pids(self.run_dir)) - {os.getpid()}))

    def log(self) -> str:
        return (self.run_dir / "launcher.log").read_text(errors="replace")


def iterations_for(args: argparse.Namespace, run_dir: Path) -> int:
    """``--iters``, or what ``--duration`` asks: a 20-iteration failure-free probe's time per iteration."""
    if args.duration is None:
        return args.iters or 400
    probe = Job(run_dir / "probe", job_args(args, 20), args.sample_s, args.timeout_s)
    if probe.run() != 0:
        raise SystemExit(f"soak: the probe failed ({probe.exit_code}); see {probe.run_dir / 'launcher.log'}")
    its = [r for r in read_records(probe.metrics) if r.get("kind") == "iteration"]
    per_iter = (its[-1]["time"] - its[len(its) // 2]["time"]) / max(1, len(its) - 1 - len(its) // 2)
    iters = max(20, math.ceil(args.duration / max(per_iter, 1e-3)))
    print(f"soak: {per_iter * 1000:.0f} ms per iteration without failures: {iters} iterations for {args.duration:g} s")
    return iters


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        check(args)
    except ConfigError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).resolve()
    iters = iterations_for(args, run_dir)
    if args.reference:
        reference = read_records(Path(args.reference))
    else:
        print(f"soak: the failure-free run, {iters} iterations ({run_dir / 'reference'})", flush=True)
        ref = Job(run_dir / "reference", job_args(args, iters), args.sample_s, args.timeout_s)
        if ref.run() != 0:
            print(f"soak: the failure-free run failed ({ref.exit_code}); see {ref.run_dir / 'launcher.log'}",
                  file=sys.stderr)
            return 1
        reference = read_records(ref.metrics)
    print(f"soak: the soak, {iters} iterations, --inject-failure {failure_spec(args)} ({run_dir / 'soak'})",
          flush=True)
    started = time.time()
    job = Job(run_dir / "soak", [*job_args(args, iters), "--inject-failure", failure_spec(args)], args.sample_s,
              args.timeout_s)
    code = job.run()
    rep = soak_report.report(job.log(), read_records(job.metrics), reference, job.samples, code, args.tp, iters,
                             job.leftover())
    rep.update(command=" ".join(sys.argv), spec=failure_spec(args), iterations=iters, tp=args.tp, dp=args.dp,
               warm_spares=args.warm_spares, rejoin_after_s=args.rejoin_after_s, soak_wall_s=time.time() - started)
    out = Path(args.out) if args.out else run_dir / "soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1, default=str))
    (run_dir / "samples.json").write_text(json.dumps([vars(s) for s in job.samples]))
    print(soak_report.table(rep))
    print(f"soak: report {out}, /proc samples {run_dir / 'samples.json'}, logs {job.run_dir / 'launcher.log'}")
    v = rep["verdict"]
    return 0 if v["nothing_lost"] and v["nothing_leaked"] and v["loss_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
