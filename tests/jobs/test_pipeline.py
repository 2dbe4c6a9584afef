"""Pipeline stages against plain Megatron-Core: NTP on PP2 × TP2 × 2 replicas (8 gloo ranks) with dead slots in
stage 0, in stage 1 and in both, the same job with NTP off, and their checkpoints.

The reference is ``tests/plain_megatron.py`` (a process that never imports ntp-megatron) at PP1 × TP1 and at
PP2 × TP2, both × DP2, started from the NTP job's initial weights (``--init-state``: the stages' dumps of
``logging.dump_state`` merged under PP1 names) and trained on the same samples. Per iteration the lm loss and the
grad norm of every layout must agree within ``TOL`` (1e-5 relative), and plain Megatron-Core's own two layouts
with each other (its spread between layouts, measured in the same test, must lie within it too); every replica
of the NTP job reports the same state checksums per stage after every iteration.

Checkpoints: the job with dead slots in both stages saves at iteration 3 of 6; the save resumes under NTP at
PP1 × TP2 and under plain Megatron-Core at PP2 × TP2, and the loss continues the uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.equivalence_cases import PLAIN_TIMEOUT_S, TOL, PlainServer
from tests.harness import TINY, assert_ok, assert_replicas_agree, relative_difference, run_job

pytestmark = pytest.mark.job

ITERS = 6
SAVE_AT = 3
DEAD = {"stage0": ["1:0@0"], "stage1": ["0:1@1"], "both": ["1:1@0", "0:0@1"]}


def pipeline_args(ntp: bool, pp: int, tp: int, dead=(), extra: tuple[str, ...] = ()) -> list[str]:
    return [*TINY, "--set", f"ntp.enabled={str(ntp).lower()}", "--set", f"parallel.pipeline_model_parallel_size={pp}",
            "--set", f"parallel.tensor_model_parallel_size={tp}", "--set", "parallel.data_parallel_size=2",
            "--set", "model.untie_embeddings_and_output_weights=true", "--set", "model.init=layout_free",
            "--set", f"training.train_iters={ITERS}", "--set", "logging.state_checksums=true",
            "--set", f"ntp.dead_slots={json.dumps(list(dead))}", *extra]


def records(result) -> dict[int, dict]:
    return {r["iteration"]: r for r in result.records if r.get("kind") == "iteration"}


def merged_state(state_dir: Path, replica: int, initial: bool) -> dict:
    """One replica's full state from its stages' dumps, under PP1 names (a tensor two stages both hold, as the
    tied embeddings, must be the same bits in both)."""
    out: dict = {}
    for stage in (0, 1):
        for key, value in torch.load(state_dir / f"replica{replica}.stage{stage}{'.init' if initial else ''}.pt").items():
            assert key not in out or torch.equal(out[key], value), key
            out[key] = value
    return out


def plain(out_dir: Path, *args: str) -> dict[int, dict]:
    """Plain Megatron-Core's per-iteration records (``--full-records``) of one run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "records.json"
    code = PlainServer.run(["train", "--untie-embeddings-and-output-weights", "--dp", "2", "--iters", str(ITERS),
                            "--out", str(out), "--full-records", *args],
                           out_dir / "plain.stdout", out_dir / "plain.stderr", PLAIN_TIMEOUT_S)
    assert code == 0, (out_dir / "plain.stderr").read_text(errors="replace")[-4000:]
    return {int(i): r for i, r in json.loads(out.read_text()).items()}


def assert_close(got: dict[int, dict], want: dict[int, dict], what: str, iters=range(1, ITERS + 1)) -> None:
    for i in iters:
        for key in ("lm_loss", "grad_norm"):
            diff = relative_difference(got[i][key], want[i][key])
            assert diff <= TOL, f"{what}, iteration {i}: {key} {got[i][key]!r} vs {want[i][key]!r} ({diff:.2e})"


