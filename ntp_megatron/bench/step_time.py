"""``scripts/bench.sh``: step time of NTP against plain Megatron-Core, measured side by side in one run.

Every case is a real job through ``ntp-launch``; the cases run in interleaved rounds (A B C … A B C …) so
machine drift hits all of them alike, and each case's step time is the median ``elapsed_ms`` over its
iterations after warm-up, pooled over rounds. Output: a table on stdout and JSON (``--out``), including a
``degraded_step_time_ratio`` section in the format the goodput simulator reads as calibration. Also measured:
communication of healthy ranks, a failure absorbed by NTP against a restart from checkpoint, and the training
stall of a checkpoint save, sync against async (``--only checkpoint-stall`` runs that part alone), and the time and
peak memory of initialising one rank's model, Megatron replay against the layout-free initialiser (``--only init``),
and each rank's training state with NTP and the distributed optimizer against plain Megatron-Core's distributed
optimizer at the same layout and instance count and against NTP without it, with step times, and the peaks of
re-forming ranks against their steady state (``--only memory``), and recovery at TP2 x DP2 and TP4 x DP2 with the
groups a failure did not touch kept against every group made anew (``--only recovery``).
``--smoke`` runs every part once at its smallest size (``SMOKE``): what the test suite runs, so that the harness
cannot break unnoticed; its figures mean nothing.

On a CPU machine with fewer cores than ranks, ranks time-share cores: ratios between jobs with different
rank counts then measure total work rather than per-GPU speed. The comparisons below are arranged so that
each pair runs the same number of ranks, except where the table says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ntp_megatron.bench import control_plane, slow_rank
from ntp_megatron.bench.common import RunModule, layout_args, run_in_subprocess, run_job_records
from ntp_megatron.config.schema import load_job_config


@dataclass(frozen=True)
class Sizes:
    """How long every part runs: ``FULL`` for the figures, ``SMOKE`` to run every part once at its smallest
    (``--smoke``; the suite's test of this harness, not a measurement)."""

    iters: int = 12
    warmup: int = 3
    rounds: int = 2
    comm_iters: int = 3
    comm_tp: int = 4
    """The communication jobs: TP ``comm_tp`` x 2, healthy, and with replica 1's last slot dead."""
    fail_iters: int = 16
    fail_at: int = 11
    ckpt_interval: int = 4
    stall_iters: int = 14
    stall_interval: int = 3
    stall_warmup: int = 2
    init_model: tuple[str, ...] = ("model.num_layers=4", "model.hidden_size=2048", "model.num_attention_heads=16",
                                   "model.ffn_hidden_size=8192", "model.vocab_size=32768", "model.seq_length=1024")
    init_tps: tuple[int, ...] = (1, 2, 4, 8)
    memory_tp: int = 2
    memory_dp: int = 4
    memory_instances: tuple[int, ...] = (1, 2)
    memory_iters: int = 8
    memory_micro_batch: int = 1
    """Of the global batch of 12 samples, a multiple of micro-batch x DP."""
    reform_tp: Optional[int] = 3
    """The memory part's own failure job: TP ``reform_tp`` x 2, the last rank killed (None: the failure part's
    job alone)."""
    recovery_tps: tuple[int, ...] = (2, 4)
    """The recovery part: TP k x DP2 for each k, the last rank killed, groups kept against every group made anew."""
    control_plane_ranks: tuple[int, ...] = (1000, 4000, 10000)
    control_plane_iters: int = 8
    """The control-plane load test (:mod:`ntp_megatron.bench.control_plane`): simulated ranks, iterations."""


FULL = Sizes()
SMOKE = Sizes(iters=2, warmup=1, rounds=1, comm_iters=2, comm_tp=2, fail_iters=4, fail_at=3, ckpt_interval=2,
              stall_iters=5, stall_interval=2, stall_warmup=1,
              init_model=("model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=4",
                          "model.ffn_hidden_size=128", "model.vocab_size=256", "model.seq_length=32"),
              init_tps=(1, 2), memory_dp=1, memory_instances=(1,), memory_iters=2, memory_micro_batch=2,
              reform_tp=None, recovery_tps=(2,), control_plane_ranks=(16,), control_plane_iters=2)

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
        ratios.append({"layout": f"TP{tp} x DP2", "kill_to_next_iteration": _ratio(
            after["kill_to_next_iteration_s"], before["kill_to_next_iteration_s"]),
            "reform": _ratio(after["reform_s"], before["reform_s"])})
    return {"job": f"TP k x DP2, {sizes.fail_iters} iterations, SIGKILL of the last rank in the backward pass of "
                   f"iteration {sizes.fail_at}; 'rebuild_all' makes every group anew (ntp.keep_groups=false)",
            "rows": rows, "ratios": ratios}


# The training stall of a checkpoint save, sync against async (Megatron-Core's async path), on one job: plain
# Megatron (NTP off; async saves need it), TP2 x DP1, a larger model so that a save writes tens of MB.
STALL_MODEL = ["--set", "model.num_layers=4", "--set", "model.hidden_size=256", "--set", "model.vocab_size=4096",
               "--set", "model.seq_length=64", "--set", "training.micro_batch_size=2",
               "--set", "training.global_batch_size=4"]


def measure_slow_rank(smoke: bool, run: RunModule, workdir: Path) -> dict:
    """A slow rank, not rebalanced and rebalanced, next to the healthy job (:mod:`ntp_megatron.bench.slow_rank`)."""
    return slow_rank.measure(slow_rank.SLOW_SMOKE if smoke else slow_rank.SLOW_FULL, run, workdir)


def measure_control_plane(sizes: Sizes) -> list[dict]:
    """One row per (design, simulated ranks): :mod:`ntp_megatron.bench.control_plane` (its own processes)."""
    return control_plane.measure(sizes.control_plane_ranks, sizes.control_plane_iters, period=0.5)


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


# Initialisation cost of one rank's model, Megatron replay (every full-size master weight drawn on every rank, then
# the rank's units kept) against the layout-free initialiser (only the rank's units computed), at TP 1, 2, 4, 8:
# a wider model (``Sizes.init_model``), built in a fresh process per measurement (rank 0's canonical block) so
# that its peak RSS is its own.
INIT_KINDS = ("megatron", "layout_free")


def init_probe(tp: int, init: str, model: Sequence[str] = FULL.init_model) -> dict:
    """In a fresh process: build rank 0's NTP model of a TP ``tp`` replica with ``init``; time and peak RSS."""
    # Megatron-Core (a few seconds to import) loads in the probe's own process, never in the benchmark's driver
    from megatron.core import parallel_state

    from ntp_megatron.core.groups import dense_groups
    from ntp_megatron.core.gpt import RankUnits, build_ntp_gpt
    from ntp_megatron.patches import apply_patches
    from ntp_megatron.patches import parallel_state as ps_patch
    from ntp_megatron.training.model import transformer_config

    torch.set_num_threads(1)  # as a rank runs (the launcher's default OMP_NUM_THREADS=1)
    apply_patches(cpu=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port
    pg_collection = ps_patch.install(dense_groups(1, 0, 1, timedelta(seconds=60)))  # Megatron's groups of one rank
    cfg = load_job_config(None, [*model, f"parallel.tensor_model_parallel_size={tp}",
                                 "parallel.data_parallel_size=1", f"model.init={init}"])
    m = cfg.model
    units = RankUnits(*(tuple(cfg.topology().units_of(0, f)) for f in ("heads", "ffn", "vocab")))
    tf_config = transformer_config(cfg, torch.device("cpu"))
    torch.manual_seed(cfg.training.seed)
    page_mb = os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    rss_start_mb = int(open("/proc/self/statm").read().split()[1]) * page_mb
    started = time.perf_counter()
    model = build_ntp_gpt(tf_config, units, m.normalization, m.vocab_size, init=init, seed=cfg.training.seed,
                          max_sequence_length=m.seq_length, pre_process=True, post_process=True,
                          share_embeddings_and_output_weights=True, position_embedding_type=m.position_embedding_type,
                          pg_collection=pg_collection)
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = sum(p.numel() for p in model.parameters())
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"tp": tp, "init": init, "build_s": seconds, "peak_rss_mb": peak_mb,
            "peak_over_start_mb": peak_mb - rss_start_mb, "local_params": params,
            "local_param_mb": params * 4 / 2 ** 20}


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b > 0 else None


def measure_init(sizes: Sizes, run: RunModule, workdir: Path) -> dict:
    """Every (TP, initialiser) pair in its own process, interleaved over ``sizes.rounds``; medians."""
    runs: dict[str, list[dict]] = {f"{init} tp{tp}": [] for tp in sizes.init_tps for init in INIT_KINDS}
    for round_index in range(sizes.rounds):
        for tp in sizes.init_tps:
            for init in INIT_KINDS:
                out = Path(tempfile.mkdtemp(prefix=f"init-{init}-tp{tp}", dir=workdir))
                probe = ["--probe", str(tp), init, *(f"--probe-model={kv}" for kv in sizes.init_model)]
                code, stdout, err = run("ntp_megatron.bench.step_time", probe, out)
                if code != 0:
                    raise SystemExit(f"bench: init probe tp{tp} {init} failed:\n{err[-3000:]}")
                runs[f"{init} tp{tp}"].append(json.loads(stdout.strip().splitlines()[-1]))
                print(f"init round {round_index + 1}/{sizes.rounds} {init:<12} tp{tp} done", file=sys.stderr)
    keys = ("build_s", "peak_rss_mb", "peak_over_start_mb", "local_param_mb")
    cases = {name: {key: statistics.median(r[key] for r in rs) for key in keys} for name, rs in runs.items()}
    for name, c in cases.items():
        c["best_build_s"] = min(r["build_s"] for r in runs[name])  # the least disturbed by other load
        base = cases[name.rsplit(" ", 1)[0] + " tp1"]
        c["best_build_s_over_tp1"] = _ratio(c["best_build_s"], base["best_build_s"])
        c["peak_over_start_over_tp1"] = _ratio(c["peak_over_start_mb"], base["peak_over_start_mb"])
    return {"model": " ".join(sizes.init_model), "rounds": sizes.rounds, "runs": runs, "cases": cases}


# Memory: each rank's training state (``memory`` records, ntp_megatron.training.memory) with NTP and the
# distributed optimizer against plain Megatron-Core's distributed optimizer (tests/plain_megatron.py --memory) at the
# same layout and instance count, and NTP without it; the model is the reference's (the default config's with the
# test suite's batch), and so are the step times compared. Then the re-forming ranks' peaks against their steady
# state, from the memory records of failure jobs.
MEMORY_MODEL = ["--set", "model.hidden_dropout=0", "--set", "model.attention_dropout=0",
                "--set", "training.micro_batch_size=2", "--set", "training.global_batch_size=12",
                "--set", "training.lr_warmup_iters=1", "--set", "logging.tensorboard_dir=",
                "--set", "logging.log_interval=1000"]
STATE_KINDS = ("params", "grads", "optimizer", "shadow_params", "shadow_grads")


def memory_cases(sizes: Sizes) -> dict[str, tuple[str, Optional[int]]]:
    """name -> (``ntp`` or ``megatron``, distributed-optimizer instances or None without it)."""
    cases = {}
    for k in sizes.memory_instances:
        cases[f"ntp dist-opt k={k}"] = ("ntp", k)
        cases[f"megatron dist-opt k={k}"] = ("megatron", k)
    cases["ntp"] = ("ntp", None)
    return cases


def _largest(states: list[dict]) -> dict:
    """Per kind, the most any rank holds, and the largest total."""
    out = {kind: max(s.get(kind, 0) for s in states) for kind in STATE_KINDS}
    out["total"] = max(sum(s.get(kind, 0) for kind in STATE_KINDS) for s in states)
    return out


def _memory_ntp(sizes: Sizes, instances: Optional[int], run: RunModule, workdir: Path, name: str) -> dict:
    args = [*layout_args(sizes.memory_tp, sizes.memory_dp, True),
            "--set", f"training.micro_batch_size={sizes.memory_micro_batch}"]
    if instances is not None:
        args += ["--set", "parallel.use_distributed_optimizer=true",
                 "--set", f"parallel.num_distributed_optimizer_instances={instances}"]
    records = run_job_records(args, sizes.memory_iters, workdir, run, name, model=MEMORY_MODEL)
    steady = [r for r in records if r.get("kind") == "memory" and r["phase"] == "steady"]
    times = [r["elapsed_ms"] for r in records if r.get("kind") == "iteration"][sizes.warmup:]
    # The plan counts a distributed-optimizer shard at the most any position's holds: every rank within it, and
    # the largest rank's state equal to it.
    largest = _largest([r["state"] for r in steady])
    within = all(r["state"][k] <= r["planned"][k] for r in steady for k in STATE_KINDS)
    return {"ranks": len(steady), "state": largest,
            "planned_equal": within and largest == _largest([r["planned"] for r in steady]),
            "rss_hwm_mb": max(r["rss_hwm_bytes"] for r in steady) / 2**20, "step_ms": times}


def _memory_megatron(sizes: Sizes, instances: int, run: RunModule, workdir: Path, name: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"megatron-k{instances}", dir=workdir))
    args = ["train", "--tp", str(sizes.memory_tp), "--dp", str(sizes.memory_dp), "--dist-opt",
            "--instances", str(instances), "--iters", str(sizes.memory_iters), "--save-at", "0",
            "--micro-batch", str(sizes.memory_micro_batch),
            "--ckpt", str(out / "ckpt"), "--out", str(out / "losses.json"), "--memory", str(out / "memory")]
    code, _, err = run("tests.plain_megatron", args, out)
    if code != 0:
        raise SystemExit(f"bench: case {name!r} failed ({code}):\n{err[-3000:]}")
    ranks = [json.loads(f.read_text()) for f in sorted((out / "memory").glob("rank*.json"))]
    times = [1e3 * t for t in ranks[0]["step_s"][sizes.warmup:]]
    return {"ranks": len(ranks), "state": _largest([r["state"] for r in ranks]),
            "rss_hwm_mb": max(r["rss_hwm_bytes"] for r in ranks) / 2**20, "step_ms": times}


