"""What a run amounted to, from its metrics records: the end-of-run summary and ``<run_dir>/run.png``.

Goodput here is useful iteration time over wall time: the time of every iteration that counted (each
iteration once, however often it was computed) divided by the launcher's wall-clock time from start to end.
Start-up, recovery, redone and rolled-back iterations, and checkpoint saves are what is lost. Iterations lost:
every iteration computed but not kept — the one in flight at each failure (redone under NTP, lost with the
processes on a restart) and, on a restart, every iteration since the last checkpoint. Of those, *rolled back*
are the completed ones that were computed again (none under NTP: only a restart rolls back).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional


def _iterations(records: list[dict[str, Any]]) -> tuple[dict[int, dict], int]:
    first: dict[int, dict] = {}
    repeated = 0
    for r in records:
        if r.get("kind") != "iteration":
            continue
        if r["iteration"] in first:
            repeated += 1
        else:
            first[r["iteration"]] = r
    return first, repeated


def _events(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "event" and r.get("event") == name]


def _width(widths: list, replica: int, stage: Optional[int]) -> int:
    """A replica's TP degree in an iteration record (in one pipeline stage), 0 where it has none."""
    if replica >= len(widths):
        return 0
    width = widths[replica]
    return width if stage is None else (width[stage] if stage < len(width) else 0)


def _evaluations(records: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "evaluation" and r.get("split") == split]


def _final_evaluation(records: list[dict[str, Any]], split: str) -> Optional[dict[str, Any]]:
    return next((r for r in _evaluations(records, split) if r.get("final")), None)


