"""Step time of NTP against plain Megatron-Core, measured side by side in one run, and the parts of
``scripts/bench.sh`` that run the same small jobs: a healthy replica's communication, a failure absorbed by NTP
against a restart from checkpoint, recovery with the untouched groups kept against every group made anew
(``--only recovery``), and the training stall of a checkpoint save, sync against async (``--only checkpoint-stall``).

Every case is a real job through ``ntp-launch``; the cases run in interleaved rounds (A B C … A B C …) so
machine drift hits all of them alike, and each case's step time is the median ``elapsed_ms`` over its
iterations after warm-up, pooled over rounds. The step-time part's JSON includes a ``degraded_step_time_ratio``
section in the format the goodput simulator reads as calibration. How long each part runs:
:mod:`ntp_megatron.bench.sizes`; the command line and the table: :mod:`ntp_megatron.bench.cli`,
:mod:`ntp_megatron.bench.report`.

On a CPU machine with fewer cores than ranks, ranks time-share cores: ratios between jobs with different
rank counts then measure total work rather than per-GPU speed. The comparisons below are arranged so that
each pair runs the same number of ranks, except where the table says otherwise.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ntp_megatron.bench.common import RunModule, layout_args, ratio, run_job_records
from ntp_megatron.bench.sizes import Sizes


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    ranks: int


CASES = [
    Case("megatron tp2x1", layout_args(2, 1, False), 2),
    Case("ntp tp2x1", layout_args(2, 1, True), 2),
    Case("megatron tp2x2", layout_args(2, 2, False), 4),
    Case("ntp tp2x2", layout_args(2, 2, True), 4),
    Case("ntp tp2+tp1", layout_args(2, 2, True, ["1:1"]), 3),
    Case("ntp tp1 (of tp2)", layout_args(2, 1, True, ["0:1"]), 1),
    Case("megatron pp2 tp2x1", layout_args(2, 1, False, pp=2), 4),
    Case("ntp pp2 tp2x1", layout_args(2, 1, True, pp=2), 4),
    Case("ntp pp2, stage 1 tp1", layout_args(2, 1, True, ["0:1@1"], pp=2), 3),
]

# (label, case, baseline case, note)
RATIOS = [
    ("NTP on a uniform topology / plain Megatron, TP2 x DP1", "ntp tp2x1", "megatron tp2x1", "same ranks"),
    ("NTP on a uniform topology / plain Megatron, TP2 x DP2", "ntp tp2x2", "megatron tp2x2", "same ranks"),
    ("mixed TP2+TP1 / uniform TP2+TP2 (NTP)", "ntp tp2+tp1", "ntp tp2x2", "3 vs 4 ranks time-share cores"),
    ("one replica degraded TP2 -> TP1 / healthy TP2", "ntp tp1 (of tp2)", "ntp tp2x1", "1 vs 2 ranks"),
    ("NTP on a uniform topology / plain Megatron, PP2 x TP2", "ntp pp2 tp2x1", "megatron pp2 tp2x1", "same ranks"),
    ("one stage degraded TP2 -> TP1 / healthy, PP2 x TP2", "ntp pp2, stage 1 tp1", "ntp pp2 tp2x1",
     "3 vs 4 ranks time-share cores"),
]


def run_case(case: Case, iters: int, workdir: Path, run: RunModule) -> list[float]:
    rows = run_job_records(case.args, iters, workdir, run, case.name)
    return [r["elapsed_ms"] for r in rows if r.get("kind") == "iteration"]


def measure(sizes: Sizes, run: RunModule, workdir: Path) -> dict:
    iters, rounds, warmup = sizes.iters, sizes.rounds, sizes.warmup
    samples: dict[str, list[float]] = {c.name: [] for c in CASES}
    for round_index in range(rounds):
        for case in CASES:
            started = time.monotonic()
            times = run_case(case, iters, workdir, run)
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


# Communication of a healthy replica's ranks, in a job with one degraded replica and in the same job with none:
# NTP's promise is that the healthy ranks' steps do not change (same collectives, same payload bytes).
def comm_jobs(tp: int) -> dict[str, tuple[str, ...]]:
    return {"no degraded replica": layout_args(tp, 2, True), "one degraded replica": layout_args(tp, 2, True, [f"1:{tp - 1}"])}


def measure_comm(sizes: Sizes, run: RunModule, workdir: Path) -> dict:
    """Per-iteration torch.distributed calls and payload bytes of replica 0's ranks (healthy in both jobs)."""
    per_job = {}
    jobs = comm_jobs(sizes.comm_tp)
    for name, args in jobs.items():
        records = run_job_records([*args, "--set", "logging.comm_stats=true"], sizes.comm_iters, workdir, run, name)
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
    return {"tp": sizes.comm_tp, "jobs": {name: " ".join(args) for name, args in jobs.items()}, "ranks": ranks}


