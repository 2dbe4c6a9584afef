"""A Megatron user's first hour (issue 10): paths from the user's directory, resume with one directory, refusals
before any rank starts, Megatron's flags, JSON-lines preprocessing, and what a run tells its user."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ntp_megatron import launcher
from ntp_megatron.config import load_job_config
from ntp_megatron.config_io import ConfigError
from ntp_megatron.megatron_flags import translate
from tests.jobs import REPO, TINY, run_module

SMALL = ["--tensor-model-parallel-size", "1", "--data-parallel-size", "2", "--micro-batch-size", "2",
         "--global-batch-size", "4", *TINY[:6], "--lr-warmup-iters", "1", "--log-interval", "1"]


def _launch(cwd: Path, args: list[str], out: Path) -> tuple[int, str]:
    """ntp-launch in ``cwd``: exit code, and its stderr (the launcher's lines) followed by its stdout (ranks')."""
    code, stderr = run_module("ntp_megatron.launcher", args, out, cwd=cwd)
    return code, stderr + (out / "ntp_megatron.launcher.stdout").read_text()


# -- flags ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, expected", [
    (["--bf16"], ["training.precision=bf16"]),
    (["--fp16"], ["training.precision=fp16"]),
    (["--swiglu"], ["model.gated_linear_unit=true", "model.activation=swiglu"]),
    (["--untie-embeddings-and-output-weights"], ["model.untie_embeddings_and_output_weights=true"]),
    (["--tokenizer-type", "byte-level"], ["data.tokenizer=byte-level"]),
    (["--pipeline-model-parallel-size", "1"], []),
    (["--distributed-timeout-minutes", "2"], ["parallel.timeout_s=120.0"]),
    (["--norm-epsilon=1e-6"], ["model.layernorm_epsilon=1e-6"]),
])
def test_megatron_spellings_are_accepted(flags, expected):
    assert translate(flags) == expected
    load_job_config(overrides=[*translate(flags), "ntp.enabled=false"])  # and they are valid config


@pytest.mark.parametrize("flags, expected", [
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size: pipeline parallelism is not supported yet"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type: tokenizer 'GPT2BPETokenizer' is not supported"),
    (["--num-experts", "8"], "--num-experts: mixture of experts is not supported yet"),
    (["--train-samples", "1000"], "--train-samples: sample-based training is not supported yet: use --train-iters"),
    (["--bf16", "yes"], "--bf16: takes no value"),
    (["--no-such-flag"], "unknown argument --no-such-flag: neither a config key nor a Megatron flag"),
    (["--disable-bias-linear"], "--disable-bias-linear: linear layers without biases are not supported yet"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 exclude each other"),
])
def test_unsupported_megatron_flags_are_refused_by_name(flags, expected):
    with pytest.raises(ConfigError) as err:
        translate(flags)
    assert str(err.value).startswith(expected), err.value


def test_help_lists_megatron_flags_and_multi_node_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        launcher.main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--bf16 training.precision=bf16", "--swiglu", "--train-iters", "--eval-iters", "--eval-interval",
                 "--tokenizer-type byte-level only", "--pipeline-model-parallel-size 1 only",
                 "--nnodes NNODES nodes in the job", "--node-rank NODE_RANK this node's index"):
        assert text in out, text


# -- refusals before any rank starts --------------------------------------------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["--data-path", "no/such/corpus_text_document"],
     "ntp-launch: data.data_path: no/such/corpus_text_document.bin not found (relative paths are relative to"),
    (["--set", "training.device=cuda"], "ntp-launch: training.device is 'cuda', but torch sees no CUDA device"),
    (["--distributed-backend", "nccl"], "ntp-launch: parallel.backend is 'nccl', but torch sees no CUDA device"),
    (["--load", "no/such/ckpt"], "ntp-launch: checkpoint.load: no such directory: "),
    (["--train-iters", "5"], "ntp-launch: training.lr_warmup_iters (5) must be below the decay length, "
                             "training.train_iters (lr_decay_iters unset) = 5: shorten the warmup (--lr-warmup-iters 4)"),
    (["--inject-failure", "kill:rank=1,iter=60"], "ntp-launch: --inject-failure 'kill:rank=1,iter=60': iter 60 is "
                                                  "past training.train_iters (50)"),
    (["--pipeline-model-parallel-size", "4"], "ntp-launch: --pipeline-model-parallel-size: pipeline parallelism"),
], ids=["data", "cuda", "nccl", "load", "warmup", "failure-past-end", "pipeline"])
def test_refused_in_one_line_before_any_rank_starts(tmp_path, args, expected):
    import torch

    if "cuda" in " ".join(args) or "nccl" in args:
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    code, output = _launch(tmp_path, ["--run-dir", "run", *args], tmp_path / "out")
    assert code == 2, output
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), output
    assert not (tmp_path / "run").exists(), "nothing may start"


# -- paths, resume, what a run says --------------------------------------------------------------------------

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

    from ntp_megatron.preprocess import build_indexed_dataset

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
