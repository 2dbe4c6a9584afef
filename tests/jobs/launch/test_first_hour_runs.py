"""A Megatron user's first hour, as whole runs: the scripts from another directory, indexed JSON-lines data, one
directory for --save and --load (the in-process checks are in ``tests/unit/launch/test_first_hour.py``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.harness import REPO, TINY, run_module

SMALL = ["--tensor-model-parallel-size", "1", "--data-parallel-size", "2", "--micro-batch-size", "2",
         "--global-batch-size", "4", *TINY[:6], "--lr-warmup-iters", "1", "--log-interval", "1"]


def _launch(cwd: Path, args: list[str], out: Path) -> tuple[int, str]:
    """ntp-launch in ``cwd``: exit code, and its stderr (the launcher's lines) followed by its stdout (ranks')."""
    code, stderr = run_module("ntp_megatron.launch.launcher", args, out, cwd=cwd)
    return code, stderr + (out / "ntp_megatron.launch.launcher.stdout").read_text()



def test_script_paths_are_the_callers(tmp_path):
    """``scripts/pretrain_gpt.sh`` run from another directory: --config, --data-path, --metrics-file and --save
    are relative to that directory, as in the user's shell."""
    shutil.copy(REPO / "configs" / "tiny_cpu.yaml", tmp_path / "my.yaml")
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "words " * 40}) + "\n" for i in range(30)))
    prep = subprocess.run([str(REPO / ".venv" / "bin" / "ntp-preprocess"), "--input", "docs.jsonl",
                           "--output-prefix", "data/docs"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr
    proc = subprocess.run([str(REPO / "scripts" / "pretrain_gpt.sh"), "--config", "my.yaml", "--data-path",
                           "data/docs_text_document", "--metrics-file", "out/m.jsonl", "--train-iters", "2",
                           *SMALL, "--set", "logging.tensorboard_dir=", "--run-dir", "run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "m.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if r["kind"] == "iteration"] == [1, 2]
    assert (tmp_path / "run" / "run.png").is_file()
    assert "data: indexed (Megatron-Core GPTDataset), data/docs_text_document (30 documents" in proc.stderr
    assert not (REPO / "out").exists() and not (REPO / "my.yaml").exists()


def test_json_lines_are_detected_and_read_by_their_text_key(tmp_path):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from ntp_megatron.training.preprocess import build_indexed_dataset

    path = tmp_path / "docs.json"  # no .jsonl suffix: detected from the content
    path.write_text(json.dumps({"id": 1, "text": "first document"}) + "\n\n"
                    + json.dumps({"text": "second", "meta": {"x": 1}}) + "\n")
    prefix, docs, _ = build_indexed_dataset([path], str(tmp_path / "out"))
    ds = IndexedDataset(prefix)
    texts = [bytes(np.asarray(ds[i][:-1], dtype=np.uint8)).decode() for i in range(len(ds))]
    assert (docs, texts) == (2, ["first document", "second"])
    plain = tmp_path / "plain.txt"
    plain.write_text("{not json} a plain text document")
    prefix, docs, _ = build_indexed_dataset([plain], str(tmp_path / "plain"))
    ds = IndexedDataset(prefix)  # kept alive: its items are views of its memory map
    assert bytes(np.asarray(ds[0][:-1], dtype=np.uint8)).decode() == "{not json} a plain text document"


def test_one_directory_for_save_and_load_resumes_automatically(tmp_path):
    """Megatron's ``--save ck --load ck`` from the first run: starts fresh and says so, the next run resumes
    (no deprecation noise), a finished run says there is nothing to do, and each run's TensorBoard data is
    its own; the summary says where everything went."""
    common = ["--run-dir", "run", "--save", "ck", "--load", "ck", "--save-interval", "2", *SMALL]
    code, first = _launch(tmp_path, [*common, "--train-iters", "2"], tmp_path / "o1")
    assert code == 0, first
    assert "ntp-launch: no checkpoint in ck yet: starting from iteration 0" in first
    assert "successfully saved checkpoint from iteration        2 to ck/iter_0000002 (" in first
    assert "ETA: 0:00:0" in first
    assert f"checkpoints: {tmp_path / 'ck'} (latest: iteration 2)" in first
    assert f"metrics: {tmp_path / 'run' / 'metrics.jsonl'} | tensorboard: {tmp_path / 'run' / 'tensorboard'}/" in first

    code, second = _launch(tmp_path, [*common, "--train-iters", "3"], tmp_path / "o2")
    assert code == 0, second
    assert f"resuming from checkpoint ck/iter_0000002 (iteration 2)" in second
    assert "Warning" not in second, second
    iterations = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in iterations if r["kind"] == "iteration"] == [1, 2, 3]
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 2, "one TensorBoard directory per run"

    code, third = _launch(tmp_path, [*common, "--train-iters", "3"], tmp_path / "o3")
    assert (code, third.strip()) == (0, f"ntp-launch: nothing to do: checkpoint {tmp_path / 'ck' / 'iter_0000003'} "
                                        "is at iteration 3 = training.train_iters (3); raise --train-iters to train further")
    code, fourth = _launch(tmp_path, [*common, "--train-iters", "5", "--inject-failure", "kill:rank=1,iter=2"],
                           tmp_path / "o4")
    assert code == 2 and "iter 2 is not after iteration 3, where the run resumes" in fourth, fourth