# A failure in the same job, absorbed by NTP and by the restart-from-checkpoint baseline (NTP off).
def failure_jobs(sizes: Sizes) -> dict[str, list[str]]:
    failure = ["--inject-failure", f"kill:rank=3,iter={sizes.fail_at},phase=backward"]
    return {"ntp": [*layout_args(2, 2, True), *failure],
            "restart from checkpoint": [*layout_args(2, 2, False),
                                        "--set", f"checkpoint.save_interval={sizes.ckpt_interval}", *failure]}


def _failure_figures(records: list[dict], fail_at: int) -> dict:
    """From one failed run: kill to the next completed iteration, and to completing the iteration that was in
    flight (the first one that is progress again); iterations lost; detection; bytes moved."""
    failed = next(r for r in records if r.get("event") == "rank_failed")
    killed_at = failed["time"]
    after = [r for r in records if r.get("kind") == "iteration" and r["time"] > killed_at]
    summary = next(r for r in records if r.get("event") == "job_summary")
    reformed = [r for r in records if r.get("event") == "reformed"]
    return {
        "kill_to_next_iteration_s": after[0]["time"] - killed_at,
        "kill_to_progress_s": next(r for r in after if r["iteration"] >= fail_at)["time"] - killed_at,
        "iterations_lost": summary["iterations_lost"],
        "iterations_rolled_back": summary["iterations_rolled_back"],
        "detect_s": failed.get("detect_s"),
        "moved_bytes": reformed[0]["moved_bytes"] if reformed else None,
        "lower_bound_bytes": reformed[0]["lower_bound_bytes"] if reformed else None,
        "recovery_s": reformed[0]["recovery_s"] if reformed else None,
    }


def measure_failures(sizes: Sizes, run: RunModule, workdir: Path, ntp_records: Optional[list] = None) -> dict:
    """NTP against the restart baseline, interleaved over ``sizes.rounds``; medians per figure. The records of
    every NTP run are appended to ``ntp_records`` (the memory part reads its re-formations)."""
    jobs = failure_jobs(sizes)
    samples: dict[str, list[dict]] = {name: [] for name in jobs}
    for round_index in range(sizes.rounds):
        for name, args in jobs.items():
            extra = []
            if name != "ntp":
                extra = ["--set", f"checkpoint.save={Path(tempfile.mkdtemp(prefix='ckpt', dir=workdir))}"]
            records = run_job_records([*args, *extra], sizes.fail_iters, workdir, run, name)
            samples[name].append(_failure_figures(records, sizes.fail_at))
            if name == "ntp" and ntp_records is not None:
                ntp_records.append(records)
            print(f"failure round {round_index + 1}/{sizes.rounds} {name:<24} done", file=sys.stderr)
    medians = {}
    for name, runs in samples.items():
        medians[name] = {key: (statistics.median(v[key] for v in runs) if runs[0][key] is not None else None)
                         for key in runs[0]}
    ntp, restart = medians["ntp"], medians["restart from checkpoint"]
    return {
        "job": f"TP2 x DP2, {sizes.fail_iters} iterations, SIGKILL of launch rank 3 in the backward pass of iteration "
               f"{sizes.fail_at}; the baseline checkpoints every {sizes.ckpt_interval} iterations",
        "runs": samples, "median": medians,
        "ratio_kill_to_next_iteration": ntp["kill_to_next_iteration_s"] / restart["kill_to_next_iteration_s"],
        "ratio_kill_to_progress": ntp["kill_to_progress_s"] / restart["kill_to_progress_s"],
        "moved_over_lower_bound": ntp["moved_bytes"] / ntp["lower_bound_bytes"],
    }