def reform_memory(records: list[dict]) -> list[dict]:
    """Per rank of every re-formation in a job's records: its role, its peak while re-forming, its steady state
    before (the generation it re-formed from) and after (the one it re-formed into), and the ratios."""
    memory = [r for r in records if r.get("kind") == "memory"]
    steady = {(r["launch_rank"], r["generation"]): r for r in memory if r["phase"] == "steady"}
    out = []
    for r in memory:
        if r["phase"] != "reform":
            continue
        before = max((g for (rank, g) in steady if rank == r["launch_rank"] and g < r["generation"]), default=None)
        after = steady.get((r["launch_rank"], r["generation"]))
        if before is None or after is None:
            continue
        before_total, after_total = steady[(r["launch_rank"], before)]["state"]["total"], after["state"]["total"]
        out.append({"launch_rank": r["launch_rank"], "generation": r["generation"], "role": r["role"],
                    "rebuilt": r["rebuilt"], "peak_bytes": r["peak_bytes"], "peak_source": r["peak_source"],
                    "steady_before_bytes": before_total, "steady_after_bytes": after_total,
                    "peak_over_steady_after": r["peak_bytes"] / after_total,
                    "peak_over_steady_before": r["peak_bytes"] / before_total,
                    "largest_message_bytes": r.get("largest_message_bytes", 0)})
    return sorted(out, key=lambda x: (x["generation"], x["launch_rank"]))


