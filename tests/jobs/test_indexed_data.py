"""ntp-preprocess builds Megatron indexed data from the shipped corpus; training reads it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from tests.harness import REPO, assert_ok, layout_args, run_job


def test_preprocess_then_train_on_indexed_data(tmp_path):
    prefix = tmp_path / "data" / "corpus"
    proc = subprocess.run([sys.executable, "-m", "ntp_megatron.preprocess", "--output-prefix", str(prefix)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data_prefix = f"{prefix}_text_document"

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(data_prefix)
    assert len(ds) > 100
    first = ds[0]
    assert first[-1] == 0, "documents end with the end-of-document token"
    text = bytes(np.asarray(first[:-1], dtype=np.uint8)).decode("utf-8")
    assert text.startswith("This module implements specialized container datatypes")

    result = run_job(tmp_path / "run", layout_args(1, 2, 8) + ["--data-path", data_prefix])
    assert_ok(result)
    losses = result.losses()
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1]

    mock = run_job(tmp_path / "mock", layout_args(1, 2, 2))
    assert_ok(mock)
    assert mock.losses()[1] != losses[1], "the --data-path run must not be training on mock data"
