"""A Megatron user's first hour: paths from the user's directory, resume with one directory, refusals
before any rank starts, Megatron's flags, JSON-lines preprocessing, and what a run tells its user."""

from __future__ import annotations

from pathlib import Path

import pytest

from ntp_megatron.launch import launcher
from ntp_megatron.config.schema import load_job_config
from ntp_megatron.config.files import ConfigError
from ntp_megatron.config.flags import translate
from tests.harness import TINY, run_module

# The launchers these tests start are forked from a zygote that each worker process starts once (its imports
# take seconds): the tests share one worker (pytest-xdist, --dist loadgroup), so one zygote serves them all.
pytestmark = pytest.mark.xdist_group("zygote")

SMALL = ["--tensor-model-parallel-size", "1", "--data-parallel-size", "2", "--micro-batch-size", "2",
         "--global-batch-size", "4", *TINY[:6], "--lr-warmup-iters", "1", "--log-interval", "1"]


def _launch(cwd: Path, args: list[str], out: Path) -> tuple[int, str]:
    """ntp-launch in ``cwd``: exit code, and its stderr (the launcher's lines) followed by its stdout (ranks')."""
    code, stderr = run_module("ntp_megatron.launch.launcher", args, out, cwd=cwd)
    return code, stderr + (out / "ntp_megatron.launch.launcher.stdout").read_text()


# -- flags ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, expected", [
    (["--bf16"], ["training.precision=bf16"]),
    (["--fp16"], ["training.precision=fp16"]),
    (["--swiglu"], ["model.gated_linear_unit=true", "model.activation=swiglu"]),
    (["--untie-embeddings-and-output-weights"], ["model.untie_embeddings_and_output_weights=true"]),
    (["--tokenizer-type", "byte-level"], ["data.tokenizer=byte-level"]),
    (["--pipeline-model-parallel-size", "2"], ["parallel.pipeline_model_parallel_size=2"]),
    (["--distributed-timeout-minutes", "2"], ["parallel.timeout_s=120.0"]),
    (["--norm-epsilon=1e-6"], ["model.layernorm_epsilon=1e-6"]),
])
def test_megatron_spellings_are_accepted(flags, expected):
    assert translate(flags) == expected
    load_job_config(overrides=[*translate(flags), "ntp.enabled=false"])  # and they are valid config


@pytest.mark.parametrize("flags, expected", [
    (["--virtual-pipeline-model-parallel-size", "2"], "--virtual-pipeline-model-parallel-size: virtual pipeline "
                                                      "stages (the interleaved schedule) are not supported yet"),
    (["--pipeline-model-parallel-layout", "Et|tL"], "--pipeline-model-parallel-layout: uneven pipeline stages are "
                                                     "not supported yet"),
    (["--account-for-loss-in-pipeline-split"], "--account-for-loss-in-pipeline-split: uneven pipeline stages are "
                                               "not supported yet"),
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
                 "--tokenizer-type byte-level only", "--pipeline-model-parallel-size",
                 "--virtual-pipeline-model-parallel-size",
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
    (["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
     "ntp-launch: parallel.use_distributed_optimizer is not supported with ntp.enabled and "
     "parallel.pipeline_model_parallel_size 2 yet"),
    (["--pipeline-model-parallel-size", "3", "--set", "ntp.enabled=false"],
     "ntp-launch: parallel.pipeline_model_parallel_size (3) must divide model.num_layers (2): allowed 1, 2"),
], ids=["data", "cuda", "nccl", "load", "warmup", "failure-past-end", "pipeline-ntp", "pipeline-layers"])
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