# Recovery with the groups a failure did not touch kept (the same objects and communicators) against every group
# of every rank made anew in every generation (``ntp.keep_groups: false``, the design before), same jobs otherwise.
RECOVERY_DESIGNS = {"rebuild_all": ("--set", "ntp.keep_groups=false"), "keep_untouched": ()}


def recovery_jobs(sizes: Sizes) -> dict[tuple[int, str], list[str]]:
    """(TP, design) -> the job: TP x DP2, the last rank (replica 1's last slot) killed in the backward pass."""
    return {(tp, design): [*layout_args(tp, 2, True), "--inject-failure",
                           f"kill:rank={2 * tp - 1},iter={sizes.fail_at},phase=backward", *extra]
            for tp in sizes.recovery_tps for design, extra in RECOVERY_DESIGNS.items()}


def _recovery_figures(records: list[dict], fail_at: int) -> dict:
    figures = _failure_figures(records, fail_at)
    [reformed] = [r for r in records if r.get("event") == "reformed"]
    ranks = [r for r in records if r.get("kind") == "reform_rank" and r["generation"] == reformed["generation"]]
    healthy = [r for r in ranks if r["replica"] == 0]
    return {"kill_to_next_iteration_s": figures["kill_to_next_iteration_s"], "recovery_s": figures["recovery_s"],
            "reform_s": reformed["reform_s"], "detect_s": figures["detect_s"],
            "groups_made": sum(len(r["groups_made"]) for r in ranks),
            "groups_made_per_healthy_rank": max(len(r["groups_made"]) for r in healthy),
            "groups_kept": sum(len(r["groups_kept"]) for r in ranks)}


def measure_recovery(sizes: Sizes, run: RunModule, workdir: Path) -> dict:
    """Kill to the next completed iteration, before (every group made anew) and after (untouched groups kept), at
    each TP x DP2, interleaved over ``sizes.rounds``; medians per figure."""
    jobs = recovery_jobs(sizes)
    samples: dict[tuple[int, str], list[dict]] = {key: [] for key in jobs}
    for round_index in range(sizes.rounds):
        for (tp, design), args in jobs.items():
            records = run_job_records(args, sizes.fail_iters, workdir, run, f"recovery-tp{tp}-{design}")
            samples[tp, design].append(_recovery_figures(records, sizes.fail_at))
            print(f"recovery round {round_index + 1}/{sizes.rounds} TP{tp} x DP2 {design:<16} done", file=sys.stderr)
    rows = []
    for (tp, design), runs in samples.items():
        rows.append({"layout": f"TP{tp} x DP2", "ranks": 2 * tp, "design": design, "runs": runs,
                     **{key: statistics.median(v[key] for v in runs) for key in runs[0]}})
    ratios = []
    for tp in sizes.recovery_tps:
        before, after = (next(r for r in rows if r["layout"] == f"TP{tp} x DP2" and r["design"] == d)
                         for d in RECOVERY_DESIGNS)
        ratios.append({"layout": f"TP{tp} x DP2", "kill_to_next_iteration": ratio(
            after["kill_to_next_iteration_s"], before["kill_to_next_iteration_s"]),
            "reform": ratio(after["reform_s"], before["reform_s"])})
    return {"job": f"TP k x DP2, {sizes.fail_iters} iterations, SIGKILL of the last rank in the backward pass of "
                   f"iteration {sizes.fail_at}; 'rebuild_all' makes every group anew (ntp.keep_groups=false)",
            "rows": rows, "ratios": ratios}


# The training stall of a checkpoint save, sync against async (Megatron-Core's async path), on one job: plain
# Megatron (NTP off; async saves need it), TP2 x DP1, a larger model so that a save writes tens of MB.
STALL_MODEL = ["--set", "model.num_layers=4", "--set", "model.hidden_size=256", "--set", "model.vocab_size=4096",
               "--set", "model.seq_length=64", "--set", "training.micro_batch_size=2",
               "--set", "training.global_batch_size=4"]


def stall_jobs(sizes: Sizes) -> dict[str, list[str]]:
    every = ["--set", f"checkpoint.save_interval={sizes.stall_interval}"]
    return {"no saves": [], "sync saves": every, "async saves": [*every, "--set", "checkpoint.async_save=true"]}