def measure_memory(sizes: Sizes, run: RunModule, workdir: Path, failure_records: Sequence[list[dict]]) -> dict:
    """The cases of :func:`memory_cases`, interleaved over ``sizes.rounds`` (memory is the same every round; step
    times pooled), then the re-formations of the failure part's NTP jobs (``failure_records``) and, with
    ``sizes.reform_tp``, of two jobs of its own (without the distributed optimizer, and with it at two instances)."""
    cases = memory_cases(sizes)
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for round_index in range(sizes.rounds):
        for name, (stack, instances) in cases.items():
            measure_one = _memory_ntp if stack == "ntp" else _memory_megatron
            runs[name].append(measure_one(sizes, instances, run, workdir, name))
            print(f"memory round {round_index + 1}/{sizes.rounds} {name:<22} done", file=sys.stderr)
    figures = {}
    for name, rs in runs.items():
        figures[name] = {**{key: rs[-1][key] for key in ("ranks", "state")},
                         "rss_hwm_mb": max(r["rss_hwm_mb"] for r in rs),
                         "median_step_ms": statistics.median(t for r in rs for t in r["step_ms"]),
                         "same_every_round": all(r["state"] == rs[0]["state"] for r in rs)}
        if "planned_equal" in rs[0]:
            figures[name]["planned_equal"] = all(r["planned_equal"] for r in rs)
    ratios = []
    for k in sizes.memory_instances:
        ntp, plain = figures[f"ntp dist-opt k={k}"], figures[f"megatron dist-opt k={k}"]
        ratios += [
            {"comparison": f"state per rank, NTP + dist-opt / Megatron dist-opt, k={k}",
             "ratio": _ratio(ntp["state"]["total"], plain["state"]["total"]), "goal": 1.05},
            {"comparison": f"optimizer state per rank, NTP + dist-opt / Megatron dist-opt, k={k}",
             "ratio": _ratio(ntp["state"]["optimizer"], plain["state"]["optimizer"]), "goal": None},
            {"comparison": f"optimizer state per rank, NTP + dist-opt k={k} / NTP without it",
             "ratio": _ratio(ntp["state"]["optimizer"], figures["ntp"]["state"]["optimizer"]), "goal": None},
            {"comparison": f"step time, NTP + dist-opt / Megatron dist-opt, k={k}",
             "ratio": _ratio(ntp["median_step_ms"], plain["median_step_ms"]), "goal": None}]
    reform_jobs = {f"TP2 x 2, launch rank 3 killed (the failure part's NTP job, round {i + 1})":
                   reform_memory(records) for i, records in enumerate(failure_records)}
    if sizes.reform_tp is not None:
        tp = sizes.reform_tp
        kill = ["--inject-failure", f"kill:rank={2 * tp - 1},iter=3,phase=backward"]
        dist_opt = ["--set", "parallel.use_distributed_optimizer=true",
                    "--set", "parallel.num_distributed_optimizer_instances=2"]
        for extra, label in (([], ""), (dist_opt, ", dist-opt k=2")):
            records = run_job_records([*layout_args(tp, 2, True), *extra, *kill], 5, workdir, run,
                                      f"reform tp{tp}{label}", model=MEMORY_MODEL)
            reform_jobs[f"TP{tp} x 2{label}, launch rank {2 * tp - 1} killed in iteration 3"] = reform_memory(records)
            print(f"memory reform tp{tp}{label} done", file=sys.stderr)
    return {"layout": f"TP{sizes.memory_tp} x DP{sizes.memory_dp}", "iterations": sizes.memory_iters,
            "rounds": sizes.rounds, "cases": figures, "ratios": ratios, "reform": reform_jobs}


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


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(result: dict) -> str:
    lines = []
    if result["cases"]:
        lines += ["| case | ranks | median step (ms) |", "|---|---|---|"]
        lines += [f"| {name} | {c['ranks']} | {c['median_step_ms']:.1f} |" for name, c in result["cases"].items()]
        lines += ["", "| comparison | ratio | note |", "|---|---|---|"]
        lines += [f"| {r['comparison']} | {r['ratio']:.3f} | {r['note']} |" for r in result["ratios"]]
    comm = result.get("communication")
    if comm:
        tp = comm["tp"]
        lines += ["", f"Per iteration, replica 0 (healthy) of TP{tp} x 2, without and with replica 1 degraded to "
                  f"TP{tp - 1}:", "",
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
    if result.get("slow_rank"):

        lines += slow_rank.table_lines(result["slow_rank"])
    recovery = result.get("recovery")
    if recovery:
        lines += ["", f"Recovery, groups made anew against kept ({recovery['job']}), medians:", "",
                  "| layout | design | kill to next iteration (s) | re-formation (s) | groups made (all ranks) | "
                  "made by a healthy rank | kept |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['layout']} | {r['design']} | {r['kill_to_next_iteration_s']:.2f} | {r['reform_s']:.2f} | "
                  f"{r['groups_made']:g} | {r['groups_made_per_healthy_rank']:g} | {r['groups_kept']:g} |"
                  for r in recovery["rows"]]
        lines += ["", "| layout | kept / made anew: kill to next iteration | re-formation |", "|---|---|---|"]
        lines += [f"| {r['layout']} | {_fmt(r['kill_to_next_iteration'], '.3f')} | {_fmt(r['reform'], '.3f')} |"
                  for r in recovery["ratios"]]
    control = result.get("control_plane")
    if control:
        lines += ["", "Control plane, one store against two levels (simulated ranks in nodes of 8; "
                  "`ntp_megatron/bench/control_plane.py`):", "",
                  "| design | ranks | vote p50 (ms) | vote p99 (ms) | node vote p99 (ms) | oldest heartbeat (s) | "
                  "root requests/s | false fences | death → generation (s) | death → survivors noted (s) | "
                  "bytes read per rank | threads late p99 (ms) | CPU: harness / store (s) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['design']} | {r['ranks']} | {r['vote_p50_ms']:.1f} | {r['vote_p99_ms']:.1f} | "
                  f"{r['node_vote_p99_ms']:.1f} | "
                  f"{r['heartbeat_staleness_max_s']:.2f} | {r['requests_per_s']:.0f} | {r['false_fences']} | "
                  f"{_fmt(r['failure_to_generation_s'], '.3f')} | {_fmt(r['survivors_noted_s'], '.3f')} | "
                  f"{_fmt(r['generation_bytes_per_rank'], '.0f')} | "
                  f"{r['arrival_late_p99_ms']:.1f} | {r['harness_cpu_s']:.1f} / {r['store_cpu_s']:.1f} |"
                  for r in sorted(control, key=lambda r: (r["ranks"], r["design"] != "two_level"))]  # side by side
    init = result.get("init")
    if init:
        lines += ["", f"Building one rank's model (rank 0 of a TP k replica; {init['model']}), "
                  f"{init['rounds']} round(s), one thread:", "",
                  "| initialiser | TP | local params (MiB fp32) | best build (s) | × TP1's | median build (s) | "
                  "peak RSS over start (MiB) | × TP1's | peak RSS (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
        for name, c in init["cases"].items():
            kind, tp = name.rsplit(" ", 1)
            lines.append(f"| {kind} | {tp[2:]} | {c['local_param_mb']:.0f} | {c['best_build_s']:.2f} | "
                         f"{_fmt(c['best_build_s_over_tp1'], '.2f')} | {c['build_s']:.2f} | "
                         f"{c['peak_over_start_mb']:.0f} | {_fmt(c['peak_over_start_over_tp1'], '.2f')} | "
                         f"{c['peak_rss_mb']:.0f} |")
    memory = result.get("memory")
    if memory:
        mib = lambda n: f"{n / 2**20:.3f}"
        lines += ["", f"Training state per rank (MiB, the most any rank holds; {memory['layout']}, the reference's "
                  f"model, {memory['iterations']} iterations, {memory['rounds']} round(s)):", "",
                  "| case | ranks | params | grads | optimizer | shadows | total | RSS high-water (MiB) | "
                  "median step (ms) |", "|---|---|---|---|---|---|---|---|---|"]
        for name, c in memory["cases"].items():
            st = c["state"]
            lines.append(f"| {name} | {c['ranks']} | {mib(st['params'])} | {mib(st['grads'])} | "
                         f"{mib(st['optimizer'])} | {mib(st['shadow_params'] + st['shadow_grads'])} | "
                         f"{mib(st['total'])} | {c['rss_hwm_mb']:.0f} | {c['median_step_ms']:.1f} |")
        lines += ["", "| comparison | ratio | goal |", "|---|---|---|"]
        lines += [f"| {r['comparison']} | {_fmt(r['ratio'], '.3f')} | {_fmt(r['goal'], '.2f')} |"
                  for r in memory["ratios"]]
        for job, rows in memory["reform"].items():
            lines += ["", f"Re-forming ranks' peaks ({job}):", "",
                      "| launch rank | role | rebuilt | peak (MiB) | steady before (MiB) | steady after (MiB) | "
                      "peak / steady after | peak / steady before | largest message (MiB) |",
                      "|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {r['launch_rank']} | {r['role']} | {'yes' if r['rebuilt'] else 'no'} | "
                      f"{mib(r['peak_bytes'])} | {mib(r['steady_before_bytes'])} | {mib(r['steady_after_bytes'])} | "
                      f"{r['peak_over_steady_after']:.3f} | {r['peak_over_steady_before']:.3f} | "
                      f"{mib(r['largest_message_bytes'])} |" for r in rows]
    stall = result.get("checkpoint_stall")
    if stall:
        lines += ["", f"Checkpoint stall, sync against async save ({stall['job']}), medians:", "",
                  "| | median iteration gap (s) | training blocked per save (s) | extra wall time per save (s) | "
                  "gap after a save − median gap (s) |", "|---|---|---|---|---|"]
        fmt = lambda v: "–" if v is None else f"{v:.3f}"
        for name, c in stall["cases"].items():
            lines.append(f"| {name} | {c['median_gap_s']:.3f} | {fmt(c['blocked_per_save_s'])} | "
                         f"{fmt(c['extra_per_save_s'])} | {fmt(c['gap_after_save_minus_median_s'])} |")
        lines.append(f"| async / sync | | {fmt(stall['async_over_sync_blocked_per_save'])} | "
                     f"{fmt(stall['async_over_sync_extra_per_save'])} | |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None, run: RunModule = run_in_subprocess) -> int:
    """``run``: how each job and probe process is started (the suite's smoke test forks them from its zygote)."""
    p = argparse.ArgumentParser(prog="bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=FULL.iters, help="iterations per job")
    p.add_argument("--warmup", type=int, default=FULL.warmup, help="iterations dropped from the start of each job")
    p.add_argument("--rounds", type=int, default=FULL.rounds, help="interleaved rounds over all cases")
    p.add_argument("--out", type=Path, default=Path("runs/bench/bench.json"))
    p.add_argument("--only", choices=["checkpoint-stall", "init", "memory", "recovery", "control-plane", "slow-rank"],
                   default=None,
                   help="run one part only (its figures alone in the JSON and the table)")
    p.add_argument("--smoke", action="store_true",
                   help="every part once at its smallest size: a check that the harness runs, not a measurement")
    p.add_argument("--probe", nargs=2, metavar=("TP", "INIT"), help=argparse.SUPPRESS)  # one init measurement
    p.add_argument("--probe-model", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        print(json.dumps(init_probe(int(args.probe[0]), args.probe[1], args.probe_model or FULL.init_model)))
        return 0
    sizes = SMOKE if args.smoke else Sizes(iters=args.iters, warmup=args.warmup, rounds=args.rounds)
    if sizes.warmup >= sizes.iters:
        print("bench: --warmup must be below --iters", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ntp-bench-") as tmp:
        workdir = Path(tmp)
        if args.only == "init":
            result = {"machine": "CPU", "cases": {}, "ratios": [], "init": measure_init(sizes, run, workdir)}
        elif args.only == "memory":
            result = {"machine": "CPU, gloo", "cases": {}, "ratios": [],
                      "memory": measure_memory(sizes, run, workdir, [])}
        elif args.only == "recovery":
            result = {"machine": "CPU, gloo", "cases": {}, "ratios": [],
                      "recovery": measure_recovery(sizes, run, workdir)}
        elif args.only == "control-plane":
            result = {"machine": "CPU", "cases": {}, "ratios": [], "control_plane": measure_control_plane(sizes)}
        elif args.only == "slow-rank":
            result = {"machine": "CPU, gloo, emulated device", "cases": {}, "ratios": [],
                      "slow_rank": measure_slow_rank(args.smoke, run, workdir)}
        else:
            if args.only == "checkpoint-stall":
                result = {"machine": "CPU, gloo", "cases": {}, "ratios": []}
            else:
                result = measure(sizes, run, workdir)
                result["communication"] = measure_comm(sizes, run, workdir)
                failure_records: list[list[dict]] = []
                result["failure_recovery"] = measure_failures(sizes, run, workdir, failure_records)
                # Calibration for the goodput simulator: measured seconds from a failure to training again.
                result["recovery_s"] = result["failure_recovery"]["median"]["ntp"]["kill_to_next_iteration_s"]
                result["recovery"] = measure_recovery(sizes, run, workdir)
                result["control_plane"] = measure_control_plane(sizes)
                result["slow_rank"] = measure_slow_rank(args.smoke, run, workdir)
                result["init"] = measure_init(sizes, run, workdir)
                result["memory"] = measure_memory(sizes, run, workdir, failure_records)
            result["checkpoint_stall"] = measure_checkpoint_stall(sizes, run, workdir)
    if args.smoke:
        result["smoke"] = "every part once at its smallest size: not a measurement"
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if result.get("slow_rank"):

        print(f"step times per iteration: {slow_rank.plot(result['slow_rank'], args.out.with_name('slow_rank.png'))}")
    print(table(result))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
