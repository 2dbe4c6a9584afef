"""Iteration records: the tagged channel, the Megatron-style line, the JSON-lines sink."""

from __future__ import annotations

import io
import json

from ntp_megatron import metrics

RECORD = {"kind": "iteration", "iteration": 10, "train_iters": 50, "consumed_samples": 160,
          "global_batch_size": 16, "lm_loss": 4.5, "grad_norm": 1.25, "lr": 3e-3, "elapsed_ms": 250.0,
          "tokens_per_s": 4096.0, "skipped": 0, "tp_per_replica": [2, 2]}


def test_emit_parse_round_trip():
    buf = io.StringIO()
    metrics.emit(RECORD, buf)
    line = buf.getvalue()
    assert line.startswith(metrics.METRIC_TAG) and line.endswith("\n")
    assert metrics.parse(line) == RECORD
    assert metrics.parse("[rank 0] ordinary output\n") is None


def test_iteration_line_has_megatron_fields_and_ntp_state():
    line = metrics.iteration_line(RECORD)
    for fragment in ("iteration       10/      50", "consumed samples:          160",
                     "elapsed time per iteration (ms): 250.0", "tokens/s: 4096.0", "learning rate: 3.000000E-03",
                     "global batch size:    16", "lm loss: 4.500000E+00", "grad norm: 1.250",
                     "tp per replica: [2, 2]"):
        assert fragment in line


def test_sink_writes_json_lines_with_required_fields(tmp_path):
    sink = metrics.MetricsSink(tmp_path / "m.jsonl", tmp_path / "tb")
    sink.write(RECORD)
    sink.event("rank_failed", rank=3)
    sink.close()
    rows = [json.loads(l) for l in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert set(metrics.ITERATION_FIELDS) <= set(rows[0])
    assert rows[1]["event"] == "rank_failed" and rows[1]["rank"] == 3
    assert any((tmp_path / "tb").iterdir()), "no TensorBoard event file"


def test_two_runs_started_in_one_second_get_a_tensorboard_series_each(tmp_path, monkeypatch):
    """A run relaunched in the second its predecessor started (a finished run's ``nothing to do`` and the next,
    say) must not write into the other's TensorBoard series."""
    from ntp_megatron.config.schema import JobConfig
    from ntp_megatron.launch import console

    monkeypatch.setattr(console.time, "strftime", lambda fmt: "20261202-080000")
    cfg = JobConfig()
    dirs = [console.run_outputs(cfg, tmp_path)[1] for _ in range(3)]
    assert [d.name for d in dirs] == ["20261202-080000", "20261202-080000-2", "20261202-080000-3"]
    assert all(d.is_dir() for d in dirs)
