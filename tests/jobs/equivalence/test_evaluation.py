"""Evaluation (``training.eval_interval`` / ``eval_iters``): validation and test loss, the same number under
every layout — plain TP1, an NTP topology with a dead slot, ``degraded_batch: proportional``, and a run whose rank
dies in the middle of an evaluation — plus its config keys and errors, log lines, records, TensorBoard scalars,
summary and plot."""

from __future__ import annotations

import json

import pytest

from ntp_megatron import faults, metrics

from ntp_megatron.config import flags

from ntp_megatron.launch import launcher, run_report
from ntp_megatron.config.schema import load_job_config
from ntp_megatron.config.files import ConfigError
from ntp_megatron.training.data import evaluation_batches, evaluation_window, replica_sample_range
from ntp_megatron.training.parallel import assign_shares
from tests.harness import TINY, assert_ok, assert_replicas_agree, relative_difference, run_job

TOL = 1e-5  # as the training-loss equivalence: fp32 forward passes of different widths, summed in float64
EVAL = ["--eval-interval", "2", "--eval-iters", "2"]  # through the launcher's Megatron-style flags
ITERS = 4


def run_args(tp: int, dp: int, *extra: str) -> list[str]:
    return [*TINY, "--set", f"parallel.tensor_model_parallel_size={tp}", "--set", f"parallel.data_parallel_size={dp}",
            "--set", f"training.train_iters={ITERS}", "--set", "model.init=layout_free", *EVAL, *extra]


def ntp_args(tp: int, dp: int, *extra: str) -> list[str]:
    return run_args(tp, dp, "--set", "ntp.enabled=true", "--set", "parallel.timeout_s=60",
                    "--set", "logging.state_checksums=true", *extra)


def evaluations(result) -> dict[tuple, dict]:
    out = {}
    for r in result.records:
        if r.get("kind") == "evaluation":
            key = (r["split"], r["iteration"], r["final"])
            assert key not in out, f"evaluation {key} recorded twice"
            out[key] = r
    return out


EXPECTED = {("validation", 2, False), ("validation", 4, False), ("validation", 4, True), ("test", 4, True)}


def assert_same_evaluations(result, reference, expected=EXPECTED) -> dict[tuple, dict]:
    assert_ok(result)
    assert_ok(reference)
    got, want = evaluations(result), evaluations(reference)
    assert set(got) == set(want) == expected
    for key, r in want.items():
        assert got[key]["tokens"] == r["tokens"] > 0
        diff = relative_difference(got[key]["lm_loss"], r["lm_loss"])
        assert diff <= TOL, f"{key}: lm loss {got[key]['lm_loss']} vs {r['lm_loss']} (relative {diff:.1e})"
    return got


@pytest.fixture(scope="module")
def reference(jobs):
    """Plain Megatron-Core at TP1 × DP1 (NTP off)."""
    return jobs.run("eval-tp1", run_args(1, 1))


# -- config, data order, spec: pure -----------------------------------------------------------------------------

def test_megatron_flags_set_the_eval_keys():
    overrides = flags.translate(EVAL)
    assert overrides == ["training.eval_interval=2", "training.eval_iters=2"]
    t = load_job_config(overrides=overrides).training
    assert (t.eval_interval, t.eval_iters, t.evaluates) == (2, 2, True)
    assert not load_job_config().training.evaluates  # opt-in
    assert not load_job_config(overrides=["training.eval_interval=2", "training.eval_iters=0"]).training.evaluates