def summarize(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    iterations, repeated = _iterations(records)
    useful_s = sum(r["elapsed_ms"] for r in iterations.values()) / 1e3
    reformed = _events(records, "reformed")
    redone = sum(e.get("iterations_redone", 0) for e in reformed)
    losses = [r["lm_loss"] for _, r in sorted(iterations.items())]
    final_eval = {split: _final_evaluation(records, split) for split in ("validation", "test")}
    return {
        "iterations": len(iterations),
        "final_lm_loss": losses[-1] if losses else None,
        "best_lm_loss": min(losses) if losses else None,
        **{f"final_{split}_lm_loss": r["lm_loss"] if r else None for split, r in final_eval.items()},
        **{f"final_{split}_ppl": r["ppl"] if r else None for split, r in final_eval.items()},
        "wall_s": wall_s,
        "useful_s": useful_s,
        "goodput": useful_s / wall_s if wall_s > 0 else None,
        "iterations_lost": redone + repeated + len(_events(records, "restarted")),
        "iterations_rolled_back": repeated,
        "failures": len(_events(records, "rank_failed")),
        "reformations": len(reformed),
        "restarts": len(_events(records, "restarted")),
        "rebalances": len(_events(records, "rebalanced")),
        "max_boost_power": max((e["power"] for e in _events(records, "boost")), default=None),
        "boost_applied": any(e["applied"] and e["power"] > 1 for e in _events(records, "boost")),
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    if not summary["iterations"]:
        return ["summary: no iteration completed"]
    lines = [f"summary: {summary['iterations']} iterations, final lm loss {summary['final_lm_loss']:.6f} "
             f"(best {summary['best_lm_loss']:.6f}), wall time {summary['wall_s']:.1f} s"]
    for split in ("validation", "test"):
        if summary.get(f"final_{split}_lm_loss") is not None:
            lines.append(f"{split} loss at the end of training: lm loss {summary[f'final_{split}_lm_loss']:.6f} "
                         f"(PPL {summary[f'final_{split}_ppl']:.3f})")
    if summary["goodput"] is not None:
        lines.append(f"goodput: {100 * summary['goodput']:.1f} % (useful iteration time {summary['useful_s']:.1f} s "
                     f"of {summary['wall_s']:.1f} s wall) | iterations lost: {summary['iterations_lost']} "
                     f"({summary['iterations_rolled_back']} completed ones rolled back) | "
                     f"failures: {summary['failures']} | re-formations: {summary['reformations']} | "
                     f"restarts: {summary['restarts']}"
                     + (f" | rebalances: {summary['rebalances']}" if summary.get("rebalances") else "")
                     + (f" | power boost up to {summary['max_boost_power']:.2f}x"
                        f"{'' if summary['boost_applied'] else ' (a dry run: not applied)'}"
                        if summary.get("max_boost_power") else ""))
    return lines


def _plot_compute(ax, compute: dict[int, dict[int, tuple[int, float]]], records: list[dict[str, Any]]) -> None:
    """Per replica the slowest rank's compute per iteration; rebalances (purple) and power boosts marked."""
    for replica, times in sorted(compute.items()):
        its = sorted(times)
        ax.plot(its, [times[i][1] for i in its], label=f"replica {replica}", linewidth=1)
    ax.set_ylabel("compute (ms),\nslowest rank")
    for event in _events(records, "reformed"):
        if event.get("weights"):
            ax.axvline(event["resume_iteration"], color="tab:purple", linestyle="--", linewidth=1)
            ax.annotate("rebalanced", (event["resume_iteration"], ax.get_ylim()[1]), color="tab:purple",
                        fontsize="small", ha="left", va="top")
    boosted = {}
    for event in _events(records, "boost"):
        boosted.setdefault(event["generation"], []).append(event["power"])
    first_of: dict[int, int] = {}
    for times in compute.values():
        for iteration, (generation, _) in times.items():
            first_of[generation] = min(first_of.get(generation, iteration), iteration)
    for generation, powers in sorted(boosted.items()):
        if generation in first_of:
            text = f"boost up to {max(powers):.2f}x" if max(powers) > 1 else "boost off"
            ax.annotate(text, (first_of[generation], ax.get_ylim()[0]), color="tab:brown", fontsize="small",
                        ha="left", va="bottom")
    ax.legend(loc="upper right", fontsize="small")


LABEL_ROW_PT = 11
"""The height of one row of event labels on the loss panel (points: a "small" label's)."""
LABEL_CHARS_ACROSS = 110
"""About how many characters of a "small" label fit across the run plot's 9-inch axes."""


def label_rows(labels: list[tuple[float, str, str]], x_span: float,
               chars_across: float = LABEL_CHARS_ACROSS) -> list[int]:
    """A row for each label ``(x, text, ha)``, the lowest where it comes no closer than a character to a label
    already placed in that row: a label takes ``len(text) / chars_across`` of the x axis (``x_span`` iterations),
    right of ``x`` (``ha`` "left") or left of it ("right")."""
    per_char = x_span / chars_across
    rows: list[list[tuple[float, float]]] = []
    out = []
    for x, text, ha in labels:
        width = (len(text) + 1) * per_char
        lo, hi = (x, x + width) if ha == "left" else (x - width, x)
        row = next((i for i, taken in enumerate(rows) if not any(lo <= b and a <= hi for a, b in taken)), len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append((lo, hi))
        out.append(row)
    return out


def plot(records: list[dict[str, Any]], path: Path,
         compute: Optional[dict[int, dict[int, tuple[int, float]]]] = None) -> Optional[Path]:
    """Draw the run plot (:func:`figure`) into ``path``; None if the run has no iteration."""
    fig = figure(records, compute)
    if fig is None:
        return None
    import matplotlib.pyplot as plt  # loaded by figure() already

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figure(records: list[dict[str, Any]], compute: Optional[dict[int, dict[int, tuple[int, float]]]] = None):
    """Loss per iteration with the validation loss (points; the end-of-training ones as stars), TP per replica over
    iterations, failures (red) and rejoins (green) marked; with ranks' compute times, a third panel: each replica's
    slowest rank's compute per iteration (``compute``: :attr:`ntp_megatron.metrics.MetricsSink.compute`),
    rebalances and power boosts marked."""
    iterations, _ = _iterations(records)
    if not iterations:
        return None
    import matplotlib  # imported when a plot is drawn: it costs the launcher's start-up half a second

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    steps = sorted(iterations)
    panels = 3 if compute else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 6 + 2 * (panels - 2)), sharex=True,
                             gridspec_kw={"height_ratios": [2, 1, 1][:panels]})
    loss_ax, tp_ax = axes[0], axes[1]
    loss_ax.plot(steps, [iterations[i]["lm_loss"] for i in steps], color="tab:blue", label="lm loss")
    for split, color in (("validation", "tab:orange"), ("test", "tab:purple")):
        evaluations = _evaluations(records, split)
        periodic = [r for r in evaluations if not r.get("final")]
        if periodic:
            loss_ax.plot([r["iteration"] for r in periodic], [r["lm_loss"] for r in periodic], "o-", color=color,
                         markersize=4, label=f"{split} lm loss")
        for r in evaluations:
            if r.get("final"):
                loss_ax.plot([r["iteration"]], [r["lm_loss"]], "*", color=color, markersize=11,
                             label=f"{split} lm loss, end of training")
    loss_ax.set_ylabel("lm loss")
    if any(r.get("kind") == "evaluation" for r in records):
        loss_ax.legend(loc="upper right", fontsize="small")
    widths = [iterations[i]["tp_per_replica"] for i in steps]
    for replica in range(max(len(w) for w in widths)):
        per_stage = any(isinstance(w[replica], list) for w in widths if replica < len(w))
        for stage in range(max(len(w[replica]) for w in widths if replica < len(w)) if per_stage else 1):
            tp_ax.step(steps, [_width(w, replica, stage if per_stage else None) for w in widths], where="post",
                       label=f"replica {replica}" + (f", stage {stage}" if per_stage else ""))
    tp_ax.set_ylabel("TP degree")
    axes[-1].set_xlabel("iteration")
    tp_ax.set_ylim(bottom=0)
    tp_ax.yaxis.get_major_locator().set_params(integer=True)
    tp_ax.legend(loc="lower left", fontsize="small")
    labels = []  # (x, text, color, ha): failures and rejoins, drawn in rows so that close ones do not overlap
    for event in _events(records, "rank_failed"):
        if event.get("iteration") is not None:
            labels.append((event["iteration"], f"rank {event.get('launch_rank')} failed", "tab:red", "left"))
    for event in _events(records, "reformed"):
        if event.get("joined"):
            slots = ", ".join(f"replica {j[0]} slot {j[1]}" + "".join(f" stage {p}" for p in j[2:])
                              for j in event["joined"])
            labels.append((event["resume_iteration"], f"{slots} rejoined", "tab:green", "right"))
    x_span = max(steps[-1] - steps[0], 1)
    for (x, text, color, ha), row in zip(labels, label_rows([(x, t, ha) for x, t, _, ha in labels], x_span)):
        for ax in (loss_ax, tp_ax):
            ax.axvline(x, color=color, linestyle="--", linewidth=1)
        loss_ax.annotate(text, (x, loss_ax.get_ylim()[1]), xytext=(0, -LABEL_ROW_PT * row), textcoords="offset points",
                         color=color, fontsize="small", ha=ha, va="top", zorder=5,  # above the event lines
                         bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 0.5})
    if compute:
        _plot_compute(axes[2], compute, records)
    loss_ax.set_title("ntp-megatron run")
    fig.tight_layout()
    return fig
