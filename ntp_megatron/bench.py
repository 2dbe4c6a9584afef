"""``scripts/bench.sh``: step time of NTP against plain Megatron-Core, measured side by side in one run.

Every case is a real job through ``ntp-launch``; the cases run in interleaved rounds (A B C … A B C …) so
machine drift hits all of them alike, and each case's step time is the median ``elapsed_ms`` over its
iterations after warm-up, pooled over rounds. Output: a table on stdout and JSON (``--out``), including a
``degraded_step_time_ratio`` section in the format the goodput simulator reads as calibration.

On a CPU machine with fewer cores than ranks, ranks time-share cores: ratios between jobs with different
rank counts then measure total work rather than per-GPU speed. The comparisons below are arranged so that
each pair runs the same number of ranks, except where the table says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

MODEL = ["--set", "model.num_layers=2", "--set", "model.hidden_size=128", "--set", "model.num_attention_heads=8",
         "--set", "model.seq_length=128", "--set", "model.hidden_dropout=0", "--set", "model.attention_dropout=0",
         "--set", "training.micro_batch_size=4", "--set", "training.global_batch_size=16",
         "--set", "training.lr_warmup_iters=1", "--set", "logging.tensorboard_dir=", "--set", "logging.log_interval=1000"]


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    ranks: int


def _layout(tp: int, dp: int, ntp: bool, dead: Sequence[str] = ()) -> tuple[str, ...]:
    args = ["--set", f"parallel.tensor_model_parallel_size={tp}", "--set", f"parallel.data_parallel_size={dp}",
            "--set", f"ntp.enabled={'true' if ntp else 'false'}"]
    if dead:
        args += ["--set", f"ntp.dead_slots=[{','.join(dead)}]"]
    return tuple(args)


CASES = [
    Case("megatron tp2x1", _layout(2, 1, False), 2),
    Case("ntp tp2x1", _layout(2, 1, True), 2),
    Case("megatron tp2x2", _layout(2, 2, False), 4),
    Case("ntp tp2x2", _layout(2, 2, True), 4),
    Case("ntp tp2+tp1", _layout(2, 2, True, ["1:1"]), 3),
    Case("ntp tp1 (of tp2)", _layout(2, 1, True, ["0:1"]), 1),
]

# (label, case, baseline case, note)
RATIOS = [
    ("NTP on a uniform topology / plain Megatron, TP2 x DP1", "ntp tp2x1", "megatron tp2x1", "same ranks"),
    ("NTP on a uniform topology / plain Megatron, TP2 x DP2", "ntp tp2x2", "megatron tp2x2", "same ranks"),
    ("mixed TP2+TP1 / uniform TP2+TP2 (NTP)", "ntp tp2+tp1", "ntp tp2x2", "3 vs 4 ranks time-share cores"),
    ("one replica degraded TP2 -> TP1 / healthy TP2", "ntp tp1 (of tp2)", "ntp tp2x1", "1 vs 2 ranks"),
]


# Communication of a healthy replica's ranks, in a job with one degraded replica and in the same job with none:
# NTP's promise is that the healthy ranks' steps do not change (same collectives, same payload bytes).
COMM_JOBS = {"no degraded replica": _layout(4, 2, True), "one degraded replica": _layout(4, 2, True, ["1:3"])}
COMM_ITERS = 3


def run_job_records(args: Sequence[str], iters: int, workdir: Path, launcher: Sequence[str], name: str) -> list[dict]:
    run_dir = Path(tempfile.mkdtemp(prefix=name.replace(" ", "_"), dir=workdir))
    metrics = run_dir / "metrics.jsonl"
    cmd = [*launcher, "--run-dir", str(run_dir), "--metrics-file", str(metrics), *MODEL,
           "--set", f"training.train_iters={iters}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench: case {name!r} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def measure_comm(launcher: Sequence[str], workdir: Path) -> dict:
    """Per-iteration torch.distributed calls and payload bytes of replica 0's ranks (healthy in both jobs)."""
    per_job = {}
    for name, args in COMM_JOBS.items():
        records = run_job_records([*args, "--set", "logging.comm_stats=true"], COMM_ITERS, workdir, launcher, name)
        stats: dict[int, list[dict]] = {}
        for r in records:
            if r.get("kind") == "comm_stats" and r["replica"] == 0:
                stats.setdefault(r["tp_rank"], []).append({"calls": r["calls"], "bytes": r["bytes"]})
        per_job[name] = stats
        print(f"comm {name:<22} done", file=sys.stderr)
    healthy, degraded = per_job["no degraded replica"], per_job["one degraded replica"]
    ranks = []
    for tp_rank in sorted(healthy):
        a, b = healthy[tp_rank], degraded.get(tp_rank)
        ranks.append({
            "replica": 0, "tp_rank": tp_rank, "equal": a == b,
            "per_iteration": {"no degraded replica": a[-1], "one degraded replica": b[-1] if b else None},
            "iterations_compared": len(a),
        })
    return {"jobs": {name: " ".join(args) for name, args in COMM_JOBS.items()}, "ranks": ranks}


