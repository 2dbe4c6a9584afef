"""``scripts/bench.sh`` (``python -m ntp_megatron.bench``): every part of the benchmark, a table and a JSON.

With no arguments every part runs at the default sizes, about 10 minutes here, each part with its headline ratio;
``--full`` runs them as docs/benchmarks.md measured them (more than 20 minutes: the control plane at 4,000 and
10,000 simulated ranks, the slow-rank part's long schedule, second rounds); ``--only PART`` runs one part, at the
default sizes or with ``--full``; ``--smoke`` runs every part once at its smallest (what the test suite runs). What
the default leaves out, part by part: :mod:`ntp_megatron.bench.sizes`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ntp_megatron.bench import control_plane, init_weights, memory, slow_rank, step_time
from ntp_megatron.bench.common import RunModule, run_in_subprocess
from ntp_megatron.bench.report import table
from ntp_megatron.bench.sizes import Sizes, choose


@dataclass
class Context:
    """What every part is measured with; ``failure_records`` carries the failure part's NTP jobs to the memory
    part (their re-formations' peaks)."""

    sizes: Sizes
    run: RunModule
    workdir: Path
    failure_records: list[list[dict]] = field(default_factory=list)


def _step_time(ctx: Context) -> dict:
    """Step time against plain Megatron-Core, a healthy replica's collectives, a failure against a restart."""
    result = step_time.measure(ctx.sizes, ctx.run, ctx.workdir)
    result["communication"] = step_time.measure_comm(ctx.sizes, ctx.run, ctx.workdir)
    result["failure_recovery"] = step_time.measure_failures(ctx.sizes, ctx.run, ctx.workdir, ctx.failure_records)
    # Calibration for the goodput simulator: measured seconds from a failure to training again.
    result["recovery_s"] = result["failure_recovery"]["median"]["ntp"]["kill_to_next_iteration_s"]
    return result


def _recovery(ctx: Context) -> dict:
    return {"recovery": step_time.measure_recovery(ctx.sizes, ctx.run, ctx.workdir)}


def _control_plane(ctx: Context) -> dict:
    """One row per (design, simulated ranks): :mod:`ntp_megatron.bench.control_plane` (its own processes)."""
    return {"control_plane": control_plane.measure(ctx.sizes.control_plane_ranks, ctx.sizes.control_plane_iters,
                                                   period=0.5)}


def _slow_rank(ctx: Context) -> dict:
    """A slow rank, not rebalanced and rebalanced, next to the healthy job (:mod:`ntp_megatron.bench.slow_rank`)."""
    return {"slow_rank": slow_rank.measure(ctx.sizes.slow_rank, ctx.run, ctx.workdir)}


def _init(ctx: Context) -> dict:
    return {"init": init_weights.measure_init(ctx.sizes, ctx.run, ctx.workdir)}


def _memory(ctx: Context) -> dict:
    return {"memory": memory.measure_memory(ctx.sizes, ctx.run, ctx.workdir, ctx.failure_records)}


def _checkpoint_stall(ctx: Context) -> dict:
    return {"checkpoint_stall": step_time.measure_checkpoint_stall(ctx.sizes, ctx.run, ctx.workdir)}


@dataclass(frozen=True)
class Part:
    name: str
    """Its ``--only`` name."""
    machine: str
    """The JSON's ``machine`` when it runs alone."""
    measure: Callable[[Context], dict]
    """Its sections of the JSON."""


PARTS = [
    Part("step-time", "CPU, gloo", _step_time),
    Part("recovery", "CPU, gloo", _recovery),
    Part("control-plane", "CPU", _control_plane),
    Part("slow-rank", "CPU, gloo, emulated device", _slow_rank),
    Part("init", "CPU", _init),
    Part("memory", "CPU, gloo", _memory),  # after step-time: a whole run's memory part reads its failure jobs
    Part("checkpoint-stall", "CPU, gloo", _checkpoint_stall),
]
"""Every part, in the order a whole run measures them."""


def measure_parts(only: Optional[str], ctx: Context) -> dict:
    """Every part in turn (each one's sections of the JSON in that order), or the part ``only`` alone next to an
    empty step-time table."""
    result: dict = {}
    for part in PARTS:
        if only not in (None, part.name):
            continue
        if only is not None:
            result.update({"machine": part.machine, "cases": {}, "ratios": []})
        started = time.monotonic()
        result.update(part.measure(ctx))
        print(f"bench: {part.name} took {time.monotonic() - started:.0f} s", file=sys.stderr)
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=None, help="iterations per job (12)")
    p.add_argument("--warmup", type=int, default=None, help="iterations dropped from the start of each job (3)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds over all cases (1; with --full 2)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/bench.json"))
    p.add_argument("--only", choices=[part.name for part in PARTS], default=None,
                   help="run one part only (its figures alone in the JSON and the table)")
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--full", action="store_true",
                       help="every part at its full sizes, as docs/benchmarks.md measured it (more than 20 minutes)")
    sizes.add_argument("--smoke", action="store_true",
                       help="every part once at its smallest size: a check that the harness runs, not a measurement")
    return p


def main(argv: Optional[Sequence[str]] = None, run: RunModule = run_in_subprocess) -> int:
    """``run``: how each job and probe process is started (the suite's smoke test forks them from its zygote)."""
    args = parser().parse_args(argv)
    sizes = choose(args.smoke, args.full, args.iters, args.warmup, args.rounds)
    if sizes.warmup >= sizes.iters:
        print("bench: --warmup must be below --iters", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ntp-bench-") as tmp:
        result = measure_parts(args.only, Context(sizes, run, Path(tmp)))
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
