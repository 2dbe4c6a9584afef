"""Speed benchmark (not a test): 60 simulated days, all five strategies, from 32K to a million GPUs.

    python -m ntp_megatron.sim.bench [--trials 1] [--days 60] [--repeat 3] [--out runs/sim/bench.json]

The cluster is the NTP paper's: NVL32 domains, TP32 x PP8 replicas, Llama 3 failure rates, and one spare
domain per 1,024 GPUs; every other setting is the simulator's default. The best of ``--repeat`` runs is
reported because the machine may be shared (the minimum is the least disturbed run).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from ntp_megatron.sim.config import load
from ntp_megatron.sim.run import simulate

SIZES = (32768, 131072, 1048576)


def time_one(gpus: int, trials: int, days: float, repeat: int) -> dict:
    overrides = [
        f"cluster.gpus={gpus}", "cluster.domain_size=32", "cluster.tp=32", "cluster.pp=8",
        f"cluster.spare_domains={max(1, gpus // 1024)}", f"run.trials={trials}", f"run.duration_days={days}",
    ]  # fmt: skip
    _, points = load(None, overrides)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        results, _ = simulate(points)
        times.append(time.perf_counter() - started)
    best = min(times)
    steps = results[0].extra["trace_steps_mean"]
    return {
        "gpus": gpus,
        "trials": trials,
        "days": days,
        "strategies": len(results[0].summaries),
        "trace_steps_per_trial": steps,
        "seconds": best,
        "seconds_all_repeats": times,
        "seconds_per_trial": best / trials,
        "microseconds_per_step": 1e6 * best / trials / max(steps, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ntp_megatron.sim.bench", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--days", type=float, default=60.0)
    p.add_argument("--repeat", type=int, default=3, help="report the best of this many runs")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated GPU counts")
    p.add_argument("--out", type=Path, default=Path("runs/sim/bench.json"))
    args = p.parse_args(argv)
    rows = [time_one(int(s), args.trials, args.days, args.repeat) for s in args.sizes.split(",")]
    print(
        f"| GPUs | trials | strategies | trace steps/trial | best of {args.repeat} (s) | all runs (s) | us/step |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in rows:
        runs = ", ".join(f"{x:.2f}" for x in r["seconds_all_repeats"])
        print(
            f"| {r['gpus']:,} | {r['trials']} | {r['strategies']} | {r['trace_steps_per_trial']:,.0f} "
            f"| {r['seconds']:.2f} | {runs} | {r['microseconds_per_step']:.1f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": platform.platform(), "python": platform.python_version(), "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
