"""ntp-preprocess builds Megatron indexed data from the shipped corpus; training reads it."""

from __future__ import annotations

import numpy as np

from tests.harness import assert_ok, layout_args, run_job, run_module


def test_preprocess_then_train_on_indexed_data(tmp_path, jobs):
    prefix = tmp_path / "data" / "corpus"
    returncode, stderr = run_module("ntp_megatron.training.preprocess", ["--output-prefix", str(prefix)], tmp_path / "prep",
                                    timeout=120)
    assert returncode == 0, stderr
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

    # Iteration 1's loss (before any update: the model and the first batch alone) on mock data, from the TP1 x DP2
    # run of tests/jobs/equivalence/test_equivalence.py (the session runs it once).
    mock = jobs.run("tp1dp2", layout_args(1, 2, 10))
    assert_ok(mock)
    assert mock.losses()[1] != losses[1], "the --data-path run must not be training on mock data"