def _stall_figures(records: list[dict], sizes: Sizes) -> dict:
    """From one run: the wall time from the end of iteration ``stall_warmup`` to the end of the last iteration
    (the saves of iterations ``stall_interval``, 2·``stall_interval``, … below the last happen inside it; the
    final checkpoint after the last iteration is outside), and the gaps between consecutive iterations' ends,
    split into those that follow a save iteration and the others."""
    warmup, interval, last = sizes.stall_warmup, sizes.stall_interval, sizes.stall_iters
    end = {r["iteration"]: r["time"] for r in records if r.get("kind") == "iteration"}
    gaps = {k: end[k] - end[k - 1] for k in end if k - 1 in end and k - 1 >= warmup}
    after_save = [gaps[k] for k in gaps if (k - 1) % interval == 0]
    others = [gaps[k] for k in gaps if (k - 1) % interval != 0]
    in_window = {k for k in end if warmup < k < last and k % interval == 0}
    blocked = sum(r["seconds"] for r in records if r.get("kind") == "checkpoint_stall" and r["iteration"] in in_window)
    return {"window_s": end[last] - end[warmup], "after_save_gap_s": after_save, "other_gap_s": others,
            "saves_in_window": len(after_save), "blocked_per_save_s": blocked / len(in_window),
            "step_s": statistics.median(r["elapsed_ms"] for r in records if r.get("kind") == "iteration") / 1e3}


def measure_checkpoint_stall(sizes: Sizes, run: RunModule, workdir: Path) -> dict:
    """The same job without saves, with sync saves and with async saves every ``stall_interval`` iterations,
    interleaved over ``sizes.rounds``. Extra wall time per save = (window of the case − window without saves) / saves
    in the window (medians over rounds); also, per case, the median gap after a save iteration minus the median
    of the other gaps (the stall seen by the iteration right after a save; an async save's finalization and its
    writer's CPU use may land later). Also measured in the rank (``checkpoint_stall`` records of the reporting
    rank): training blocked per save = the time inside the save call plus, for async saves, the checks and the
    finalization attributed to it — the least noisy figure on a shared machine."""
    rounds = sizes.rounds
    runs: dict[str, list[dict]] = {name: [] for name in stall_jobs(sizes)}
    for round_index in range(rounds):
        for name, args in stall_jobs(sizes).items():
            extra = list(args)
            if args:
                extra += ["--set", f"checkpoint.save={Path(tempfile.mkdtemp(prefix='ckpt', dir=workdir))}"]
            records = run_job_records([*layout_args(2, 1, False), *STALL_MODEL, *extra], sizes.stall_iters, workdir, run,
                                      name)
            runs[name].append(_stall_figures(records, sizes))
            print(f"checkpoint stall round {round_index + 1}/{rounds} {name:<12} done", file=sys.stderr)
    window = {name: statistics.median(r["window_s"] for r in rs) for name, rs in runs.items()}
    saves = runs["sync saves"][0]["saves_in_window"]
    cases = {}
    for name, rs in runs.items():
        after = [g for r in rs for g in r["after_save_gap_s"]]
        other = statistics.median(g for r in rs for g in r["other_gap_s"])
        cases[name] = {
            "window_s": window[name], "median_step_s": statistics.median(r["step_s"] for r in rs),
            "median_gap_s": other,
            "gap_after_save_minus_median_s": (statistics.median(after) - other) if name != "no saves" else None,
            "extra_per_save_s": (window[name] - window["no saves"]) / saves if name != "no saves" else None,
            "blocked_per_save_s": statistics.median(r["blocked_per_save_s"] for r in rs) if name != "no saves"
            else None,
        }
    sync, asyn = cases["sync saves"], cases["async saves"]
    return {
        "job": f"plain Megatron TP2 x DP1, {' '.join(STALL_MODEL[1::2])}, {sizes.stall_iters} iterations, a save "
               f"every {sizes.stall_interval} ({saves} in the window from the end of iteration {sizes.stall_warmup} "
               f"to the end of iteration {sizes.stall_iters}), {rounds} rounds",
        "runs": runs, "cases": cases,
        "async_over_sync_extra_per_save": (asyn["extra_per_save_s"] / sync["extra_per_save_s"]
                                           if sync["extra_per_save_s"] else None),
        "async_over_sync_blocked_per_save": asyn["blocked_per_save_s"] / sync["blocked_per_save_s"],
    }