# A failure in the same job, absorbed by NTP and by the restart-from-checkpoint baseline (NTP off).
FAIL_ITERS, FAIL_AT, CKPT_INTERVAL = 16, 11, 4
FAILURE = ["--inject-failure", f"kill:rank=3,iter={FAIL_AT},phase=backward"]
FAILURE_JOBS = {
    "ntp": [*_layout(2, 2, True), *FAILURE],
    "restart from checkpoint": [*_layout(2, 2, False), "--set", f"checkpoint.save_interval={CKPT_INTERVAL}", *FAILURE],
}


def _failure_figures(records: list[dict]) -> dict:
    """From one failed run: kill to the next completed iteration, and to completing the iteration that was in
    flight (the first one that is progress again); iterations lost; detection; bytes moved."""
    failed = next(r for r in records if r.get("event") == "rank_failed")
    killed_at = failed["time"]
    after = [r for r in records if r.get("kind") == "iteration" and r["time"] > killed_at]
    summary = next(r for r in records if r.get("event") == "job_summary")
    reformed = [r for r in records if r.get("event") == "reformed"]
    return {
        "kill_to_next_iteration_s": after[0]["time"] - killed_at,
        "kill_to_progress_s": next(r for r in after if r["iteration"] >= FAIL_AT)["time"] - killed_at,
        "iterations_lost": summary["iterations_lost"],
        "iterations_rolled_back": summary["iterations_rolled_back"],
        "detect_s": failed.get("detect_s"),
        "moved_bytes": reformed[0]["moved_bytes"] if reformed else None,
        "lower_bound_bytes": reformed[0]["lower_bound_bytes"] if reformed else None,
        "recovery_s": reformed[0]["recovery_s"] if reformed else None,
    }


def measure_failures(rounds: int, launcher: Sequence[str], workdir: Path) -> dict:
    """NTP against the restart baseline, interleaved over ``rounds``; medians per figure."""
    samples: dict[str, list[dict]] = {name: [] for name in FAILURE_JOBS}
    for round_index in range(rounds):
        for name, args in FAILURE_JOBS.items():
            extra = []
            if name != "ntp":
                extra = ["--set", f"checkpoint.save={Path(tempfile.mkdtemp(prefix='ckpt', dir=workdir))}"]
            records = run_job_records([*args, *extra], FAIL_ITERS, workdir, launcher, name)
            samples[name].append(_failure_figures(records))
            print(f"failure round {round_index + 1}/{rounds} {name:<24} done", file=sys.stderr)
    medians = {}
    for name, runs in samples.items():
        medians[name] = {key: (statistics.median(v[key] for v in runs) if runs[0][key] is not None else None)
                         for key in runs[0]}
    ntp, restart = medians["ntp"], medians["restart from checkpoint"]
    return {
        "job": f"TP2 x DP2, {FAIL_ITERS} iterations, SIGKILL of launch rank 3 in the backward pass of iteration "
               f"{FAIL_AT}; the baseline checkpoints every {CKPT_INTERVAL} iterations",
        "runs": samples, "median": medians,
        "ratio_kill_to_next_iteration": ntp["kill_to_next_iteration_s"] / restart["kill_to_next_iteration_s"],
        "ratio_kill_to_progress": ntp["kill_to_progress_s"] / restart["kill_to_progress_s"],
        "moved_over_lower_bound": ntp["moved_bytes"] / ntp["lower_bound_bytes"],
    }


def run_case(case: Case, iters: int, workdir: Path, launcher: Sequence[str]) -> list[float]:
    rows = run_job_records(case.args, iters, workdir, launcher, case.name.replace("(", "").replace(")", ""))
    return [r["elapsed_ms"] for r in rows if r.get("kind") == "iteration"]


