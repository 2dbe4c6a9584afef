"""Memory (``scripts/bench.sh --only memory``): each rank's training state (``memory`` records,
:mod:`ntp_megatron.training.memory`) with NTP and the distributed optimizer against plain Megatron-Core's distributed
optimizer (``tests/plain_megatron.py --memory``) at the same layout and instance count, and NTP without it; the model
is the reference's (the default config's with the test suite's batch), and so are the step times compared. Then the
re-forming ranks' peaks against their steady state, from the memory records of failure jobs.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from ntp_megatron.bench.common import RunModule, layout_args, ratio, run_job_records
from ntp_megatron.bench.sizes import Sizes

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
             "ratio": ratio(ntp["state"]["total"], plain["state"]["total"]), "goal": 1.05},
            {"comparison": f"optimizer state per rank, NTP + dist-opt / Megatron dist-opt, k={k}",
             "ratio": ratio(ntp["state"]["optimizer"], plain["state"]["optimizer"]), "goal": None},
            {"comparison": f"optimizer state per rank, NTP + dist-opt k={k} / NTP without it",
             "ratio": ratio(ntp["state"]["optimizer"], figures["ntp"]["state"]["optimizer"]), "goal": None},
            {"comparison": f"step time, NTP + dist-opt / Megatron dist-opt, k={k}",
             "ratio": ratio(ntp["median_step_ms"], plain["median_step_ms"]), "goal": None}]
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
