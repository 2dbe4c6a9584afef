"""Iteration records: how ranks report them, how they read as a Megatron-style log line, where they go.

Ranks print records to stdout as one tagged JSON line; the launcher relays ordinary lines and routes
tagged ones to the metrics file (``--metrics-file``, one JSON object per line) and TensorBoard. The sink
lives in the launcher so the record of a run survives the death of any rank, rank 0 included.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Optional, TextIO

logger = logging.getLogger(__name__)

METRIC_TAG = "@@ntp-metric "
"""Prefix of a stdout line that carries a record for the launcher, not for the console."""

ITERATION_FIELDS = ("iteration", "lm_loss", "grad_norm", "lr", "elapsed_ms", "tokens_per_s", "tp_per_replica")


def emit(record: dict[str, Any], stream: TextIO) -> None:
    """Send one record to the launcher (a rank calls this with ``sys.stdout``)."""
    stream.write(METRIC_TAG + json.dumps(record, separators=(",", ":")) + "\n")
    stream.flush()


def parse(line: str) -> Optional[dict[str, Any]]:
    """The record in a tagged line, or None for an ordinary log line."""
    if not line.startswith(METRIC_TAG):
        return None
    return json.loads(line[len(METRIC_TAG):])


def iteration_line(record: dict[str, Any], eta_s: Optional[float] = None) -> str:
    """Megatron's iteration line, plus the NTP state (TP degree of every replica) and, given ``eta_s``, the
    estimated time to the end of the run."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        f" [{stamp}] iteration {record['iteration']:>8d}/{record['train_iters']:>8d} |"
        f" consumed samples: {record['consumed_samples']:>12d} |"
        f" elapsed time per iteration (ms): {record['elapsed_ms']:.1f} |"
        f" tokens/s: {record['tokens_per_s']:.1f} |"
        f" learning rate: {record['lr']:.6E} |"
        f" global batch size: {record['global_batch_size']:>5d} |"
        f" lm loss: {record['lm_loss']:.6E} |"
        f" grad norm: {_fmt(record.get('grad_norm'), '.3f')} |"
        f" number of skipped iterations: {record.get('skipped', 0):>3d} |"
        f" tp per replica: {record['tp_per_replica']} |"
        + (f" generation: {record['generation']} |" if record.get("generation") else "")
        + (f" ETA: {_duration(eta_s)} |" if eta_s is not None else "")
    )


def evaluation_line(record: dict[str, Any]) -> str:
    """Megatron's evaluation line: ``validation loss at iteration 10 | lm loss value: … | lm loss PPL: … |``;
    the final evaluations are ``… at the end of training``."""
    where = "the end of training" if record["final"] else f"iteration {record['iteration']}"
    return (f" {record['split']} loss at {where} | lm loss value: {record['lm_loss']:.6E} |"
            f" lm loss PPL: {record['ppl']:.6E} | ")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


class MetricsSink:
    """Writes records to a JSON-lines file and TensorBoard scalars; either may be switched off."""

    def __init__(self, metrics_file: Optional[Path], tensorboard_dir: Optional[Path]) -> None:
        self.records: list[dict[str, Any]] = []
        """Iteration and evaluation records, and events, in order (the launcher's end-of-run summary and plot read
        them)."""
        self.compute: dict[int, dict[int, tuple[int, float]]] = {}
        """Replica -> iteration -> (generation, its slowest rank's compute ms) from the ranks' ``compute`` records,
        the newest generation's where an iteration was computed twice (a redone one): what the plot draws. One
        number per replica and iteration, however many ranks report."""
        self._seen: set[tuple] = set()
        self._file: Optional[TextIO] = None
        if metrics_file is not None:
            metrics_file.parent.mkdir(parents=True, exist_ok=True)
            self._file = metrics_file.open("a", buffering=1)
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # TensorBoard takes a second to import: only when asked

            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        key = None
        if kind == "iteration":
            key = (kind, record["iteration"], record.get("restart", 0), record.get("generation"))
        elif kind == "evaluation":  # once per evaluation, however often it was computed (equal values)
            key = (kind, record["split"], record["iteration"], record["final"])
        if key is not None:
            if key in self._seen:
                return  # every rank reports each iteration and evaluation; one record is kept
            self._seen.add(key)
        if kind in ("iteration", "evaluation", "event"):
            self.records.append(record)
        if kind == "compute":
            self._slowest(record)
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        if self._tb is not None and kind == "iteration":
            step = record["iteration"]
            for key in ("lm_loss", "grad_norm", "lr", "elapsed_ms", "tokens_per_s"):
                if record.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", record[key], step)
            for replica, tp in enumerate(record.get("tp_per_replica", [])):
                if isinstance(tp, list):  # one width per pipeline stage
                    for stage, width in enumerate(tp):
                        self._tb.add_scalar(f"ntp/tp_replica{replica}_stage{stage}", width, step)
                else:
                    self._tb.add_scalar(f"ntp/tp_replica{replica}", tp, step)
        if self._tb is not None and kind == "evaluation":  # Megatron's names: "lm loss validation", "... ppl"
            self._tb.add_scalar(f"lm loss {record['split']}", record["lm_loss"], record["iteration"])
            self._tb.add_scalar(f"lm loss {record['split']} ppl", record["ppl"], record["iteration"])

    def _slowest(self, record: dict[str, Any]) -> None:
        mine = self.compute.setdefault(record["replica"], {})
        held = mine.get(record["iteration"])
        generation, ms = record["generation"], record["compute_ms"]
        if held is None or generation > held[0] or (generation == held[0] and ms > held[1]):
            mine[record["iteration"]] = (generation, ms)

    def event(self, name: str, **fields: Any) -> None:
        self.write({"kind": "event", "event": name, "time": time.time(), **fields})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