def measure(iters: int, rounds: int, warmup: int, launcher: Sequence[str], workdir: Path) -> dict:
    samples: dict[str, list[float]] = {c.name: [] for c in CASES}
    for round_index in range(rounds):
        for case in CASES:
            started = time.monotonic()
            times = run_case(case, iters, workdir, launcher)
            samples[case.name].extend(times[warmup:])
            print(f"round {round_index + 1}/{rounds} {case.name:<18} {time.monotonic() - started:6.1f} s", file=sys.stderr)
    step_ms = {name: statistics.median(values) for name, values in samples.items()}
    ratios = [{"comparison": label, "ratio": step_ms[case] / step_ms[base], "case_ms": step_ms[case],
               "baseline_ms": step_ms[base], "note": note} for label, case, base, note in RATIOS]
    return {
        "machine": "CPU, gloo",
        "iterations_per_case": iters, "warmup_iterations": warmup, "rounds": rounds,
        "cases": {c.name: {"ranks": c.ranks, "median_step_ms": step_ms[c.name], "samples": len(samples[c.name])}
                  for c in CASES},
        "ratios": ratios,
        "degraded_step_time_ratio": {"2": {"1": step_ms["ntp tp1 (of tp2)"] / step_ms["ntp tp2x1"]}},
    }


def table(result: dict) -> str:
    lines = ["| case | ranks | median step (ms) |", "|---|---|---|"]
    lines += [f"| {name} | {c['ranks']} | {c['median_step_ms']:.1f} |" for name, c in result["cases"].items()]
    lines += ["", "| comparison | ratio | note |", "|---|---|---|"]
    lines += [f"| {r['comparison']} | {r['ratio']:.3f} | {r['note']} |" for r in result["ratios"]]
    comm = result.get("communication")
    if comm:
        lines += ["", "Per iteration, replica 0 (healthy) of TP4 x 2, without and with replica 1 degraded to TP3:", "",
                  "| rank | collectives (none degraded) | collectives (one degraded) | payload bytes (none) | "
                  "payload bytes (one) | equal |", "|---|---|---|---|---|---|"]
        for r in comm["ranks"]:
            a, b = r["per_iteration"]["no degraded replica"], r["per_iteration"]["one degraded replica"] or {}
            calls = lambda s: ", ".join(f"{k} {v}" for k, v in s.get("calls", {}).items())
            total = lambda s: sum(s.get("bytes", {}).values())
            lines.append(f"| replica 0, TP rank {r['tp_rank']} | {calls(a)} | {calls(b)} | {total(a)} | {total(b)} | "
                         f"{'yes' if r['equal'] else 'NO'} |")
    failures = result.get("failure_recovery")
    if failures:
        ntp, restart = failures["median"]["ntp"], failures["median"]["restart from checkpoint"]
        lines += ["", f"A failure, same job ({failures['job']}), medians:", "",
                  "| | NTP | restart from checkpoint | ratio |", "|---|---|---|---|",
                  f"| kill to the next completed iteration (s) | {ntp['kill_to_next_iteration_s']:.2f} | "
                  f"{restart['kill_to_next_iteration_s']:.2f} | {failures['ratio_kill_to_next_iteration']:.3f} |",
                  f"| kill to completing the interrupted iteration (s) | {ntp['kill_to_progress_s']:.2f} | "
                  f"{restart['kill_to_progress_s']:.2f} | {failures['ratio_kill_to_progress']:.3f} |",
                  f"| iterations lost: computed again (of them, completed ones rolled back) | "
                  f"{ntp['iterations_lost']:g} ({ntp['iterations_rolled_back']:g}) | "
                  f"{restart['iterations_lost']:g} ({restart['iterations_rolled_back']:g}) | |",
                  f"| detection: kill to every survivor aware (s) | {ntp['detect_s']:.3f} | n/a (every rank restarts) | |",
                  f"| bytes moved / lower bound | {ntp['moved_bytes']:.0f} / {ntp['lower_bound_bytes']:.0f} | "
                  f"n/a (everything reloaded) | {failures['moved_over_lower_bound']:.3f} |"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=12, help="iterations per job")
    p.add_argument("--warmup", type=int, default=3, help="iterations dropped from the start of each job")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all cases")
    p.add_argument("--out", type=Path, default=Path("runs/bench/bench.json"))
    args = p.parse_args(argv)
    if args.warmup >= args.iters:
        print("bench: --warmup must be below --iters", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ntp-bench-") as workdir:
        launcher = [sys.executable, "-m", "ntp_megatron.launcher"]
        result = measure(args.iters, args.rounds, args.warmup, launcher, Path(workdir))
        result["communication"] = measure_comm(launcher, Path(workdir))
        result["failure_recovery"] = measure_failures(args.rounds, launcher, Path(workdir))
        # Calibration for the goodput simulator: measured seconds from a failure to training again.
        result["recovery_s"] = result["failure_recovery"]["median"]["ntp"]["kill_to_next_iteration_s"]
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