def test_evaluation_without_validation_data_is_one_line_exit_2(capsys):
    indexed = ["--set", "data.mock=false", "--set", "data.data_path=[some/prefix]"]
    with pytest.raises(ConfigError, match=r"data.split '100,0,0' has no validation share.*training.eval_iters"):
        load_job_config(overrides=["data.mock=false", "data.data_path=[p]", "training.eval_interval=5"])
    assert launcher.main([*indexed, "--eval-interval", "5"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "data.split" in line and "training.eval_iters" in line, line
    # Mock data has validation and test splits whatever data.split says (Megatron-Core splits it 1,1,1).
    assert load_job_config(overrides=["training.eval_interval=5"]).training.evaluates


def test_a_split_without_validation_documents_is_refused_before_any_rank_starts(tmp_path, capsys):
    """99,1,0 of 10 documents leaves none for validation (Megatron's builder would never finish building it)."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for doc in range(10):
        builder.add_document(numpy.arange(100) + doc, [100])
    builder.finalize(prefix + ".idx")
    args = ["--run-dir", str(tmp_path / "run"), "--data-path", prefix, "--eval-interval", "5", "--eval-iters", "1"]
    assert launcher.main([*args, "--split", "99,1,0"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("ntp-launch: data.split '99,1,0' leaves no validation document of the 10 in"), line
    assert launcher.main([*args, "--split", "80,15,4"]) == 2  # test: documents 9.6 to 10 of 10
    assert "leaves no test document" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the run started


def test_evaluation_samples_depend_on_window_and_shares_only():
    g, dp, eval_iters = 12, 3, 2
    full = [list(range(b * g, (b + 1) * g)) for b in range(2 * eval_iters, 3 * eval_iters)]  # window 2
    for live in ([0, 1, 2], [0, 2], [1]):  # healthy, one replica dropped, two dropped: the same samples
        per_replica = [evaluation_batches(2, eval_iters, shares, dp, g) for shares in assign_shares(live, dp).values()]
        assert [sorted(i for batches in per_replica for i in batches[b]) for b in range(eval_iters)] == full
    # A replica reads each of its shares in full (as training does with degraded_batch: full).
    assert evaluation_batches(0, 1, [1], dp, g) == [list(replica_sample_range(0, 1, dp, g))]
    cfg = load_job_config(overrides=["training.train_iters=10", "training.eval_interval=4"])
    assert [evaluation_window(cfg, k, "validation", False) for k in (4, 8)] == [0, 1]
    assert evaluation_window(cfg, 10, "validation", True) == 2  # after the periodic ones, as Megatron-LM reads
    assert evaluation_window(cfg, 10, "test", True) == 0


def test_eval_failure_phase_needs_an_evaluation_at_its_iteration():
    spec = faults.parse_failure_spec("kill:rank=1,iter=4,phase=eval", 4, 10, eval_interval=2)
    assert spec.phase == "eval"
    faults.parse_failure_spec("kill:rank=1,iter=5,phase=eval", 4, 5, eval_interval=2)  # the final evaluation
    with pytest.raises(ConfigError, match="phase eval needs evaluation"):
        faults.parse_failure_spec("kill:rank=1,iter=4,phase=eval", 4, 10)
    with pytest.raises(ConfigError, match="no evaluation follows iteration 3"):
        faults.parse_failure_spec("kill:rank=1,iter=3,phase=eval", 4, 10, eval_interval=2)


# -- records, TensorBoard, summary, plot --------------------------------------------------------------------------

RECORD = {"kind": "evaluation", "split": "validation", "iteration": 10, "final": False, "lm_loss": 4.123456,
          "ppl": 61.78, "tokens": 1024}


def test_evaluation_line_record_tensorboard_summary_and_plot(tmp_path):
    assert metrics.evaluation_line(RECORD) == (" validation loss at iteration 10 | lm loss value: 4.123456E+00 |"
                                               " lm loss PPL: 6.178000E+01 | ")
    final = {**RECORD, "iteration": 20, "final": True, "lm_loss": 3.5, "ppl": 33.1}
    test = {**final, "split": "test", "lm_loss": 3.6, "ppl": 36.6}
    assert metrics.evaluation_line(test).startswith(" test loss at the end of training | lm loss value: 3.600000E+00")
    sink = metrics.MetricsSink(tmp_path / "m.jsonl", tmp_path / "tb")
    sink.write({"kind": "iteration", "iteration": 20, "lm_loss": 3.4, "elapsed_ms": 1.0, "tp_per_replica": [2, 1]})
    for record in (RECORD, RECORD, final, test):  # every rank sends each record: one is kept
        sink.write(record)
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["iteration", "evaluation", "evaluation", "evaluation"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    scalars = {tag: [(e.step, round(e.value, 4)) for e in tb.Scalars(tag)] for tag in tb.Tags()["scalars"]}
    assert scalars["lm loss validation"] == [(10, 4.1235), (20, 3.5)]
    assert scalars["lm loss validation ppl"] == [(10, 61.78), (20, 33.1)]
    assert scalars["lm loss test"] == [(20, 3.6)]
    summary = run_report.summarize(sink.records, wall_s=2.0)
    assert (summary["final_validation_lm_loss"], summary["final_test_lm_loss"]) == (3.5, 3.6)
    lines = run_report.summary_lines(summary)
    assert "validation loss at the end of training: lm loss 3.500000 (PPL 33.100)" in lines
    assert run_report.plot(sink.records, tmp_path / "run.png").stat().st_size > 0


# -- real runs -----------------------------------------------------------------------------------------------------

def test_evaluation_equals_tp1_under_ntp_with_a_dead_slot(jobs, reference):
    """TP2 × 2 with slot 1 of replica 1 dead (TP2 + TP1, 3 ranks) against TP1: the same validation and test losses,
    in Megatron's log lines, the metrics file and TensorBoard."""
    result = jobs.run("eval-ntp", ntp_args(2, 2, "--set", "ntp.dead_slots=[1:1]",
                                           "--set", "logging.tensorboard_dir=null"))
    got = assert_same_evaluations(result, reference)
    assert_replicas_agree(result, ITERS)
    assert all(r["tp_per_replica"] == [2, 1] for r in got.values())
    assert got[("validation", 2, False)]["lm_loss"] != got[("validation", 4, False)]["lm_loss"]  # other samples
    for key, r in got.items():
        where = "the end of training" if r["final"] else f"iteration {r['iteration']}"
        assert f" {r['split']} loss at {where} | lm loss value: {r['lm_loss']:.6E} | lm loss PPL:" in result.stdout
    assert "validation loss at the end of training: lm loss" in result.stderr  # the end-of-run summary
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [run_tb] = (result.run_dir / "tensorboard").iterdir()  # one subdirectory per run
    tb = EventAccumulator(str(run_tb))
    tb.Reload()
    assert [e.step for e in tb.Scalars("lm loss validation")] == [2, 4, 4]
    assert [e.step for e in tb.Scalars("lm loss validation ppl")] == [2, 4, 4]
    assert [e.step for e in tb.Scalars("lm loss test")] == [4]


def test_proportional_batch_does_not_change_evaluation(jobs):
    """TP2 + TP1 with ``degraded_batch: proportional`` trains on samples 0..9 of each 12 (the TP1 replica runs 2
    of its 3 micro-batches); evaluation still reads every sample. Against TP1 with a global batch of 10: the same
    one training step (samples 0..9) and, with 6 evaluation batches of 10 against 5 of 12, the same 60 samples."""
    common = ["--set", "training.train_iters=1", "--set", "training.lr_warmup_iters=0",
              "--eval-interval", "100"]  # the final evaluation only
    prop = jobs.run("eval-prop", ntp_args(2, 2, "--set", "ntp.dead_slots=[1:1]",
                                          "--set", "ntp.degraded_batch=proportional", *common, "--eval-iters", "5"))
    ref = jobs.run("eval-prop-ref", run_args(1, 1, "--set", "training.global_batch_size=10", *common,
                                             "--eval-iters", "6"))
    assert_same_evaluations(prop, ref, expected={("validation", 1, True), ("test", 1, True)})
    assert_replicas_agree(prop, 1)
    [record] = [r for r in prop.records if r.get("kind") == "iteration"]
    assert record["global_batch_size"] == 10


def test_kill_during_evaluation_is_absorbed_and_the_evaluation_redone(tmp_path, reference):
    """A rank dies in the middle of the evaluation after iteration 2: its replica re-forms at TP1, the evaluation
    is done again in the new generation, and every value equals the failure-free TP1 run's."""
    result = run_job(tmp_path / "run", ntp_args(2, 2, "--inject-failure", "kill:rank=3,iter=2,phase=eval"))
    got = assert_same_evaluations(result, reference)
    assert_replicas_agree(result, ITERS)
    [failed] = result.events("rank_failed")
    assert (failed["launch_rank"], failed["phase"]) == (3, "eval")
    [reformed] = result.events("reformed")
    assert reformed["tp_per_replica"] == [2, 1] and reformed["resume_iteration"] == 3
    assert got[("validation", 2, False)]["generation"] == 1  # redone in the new generation
    assert got[("validation", 2, False)]["tp_per_replica"] == [2, 1]
    losses, want = result.losses(), reference.losses()
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert max(relative_difference(losses[i], want[i]) for i in want) <= TOL
