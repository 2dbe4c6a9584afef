"""The end of a run, on node 0: the summary (goodput, iterations lost), the injected failures that never fired,
where the checkpoints, metrics and run plot went."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

from ntp_megatron import faults, metrics
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.elastic import keys
from ntp_megatron.launch import run_report


def summarize(cfg: JobConfig, sink: metrics.MetricsSink, say: Callable[[str], None], started: float, run_dir: Path,
              outputs: tuple[Optional[Path], Optional[Path]], store: Any, failures: list) -> None:
    """The end-of-run summary and ``<run_dir>/run.png`` (``outputs``: the metrics file and TensorBoard directory)."""
    summary = run_report.summarize(sink.records, wall_s=time.time() - started)
    sink.write({"kind": "event", "event": "job_summary", "time": time.time(), **summary})
    for line in run_report.summary_lines(summary):
        say(line)
    report_unfired(store, failures, sink, say)
    saves = [r for r in sink.records if r.get("event") == "checkpoint_saved"]
    if saves:
        say(f"checkpoints: {Path(cfg.checkpoint.save).resolve()} (latest: iteration {saves[-1]['iteration']})")
    metrics_file, tensorboard_dir = outputs
    say(f"metrics: {metrics_file or 'off'} | tensorboard: {tensorboard_dir or 'off'}")
    try:
        path = run_report.plot(sink.records, run_dir / "run.png", sink.compute)
        if path is not None:
            say(f"run plot: {path}")
    except Exception as exc:  # noqa: BLE001 - a plot must never fail a run
        say(f"could not draw the run plot: {exc}")


def report_unfired(store: Any, failures: list, sink: metrics.MetricsSink, say: Callable[[str], None]) -> None:
    """Every in-rank ``--inject-failure`` that never fired, in one line each and an event: the run never reached its
    iteration and phase (a ``reform`` with no re-formation after it, an iteration past the end of a run that stopped
    early), so a run that was meant to test it did not."""
    if store is None:
        return
    for spec in failures:
        if isinstance(spec, faults.RankFailure) and not keys.quietly(keys.has_fired, store, spec, default=False):
            say(f"injected failure {spec} did not fire: the run never reached iteration {spec.iteration} in phase "
                f"{spec.phase} on launch rank {spec.rank}")
            sink.event("failure_not_fired", spec=str(spec))
