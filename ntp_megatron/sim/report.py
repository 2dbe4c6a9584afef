"""Results as JSON, markdown tables and matplotlib PNGs (Agg backend, imported only when plotting)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ntp_megatron.sim.config import SimConfig
from ntp_megatron.sim.run import PointResult

LABELS = {
    "checkpoint_restart": "checkpoint-restart",
    "dp_drop": "DP-drop",
    "hot_spares": "hot spares",
    "ntp": "NTP",
    "ntp_boost": "NTP + power boost",
}
STYLES = {  # strategies that coincide (e.g. all DP-drop variants under a fixed minibatch) stay visible
    "checkpoint_restart": (":", "s"),
    "dp_drop": ("-", "o"),
    "hot_spares": ("--", "^"),
    "ntp": ("-", "o"),
    "ntp_boost": ("-.", "D"),
}
COLORS = {
    "checkpoint_restart": "tab:gray",
    "dp_drop": "tab:red",
    "hot_spares": "tab:purple",
    "ntp": "tab:blue",
    "ntp_boost": "tab:green",
}


def to_json(base: SimConfig, points: list[PointResult], notes: list[str]) -> dict[str, Any]:
    return {
        "mode": base.failures.mode,
        "notes": notes,
        "elapsed_s": {p.label: p.elapsed_s for p in points},
        "config": base.model_dump(mode="json"),
        "points": [
            {
                "label": p.label,
                "layout": p.layout.describe(),
                "extra": p.extra,
                "hours": p.hours,
                "strategies": {
                    name: {"summary": summary, "series": p.series.get(name, {})}
                    for name, summary in p.summaries.items()
                },
            }
            for p in points
        ],
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _placement(p: PointResult, name: str) -> str:
    return getattr(p.config.strategies.placement, name)


def summary_table(base: SimConfig, points: list[PointResult]) -> str:
    """One markdown row per (sweep point, strategy); means over trials unless the column says otherwise.

    Spares: *needed* is the peak of what a fixed minibatch needs (spares assumed healthy), as the mean over
    trials and the worst trial; *never pause* is the fewest spares with no pause in any trial when spares fail
    too (the answer to "how many spares so that we never pause"). Re-packing restarts are the restarts that
    move domains without a failure forcing them: planned ones, and (placement ``packed``) re-packing at repairs.
    """
    sweep = len(points) > 1 or points[0].label
    lead = ["point"] if sweep else []
    rows = []
    if base.failures.mode == "snapshot":
        header = lead + [
            "strategy", "placement", "capacity %", "loss % (mean)", "loss % (max)", "domains hit %",
            "spares needed (mean / max)", "spares to never pause",
        ]  # fmt: skip
        for p in points:
            hit = p.extra["domains_hit_fraction"]["mean"]
            for name, m in p.summaries.items():
                rows.append(([p.label] if sweep else []) + [
                    LABELS[name], _placement(p, name), _pct(m["capacity"]["mean"]), _pct(m["throughput_loss"]["mean"]),
                    _pct(m["throughput_loss"]["max"]), _pct(hit),
                    f"{m['spares_needed']['mean']:.1f} / {m['spares_needed']['max']:.0f}",
                    f"{m['spares_no_pause']['max']:.0f}",
                ])  # fmt: skip
        return _table(header, rows)
    pct = f"{100 - base.run.spares_percentile:g}"
    header = lead + [
        "strategy", "placement", "goodput %", "lost: capacity %", "lost: pauses %", "lost: rollback %",
        "max loss %", "interruptions/day", "re-packing restarts/day", "spares needed, peak (mean / max)",
        "spares to never pause",
        f"spares to pause <= {pct} %",
    ]  # fmt: skip
    for p in points:
        for name, m in p.summaries.items():
            rows.append(([p.label] if sweep else []) + [
                LABELS[name], _placement(p, name), _pct(m["goodput"]["mean"]), _pct(m["lost_capacity"]["mean"]),
                _pct(m["lost_pause"]["mean"]), _pct(m["lost_rollback"]["mean"]),
                _pct(m["max_throughput_loss"]["max"]), f"{m['interruptions_per_day']['mean']:.1f}",
                f"{m['repacks_per_day']['mean']:.1f}",
                f"{m['spares_needed_max']['mean']:.1f} / {m['spares_needed_max']['max']:.0f}",
                f"{m['spares_no_pause']['max']:.0f}", f"{m['spares_at_percentile']['max']:.0f}",
            ])  # fmt: skip
    return _table(header, rows)


def _sweep_axis(base: SimConfig, points: list[PointResult]) -> tuple[list[float], str, list[str] | None]:
    """x values, axis label and tick labels (None when the sweep key is numeric)."""
    s = base.sweep
    if s is not None and s.key is not None and all(isinstance(v, (int, float)) for v in s.values or []):
        if s.key.endswith("fraction"):
            return [100 * v for v in s.values], f"{s.key} (% of GPUs)", None
        return [float(v) for v in s.values], s.key, None
    return list(range(len(points))), "", [p.label or "run" for p in points]


def _pyplot():
    import matplotlib  # imported only when plotting: the simulator's tables need no matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    return plt


def plot_sweep(base: SimConfig, points: list[PointResult], path: Path, title: str) -> None:
    """Snapshot: throughput loss (mean solid, max dashed) and spares needed against the sweep variable.
    Poisson: goodput, and the spare domains that never pause (with the peak need for healthy spares) against it."""
    plt = _pyplot()
    xs, xlabel, ticks = _sweep_axis(base, points)
    snapshot = base.failures.mode == "snapshot"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in points[0].summaries:
        line = STYLES[name][0] if ticks is None else "none"  # categorical points are not a curve
        style = dict(color=COLORS[name], ls=line, marker=STYLES[name][1], ms=5, label=LABELS[name])
        worst_style = dict(color=COLORS[name], ls="none", marker="_", ms=10, alpha=0.8)
        if snapshot:
            ax1.plot(xs, [100 * p.summaries[name]["throughput_loss"]["mean"] for p in points], **style)
            ax1.plot(xs, [100 * p.summaries[name]["throughput_loss"]["max"] for p in points], **worst_style)
            ax2.plot(xs, [p.summaries[name]["spares_needed"]["mean"] for p in points], **style)
            ax2.plot(xs, [p.summaries[name]["spares_needed"]["max"] for p in points], **worst_style)
        else:
            ax1.plot(xs, [p.summaries[name]["spares_no_pause"]["max"] for p in points], **style)
            ax1.plot(xs, [p.summaries[name]["spares_needed_max"]["max"] for p in points], **{**worst_style, "marker": "x", "ms": 6})
            ax2.plot(xs, [100 * p.summaries[name]["goodput"]["mean"] for p in points], **style)
    if snapshot:
        ax1.set_title("throughput loss, % of healthy (dash: worst trial)", fontsize=9)
        ax2.set_title("spare domains for a fixed minibatch (dash: worst trial)", fontsize=9)
    else:
        ax1.set_title(
            "spare domains, fixed minibatch: fewest with no pause in any\n"
            "trial, spares failing (dots); peak need if spares never fail (x)", fontsize=9,
        )  # fmt: skip
        ax2.set_title(f"goodput, % of ideal, with {base.cluster.spare_domains} spare domains", fontsize=9)
    for ax in (ax1, ax2):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ticks is not None:
            ax.set_xticks(xs, ticks, rotation=20, fontsize=8)
    ax1.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeseries(point: PointResult, path: Path, title: str) -> None:
    """Throughput, cumulative goodput and spare domains needed over time (mean over trials, 5-95 % band)."""
    plt = _pyplot()
    days = [h / 24.0 for h in point.hours]
    panels = [
        ("throughput", "throughput (% of ideal)", 100.0),
        ("goodput", "cumulative goodput (% of ideal)", 100.0),
        ("spares_needed", "spare domains needed\n(fixed minibatch)", 1.0),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 8), sharex=True)
    for ax, (key, ylabel, scale) in zip(axes, panels):
        for name, s in point.series.items():
            mean = [scale * v for v in s[f"{key}_mean"]]
            ax.plot(days, mean, color=COLORS[name], ls=STYLES[name][0], label=LABELS[name], lw=1.3)
            ax.fill_between(
                days, [scale * v for v in s[f"{key}_p5"]], [scale * v for v in s[f"{key}_p95"]],
                color=COLORS[name], alpha=0.12, lw=0,
            )  # fmt: skip
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=3)
    axes[-1].set_xlabel("time (days)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(
    base: SimConfig, points: list[PointResult], notes: list[str], out: Path, title: str, plots: bool = True
) -> list[Path]:
    """Write results.json, summary.md and the PNGs into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "summary.md"]
    write_json(written[0], to_json(base, points, notes))
    written[1].write_text(
        f"# {title}\n\n" + summary_table(base, points) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    )
    if not plots:
        return written
    if len(points) > 1:
        written.append(out / "sweep.png")
        plot_sweep(base, points, written[-1], title)
    elif base.failures.mode == "snapshot":
        written.append(out / "snapshot.png")
        plot_sweep(base, points, written[-1], title)
    if base.failures.mode == "poisson":
        for i, p in enumerate(points):
            written.append(out / (f"timeseries_{i}.png" if len(points) > 1 else "timeseries.png"))
            plot_timeseries(p, written[-1], f"{title} — {p.label}" if p.label else title)
    return written
