"""The "slow, not dead" part of ``scripts/bench.sh`` (``--only slow-rank``): a slow rank, and a degraded replica with
and without power boost, next to the same job healthy.

TP4 x DP2 under NTP on the emulated device (``ntp.emulated_device_ms``: on this 2-core machine a sleeping rank would
hand its CPU to its peers, :mod:`ntp_megatron.speed.device_model`): without a slowdown; with launch rank 1 at ``factor``
from iteration ``slow_at`` until ``slow_end`` and rebalancing off (``ntp.rebalance=false``); and the same with
rebalancing. Step time per iteration of each, the medians of each stretch (healthy; slow; rebalanced, from the
iteration after the rebalance's re-formation; after the slowdown ended and the units went back), their ratios to the
healthy run's, the loss against the healthy run's at every iteration, and whether the replicas agree (every
iteration's state checksums, ``logging.state_checksums``).

Power boost, on the same job and device: launch rank ``2 * tp - 1`` killed in iteration ``slow_at`` (replica 1 goes
on at TP ``tp - 1``), without boost and with ``ntp.boost`` at a cap the curve needs (``boost_max_power``); the
boost is a dry run here (no GPU), and the emulated device runs ``perf(power)`` times faster. Step times after the
re-formation against the healthy run's.

The schedule: :class:`~ntp_megatron.bench.sizes.SlowSizes` (``SLOW_FULL`` under ``--full``, a shorter
``SLOW_DEFAULT`` by default).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

from ntp_megatron.bench.common import MODEL, RunModule, layout_args, run_job_records
from ntp_megatron.bench.sizes import SlowSizes
from ntp_megatron.config.files import load_config
from ntp_megatron.config.schema import DEFAULT_CONFIG, JobConfig
from ntp_megatron.plan.memory_plan import ModelDims
from ntp_megatron.plan.power_curve import boost_model
from ntp_megatron.sim.rebalance import degraded_step, group_step


def jobs(sizes: SlowSizes) -> dict[str, list[str]]:
    base = [*layout_args(sizes.tp, 2, True), "--set", f"ntp.emulated_device_ms={sizes.device_ms:g}",
            "--set", f"ntp.rebalance_window={sizes.window}", "--set", "logging.state_checksums=true"]
    slow = ["--inject-failure", f"slow:rank=1,factor={sizes.factor:g},iter={sizes.slow_at}",
            "--inject-failure", f"slow:rank=1,factor=1,iter={sizes.slow_end}"]
    kill = ["--inject-failure", f"kill:rank={2 * sizes.tp - 1},iter={sizes.slow_at},phase=backward"]
    return {"healthy": base, "slow, not rebalanced": [*base, "--set", "ntp.rebalance=false", *slow],
            "slow, rebalanced": [*base, *slow], "degraded": [*base, *kill],
            "degraded, boost": [*base, *kill, "--set", "ntp.boost=true",
                                "--set", f"ntp.boost_max_power={sizes.boost_max_power:g}"]}


def _steps(records: list[dict]) -> dict[int, float]:
    """Iteration -> step time (ms), one per iteration (every rank sends the record; the launcher keeps one)."""
    return {r["iteration"]: r["elapsed_ms"] for r in records if r.get("kind") == "iteration"}


def _median(steps: dict[int, float], first: int, last: int) -> Optional[float]:
    values = [ms for k, ms in steps.items() if first <= k <= last]
    return statistics.median(values) if values else None


def replicas_disagree(records: list[dict]) -> tuple[int, list[int]]:
    """(iterations checked, iterations whose state checksums differ between any two ranks)."""
    rows: dict[int, list[dict]] = {}
    for r in records:
        if r.get("kind") == "state_checksums":
            rows.setdefault(r["iteration"], []).append(r)
    differ = [k for k, rs in sorted(rows.items())
              if any(r["checksums"] != rs[0]["checksums"] or r["grad_norm"] != rs[0]["grad_norm"] for r in rs)]
    return len(rows), differ


def _model_dims():
    """The benchmark job's model (``bench.MODEL`` over the default config), for the simulator's prediction."""
    overrides = [value for flag, value in zip(MODEL[::2], MODEL[1::2]) if flag == "--set"]
    return ModelDims.of(load_config(JobConfig, DEFAULT_CONFIG, overrides).model)


def predicted(runs: dict[str, list[dict]], sizes: SlowSizes) -> dict:
    """The simulator's rebalance model (:mod:`ntp_megatron.sim.rebalance`) on the same case: the healthy run's
    compute fraction (the passes' compute time over the step time, medians) and the same model and factor."""
    healthy = [r for r in runs["healthy"] if r.get("kind") == "iteration" and r["iteration"] > 1]
    fraction = min(1.0, statistics.median(r["compute_ms"] for r in healthy)
                   / statistics.median(r["elapsed_ms"] for r in healthy))
    dims = _model_dims()
    boost = boost_model(sizes.boost_max_power, 0.58, None)
    slow = group_step(dims, sizes.tp, sizes.factor, fraction)
    degraded, boosted = degraded_step(dims, sizes.tp, sizes.tp - 1, fraction, boost)
    return {"compute_fraction": fraction,
            "ratios_to_healthy": {"slow, not rebalanced": slow.not_rebalanced, "slow, rebalanced": slow.rebalanced,
                                  "degraded": degraded, "degraded, boost": boosted}}


def figures(runs: dict[str, list[dict]], sizes: SlowSizes) -> dict:
    healthy, slow, rebalanced = (runs[k] for k in ("healthy", "slow, not rebalanced", "slow, rebalanced"))
    steps = {name: _steps(records) for name, records in runs.items()}
    reformed = [r for r in rebalanced if r.get("event") == "reformed"]
    events = [r for r in rebalanced if r.get("event") == "rebalanced"]
    shrink = next((r for r in reformed if r["resume_iteration"] <= sizes.slow_end), None)
    back = next((r for r in reformed if r["resume_iteration"] > sizes.slow_end), None)
    base = _median(steps["healthy"], 2, sizes.iters)  # the first iteration builds and warms up
    stretches = {
        "healthy": base,
        "slow, not rebalanced": _median(steps["slow, not rebalanced"], sizes.slow_at + 1, sizes.slow_end - 1),
        "slow, rebalanced": _median(steps["slow, rebalanced"], shrink["resume_iteration"] + 1, sizes.slow_end - 1)
        if shrink else None,
        "after the slowdown, units back": _median(steps["slow, rebalanced"], back["resume_iteration"] + 1, sizes.iters)
        if back else None,
    }
    want = {r["iteration"]: r["lm_loss"] for r in healthy if r.get("kind") == "iteration"}
    loss_diff = {}
    for name in ("slow, not rebalanced", "slow, rebalanced"):
        got = {r["iteration"]: r["lm_loss"] for r in runs[name] if r.get("kind") == "iteration"}
        loss_diff[name] = max(abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in want) if got.keys() == \
            want.keys() else None
    agree = {name: replicas_disagree(records) for name, records in runs.items()}
    boost = {}
    for name in ("degraded", "degraded, boost"):
        [reform] = [r for r in runs[name] if r.get("event") == "reformed" and not r.get("weights")]  # the failure's
        boost[name] = _median(steps[name], reform["resume_iteration"] + 1, sizes.iters)
    return {
        "job": f"TP{sizes.tp} x DP2 under NTP, {sizes.iters} iterations, emulated device {sizes.device_ms:g} ms per "
               f"replica micro-batch; launch rank 1 at factor {sizes.factor:g} from iteration {sizes.slow_at} to "
               f"{sizes.slow_end - 1}; rebalance window {sizes.window}",
        "medians_ms": stretches,
        "ratios_to_healthy": {k: (v / base if v is not None and base else None) for k, v in stretches.items()},
        "loss_max_relative_difference": loss_diff,
        "replicas": {name: {"iterations_checked": n, "differing": d} for name, (n, d) in agree.items()},
        "rebalanced": [{"generation": e["generation"], "weights": e["weights"], "slowness": e["slowness"],
                        "iterations": e["iterations"]} for e in events],
        "reformations": [{"generation": r["generation"], "resume_iteration": r["resume_iteration"],
                          "moved_bytes": r["moved_bytes"], "lower_bound_bytes": r["lower_bound_bytes"],
                          "weights": r.get("weights")} for r in reformed],
        "step_ms": {name: [s[k] for k in sorted(s)] for name, s in steps.items()},
        "simulator": predicted(runs, sizes),
        "boost": {
            "medians_ms": {"healthy": base, **boost},
            "ratios_to_healthy": {k: (v / base if v is not None and base else None) for k, v in boost.items()},
            "ranks": [{k: r[k] for k in ("launch_rank", "generation", "load", "power", "perf", "short", "applied",
                                         "reason")}
                      for r in runs["degraded, boost"] if r.get("event") == "boost"],
        },
    }


def measure(sizes: SlowSizes, run: RunModule, workdir: Path) -> dict:
    runs = {name: run_job_records(args, sizes.iters, workdir, run, f"slow-{name}")
            for name, args in jobs(sizes).items()}
    return figures(runs, sizes)


def table_lines(result: dict) -> list[str]:
    def fmt(value: Optional[float], spec: str) -> str:
        return "—" if value is None else format(value, spec)

    model = result["simulator"]["ratios_to_healthy"]
    lines = ["", f"A slow rank ({result['job']}); the simulator's rebalance model on the same case (compute "
             f"{result['simulator']['compute_fraction']:.0%} of a healthy step):", "",
             "| stretch | median step (ms) | / healthy | simulator |", "|---|---|---|---|"]
    for name, ms in result["medians_ms"].items():
        lines.append(f"| {name} | {fmt(ms, '.0f')} | {fmt(result['ratios_to_healthy'][name], '.3f')} | "
                     f"{fmt(model.get(name, 1.0 if name == 'healthy' else None), '.3f')} |")
    lines += ["", "| run | loss vs healthy (max relative) | replicas agree (iterations checked) |", "|---|---|---|"]
    for name, rep in result["replicas"].items():
        diff = result["loss_max_relative_difference"].get(name, 0.0)
        agree = "yes" if not rep["differing"] else f"NO at {rep['differing'][:5]}"
        lines.append(f"| {name} | {fmt(diff, '.1e')} | {agree} ({rep['iterations_checked']}) |")
    for e in result["rebalanced"]:
        lines.append(f"\nrebalanced into generation {e['generation']}: weights {e['weights'] or 'even'}, slowness "
                     f"{e['slowness']} (iterations {e['iterations'][0]}..{e['iterations'][-1]})")
    boost = result["boost"]
    lines += ["", "Power boost of the degraded replica (a dry run: no GPU; the emulated device runs perf(power) times "
              "faster):", "", "| run | median step after the re-formation (ms) | / healthy | simulator |",
              "|---|---|---|---|"]
    for name, ms in boost["medians_ms"].items():
        ratio = 1.0 if name == "healthy" else boost["ratios_to_healthy"][name]
        lines.append(f"| {name} | {fmt(ms, '.0f')} | {fmt(ratio, '.3f')} | "
                     f"{fmt(model.get(name, 1.0 if name == 'healthy' else None), '.3f')} |")
    lines += ["", "| launch rank | load | power (x nominal) | performance | applied |", "|---|---|---|---|---|"]
    lines += [f"| {r['launch_rank']} | {r['load']:.3f} | {r['power']:.3f} | {r['perf']:.3f} | "
              f"{'yes' if r['applied'] else 'no: ' + r['reason']} |" for r in boost["ranks"]]
    return lines


def plot(result: dict, path: Path) -> Path:
    """Step time per iteration of every run (the slowdown's iterations shaded), from the part's JSON."""
    import matplotlib  # imported when a plot is drawn: it costs the benchmark's start-up half a second

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, steps in result["step_ms"].items():
        ax.plot(range(1, len(steps) + 1), [ms / 1e3 for ms in steps], label=name, linewidth=1.2,
                linestyle="--" if name.startswith("degraded") else "-")
    slow = next((e["iterations"] for e in result["rebalanced"]), None)
    if slow:
        ax.axvline(slow[0], color="grey", linestyle=":", linewidth=1)
        ax.annotate("slowdown measured from here", (slow[0], ax.get_ylim()[1]), fontsize="small", va="top")
    for r in result["reformations"]:
        ax.axvline(r["resume_iteration"], color="tab:purple", linestyle="--", linewidth=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("step time (s)")
    ax.set_title(result["job"][:110], fontsize="small")
    ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":  # python -m ntp_megatron.bench.slow_rank BENCH_JSON PNG: the plot again from a run's JSON
    import json
    import sys

    print(plot(json.loads(Path(sys.argv[1]).read_text())["slow_rank"], Path(sys.argv[2])))