@pytest.fixture(scope="module")
def ntp_jobs(tmp_path_factory):
    """The NTP jobs, each with its state dumps; the one with dead slots in both stages saves at iteration 3."""
    out = {}
    for name, dead in DEAD.items():
        run_dir = tmp_path_factory.mktemp(f"pp-ntp-{name}")
        extra = ["--set", f"logging.dump_state={run_dir / 'state'}"]
        if name == "both":
            extra += ["--set", f"checkpoint.save={run_dir / 'ckpt'}", "--set", f"checkpoint.save_interval={SAVE_AT}"]
        out[name] = run_job(run_dir / "run", pipeline_args(True, 2, 2, dead, tuple(extra)))
        assert_ok(out[name])
        out[name].state_dir = run_dir / "state"
        out[name].ckpt = run_dir / "ckpt"
    return out


@pytest.fixture(scope="module")
def references(ntp_jobs, tmp_path_factory):
    """Plain Megatron-Core at PP1 × TP1 and PP2 × TP2 from the NTP jobs' initial weights."""
    base = tmp_path_factory.mktemp("pp-plain")
    init = merged_state(ntp_jobs["stage0"].state_dir, 0, initial=True)
    for job in ntp_jobs.values():  # every NTP job started from the same weights, whatever its layout
        for replica in (0, 1):
            other = merged_state(job.state_dir, replica, initial=True)
            assert set(other) == set(init) and all(torch.equal(other[k], init[k]) for k in init)
    torch.save({k: v for k, v in init.items() if not k.endswith(("exp_avg", "exp_avg_sq"))}, base / "init.pt")
    return {layout: plain(base / layout, "--tp", tp, "--pp", pp, "--init-state", str(base / "init.pt"),
                          "--save-at", "0", "--ckpt", str(base / layout / "unused"))
            for layout, tp, pp in (("pp1tp1", "1", "1"), ("pp2tp2", "2", "2"))}


@pytest.mark.parametrize("name", list(DEAD))
def test_ntp_pipeline_computes_plain_megatron(ntp_jobs, references, name):
    job = ntp_jobs[name]
    assert_close(references["pp2tp2"], references["pp1tp1"], "plain Megatron-Core PP2 TP2 vs PP1 TP1 (its spread)")
    got = records(job)
    widths = {(r, s): 2 - sum(d.startswith(f"{r}:") and d.endswith(f"@{s}") for d in DEAD[name])
              for r in range(2) for s in range(2)}
    assert all(got[i]["tp_per_replica"] == [[widths[r, 0], widths[r, 1]] for r in range(2)] for i in got)
    for layout, want in references.items():
        assert_close(got, want, f"NTP {DEAD[name]} vs plain Megatron-Core {layout}")
    assert_replicas_agree(job, ITERS)


def test_plain_pipeline_is_plain_megatron(references, tmp_path):
    """The same job with NTP off (Megatron's dense grid, PP2 × TP2 × 2) against the reference at its own layout."""
    result = run_job(tmp_path / "run", pipeline_args(False, 2, 2))
    assert_ok(result)
    assert_close(records(result), references["pp2tp2"], "plain PP2 TP2 job vs plain Megatron-Core PP2 TP2")
    assert_replicas_agree(result, ITERS)


def test_a_degraded_pipeline_checkpoint_resumes_under_pp1_and_plain_megatron_pp2(ntp_jobs, tmp_path):
    saver = ntp_jobs["both"]
    assert (saver.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    ckpt = saver.ckpt / f"iter_{SAVE_AT:07d}"
    assert ckpt.is_dir()
    uninterrupted = records(saver)
    resumed = run_job(tmp_path / "pp1", pipeline_args(True, 1, 2, extra=("--set", f"checkpoint.load={ckpt}")))
    assert_ok(resumed)
    assert sorted(records(resumed)) == list(range(SAVE_AT + 1, ITERS + 1))
    assert_close(records(resumed), uninterrupted, "NTP PP1 TP2 resumed", range(SAVE_AT + 1, ITERS + 1))
    megatron = plain(tmp_path / "megatron", "--tp", "2", "--pp", "2", "--load", str(ckpt), "--save-at", "0",
                     "--ckpt", str(tmp_path / "unused"))
    assert sorted(megatron) == list(range(SAVE_AT + 1, ITERS + 1))
    assert_close(megatron, uninterrupted, "plain Megatron-Core PP2 TP2 resumed", range(SAVE_AT + 1, ITERS + 1))
